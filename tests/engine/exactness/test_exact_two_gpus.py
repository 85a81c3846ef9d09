"""Several GPUs: one pool per GPU (on a CPU build, one CPU buffer per "GPU"), every path against
stock llama.cpp's layer split, and the layer-to-device configuration (marker two_gpu; harness:
exact_helpers.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ostinatod.engine import native, placement, runtime
from ostinatod.residency.sets import make_residency, model_block, write_residency
from ostinatod.settings import Settings
from exact_helpers import (_opt, GPU, N_GPUS, N_NEW, PROMPT_LEN, Runner, TOL, _moe_layers, _prompt, _stats,
                           _switch, drop_ost, half_hot, ost_runner)
from exact_helpers import _daemon_pool_layout, _free_shared_runner, moe, stock  # noqa: F401 (fixtures)


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
            _opt(prefill_threshold=np_tokens)
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
        _opt(prefill_threshold=512)
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
            _opt(prefill_threshold=np_tokens)
            _opt(decode_graph=bool(graph), decode_graph_max_tokens=32)   # off: the split/upload paths proper
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
        _opt(decode_graph=None)
        _opt(prefill_threshold=512)
        rt.close()
        r.close()


def test_layer_device_config_errors():
    with pytest.raises(native.ExpertEngineError, match="layer_device"):
        native.check_experts_config(placement.experts_config({0: [1]}, layer_device={0: -2}))
