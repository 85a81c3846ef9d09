"""Exactness of the decode graph against stock llama.cpp and the split path: every expert resident,
the pool's threads changing between passes, borrowed decode slots, the decode prefetch and the
decode timeline (harness: exact_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ostinatod.engine import native
from exact_helpers import (_opt, GPU, N_NEW, PROMPT_LEN, Runner, TOL, _prompt, _stats, _switch, drop_ost, half_hot,
                           llama_cpp, ost_runner)
from exact_helpers import _daemon_pool_layout, _free_shared_runner, moe, stock  # noqa: F401 (fixtures)


def _without_and_with_graph(r, with_counts=0):
    """Generates the test prompt without, then with the decode graph (max 32 tokens); returns
    (tokens, logits) of both and the stats of the run with the graph. Leaves the graph on auto."""
    try:
        _opt(decode_graph=False)
        base_toks, base_logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        _opt(decode_graph=True, decode_graph_max_tokens=32)
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        return base_toks, base_logits, toks, logits, _stats(with_counts)
    finally:
        _opt(decode_graph=None)


@pytest.mark.parametrize("np_tokens", [512, 8])
def test_decode_graph_matches_stock_and_the_split_path(moe, stock, np_tokens):
    """The decode graph (route op as a GPU/CPU op, CPU branch on the engine's thread pool fed through
    the mailbox, join op): greedy tokens identical to stock, and logits bitwise identical to the
    same placement without the graph. On a CPU build the graph is forced on (the same ops run as CPU
    custom ops), so CI runs the mailbox protocol; with np_tokens = 8 the prompt takes the upload
    path and only the decode steps take the graph."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    _opt(prefill_threshold=np_tokens)
    base_toks, base_logits, toks, logits, st = _without_and_with_graph(r)
    info = native.experts_json("ostinato_experts_info")
    ref_toks, ref_logits = stock[PROMPT_LEN]
    d = float(np.max(np.abs(logits - ref_logits)))
    print(f"\n[exactness] {moe[1]['arch']} decode graph (Np {np_tokens}): max|dlogit| {d:.3g} vs stock; "
          f"bitwise vs no graph: {np.array_equal(logits, base_logits)}; paths {st['paths']}")
    assert toks == ref_toks == base_toks
    assert d <= TOL
    assert np.array_equal(logits, base_logits)   # the graph changes where, not what, is computed
    graph = [p["decode_graph"] for p in st["last_passes"]]
    assert graph == [np_tokens > PROMPT_LEN] + [True] * N_NEW
    assert info["decode_graph"]["active"] and info["decode_graph"]["mailbox_bytes"] > 0
    assert 0 < st["hot_routes"] < st["routes"] and st["cpu_branch_ms"] > 0   # both branches worked
    # the CPU branch's own kernel computed the cold routes, except where the graph is not its shape
    # (gpt-oss: expert biases and SwiGLU-OAI), which ggml computed; bitwise the same either way
    kern = info["decode_graph"]["cpu_kernel"]
    if moe[1]["arch"] == "gpt-oss":
        assert kern["layers_kernel"] == 0 and kern["layers_ggml"] > 0 and "unmatched" in kern
    else:
        assert kern["layers_kernel"] > 0 and "unmatched" not in kern
        assert st["cpu_kernel_layers"] > 0 and st["cpu_branch_bytes"] > 0


