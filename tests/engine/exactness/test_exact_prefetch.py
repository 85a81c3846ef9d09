"""The prefill prefetch of cold experts changes where experts are computed, never the tokens or
logits (harness: exact_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ostinatod.engine import native
from ostinatod.engine.options import split_fields  # noqa: E402
from ostinatod.residency.sets import model_block
from exact_helpers import _opt, GPU, PROMPT_LEN, Runner, TOL, _prompt, _stats, drop_ost
from exact_helpers import _daemon_pool_layout, _free_shared_runner  # noqa: F401 (fixtures)


def _prefetch_runs(path, hot, share=0.0, split=None, depths=(0, 1, 2)):
    """{depth: (tokens, all logits, first pass's stats, info)} of the prompt generated at prefetch
    ``depths`` (upload path: Np 8, no decode graph, the hybrid CPU share ``share`` or the cost
    model's ``split``)."""
    runs = {}
    for depth in depths:
        _opt(prefetch_depth=depth)
        r = Runner(path, hot=hot, prefill_threshold=8)
        _opt(decode_graph=False)
        _opt(upload_cpu_share=share)
        _opt(**split_fields(split))
        r.all_logits = True
        try:
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, logits = r.generate(_prompt(PROMPT_LEN), 4)
            runs[depth] = (toks, logits, _stats()["last_passes"][0], native.experts_json("ostinato_experts_info"))
        finally:
            _opt(prefetch_depth=0)
            _opt(decode_graph=None)
            _opt(upload_cpu_share=0.0)
            _opt(**split_fields(None))
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
            _opt(prefetch_depth=bad)
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
