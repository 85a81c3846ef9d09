"""Exactness of the Ostinato expert paths against stock llama.cpp (same build), on the CPU.

Tiny synthetic qwen3moe and deepseek2 models (ostinatod.synth) with a residency set that makes about half of the experts hot:
greedy generation after a prompt on each path (decode; split path, n < Np; upload path, n >= Np via
a small forced Np) must give the same tokens as stock llama.cpp with all experts in host memory.
On a CPU-only build the pool is a CPU buffer: this still exercises the index tables, zero slots,
skipped routes and the sum of both branches. Max |delta logit| per path is printed (pytest -s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from ostinatod.engine import native, placement, runtime  # noqa: E402
from ostinatod.residency.sets import (ResidencyError, make_residency, model_block,  # noqa: E402
                                        write_residency)
from ostinatod.settings import Settings  # noqa: E402

if not native.experts_available():  # pragma: no cover - stale build
    pytest.skip("native engine built without the expert engine (run 'ostinato build')",
                allow_module_level=True)

PROMPT_LEN, N_NEW = 24, 8
# OSTINATO_TEST_GPU=1 (GPU machine only): dense layers on GPU 0 in both runs; the stock reference
# keeps every routed expert in host memory (n_cpu_moe = all layers), Ostinato puts its pool on GPU 0.
# Hot experts then run CUDA kernels (activations quantised to q8_1) where the reference runs the CPU's
# (q8_0), so logits get a tolerance there; the greedy tokens must still be identical.
GPU = os.environ.get("OSTINATO_TEST_GPU") == "1"
# GPUs of the machine for the two-pool load test (OSTINATO_TEST_GPUS=2 on a machine with >= 2 GPUs)
N_GPUS = int(os.environ.get("OSTINATO_TEST_GPUS", "1"))
TOL = 0.25 if GPU else 1e-3


ARCHS = ("qwen3moe", "deepseek2", "gpt-oss")
# the daemon's pool layout (setting pool_whole_expert_slots); the native library's own default is off
WHOLE_SLOTS = Settings.model_fields["pool_whole_expert_slots"].default


@pytest.fixture(autouse=True)
def _daemon_pool_layout():
    """Every test builds its pools with the daemon's layout, and with the prefill and decode
    prefetch off (the native defaults) unless it turns them on: the native flags are process-wide
    and an ExpertRuntime load sets them from the settings, so without this a test's layout and
    paths would depend on the tests that ran before it (a GPU failure of the decode prefetch on
    deepseek4 showed only after a runtime test had left it on)."""
    native.set_whole_slots(WHOLE_SLOTS)
    native.set_prefetch(0)
    native.set_decode_prefetch(0)
    yield


def _moe_layers(arch, n_layer):
    """MoE layer ids of a synthetic model (deepseek2 starts with dense layers). Taken from the
    writer's shape rather than the GGUF: parsing a 150k-token vocabulary takes seconds."""
    from ostinatod.synth.shapes import SHAPES
    first = SHAPES["tiny"].n_layer_dense_lead if arch == "deepseek2" else 0
    return list(range(first, n_layer))


@pytest.fixture(scope="session", params=ARCHS)
def moe(request):
    """(path, model block, MoE layer ids) of a tiny synthetic model per architecture (q8_0 experts)."""
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    CACHE.mkdir(parents=True, exist_ok=True)
    p = synthetic_model(CACHE, arch=request.param, shape="tiny")
    m = model_block(p)
    return p, m, _moe_layers(m["arch"], m["n_layer"])