@pytest.mark.parametrize("np_tokens", [512, 8])
def test_every_expert_resident_takes_the_stock_computation(moe, stock, np_tokens):
    """A pool holding every expert: each layer computes as stock does over a view of the pool (no
    route op), on the split path (Np 512) and the upload path (Np 8). Tokens stock's; logits bitwise
    equal to the same placement through the route op, with and without the decode graph; the count
    op's route counts (read back at the stats call) equal the route op's, every route hot. On a GPU
    every pass runs without host work (its decode_graph flag); a CPU pool's passes do not. (On a GPU
    the comparison with the route-op path is within the GPU tolerance.)"""
    r = ost_runner(moe)
    _switch({il: list(range(moe[1]["n_expert"])) for il in moe[2]})
    _opt(prefill_threshold=np_tokens)

    def run():
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        return toks, logits, _stats(1)

    try:
        _opt(resident_path=False)
        _opt(decode_graph=False)
        base = run()
        _opt(decode_graph=True, decode_graph_max_tokens=32)
        graph = run()
        _opt(decode_graph=None)
        _opt(resident_path=True)
        toks, logits, st = run()
    finally:
        _opt(decode_graph=None)
        _opt(resident_path=True)
        _opt(prefill_threshold=512)
        _switch(half_hot(moe))
    assert toks == stock[PROMPT_LEN][0] == base[0] == graph[0]
    assert np.array_equal(base[1], graph[1])
    if GPU:   # the pool tensors have more slots than a layer's experts: MMQ may split them otherwise
        assert float(np.max(np.abs(logits - base[1]))) <= TOL
    else:
        assert np.array_equal(logits, base[1])
    for key in ("counts_prefill", "counts_decode"):
        assert st[key] == base[2][key] == graph[2][key]
    k, L = moe[1]["n_expert_used"], len(moe[2])
    assert np.array(st["counts_decode"]).sum() == N_NEW * k * L
    assert st["cold_routes"] == 0 and st["hot_routes"] == st["routes"] == base[2]["routes"]
    assert st["pools"][0]["routes"] == st["routes"] == st["pools"][0]["hot_routes"]
    assert all(p["decode_graph"] is GPU for p in st["last_passes"])
    assert all(p["routes"] == 0 for p in st["last_passes"])   # counted on the device, not per pass


def test_every_expert_resident_has_the_stock_graph(moe):
    """With every expert resident, a forward pass computes the node sequence of stock's graph (op
    by op, decode and prefill), then the count ops at its end: no VIEW between two products, so the
    GPU backend fuses what it fuses for stock (up/gate/GLU, top-k)."""
    import ctypes

    libdir = Path(llama_cpp.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(libdir / "libggml-base.so"))
    ggml.ggml_op_desc.argtypes, ggml.ggml_op_desc.restype = [ctypes.c_void_p], ctypes.c_char_p
    ggml.ggml_get_name.argtypes, ggml.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p

    def ops_of(hot):
        seen: list = []

        def cb(t, ask, _ud):
            if ask:
                seen.append((ggml.ggml_op_desc(t).decode(), ggml.ggml_get_name(t).decode()))
            return False

        drop_ost()
        r = Runner(moe[0], hot=hot, cb_eval=llama_cpp.ggml_backend_sched_eval_callback(cb))
        try:
            passes = []
            for toks, pos in ((_prompt(8), 0), ([1000], 8)):   # a prefill, then a decode step
                seen.clear()
                r._decode(toks, pos)
                passes.append(list(seen))
            return passes
        finally:
            r.close()

    stock_passes = ops_of(None)
    ost_passes = ops_of({il: list(range(moe[1]["n_expert"])) for il in moe[2]})
    for st, ost in zip(stock_passes, ost_passes):
        n = len(st)
        assert [o for o, _ in ost[:n]] == [o for o, _ in st]
        tail = ost[n:]   # per op: a VIEW of the count table's plane, then the count op
        assert tail and all(o == "VIEW" for o, _ in tail[0::2])
        assert all(o == "CUSTOM" and name.startswith("ostdev:count-") for o, name in tail[1::2])


