"""Several GPUs without GPUs: the layer split that puts each layer's dense weights on the GPU of its
expert pool (llama.cpp's split_mode LAYER, simulated), the residency set's layer-to-GPU map, and the
benchmark's plan over two GPUs. The engine side (two pools, exactness) is in tests/engine/exactness/test_exact_two_gpus.py."""

from __future__ import annotations

import numpy as np
import pytest

from ostinatod.engine.placement import full_layer_devices, simulate_layer_split, tensor_split_for
from ostinatod.residency.sets import ResidencyError, validate_residency


def _ranges(rng, n_layer, n_gpu):
    cuts = sorted(rng.choice(np.arange(1, n_layer), n_gpu - 1, replace=False).tolist())
    out, prev = [], 0
    for d, c in enumerate(cuts + [n_layer]):
        out += [d] * (c - prev)
        prev = c
    return out


@pytest.mark.parametrize("n_gpu", [2, 3, 4])
def test_tensor_split_reproduces_the_layer_ranges(n_gpu):
    rng = np.random.default_rng(n_gpu)
    for _ in range(200):
        n_layer = int(rng.integers(n_gpu, 96))
        dev = _ranges(rng, n_layer, n_gpu)
        n_devices = int(rng.choice([n_gpu, 16]))  # llama_max_devices() entries: unused ones are 0
        ts = tensor_split_for(dev, n_devices)
        assert len(ts) == n_devices and min(ts) >= 0 and sum(ts) == pytest.approx(1)
        got = simulate_layer_split(ts, n_layer)
        assert got[:n_layer] == dev
        assert got[n_layer] == dev[-1]  # output layer with the last layers


def test_tensor_split_with_partial_offload_and_gaps():
    dev = [0] * 4 + [2] * 6  # GPU 1 unused
    ts = tensor_split_for(dev, 4)
    assert ts[1] == 0 and ts[3] == 0
    assert simulate_layer_split(ts, 10)[:10] == dev
    # n_gpu_layers 7 of 11 (10 layers + output): layers 0-3 stay on the CPU
    ts = tensor_split_for(dev, 4, n_gpu_layers=7)
    assert simulate_layer_split(ts, 10, n_gpu_layers=7)[:10] == [-1] * 4 + [2] * 6
    with pytest.raises(ValueError, match="contiguous"):
        tensor_split_for([0, 1, 0], 2)
    with pytest.raises(ValueError, match="outside"):
        tensor_split_for([0, 2], 2)


def _doc(model, gpus):
    return {"format": "ostinato-residency/1", "model": model, "workload": "coding", "gpus": gpus}


def test_layer_devices_of_a_residency_set():
    model = {"fingerprint": "f" * 64, "name": "m", "arch": "qwen3moe", "n_layer": 6, "n_expert": 8,
             "n_expert_used": 2}
    res = validate_residency(_doc(model, [
        {"device": 0, "layers": [0, 1, 2], "hot": {"1": [3]}},
        {"device": 1, "layers": [3, 4, 5], "hot": {"4": [0, 1]}}]), model)
    assert res.devices == [0, 1]
    assert full_layer_devices(res, 6) == [0, 0, 0, 1, 1, 1]
    # layers named only through hot keys; unnamed ones follow the layer before
    res = validate_residency(_doc(model, [{"device": 0, "hot": {"0": [1]}},
                                          {"device": 1, "hot": {"4": [1]}}]), model)
    assert full_layer_devices(res, 6) == [0, 0, 0, 0, 1, 1]
    bad = validate_residency(_doc(model, [{"device": 0, "layers": [0, 1, 4, 5]},
                                          {"device": 1, "layers": [2, 3]}]), model)
    with pytest.raises(ResidencyError, match="contiguous"):
        full_layer_devices(bad, 6)
    twice = validate_residency(_doc(model, [{"device": 0, "layers": [0, 1, 2]},
                                            {"device": 1, "layers": [2, 3, 4, 5]}]), model)
    with pytest.raises(ResidencyError, match="GPUs 0 and 1"):
        twice.layer_devices()


def test_planned_two_gpu_set_gives_a_valid_split(tiny_model):
    """The planner's 2-GPU ranges go through full_layer_devices and tensor_split_for unchanged."""
    from ostinatod.residency.planner import GpuSpec, plan_residency, read_model_shape
    from ostinatod.residency.traces import Trace

    shape = read_model_shape(tiny_model)
    counts = np.random.default_rng(0).integers(0, 50, (shape.n_layer, shape.n_expert))
    tr = Trace(model=shape.model_block(), workload="coding", counts_prefill=counts,
               counts_decode=np.zeros_like(counts), max_request_tokens=64)
    doc = plan_residency(shape, tr, workload="coding", gpus=[GpuSpec(0), GpuSpec(1)], budget_frac=0.5)
    res = validate_residency(doc, shape.model_block())
    dev = full_layer_devices(res, shape.n_layer)
    assert dev == [g["device"] for g in doc["gpus"] for _ in g["layers"]]
    assert simulate_layer_split(tensor_split_for(dev, 16), shape.n_layer)[:shape.n_layer] == dev


def test_per_gpu_pool_lines_and_prometheus_gauges():
    """Without GPUs: the per-GPU lines of `ostinato status` and the TUI carry each
    pool's size, hot-route share and its GPU's memory; /metrics has the same per GPU, labelled."""
    from prometheus_client import CollectorRegistry, generate_latest

    from ostinatod.control.snapshots import pool_lines
    from ostinatod.server.metrics import pool_families

    pools = [{"gpu": 0, "device": "CUDA0", "bytes": 3 << 30, "hot_experts": 1200, "routes": 1000,
              "hot_route_share": 0.9},
             {"gpu": 1, "device": "CUDA1", "bytes": 1 << 30, "hot_experts": 400, "routes": 0,
              "hot_route_share": 0.0}]
    gpus = [{"index": 0, "name": "H200", "total_bytes": 140 << 30, "used_bytes": 40 << 30},
            {"index": 1, "name": "H200", "total_bytes": 140 << 30, "used_bytes": 70 << 30}]
    lines = pool_lines(pools, gpus)
    assert lines == ["GPU 0 (CUDA0): 3.0 GiB, 1,200 hot experts, 90.0% hot routes, memory 40.0/140.0 GiB",
                     "GPU 1 (CUDA1): 1.0 GiB, 400 hot experts, no routes yet, memory 70.0/140.0 GiB"]
    assert pool_lines(pools) == [ln.rsplit(", memory", 1)[0] for ln in lines]  # no NVML: no memory
    assert pool_lines(pools[:1], gpus) == []  # one pool: the totals say it all

    class _C:
        def collect(self):
            yield from pool_families(pools, gpus)

    reg = CollectorRegistry()
    reg.register(_C())
    text = generate_latest(reg).decode()
    assert 'ostinato_pool_bytes{device="CUDA1",gpu="1"} 1.073741824e+09' in text
    assert 'ostinato_pool_hot_route_share{device="CUDA0",gpu="0"} 0.9' in text
    assert 'ostinato_gpu_memory_used_bytes{gpu="1",name="H200"} 7.516192768e+10' in text
    assert list(pool_families(None, [])) == []