def half_hot(moe, seed=1):
    """Half of each MoE layer's experts hot (a fixed random choice): {layer: expert ids}."""
    rng = np.random.default_rng(seed)
    n = moe[1]["n_expert"]
    return {il: sorted(rng.choice(n, n // 2, replace=False).tolist()) for il in moe[2]}


class Runner:
    """Loads the model with the low-level API and generates greedily; returns tokens and logits."""

    def __init__(self, path, hot=None, prefill_threshold=512, force="auto", all_logits=False, rt=None,
                 tensor_split=None, cb_eval=None):
        # all_logits: every token is an output, so llama.cpp does not prune the last layer to the
        # output rows and every MoE layer sees every token of the pass
        # rt: an ExpertRuntime from prepare() (it configured the loader; the runner loads and attaches)
        # tensor_split (GPU, stock reference): llama.cpp's layer split with these weights
        # cb_eval: a llama_cpp.ggml_backend_sched_eval_callback, called for every node in compute order
        self.all_logits = all_logits
        llama_cpp.llama_backend_init()
        cfg = None  # the placement passed with the load (None: stock)
        if rt is None and hot is not None:
            cfg = placement.experts_config(hot, device=0 if GPU else -1,
                                           prefill_threshold=prefill_threshold, force_path=force)
        mp = llama_cpp.llama_model_default_params()
        # stock reference: everything in host memory; with a config the patched loader keeps the
        # routed experts in host memory and (GPU) puts the pool and the dense layers on the GPU
        mp.n_gpu_layers = 999 if GPU else 0
        if GPU and hot is None:
            mp.tensor_buft_overrides = native.fn("ostinato_n_cpu_moe_overrides")(999)
        mp.use_extra_bufts = False  # both runs: same CPU kernels (see ExpertRuntime.adjust_model_params)
        if tensor_split is not None:
            import ctypes
            self._ts = (ctypes.c_float * len(tensor_split))(*tensor_split)
            mp.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
            mp.tensor_split = ctypes.cast(self._ts, ctypes.POINTER(ctypes.c_float))
        if rt is not None:
            self.model = rt.load(path, mp)  # adjusts mp, loads with its placement, checks the pool
        else:
            self.model, _, _ = native.load_model(path, mp, cfg)
        assert self.model, "model load failed"
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 64, 32, 32
        cp.n_threads = cp.n_threads_batch = 1  # spinning thread barriers crawl on a busy 2-core CI box
        if cb_eval is not None:
            self._cb_eval = cb_eval  # kept alive with the context
            cp.cb_eval = cb_eval
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(32, 0, 1)

    def _decode(self, toks, pos0):
        b = self.batch
        b.n_tokens = len(toks)
        for i, t in enumerate(toks):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (self.all_logits or i == len(toks) - 1) else 0
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def generate(self, prompt, n_new):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        logits = [self._decode(prompt, 0)]
        out = []
        pos = len(prompt)
        for _ in range(n_new):
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            logits.append(self._decode([tok], pos))
            pos += 1
        return out, np.stack(logits)

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def _prompt(n, seed=3):
    return np.random.default_rng(seed).integers(100, 20000, n).tolist()


@pytest.fixture(scope="session")
def stock(moe):
    drop_ost()
    r = Runner(moe[0])
    try:
        assert not native.experts_active()
        return {n: r.generate(_prompt(n), N_NEW) for n in (PROMPT_LEN, 4)}
    finally:
        r.close()


def _stats(with_counts=0):
    return json.loads(native.llama_fn("ostinato_experts_stats")(with_counts).decode())


# One Ostinato-loaded model at a time (the engine is process-global): tests share it and change
# Np, the forced path and the residency set at run time, which also tests those switches.
_OST: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _free_shared_runner():
    yield
    drop_ost()


def ost_runner(moe):
    """The shared Ostinato runner of this architecture (half of the experts hot, Np = 512)."""
    arch = moe[1]["arch"]
    if arch not in _OST:
        drop_ost()
        _OST[arch] = Runner(moe[0], hot=half_hot(moe), prefill_threshold=512)
    return _OST[arch]


def drop_ost():
    """Free the shared runner (before a test loads a model of its own)."""
    for r in _OST.values():
        r.close()
    _OST.clear()


def _switch(hot, layer_device=None):
    cfg = {"hot": {str(k): v for k, v in hot.items()}, "device": 0 if GPU else -1}
    if layer_device:
        cfg["layer_device"] = {str(k): v for k, v in layer_device.items()}
    native.experts_switch(cfg)  # raises ExpertEngineError with the native error


@pytest.mark.parametrize("path, np_tokens, force", [
    ("split", 512, "auto"),      # prompt of 24 tokens < Np: split path, then decode
    ("upload", 8, "auto"),       # small Np: the prompt takes the upload path
    ("split-forced", 8, "split"),
])
def test_paths_match_stock(moe, stock, path, np_tokens, force):
    r = ost_runner(moe)
    _switch(half_hot(moe))
    native.set_prefill_threshold(np_tokens)
    native.force_path(force)
    native.llama_fn("ostinato_experts_reset_stats")()
    try:
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        st = _stats()
    finally:
        native.force_path("auto")
    ref_toks, ref_logits = stock[PROMPT_LEN]
    d_prefill = float(np.max(np.abs(logits[0] - ref_logits[0])))
    d_decode = float(np.max(np.abs(logits[1:] - ref_logits[1:])))
    print(f"\n[exactness] {moe[1]['arch']} {path}: max|dlogit| prefill {d_prefill:.3g}, decode "
          f"{d_decode:.3g}; hot-route share {st['hot_route_share']:.2f}; paths {st['paths']}; "
          f"upload bytes {st['upload_bytes']}")
    assert toks == ref_toks
    assert d_prefill <= TOL and d_decode <= TOL
    up = force == "auto" and PROMPT_LEN >= np_tokens
    assert st["paths"]["upload" if up else "split"] == 1 and st["paths"]["decode"] == N_NEW
    assert 0 < st["hot_routes"] < st["routes"]  # both branches did work
    assert (st["upload_bytes"] > 0) == up       # cold experts uploaded only on the upload path


def test_upload_copies_take_whole_experts(moe, stock):
    """Whole-expert copies (docs/engine.md "Whole-expert copies"): the pool places each size class's
    weight tensors in the order of the host tensors at one pitch, so an expert's up, gate and down
    matrices (a run of consecutive experts: theirs) reach the pool in one 2D copy (the GPU backend's;
    row by row into a CPU pool, which tests the same rows and pitches here). The same prompt on the
    upload path with one copy per matrix and with 2D copies: tokens identical to stock and to each
    other, logits equal (bitwise on the CPU; on the GPU within 1e-3: the same bytes in the same slots,
    so only a misplaced byte could move them), the same bytes uploaded in fewer copy calls."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    native.set_prefill_threshold(8)
    r.all_logits = True
    runs = {}
    try:
        for on in (False, True):
            native.set_copy_2d(on)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
            runs[on] = (toks, logits, _stats()["last_passes"][0])
        info = native.experts_json("ostinato_experts_info")
    finally:
        r.all_logits = False
        native.set_copy_2d(True)
        native.set_prefill_threshold(512)
    ref_toks, _ = stock[PROMPT_LEN]
    (toks_1d, logits_1d, p_1d), (toks_2d, logits_2d, p_2d) = runs[False], runs[True]
    d = float(np.max(np.abs(logits_2d - logits_1d)))
    print(f"\n[exactness] {moe[1]['arch']} whole-expert copies: max|dlogit| {d:.3g} against one copy per "
          f"matrix; copies {p_2d['upload_copies']} against {p_1d['upload_copies']}, bytes {p_2d['upload_bytes']}")
    assert toks_2d == toks_1d == ref_toks
    assert np.array_equal(logits_2d, logits_1d) if not GPU else d <= 1e-3
    assert p_1d["path"] == p_2d["path"] == "upload"
    assert p_2d["upload_bytes"] == p_1d["upload_bytes"] > 0
    assert info["prefill"]["copy_2d"] is True
    # the synthetic files keep a layer's expert tensors adjacent, as llama.cpp's converter does
    assert info["size_classes"] and all(c["expert_rows_at_one_pitch"] for c in info["size_classes"])
    assert info["pools"][0]["copy_2d"] and p_2d["upload_copies"] < p_1d["upload_copies"]


@pytest.mark.parametrize("share", ["half", "all"])
def test_whole_expert_slots_change_where_not_what(moe, stock, share):
    """Whole-expert slots (docs/engine.md "Whole-expert copies"): a slot holds its expert's weight
    matrices next to each other, the class tensors strided by a whole slot. The same prompt and
    decode steps on the split path, the upload path (pool views, one 2D copy per expert with a pitch
    of one matrix) and the decode graph, with half the experts hot and with every expert hot (the
    all-resident layers' leaves over the strided slots): tokens identical to stock, logits equal to
    the default layout's (bitwise on the CPU, within the GPU tolerance there: kernels read other
    strides), uploads one copy per expert where the default layout needs one per matrix run."""
    r = ost_runner(moe)
    n = moe[1]["n_expert"]
    hot = half_hot(moe) if share == "half" else {il: list(range(n)) for il in moe[2]}
    cases = ((512, None), (8, None), (512, True))   # split + decode, upload + decode, decode graph
    r.all_logits = True
    runs, infos = {}, {}
    try:
        for whole in (False, True):
            native.set_whole_slots(whole)
            _switch(hot)   # a pool build: the layout follows the setting
            infos[whole] = native.experts_json("ostinato_experts_info")
            for np_tokens, graph in cases:
                native.set_prefill_threshold(np_tokens)
                native.set_decode_graph(graph)
                native.llama_fn("ostinato_experts_reset_stats")()
                toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
                runs[(whole, np_tokens, graph)] = (toks, logits, _stats()["last_passes"][0])
    finally:
        r.all_logits = False
        native.set_whole_slots(WHOLE_SLOTS)
        native.set_decode_graph(None)
        native.set_prefill_threshold(512)
        _switch(half_hot(moe))
    ref_toks, _ = stock[PROMPT_LEN]
    assert all(c["whole_slots"] for c in infos[True]["size_classes"]) and infos[True]["size_classes"]
    assert not any(c["whole_slots"] for c in infos[False]["size_classes"])
    assert infos[True]["prefill"]["whole_slots"] and not infos[False]["prefill"]["whole_slots"]
    assert all(c["expert_rows_at_one_pitch"] for c in infos[True]["size_classes"])
    assert infos[True]["pool_bytes"] <= infos[False]["pool_bytes"] + 4096 * len(infos[True]["size_classes"])
    for np_tokens, graph in cases:
        (t0, l0, p0), (t1, l1, p1) = runs[(False, np_tokens, graph)], runs[(True, np_tokens, graph)]
        d = float(np.max(np.abs(l1 - l0)))
        print(f"\n[exactness] {moe[1]['arch']} whole-expert slots ({share} hot, Np {np_tokens}, graph {graph}): "
              f"max|dlogit| {d:.3g} against the default layout; first pass {p1['path']}, copies "
              f"{p1['upload_copies']} against {p0['upload_copies']}")
        assert t1 == t0 == ref_toks
        assert np.array_equal(l1, l0) if not GPU else d <= TOL
        assert p1["path"] == p0["path"] == ("upload" if np_tokens == 8 else "split")
        assert p1["upload_bytes"] == p0["upload_bytes"]
        assert (p0["upload_bytes"] > 0) == (share == "half" and np_tokens == 8)
        if p0["upload_bytes"] > 0:
            # one 2D copy per staged expert (plus its bias rows, gpt-oss) against runs of matrices
            biases = 3 if moe[1]["arch"] == "gpt-oss" else 0
            assert p1["upload_copies"] == p1["distinct_cold_experts"] * (1 + biases)


@pytest.mark.parametrize("np_tokens, force", [(512, "auto"), (8, "auto"), (8, "split")])
def test_pool_views_match_stock_and_the_whole_class(moe, stock, np_tokens, force):
    """Per-layer pool views (split and upload passes of >= 9 tokens): the GPU routes over a view of
    the layer's own hot slots with -1 for the other branch's routes, the upload path's staged routes
    over a view of the staging slots. Greedy tokens identical to stock and to the same placement
    computed over the whole size class; on the CPU the logits are bitwise equal too (on the GPU the
    grouped product's stream-k split, which depends on the matrix count, may order sums differently).
    The decode graph is off so that the 24-token prompt takes the split path itself; every token is an
    output, so that the last MoE layer (deepseek2's tiny shape has one) sees the whole prompt too."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    native.set_prefill_threshold(np_tokens)
    native.force_path(force)
    native.set_decode_graph(False)
    r.all_logits = True
    try:
        native.set_views(False)
        native.llama_fn("ostinato_experts_reset_stats")()
        base_toks, base_logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        base = _stats()
        native.set_views(True)
        native.set_upload_cpu_share(0.0)   # every cold expert uploaded, as without views (the hybrid: below)
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        st = _stats()
    finally:
        r.all_logits = False
        native.set_upload_cpu_share(0.0)
        native.set_views(True)
        native.force_path("auto")
        native.set_decode_graph(None)
        native.set_prefill_threshold(512)
    ref_toks, ref_logits = stock[PROMPT_LEN]
    d = float(np.max(np.abs(logits - ref_logits)))
    d_base = float(np.max(np.abs(logits - base_logits)))
    print(f"\n[exactness] {moe[1]['arch']} pool views (Np {np_tokens}, {force}): max|dlogit| {d:.3g} vs "
          f"stock, {d_base:.3g} vs the whole class; paths {st['paths']}")
    assert toks == ref_toks == base_toks
    assert d <= TOL
    if not GPU:
        assert np.array_equal(logits, base_logits)
    assert [p["pool_views"] for p in st["last_passes"]] == [True] + [False] * N_NEW
    assert not any(p["pool_views"] for p in base["last_passes"])
    assert st["paths"] == base["paths"] and st["routes"] == base["routes"]
    assert st["upload_bytes"] == base["upload_bytes"]   # the same cold experts are staged


def _upload_pass_and_whole_class(moe, hybrid, undo):
    """One 24-token upload pass (Np 8, no decode graph, half the experts hot) over the whole class
    (no pool views), then the same with pool views after ``hybrid()`` set up the hybrid pass
    (``undo()`` reverts it). Returns (base tokens, base logits, base pass stats, tokens, logits,
    pass stats, info)."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    native.set_prefill_threshold(8)
    native.set_decode_graph(False)
    r.all_logits = True
    try:
        native.set_views(False)
        native.llama_fn("ostinato_experts_reset_stats")()
        base_toks, base_logits = r.generate(_prompt(PROMPT_LEN), 1)
        base = _stats()["last_passes"][0]
        native.set_views(True)
        hybrid()
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), 1)
        p = _stats()["last_passes"][0]
        info = native.experts_json("ostinato_experts_info")
    finally:
        r.all_logits = False
        undo()
        native.set_decode_graph(None)
        native.set_prefill_threshold(512)
    return base_toks, base_logits, base, toks, logits, p, info


@pytest.mark.parametrize("share, rows", [(0.0, 64), (0.5, 64), (1.0, 64), (1.0, 6), (None, 64)])
def test_hybrid_upload_pass_matches_stock(moe, stock, share, rows):
    """Hybrid upload pass (pool views): a fixed share of the distinct cold experts, those with the
    fewest routes, is computed by a CPU branch while the others are uploaded. Tokens identical to
    stock; on the CPU logits bitwise equal to the whole-class upload pass (None: the adapted share); the uploaded bytes shrink
    with the share (all cold experts uploaded at 0, none at 1 when the CPU branch's rows hold every
    token) and the CPU branch works at > 0. With 6 rows for a 24-token pass the CPU branch takes only
    experts whose tokens fit (the rest is uploaded) and pads its rows with other tokens."""
    def hybrid():
        native.set_upload_cpu_share(share)
        native.set_hybrid_rows(rows)

    def undo():
        native.set_hybrid_rows(64)
        native.set_upload_cpu_share(0.0)

    base_toks, base_logits, base, toks, logits, p, info = _upload_pass_and_whole_class(moe, hybrid, undo)
    ref_toks, ref_logits = stock[PROMPT_LEN]
    d = float(np.max(np.abs(logits[0] - ref_logits[0])))
    print(f"\n[exactness] {moe[1]['arch']} hybrid upload, CPU share {share}, {rows} rows: max|dlogit| {d:.3g}; upload "
          f"bytes {p['upload_bytes']} of {base['upload_bytes']}, CPU branch {p['cpu_branch_ms']:.3f} ms")
    assert toks == ref_toks[:1] == base_toks and d <= TOL
    if not GPU:
        assert np.array_equal(logits, base_logits)
    assert p["path"] == base["path"] == "upload" and p["pool_views"]
    assert base["upload_bytes"] > 0
    if share is None:   # adapted per layer from the joins' waits (a CPU pool has no upload stream: 0)
        assert info["prefill"]["upload_cpu_share_adapted"]
        assert GPU or (info["prefill"]["upload_cpu_share"] == 0 and p["upload_bytes"] == base["upload_bytes"])
        return
    assert info["prefill"]["upload_cpu_share"] == share and not info["prefill"]["upload_cpu_share_adapted"]
    if share == 0.0:
        assert p["upload_bytes"] == base["upload_bytes"]
    elif share == 1.0 and rows >= PROMPT_LEN:
        assert p["upload_bytes"] == 0
    else:
        assert 0 < p["upload_bytes"] < base["upload_bytes"]
    if share and moe[1]["arch"] != "gpt-oss":   # the kernel's share ran beside the graph (its wait op
        # counted it); gpt-oss's biased experts keep ggml's graph
        assert p["cpu_kernel_layers"] > 0 and p["cpu_branch_bytes"] > 0 and p["cpu_share_wait_ms"] >= 0


@pytest.mark.parametrize("cpu_gbps, kernel", [(10.0, True), (10.0, False), (1e-6, True)])
def test_cost_model_split_matches_stock(moe, stock, cpu_gbps, kernel):
    """The prefill's CPU share from the cost model (native/src/paths/hybrid_split.h):
    per layer the CPU branch takes the cold experts with the fewest routes while its time
    alpha + routes x bytes / cpu_gbps stays under the uploads of the rest (bytes / h2d_gbps each).
    With a CPU branch as fast per route as an upload per expert it takes some, computed by its own
    kernel on the context's threads (a CPU op of the pass; gpt-oss's biased experts keep ggml's
    graph, as do all with the kernel off); a CPU a million times slower takes none. Tokens identical
    to stock; on the CPU logits bitwise equal to the whole-class upload pass."""
    split = {"alpha_us": 0.0, "cpu_gbps": cpu_gbps, "h2d_gbps": 10.0}

    def hybrid():
        native.set_upload_cpu_share(0.0)
        native.set_cpu_kernel(kernel)
        native.set_cpu_split(split)

    def undo():
        native.set_cpu_split(None)
        native.set_cpu_kernel(True)

    base_toks, base_logits, base, toks, logits, p, info = _upload_pass_and_whole_class(moe, hybrid, undo)
    ref_toks, ref_logits = stock[PROMPT_LEN]
    d = float(np.max(np.abs(logits[0] - ref_logits[0])))
    print(f"\n[exactness] {moe[1]['arch']} cost-model split (CPU {cpu_gbps} GB/s, kernel {kernel}): max|dlogit| "
          f"{d:.3g}; upload bytes {p['upload_bytes']} of {base['upload_bytes']}, CPU kernel layers "
          f"{p['cpu_kernel_layers']}, {p['cpu_branch_bytes']} bytes")
    assert toks == ref_toks[:1] == base_toks and d <= TOL
    if not GPU:
        assert np.array_equal(logits, base_logits)
    assert p["path"] == base["path"] == "upload" and p["pool_views"]
    assert info["prefill"]["cpu_split"] == {k: v for k, v in split.items()}
    if cpu_gbps < 1:
        assert p["upload_bytes"] == base["upload_bytes"] and p["cpu_kernel_layers"] == 0
        return
    assert 0 < p["upload_bytes"] < base["upload_bytes"]
    if kernel and moe[1]["arch"] != "gpt-oss":
        assert p["cpu_kernel_layers"] > 0 and p["cpu_branch_bytes"] > 0
    else:
        assert p["cpu_kernel_layers"] == 0


def _without_and_with_graph(r, with_counts=0):
    """Generates the test prompt without, then with the decode graph (max 32 tokens); returns
    (tokens, logits) of both and the stats of the run with the graph. Leaves the graph on auto."""
    try:
        native.set_decode_graph(False)
        base_toks, base_logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        native.set_decode_graph(True, max_tokens=32)
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        return base_toks, base_logits, toks, logits, _stats(with_counts)
    finally:
        native.set_decode_graph(None)


@pytest.mark.parametrize("np_tokens", [512, 8])
def test_decode_graph_matches_stock_and_the_split_path(moe, stock, np_tokens):
    """The decode graph (route op as a GPU/CPU op, CPU branch on the engine's thread pool fed through
    the mailbox, join op): greedy tokens identical to stock, and logits bitwise identical to the
    same placement without the graph. On a CPU build the graph is forced on (the same ops run as CPU
    custom ops), so CI runs the mailbox protocol; with np_tokens = 8 the prompt takes the upload
    path and only the decode steps take the graph."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    native.set_prefill_threshold(np_tokens)
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
    native.set_prefill_threshold(np_tokens)

    def run():
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        return toks, logits, _stats(1)

    try:
        native.set_resident_path(False)
        native.set_decode_graph(False)
        base = run()
        native.set_decode_graph(True, max_tokens=32)
        graph = run()
        native.set_decode_graph(None)
        native.set_resident_path(True)
        toks, logits, st = run()
    finally:
        native.set_decode_graph(None)
        native.set_resident_path(True)
        native.set_prefill_threshold(512)
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
    native.set_prefill_threshold(512)
    try:
        native.set_decode_graph(True, max_tokens=32)
        for n in (1, 2):
            native.set_cpu_threads(n)
            toks, _ = r.generate(_prompt(PROMPT_LEN), N_NEW)
            info = native.experts_json("ostinato_experts_info")["decode_graph"]
            assert toks == stock[PROMPT_LEN][0]
            assert info["active"] and info["cpu_threads"] == n
    finally:
        native.set_decode_graph(None)
        native.set_cpu_threads(0)


@pytest.mark.parametrize("graph", [None, True])
def test_borrowed_decode_slots_change_where_not_what(moe, graph):
    """Borrowed decode memory: a long decode promotes cold experts the CPU branch keeps computing into
    the staging slots (promotions, borrowed routes > 0, hot-route share up) with the same tokens and
    logits as without borrowing (bitwise on the CPU, within the GPU tolerance there); a prefill on
    the upload path hands every slot back first."""
    r = ost_runner(moe)
    _switch(half_hot(moe))
    native.set_prefill_threshold(8)
    prompt = _prompt(PROMPT_LEN, seed=5)
    native.set_decode_graph(graph)   # True: the device index table of the decode graph too (CPU build)
    try:
        native.set_borrow(False)
        native.llama_fn("ostinato_experts_reset_stats")()
        base_toks, base_logits = r.generate(prompt, 40)
        base_share = _stats()["hot_route_share"]
        native.set_borrow(True)
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(prompt, 40)   # prompt: upload path (hands back), then 40 decode steps
        st, info = _stats(), native.experts_json("ostinato_experts_info")
        lent = info["borrowed"]["slots_lent"]
        r.generate(prompt, 1)                   # another upload-path prefill: everything handed back
        info2 = native.experts_json("ostinato_experts_info")
    finally:
        native.set_borrow(True)
        native.set_decode_graph(None)
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
    native.set_prefetch(2)   # the pool's third staging region: regions 1 and 2 take the staged experts
    _switch(half_hot(moe))
    native.set_decode_graph(True, max_tokens=32)
    runs = {}
    try:
        for n in (0, experts):
            native.set_decode_prefetch(n)
            native.set_decode_prefetch_blocks(32 if n == 1 else 8)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
            runs[n] = (toks, logits, _stats(), native.experts_json("ostinato_experts_info"))
    finally:
        native.set_decode_prefetch(0)
        native.set_decode_prefetch_blocks(8)
        native.set_decode_graph(None)
        native.set_prefetch(0)
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
        native.set_decode_prefetch(17)   # more than a stage list holds (OSTINATO_STAGE_MAX)
    with pytest.raises(ValueError):
        native.set_decode_prefetch_blocks(0)


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
    native.set_decode_graph(True, max_tokens=32)
    try:
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, _ = r.generate(_prompt(PROMPT_LEN), N_NEW)
        st = _stats()
    finally:
        native.set_decode_graph(None)
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


def _every_path_matches(r, ref_toks, decode_prefetch=0):
    """Greedy tokens of runner ``r`` equal ``ref_toks`` on the split path, the upload path (Np 8),
    the upload path with the cost model's CPU share (its CPU part on the CPU branch's kernel where
    the graph matches) and the decode graph, with both branches doing work in each; with
    ``decode_prefetch`` > 0 also the decode graph with that many experts staged per layer (the pool
    needs prefetch depth 2 at its build). Restores Np, the split and the graph and decode prefetch
    settings. Returns the stats of the last pass."""
    split = {"alpha_us": 0.0, "cpu_gbps": 10.0, "h2d_gbps": 10.0}
    passes = [(512, None, None, 0), (8, None, None, 0), (8, None, split, 0), (512, True, None, 0)]
    if decode_prefetch:
        passes.append((512, True, None, decode_prefetch))
    try:
        for np_tokens, graph, cpu_split, dpf in passes:
            native.set_prefill_threshold(np_tokens)
            native.set_decode_graph(graph)
            native.set_cpu_split(cpu_split)
            native.set_decode_prefetch(dpf)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, _ = r.generate(_prompt(PROMPT_LEN), N_NEW)
            st = _stats()
            assert toks == ref_toks, (np_tokens, graph, cpu_split, dpf)
            assert 0 < st["hot_routes"] < st["routes"], st   # both branches did work
        return st
    finally:
        native.set_decode_prefetch(0)
        native.set_cpu_split(None)
        native.set_decode_graph(None)
        native.set_prefill_threshold(512)


def merge_gate_up(src, dst):
    """Rewrites a GGUF with separate ffn_gate_exps / ffn_up_exps as one merged ffn_gate_up_exps per
    layer (gate rows first, then up rows, per expert), as recent converters write them."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    by_name = {t.name: t for t in r.tensors}
    out = []
    for t in r.tensors:
        if t.name.endswith("ffn_up_exps.weight"):
            continue
        if t.name.endswith("ffn_gate_exps.weight"):
            up = by_name[t.name.replace("ffn_gate_exps", "ffn_up_exps")]
            out.append((t.name.replace("ffn_gate_exps", "ffn_gate_up_exps"),
                        np.concatenate([t.data, up.data], axis=1), t.tensor_type))
        else:
            out.append((t.name, t.data, t.tensor_type))
    for name, data, qt in out:
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data, _ in out:
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    return dst


def test_merged_gate_up_layers_take_the_expert_engine(tmp_path):
    """A deepseek2 file with merged ffn_gate_up_exps: the engine puts the merged rows in the
    pool (a size class marked merged_gate_up) instead of serving the layers stock, and every path,
    the decode graph too, gives stock's greedy tokens for the same file."""
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    drop_ost()
    src = synthetic_model(CACHE, arch="deepseek2", shape="tiny")
    path = merge_gate_up(src, tmp_path / "merged.gguf")
    m = model_block(path)
    moe = (path, m, _moe_layers("deepseek2", m["n_layer"]))
    ref = Runner(path)
    try:
        ref_toks, _ = ref.generate(_prompt(PROMPT_LEN), N_NEW)
    finally:
        ref.close()
    r = Runner(path, hot=half_hot(moe), prefill_threshold=512)
    try:
        info = native.experts_json("ostinato_experts_info")
        assert info["size_classes"] and all(c["merged_gate_up"] for c in info["size_classes"])
        assert not any("not supported" in n for n in info["notes"])
        _every_path_matches(r, ref_toks)
    finally:
        r.close()


NEW_ARCHS = ("glm4moe", "minimax-m2", "qwen35moe", "deepseek4")


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_newer_architectures_through_the_engine(arch):
    """On the CPU: each newer architecture's tiny file (synthetic, q8_0 experts) with
    half of every MoE layer's experts hot gives stock's greedy tokens on the split path, the upload
    path and the decode graph, the latter also with decode prefetch (the daemon's default; on the
    GPU deepseek4's decode graph runs in several scheduler splits, and a prefetch chain crossing one
    once aborted the CUDA graph's capture), and the pool holds its hot experts (not the stock
    fallback); the decode graph's CPU branch runs on its own kernel in every layer."""
    from ostinatod.residency.gguf_header import read_header
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    drop_ost()
    path = synthetic_model(CACHE, arch=arch, shape="tiny")
    m = model_block(path)
    layers = sorted({int(t.name.split(".")[1]) for t in read_header(path).tensors
                     if t.name.endswith("ffn_down_exps.weight")})
    hot = half_hot((path, m, layers), seed=7)
    ref = Runner(path)
    try:
        ref_toks, _ = ref.generate(_prompt(PROMPT_LEN), N_NEW)
    finally:
        ref.close()
    native.set_prefetch(2)   # three staging regions: the decode prefetch stages in two of them
    r = Runner(path, hot=hot, prefill_threshold=512)
    try:
        info = native.experts_json("ostinato_experts_info")
        assert info["hot_experts"] == sum(len(v) for v in hot.values()), info["notes"]
        st = _every_path_matches(r, ref_toks, decode_prefetch=16)
        print(f"\n[exactness] {arch} decode prefetch: staged {st['decode_prefetch_staged']}, "
              f"{st['decode_prefetch_routes']} of {st['cold_routes']} cold routes in the GPU branch; "
              f"CPU branch layers {st['cpu_branch_layers']}, of them on its own kernel {st['cpu_kernel_layers']}")
        # every one of these architectures' expert FFNs is the CPU branch kernel's shape (deepseek4's
        # clamped SwiGLU included), so no decode-graph layer fell back to ggml's graph compute
        assert st["cpu_kernel_layers"] == st["cpu_branch_layers"] > 0, st
        if len(layers) > 1:   # a next layer to predict: the prefetch staged and its routes ran
            assert st["decode_prefetch_staged"] > 0 and st["decode_prefetch_routes"] > 0
    finally:
        r.close()
        native.set_prefetch(0)


@pytest.mark.parametrize("np_tokens", [2, 512])
def test_all_cold_and_all_hot_match_stock(moe, stock, np_tokens):
    # Np 2: the 4-token prompt takes the upload path; 512: the split path; every set also on a
    # pool where one layer holds all of its experts and the others half
    ref_toks, _ = stock[4]
    n = moe[1]["n_expert"]
    r = ost_runner(moe)
    native.set_prefill_threshold(np_tokens)
    first = min(moe[2])
    try:
        for hot in ({}, {il: list(range(n)) for il in moe[2]},
                    {**half_hot(moe), first: list(range(n))}):
            _switch(hot)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, _ = r.generate(_prompt(4), N_NEW)
            st = _stats()
            assert toks == ref_toks
            every = all(len(v) == n for v in hot.values()) and hot
            assert (st["hot_routes"] == st["routes"]) if every else st["hot_routes"] < st["routes"]
    finally:
        _switch(half_hot(moe))
        native.set_prefill_threshold(512)


def test_stats_are_consistent(moe):
    hot = half_hot(moe)
    r = ost_runner(moe)
    _switch(hot)
    native.set_prefill_threshold(16)
    native.llama_fn("ostinato_experts_reset_stats")()
    r.all_logits = True
    try:
        native.llama_fn("ostinato_experts_take_request_stats")()
        r.generate(_prompt(PROMPT_LEN), 3)
        st = _stats(1)
        req = json.loads(native.llama_fn("ostinato_experts_take_request_stats")().decode())
        again = json.loads(native.llama_fn("ostinato_experts_take_request_stats")().decode())
    finally:
        r.all_logits = False
        native.set_prefill_threshold(512)
    k, L, n_exp = moe[1]["n_expert_used"], len(moe[2]), moe[1]["n_expert"]
    n_tok = PROMPT_LEN + 3
    assert st["tokens"] == n_tok and st["passes"] == 4
    assert st["hot_routes"] + st["cold_routes"] == st["routes"] == n_tok * k * L
    cp, cd = np.array(st["counts_prefill"]), np.array(st["counts_decode"])
    assert cp.shape == cd.shape == (moe[1]["n_layer"], n_exp)
    assert cp.sum() == PROMPT_LEN * k * L and cd.sum() == 3 * k * L
    hot_mask = np.zeros_like(cp, dtype=bool)
    for il, ids in hot.items():
        hot_mask[il, ids] = True
    assert (cp + cd)[hot_mask].sum() == st["hot_routes"]
    for p in st["last_passes"]:
        assert p["hot_routes"] + p["cold_routes"] == p["routes"] == p["tokens"] * k * L
        assert p["distinct_cold_experts"] <= min(p["cold_routes"], L * (n_exp - n_exp // 2))
    assert [p["path"] for p in st["last_passes"]] == ["upload", "decode", "decode", "decode"]
    # the prompt's pass (>= 9 tokens) computed its GPU routes over pool views, decode steps did not
    assert [p["pool_views"] for p in st["last_passes"]] == [True, False, False, False]
    assert req["routes"] == st["routes"] and np.array(req["counts_prefill"]).sum() == cp.sum()
    assert again["routes"] == 0 and again["passes"] == 0


def test_runtime_refuses_other_models_set(moe, tmp_path):
    other = dict(moe[1], fingerprint="0" * 64, name="other")
    p = write_residency(make_residency(other, {moe[2][0]: [0]}), tmp_path / "other.json")
    from ostinatod.settings import Settings
    with pytest.raises(ResidencyError, match="fingerprint"):
        runtime.ExpertRuntime.prepare(moe[0], Settings(residency=p))


def test_runtime_end_to_end(moe, tmp_path, monkeypatch):
    """prepare -> load -> info/stats -> switch, as the engine worker calls it."""
    from ostinatod.settings import Settings
    drop_ost()
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    path, info_m, layers = moe
    p = write_residency(make_residency(info_m, half_hot(moe)), tmp_path / "a.json")
    rt = runtime.ExpertRuntime.prepare(path, Settings(residency=p, prefill_threshold=4))
    assert rt is not None
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = rt.load(path, mp)  # checks that the loader built the pool
    assert model
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 128
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(8, 0, 1)
    try:
        info = rt.info()
        assert info["hot_experts"] == sum(len(v) for v in half_hot(moe).values())
        assert info["moe_layers"] == len(layers)
        assert info["size_classes"][0]["zero_slots"] == info_m["n_expert_used"]
        all_hot = {il: list(range(info_m["n_expert"])) for il in layers}
        p2 = write_residency(make_residency(info_m, all_hot), tmp_path / "b.json")
        secs = rt.switch(p2)
        assert secs >= 0 and rt.info()["hot_experts"] == len(layers) * info_m["n_expert"]

        def step(tok: int, pos: int):
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = 1000 + tok, pos, 1, 1
            batch.seq_id[0][0] = 0
            return batch
        st0 = rt.stats()
        assert llama_cpp.llama_decode(ctx, step(0, 0)) == 0
        llama_cpp.llama_synchronize(ctx)   # the count op's table is read as the device has it
        st = rt.stats()   # every layer all-resident: its routes come from the count op at this call
        assert st["cold_routes"] == st0["cold_routes"] and st["hot_routes"] > st0["hot_routes"]
        # one-token steps' context threads: 1 only where the decode graph serves them (its own
        # pool runs the CPU branch); here every layer is on the CPU (n_gpu_layers 0)
        assert rt.context_decode_threads(6, 0) == 6
        rt.decode_threads = 3
        assert rt.context_decode_threads(6, 0) == 3 and rt.context_decode_threads(2, 0) == 2
        assert rt.context_decode_threads(6, -1, graph=False) == 3
        assert rt.context_decode_threads(6, -1, graph=True) == (1 if native.has_gpu() else 3)
        rt.decode_threads = None
        assert rt.info()["decode_graph"]["failed"] is False and not rt.info()["decode_graph"]["broken"]
        # the context's one-token threads follow what ran: as if the loader had given them 1 for
        # the graph, a step without it gets the batch count back, a step in the graph 1 again; a
        # request without one-token steps changes nothing
        rt.context_threads, rt.follows_graph = (1, 2), True
        assert rt.follow_decode_graph(ctx, {"paths": {"decode": 0, "upload": 1}}) is False
        rt.take_request_stats()
        # every layer is all-resident, its dense part on the CPU (n_gpu_layers 0; the pool may be on
        # a GPU): host work, not a decode-graph step even with the graph on; the route op's path
        # (resident path off) takes the graph when it is on
        try:
            native.set_decode_graph(True, max_tokens=32)
            assert llama_cpp.llama_decode(ctx, step(1, 1)) == 0
            assert rt.take_request_stats()["decode_graph_steps"] == 0
            native.set_resident_path(False)
            native.set_decode_graph(False)
            assert llama_cpp.llama_decode(ctx, step(2, 2)) == 0
            st = rt.take_request_stats()
            assert st["paths"]["decode"] == 1 and st["decode_graph_steps"] == 0
            assert rt.follow_decode_graph(ctx, st) is True and rt.context_threads == (2, 2)
            assert llama_cpp.llama_n_threads(ctx) == 2
            native.set_decode_graph(True, max_tokens=32)
            assert llama_cpp.llama_decode(ctx, step(3, 3)) == 0
            st = rt.take_request_stats()
        finally:
            native.set_decode_graph(None)
            native.set_resident_path(True)
        assert st["decode_graph_steps"] == 1
        assert rt.follow_decode_graph(ctx, st) is True and rt.context_threads == (1, 2)
        assert llama_cpp.llama_n_threads(ctx) == 1
        assert rt.follow_decode_graph(ctx, {"error": "stats failed"}) is False
    finally:
        llama_cpp.llama_batch_free(batch)
        rt.close()
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    assert not native.experts_active()


def test_stock_setting_returns_none(moe):
    from ostinatod.settings import Settings
    assert runtime.ExpertRuntime.prepare(moe[0], Settings(experts="stock")) is None


def test_bad_config_is_a_clear_error():
    with pytest.raises(native.ExpertEngineError, match="force_path"):
        native.check_experts_config(placement.experts_config({0: [1]}, force_path="sideways"))
    with pytest.raises(ValueError):
        native.set_prefill_threshold(0)


# --- several GPUs on a CPU build: one pool per "GPU", both CPU buffers -------------------------

def _two_gpus(moe):
    """{layer: 0 or 1}: the first half of the layers on "GPU" 0, the rest on "GPU" 1."""
    n = moe[1]["n_layer"]
    return {il: (0 if il < (n + 1) // 2 else 1) for il in range(n)}


def _check_pools(info, hot, layer_device):
    want = {}
    for il, ids in hot.items():
        want[layer_device[il]] = want.get(layer_device[il], 0) + len(ids)
    pools = {p["gpu"]: p for p in info["pools"]}
    assert {g: p["hot_experts"] for g, p in pools.items()} == want
    for g, p in pools.items():
        assert p["bytes"] > 0
        # CPU build: CPU buffers, no upload stream; GPU build: the pool on its own GPU, own stream
        assert (p["device"], p["upload_stream"]) == ((f"CUDA{g}", True) if GPU else ("CPU", False))
    assert info["hot_experts"] == sum(want.values())
    assert info["pool_bytes"] == sum(p["bytes"] for p in pools.values())
    for g, p in pools.items():
        assert p["layers"] == sorted(il for il, d in layer_device.items() if d == g and il in hot)
    return pools


@pytest.mark.two_gpu
@pytest.mark.skipif(GPU, reason="a switch to two GPUs needs the dense layers loaded with that split: "
                    "CPU build only (the GPU case is test_runtime_two_gpu_set_loads_two_pools)")
def test_two_pools_match_stock(moe, stock):
    """A residency switch to a two-GPU layout: pools per device, split and upload paths exact."""
    r = ost_runner(moe)
    hot, ld = half_hot(moe), _two_gpus(moe)
    try:
        _switch(hot, ld)
        info = json.loads(native.llama_fn("ostinato_experts_info")().decode())
        pools = _check_pools(info, hot, ld)
        if moe[1]["arch"] == "qwen3moe":  # deepseek2's tiny shape has one MoE layer
            assert sorted(pools) == [0, 1]
        ref_toks, ref_logits = stock[PROMPT_LEN]
        for np_tokens in (512, 8):  # split path, then upload path (staging slots of each pool)
            native.set_prefill_threshold(np_tokens)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
            st = _stats()
            d = float(np.max(np.abs(logits - ref_logits)))
            print(f"\n[exactness] {moe[1]['arch']} two pools, Np {np_tokens}: max|dlogit| {d:.3g}, "
                  f"paths {st['paths']}")
            assert toks == ref_toks and d <= TOL
            assert 0 < st["hot_routes"] < st["routes"]
            assert (st["upload_bytes"] > 0) == (np_tokens == 8)
            assert [p["hot_experts"] for p in st["pools"]] == [p["hot_experts"] for p in info["pools"]]
            # per-GPU figures: the pools' routes add up, each has its own share
            assert sum(p["routes"] for p in st["pools"]) == st["routes"]
            assert sum(p["hot_routes"] for p in st["pools"]) == st["hot_routes"]
            assert all(0 <= p["hot_route_share"] <= 1 for p in st["pools"])
        from ostinatod.control.snapshots import pool_lines
        lines = pool_lines(st["pools"])
        n = len(st["pools"])
        assert len(lines) == (n if n > 1 else 0) and all("hot routes" in ln for ln in lines)
    finally:
        native.set_prefill_threshold(512)
        _switch(half_hot(moe))
    assert len(json.loads(native.llama_fn("ostinato_experts_info")().decode())["pools"]) == 1


@pytest.mark.two_gpu
@pytest.mark.skipif(GPU and N_GPUS < 2, reason="two GPUs named: needs a CPU build or >= 2 GPUs "
                    "(OSTINATO_TEST_GPUS=2)")
def test_runtime_two_gpu_set_loads_two_pools(moe, stock, tmp_path):
    """prepare() with a residency set over two GPUs -> load -> two pools, tokens as stock."""
    from ostinatod.settings import Settings
    drop_ost()
    hot, ld = half_hot(moe), _two_gpus(moe)
    doc = make_residency(moe[1], {})
    doc["gpus"] = [{"device": g, "layers": [il for il in sorted(ld) if ld[il] == g], "budget_bytes": 0,
                    "hot": {str(il): v for il, v in hot.items() if ld[il] == g}} for g in (0, 1)]
    p = write_residency(doc, tmp_path / "two.json")
    rt = runtime.ExpertRuntime.prepare(moe[0], Settings(residency=p, prefill_threshold=512))
    assert rt.layer_device == [ld[il] for il in range(moe[1]["n_layer"])]
    ref = stock[PROMPT_LEN]
    r = Runner(moe[0], rt=rt)
    if GPU:  # stock llama.cpp with the same layer split, every routed expert in host memory
        assert rt.tensor_split is not None
        r2 = Runner(moe[0], tensor_split=rt.tensor_split)
        try:
            ref = r2.generate(_prompt(PROMPT_LEN), N_NEW)
        finally:
            r2.close()
    try:
        info = rt.info()
        _check_pools(info, hot, ld)
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        d = float(np.max(np.abs(logits - ref[1])))
        print(f"\n[exactness] {moe[1]['arch']} two-GPU set loaded: max|dlogit| {d:.3g}")
        assert toks == ref[0] and d <= TOL
        assert len(rt.stats()["pools"]) == len(info["pools"])
        one = write_residency(make_residency(moe[1], hot), tmp_path / "one.json")
        if GPU:  # the dense layers stay split over two GPUs: a one-GPU set is refused, old set kept
            with pytest.raises(native.ExpertEngineError, match="dense weights"):
                rt.switch(one)
            assert len(rt.info()["pools"]) == len(info["pools"])
        else:  # a CPU build has no dense weights on a GPU to disagree with: one pool
            rt.switch(one)
            assert [p["gpu"] for p in rt.info()["pools"]] == [0]
    finally:
        rt.close()
        r.close()


TWO_GPU_ARCHS = ("qwen3moe", "deepseek2")


@pytest.mark.two_gpu
@pytest.mark.skipif(GPU and N_GPUS < 2, reason="two GPUs named: needs a CPU build or >= 2 GPUs "
                    "(OSTINATO_TEST_GPUS=2)")
@pytest.mark.parametrize("arch", TWO_GPU_ARCHS)
def test_two_gpus_every_path_matches_stock_layer_split(arch, tmp_path):
    """A 4-layer model (deepseek2: 1 dense + 3 MoE layers, so both GPUs hold MoE
    layers and a pool) loaded with a residency set over two GPUs (layers 0-1 on GPU 0, 2-3 on GPU
    1, half of every MoE layer's experts hot). On each path -- split (Np 512), upload (Np 8) and
    the decode graph -- the greedy tokens equal stock llama.cpp's with the same layer split
    (``rt.tensor_split``, every routed expert in host memory); the max |delta logit| of the prefill
    and of the decode steps is printed per path. Both pools serve routes and both branches work.
    On a CPU build the two pools are CPU buffers and the reference is stock on the CPU."""
    from ostinatod.settings import Settings
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    drop_ost()
    CACHE.mkdir(parents=True, exist_ok=True)
    path = synthetic_model(CACHE, arch=arch, shape="tiny", n_layer=4)
    m = model_block(path)
    moe = (path, m, _moe_layers(arch, m["n_layer"]))
    hot, ld = half_hot(moe, seed=11), {il: (0 if il < 2 else 1) for il in range(m["n_layer"])}
    assert {ld[il] for il in moe[2]} == {0, 1}  # MoE layers (and so a pool) on both GPUs
    doc = make_residency(m, {})
    doc["gpus"] = [{"device": g, "layers": [il for il in sorted(ld) if ld[il] == g], "budget_bytes": 0,
                    "hot": {str(il): v for il, v in hot.items() if ld[il] == g}} for g in (0, 1)]
    p = write_residency(doc, tmp_path / "two.json")
    rt = runtime.ExpertRuntime.prepare(path, Settings(residency=p, prefill_threshold=512))
    assert rt.layer_device == [ld[il] for il in range(m["n_layer"])]
    r = Runner(path, rt=rt)
    try:
        if GPU:
            assert rt.tensor_split is not None
        ref_r = Runner(path, tensor_split=rt.tensor_split if GPU else None)
        try:
            ref_toks, ref_logits = ref_r.generate(_prompt(PROMPT_LEN), N_NEW)
        finally:
            ref_r.close()
        info = rt.info()
        _check_pools(info, hot, ld)
        worst = 0.0
        for name, np_tokens, graph in (("split", 512, None), ("upload", 8, None),
                                       ("decode-graph", 512, True)):
            native.set_prefill_threshold(np_tokens)
            native.set_decode_graph(bool(graph), max_tokens=32)   # off: the split/upload paths proper
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
            st = _stats()
            d_pre = float(np.max(np.abs(logits[0] - ref_logits[0])))
            d_dec = float(np.max(np.abs(logits[1:] - ref_logits[1:])))
            worst = max(worst, d_pre, d_dec)
            graphs = [bool(ps.get("decode_graph")) for ps in st["last_passes"]]
            print(f"\n[exactness-2gpu] {arch} {name}: max|dlogit| prefill {d_pre:.3g}, decode {d_dec:.3g}; "
                  f"tokens {'equal' if toks == ref_toks else 'DIFFER'}; paths {st['paths']}; decode-graph "
                  f"passes {sum(graphs)}/{len(graphs)}; pools "
                  + ", ".join(f"GPU {q['gpu']} {q['hot_routes']}/{q['routes']} hot" for q in st["pools"]))
            assert toks == ref_toks, name
            assert d_pre <= TOL and d_dec <= TOL, name
            assert st["paths"]["upload" if np_tokens <= PROMPT_LEN else "split"] == 1, st["paths"]
            assert st["paths"]["decode"] == N_NEW
            assert (st["upload_bytes"] > 0) == (np_tokens <= PROMPT_LEN)
            assert sorted(q["gpu"] for q in st["pools"]) == [0, 1]
            assert all(0 < q["hot_routes"] < q["routes"] for q in st["pools"]), st["pools"]
            if graph:  # every decode step ran as the decode graph
                assert graphs[-N_NEW:] == [True] * N_NEW, graphs
        print(f"\n[exactness-2gpu] {arch}: max|dlogit| over all paths {worst:.3g} (tolerance {TOL})")
    finally:
        native.set_decode_graph(None)
        native.set_prefill_threshold(512)
        rt.close()
        r.close()


def test_layer_device_config_errors():
    with pytest.raises(native.ExpertEngineError, match="layer_device"):
        native.check_experts_config(placement.experts_config({0: [1]}, layer_device={0: -2}))


def _prefetch_runs(path, hot, share=0.0, split=None, depths=(0, 1, 2)):
    """{depth: (tokens, all logits, first pass's stats, info)} of the prompt generated at prefetch
    ``depths`` (upload path: Np 8, no decode graph, the hybrid CPU share ``share`` or the cost
    model's ``split``)."""
    runs = {}
    for depth in depths:
        native.set_prefetch(depth)
        r = Runner(path, hot=hot, prefill_threshold=8)
        native.set_decode_graph(False)
        native.set_upload_cpu_share(share)
        native.set_cpu_split(split)
        r.all_logits = True
        try:
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), 4)
            runs[depth] = (toks, logits, _stats()["last_passes"][0], native.experts_json("ostinato_experts_info"))
        finally:
            native.set_prefetch(0)
            native.set_decode_graph(None)
            native.set_upload_cpu_share(0.0)
            native.set_cpu_split(None)
            r.close()
    return runs


@pytest.mark.parametrize("arch, share", [("qwen3moe", 0.0), ("deepseek2", 0.0), ("qwen3moe", 0.5)])
def test_prefetch_matches_stock(arch, share):
    """Prefetch (upload passes with pool views): at each layer the routers of the next one or two
    layers applied to this layer's input predict their routes and the copies of the predicted cold
    experts start early (on a stream of their own on a GPU), into depth + 1 staging regions (layer il
    in region il % (depth + 1)). The 8-layer, 32-expert small shape: a layer has next ones that are
    not the last, and the prediction misses some experts and stages some unused ones. At depths 1 and
    2: tokens identical to stock, logits bitwise equal to the same placement without prefetch (on the
    CPU), predicted experts used by their layer (hits), a larger pool per region, and every byte
    uploaded as without it plus what was predicted and not used; depth 2 takes depth 1's prediction
    and adds the one from two layers back (as many hits or more, as many wasted or more, the same
    experts needed). share 0.5: with the hybrid pass too (the CPU branch leaves prefetched experts to
    the copies)."""
    from ostinatod.synth.shapes import SHAPES
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    drop_ost()
    path = synthetic_model(CACHE, arch=arch, shape="small")
    m = model_block(path)
    first = SHAPES["small"].n_layer_dense_lead if arch == "deepseek2" else 0
    rng = np.random.default_rng(1)
    hot = {il: sorted(rng.choice(m["n_expert"], m["n_expert"] // 2, replace=False).tolist())
           for il in range(first, m["n_layer"])}
    ref = Runner(path)
    try:
        ref_toks, ref_logits = ref.generate(_prompt(PROMPT_LEN), 4)
    finally:
        ref.close()
    runs = _prefetch_runs(path, hot, share)
    base_toks, base_logits, base, base_info = runs[0]
    assert base["prefetch_hits"] == base["prefetch_misses"] == 0 and base_info["prefill"]["prefetch"] == 0
    for bad in (-1, 3):   # the graph predicts at most two layers ahead
        with pytest.raises(ValueError):
            native.set_prefetch(bad)
    for depth in (1, 2):
        toks, logits, p, info = runs[depth]
        d = float(np.max(np.abs(logits[0] - ref_logits[0])))
        print(f"\n[exactness] {arch} small prefetch depth {depth} (CPU share {share}): max|dlogit| {d:.3g}; hits "
              f"{p['prefetch_hits']}, misses {p['prefetch_misses']}, wasted {p['prefetch_wasted']}; upload bytes "
              f"{p['upload_bytes']} (without: {base['upload_bytes']})")
        assert toks == ref_toks == base_toks and d <= TOL
        if not GPU:
            assert np.array_equal(logits, base_logits)
        assert p["path"] == "upload" and p["pool_views"] and p["prefetch_hits"] > 0
        assert info["prefill"]["prefetch"] == depth
        assert info["pool_bytes"] > runs[depth - 1][3]["pool_bytes"]   # one staging region more
        if share == 0.0:
            assert p["prefetch_misses"] + p["prefetch_wasted"] > 0   # the prediction is not perfect here
            if p["prefetch_wasted"] == 0:
                assert p["upload_bytes"] == base["upload_bytes"]
            else:
                assert p["upload_bytes"] > base["upload_bytes"]
    if share == 0.0:
        p1, p2 = runs[1][2], runs[2][2]
        assert p1["prefetch_hits"] + p1["prefetch_misses"] == p2["prefetch_hits"] + p2["prefetch_misses"]
        assert p2["prefetch_hits"] >= p1["prefetch_hits"] and p2["prefetch_wasted"] >= p1["prefetch_wasted"]
        # the extra bytes are the extra wasted experts (all of one size here)
        assert ((p2["upload_bytes"] - base["upload_bytes"]) * p1["prefetch_wasted"]
                == (p1["upload_bytes"] - base["upload_bytes"]) * p2["prefetch_wasted"])


def _small_half_hot(seed):
    """(path, model block, hot, stock's 4 greedy tokens) of the small qwen3moe shape with a random half of every
    layer's experts hot (``seed``)."""
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    drop_ost()
    path = synthetic_model(CACHE, arch="qwen3moe", shape="small")
    m = model_block(path)
    rng = np.random.default_rng(seed)
    hot = {il: sorted(rng.choice(m["n_expert"], m["n_expert"] // 2, replace=False).tolist())
           for il in range(m["n_layer"])}
    ref = Runner(path)
    try:
        ref_toks, _ = ref.generate(_prompt(PROMPT_LEN), 4)
    finally:
        ref.close()
    return path, m, hot, ref_toks


def test_prefetch_leaves_the_cost_models_share_to_the_cpu():
    """With the cost model's split a prefetch does not copy the predicted experts the split would
    give the CPU branch (fewest predicted routes first), and the upload op counts the prefetched
    experts as the layer's copies: on the small shape at depths 1 and 2 fewer bytes cross than with
    the prefetch alone, the CPU branch's kernel computes a share in every upload pass, tokens are
    stock's and logits bitwise those without prefetch or split (CPU)."""
    path, _, hot, ref_toks = _small_half_hot(seed=1)
    plain = _prefetch_runs(path, hot)
    split = _prefetch_runs(path, hot, split={"alpha_us": 0.0, "cpu_gbps": 10.0, "h2d_gbps": 10.0}, depths=(1, 2))
    for depth in (1, 2):
        toks, logits, p, _ = split[depth]
        q = plain[depth][2]
        print(f"\n[exactness] small prefetch depth {depth} with the cost model's split: upload bytes "
              f"{p['upload_bytes']} (prefetch alone {q['upload_bytes']}), hits {p['prefetch_hits']}, "
              f"CPU kernel layers {p['cpu_kernel_layers']}")
        assert toks == ref_toks == plain[0][0]
        if not GPU:
            assert np.array_equal(logits, plain[0][1])
        assert p["path"] == "upload" and p["pool_views"]
        assert p["upload_bytes"] < q["upload_bytes"] and p["cpu_kernel_layers"] > 0 and p["prefetch_hits"] > 0


def test_prefetch_two_ahead_over_an_all_resident_layer():
    """Depth 2 where the next layer is all-resident: layer 2 of the small shape holds every expert
    (its own computation, no upload op, no prefetch ops of its own), so layer 3's experts can only be
    predicted from layer 1, two ahead; the route op of layer 1 then takes only the second prediction.
    Tokens stock's and logits bitwise equal to no prefetch (CPU); depth 2 stages predicted experts
    for more layers than depth 1 (more needed experts counted as hits or misses)."""
    path, m, hot, ref_toks = _small_half_hot(seed=2)
    hot[2] = list(range(m["n_expert"]))
    runs = _prefetch_runs(path, hot)
    needed = {d: runs[d][2]["prefetch_hits"] + runs[d][2]["prefetch_misses"] for d in (1, 2)}
    print(f"\n[exactness] small prefetch over an all-resident layer: needed experts counted at depth 1 "
          f"{needed[1]}, depth 2 {needed[2]}; hits {runs[1][2]['prefetch_hits']} / {runs[2][2]['prefetch_hits']}")
    for depth in (1, 2):
        assert runs[depth][0] == ref_toks == runs[0][0]
        if not GPU:
            assert np.array_equal(runs[depth][1], runs[0][1])
        assert runs[depth][2]["path"] == "upload" and runs[depth][2]["prefetch_hits"] > 0
    assert needed[2] > needed[1]   # layer 3 is predicted (from layer 1) only at depth 2