def test_decode_graph_pool_threads_change_between_passes(moe, stock):
    """set_cpu_threads between passes re-creates the decode graph's CPU-branch pool with that many
    threads (the calibration's decode sweep relies on it); tokens stay stock's."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    _opt(prefill_threshold=512)
    try:
        _opt(decode_graph=True, decode_graph_max_tokens=32)
        for n in (1, 2):
            _opt(cpu_threads=n)
            toks, _ = r.generate(_prompt(PROMPT_LEN), N_NEW)
            info = native.experts_json("ostinato_experts_info")["decode_graph"]
            assert toks == stock[PROMPT_LEN][0]
            assert info["active"] and info["cpu_threads"] == n
    finally:
        _opt(decode_graph=None)
        _opt(cpu_threads=0)


@pytest.mark.parametrize("graph", [None, True])
def test_borrowed_decode_slots_change_where_not_what(moe, graph):
    """Borrowed decode memory: a long decode promotes cold experts the CPU branch keeps computing into
    the staging slots (promotions, borrowed routes > 0, hot-route share up) with the same tokens and
    logits as without borrowing (bitwise on the CPU, within the GPU tolerance there); a prefill on
    the upload path hands every slot back first."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    _opt(prefill_threshold=8)
    prompt = _prompt(PROMPT_LEN, seed=5)
    _opt(decode_graph=graph)   # True: the device index table of the decode graph too (CPU build)
    try:
        _opt(decode_borrow=False)
        native.llama_fn("ostinato_experts_reset_stats")()
        base_toks, base_logits = r.generate(prompt, 40)
        base_share = _stats()["hot_route_share"]
        _opt(decode_borrow=True)
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(prompt, 40)   # prompt: upload path (hands back), then 40 decode steps
        st, info = _stats(), native.experts_json("ostinato_experts_info")
        lent = info["borrowed"]["slots_lent"]
        r.generate(prompt, 1)                   # another upload-path prefill: everything handed back
        info2 = native.experts_json("ostinato_experts_info")
    finally:
        _opt(decode_borrow=True)
        _opt(decode_graph=None)
    print(f"\n[exactness] {moe[1]['arch']} (decode graph {graph}) borrowed slots: {info['borrowed']}, borrowed routes "
          f"{st['borrowed_routes']}, hot-route share {base_share:.3f} -> {st['hot_route_share']:.3f}")
    assert toks == base_toks
    if GPU:
        assert float(np.max(np.abs(logits - base_logits))) <= TOL
    else:
        assert np.array_equal(logits, base_logits)
    assert info["borrowed"]["promotions"] > 0 and st["borrowed_routes"] > 0 and lent > 0
    assert st["hot_route_share"] > base_share
    assert info2["borrowed"]["slots_lent"] == 0 and info2["borrowed"]["handbacks"] >= lent


@pytest.mark.parametrize("experts", [1, 16])
def test_decode_prefetch_changes_where_not_what(moe, stock, experts):
    """Decode prefetch (docs/engine.md "Decode prefetch"): in each decode step a layer's route op
    predicts the next layer's routes (its router on this layer's input) and stages up to ``experts``
    of the predicted cold experts in a staging region of the pool (a copy kernel on a side stream on
    the GPU; memcpy in the CPU route op here), whose routes the next layer's GPU branch computes
    instead of the CPU branch. Tokens identical to stock and to the decode graph without it; logits
    bitwise equal on the CPU (the same ggml kernels either way), within the GPU tolerance there; the
    same routes counted (staged routes are still cold ones); the CPU branch reads fewer bytes. The
    decode timeline marks each chain (router product, stage list, end of the copies) of the layers it
    staged; with one expert per layer the copy kernel runs on 32 blocks (setting
    ``decode_prefetch_copy_blocks``), with 16 on the default 8."""
    if len(moe[2]) < 2:
        pytest.skip("one MoE layer (deepseek2's tiny shape): no next layer to predict")
    r = ost_runner(moe)
    _opt(prefetch_depth=2)   # the pool's third staging region: regions 1 and 2 take the staged experts
    _switch(half_hot(moe))
    _opt(decode_graph=True, decode_graph_max_tokens=32)
    runs = {}
    try:
        for n in (0, experts):
            _opt(decode_prefetch_experts=n)
            _opt(decode_prefetch_copy_blocks=32 if n == 1 else 8)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
            runs[n] = (toks, logits, _stats(), native.experts_json("ostinato_experts_info"))
    finally:
        _opt(decode_prefetch_experts=0)
        _opt(decode_prefetch_copy_blocks=8)
        _opt(decode_graph=None)
        _opt(prefetch_depth=0)
        _switch(half_hot(moe))
    (t0, l0, s0, _), (t1, l1, s1, info) = runs[0], runs[experts]
    ref_toks, _ = stock[PROMPT_LEN]
    d = float(np.max(np.abs(l1 - l0)))
    pf = info["decode_graph"]["prefetch"]
    print(f"\n[exactness] {moe[1]['arch']} decode prefetch ({experts} per layer): max|dlogit| {d:.3g} against "
          f"none; {pf}; staged {s1['decode_prefetch_staged']} experts ({s1['decode_prefetch_used']} used), "
          f"{s1['decode_prefetch_routes']} of {s1['cold_routes']} cold routes on the GPU; CPU branch bytes "
          f"{s1['cpu_branch_bytes']} against {s0['cpu_branch_bytes']}")
    assert t1 == t0 == ref_toks
    assert np.array_equal(l1, l0) if not GPU else d <= TOL
    assert pf["max_experts"] == experts and pf["layers"] > 0 and "note" not in pf
    assert s0["decode_prefetch_staged"] == s0["decode_prefetch_routes"] == 0
    assert (s1["routes"], s1["cold_routes"]) == (s0["routes"], s0["cold_routes"])
    # every decode step stages at most `experts` per predicting layer; the prompt's pass stages none
    n_pred_steps = N_NEW * pf["layers"]
    assert 0 < s1["decode_prefetch_staged"] <= experts * n_pred_steps
    assert s1["decode_prefetch_used"] <= s1["decode_prefetch_staged"]
    assert 0 < s1["decode_prefetch_routes"] <= s1["cold_routes"]
    assert s1["decode_prefetch_bytes"] > 0
    # bytes are counted where the CPU branch's own kernel ran (gpt-oss's biased experts take ggml's)
    assert s1["cpu_branch_bytes"] < s0["cpu_branch_bytes"] or s0["cpu_branch_bytes"] == 0
    assert s1["last_passes"][0]["decode_prefetch_staged"] == 0   # the prompt's pass predicts nothing
    assert pf["copy_blocks"] == (32 if experts == 1 else 8)
    # the chains in the decode timeline: one per sampled step and predicting layer whose next layer
    # follows it in the graph; the copies are the chain's tail; on the CPU the predict op of layer l
    # runs before route(l + 1), so no route waits for a chain
    tl0, tl1 = s0["decode_timeline"], s1["decode_timeline"]
    print(f"[exactness] decode timeline with decode prefetch: {tl1}")
    assert tl0["chain_layers"] == 0 and tl0["chain_ms"] == 0
    assert 0 < tl1["chain_layers"] <= tl1["passes"] * pf["layers"]
    assert 0 <= tl1["chain_copy_ms"] <= tl1["chain_ms"]
    assert 0 <= tl1["chain_late"] <= tl1["chain_layers"] and tl1["chain_wait_ms"] >= 0
    if not GPU:
        assert tl1["chain_late"] == 0 and tl1["chain_wait_ms"] == 0
    with pytest.raises(ValueError):
        _opt(decode_prefetch_experts=17)   # more than a stage list holds (OSTINATO_STAGE_MAX)
    with pytest.raises(ValueError):
        _opt(decode_prefetch_copy_blocks=0)


