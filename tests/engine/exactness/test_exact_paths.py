"""Exactness of the split and upload paths against stock llama.cpp: each path and forced Np, the
upload copies and the pool's whole-expert slots, the hybrid upload pass and the cost model's CPU
share, all cold and all hot (harness: exact_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ostinatod.engine import native
from ostinatod.engine.options import split_fields  # noqa: E402
from exact_helpers import (_opt, GPU, N_NEW, PROMPT_LEN, TOL, WHOLE_SLOTS, _prompt, _stats, _switch, half_hot,
                           ost_runner)
from exact_helpers import _daemon_pool_layout, _free_shared_runner, moe, stock  # noqa: F401 (fixtures)


@pytest.mark.parametrize("path, np_tokens, force", [
    ("split", 512, "auto"),      # prompt of 24 tokens < Np: split path, then decode
    ("upload", 8, "auto"),       # small Np: the prompt takes the upload path
    ("split-forced", 8, "split"),
])
def test_paths_match_stock(moe, stock, path, np_tokens, force):
    r = ost_runner(moe)
    _switch(half_hot(moe))
    _opt(prefill_threshold=np_tokens)
    _opt(force_path=force)
    native.llama_fn("ostinato_experts_reset_stats")()
    try:
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        st = _stats()
    finally:
        _opt(force_path="auto")
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
    _opt(prefill_threshold=8)
    r.all_logits = True
    runs = {}
    try:
        for on in (False, True):
            _opt(upload_copy_2d=on)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
            runs[on] = (toks, logits, _stats()["last_passes"][0])
        info = native.experts_json("ostinato_experts_info")
    finally:
        r.all_logits = False
        _opt(upload_copy_2d=True)
        _opt(prefill_threshold=512)
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
            _opt(pool_whole_expert_slots=whole)
            _switch(hot)   # a pool build: the layout follows the setting
            infos[whole] = native.experts_json("ostinato_experts_info")
            for np_tokens, graph in cases:
                _opt(prefill_threshold=np_tokens)
                _opt(decode_graph=graph)
                native.llama_fn("ostinato_experts_reset_stats")()
                toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
                runs[(whole, np_tokens, graph)] = (toks, logits, _stats()["last_passes"][0])
    finally:
        r.all_logits = False
        _opt(pool_whole_expert_slots=WHOLE_SLOTS)
        _opt(decode_graph=None)
        _opt(prefill_threshold=512)
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
    _opt(prefill_threshold=np_tokens)
    _opt(force_path=force)
    _opt(decode_graph=False)
    r.all_logits = True
    try:
        _opt(pool_views=False)
        native.llama_fn("ostinato_experts_reset_stats")()
        base_toks, base_logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        base = _stats()
        _opt(pool_views=True)
        _opt(upload_cpu_share=0.0)   # every cold expert uploaded, as without views (the hybrid: below)
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), N_NEW)
        st = _stats()
    finally:
        r.all_logits = False
        _opt(upload_cpu_share=0.0)
        _opt(pool_views=True)
        _opt(force_path="auto")
        _opt(decode_graph=None)
        _opt(prefill_threshold=512)
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
    _opt(prefill_threshold=8)
    _opt(decode_graph=False)
    r.all_logits = True
    try:
        _opt(pool_views=False)
        native.llama_fn("ostinato_experts_reset_stats")()
        base_toks, base_logits = r.generate(_prompt(PROMPT_LEN), 1)
        base = _stats()["last_passes"][0]
        _opt(pool_views=True)
        hybrid()
        native.llama_fn("ostinato_experts_reset_stats")()
        toks, logits = r.generate(_prompt(PROMPT_LEN), 1)
        p = _stats()["last_passes"][0]
        info = native.experts_json("ostinato_experts_info")
    finally:
        r.all_logits = False
        undo()
        _opt(decode_graph=None)
        _opt(prefill_threshold=512)
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
        _opt(upload_cpu_share=-1 if share is None else share)
        _opt(hybrid_rows=rows)

    def undo():
        _opt(hybrid_rows=64)
        _opt(upload_cpu_share=0.0)

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
        _opt(upload_cpu_share=0.0)
        _opt(cpu_branch_kernel=kernel)
        _opt(**split_fields(split))

    def undo():
        _opt(**split_fields(None))
        _opt(cpu_branch_kernel=True)

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


@pytest.mark.parametrize("np_tokens", [2, 512])
def test_all_cold_and_all_hot_match_stock(moe, stock, np_tokens):
    # Np 2: the 4-token prompt takes the upload path; 512: the split path; every set also on a
    # pool where one layer holds all of its experts and the others half
    ref_toks, _ = stock[4]
    n = moe[1]["n_expert"]
    r = ost_runner(moe)
    _opt(prefill_threshold=np_tokens)
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
        _opt(prefill_threshold=512)