def test_decode_timeline_marks_every_layer_of_each_decode_step(moe, stock):
    """The decode timeline (docs/engine.md, "Decode timeline"): each route op stamps when it
    published its layer, and at each pass's begin the engine samples the pass before it. Every
    decode step of a generation but the last is sampled once (the prompt's pass is not a decode
    step; the last is read at the next pass's begin), every pair
    of adjacent MoE layers gives one interval, split by whether its first layer had CPU-branch
    routes; the join's waits are part of those intervals; the tokens are stock's."""
    if len(moe[2]) < 2:
        pytest.skip("one MoE layer (deepseek2's tiny shape): no interval between two layers")
    r = ost_runner(moe)
    _switch(half_hot(moe))
    _opt(decode_graph=True, decode_graph_max_tokens=32)
    try:
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, _ = r.generate(_prompt(PROMPT_LEN), N_NEW)
        st = _stats()
    finally:
        _opt(decode_graph=None)
    tl, layers = st["decode_timeline"], moe[2]
    pairs = sum(1 for a, b in zip(layers, layers[1:]) if b == a + 1)
    steps = st["paths"]["decode"]
    print(f"\n[exactness] {moe[1]['arch']} decode timeline: {tl} over {steps} decode steps, {pairs} pairs")
    assert toks == stock[PROMPT_LEN][0]
    # the last step is read at the next pass's begin (or where stats are reset or taken)
    assert tl["passes"] == steps - 1 > 0
    assert tl["cpu_layers"] + tl["gpu_layers"] == tl["passes"] * pairs
    assert tl["cpu_layers"] > 0   # half the experts hot: some layers send routes to the CPU branch
    assert 0 <= tl["cpu_wait_ms"] <= tl["cpu_ms"] and tl["gpu_ms"] >= 0
    assert tl["span_ms"] >= tl["cpu_ms"] + tl["gpu_ms"] - 1e-9 * tl["passes"]
    # taking a request's stats (the worker, after each request) reads its last step too
    assert native.experts_json("ostinato_experts_take_request_stats")["decode_timeline"]["passes"] == steps
    native.llama_fn("ostinato_experts_reset_stats")()
    assert _stats()["decode_timeline"]["passes"] == 0
