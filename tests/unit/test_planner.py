"""Residency planner: Rule 1 fill, multi-GPU layer split, capacity test, the residency file.

Synthetic route counts; the GGUF for the CLI test is a tiny MoE-shaped file written here with the
``gguf`` package (the planner reads only metadata and tensor sizes, never runs it).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from ostinatod.residency import planner
from ostinatod.residency.planner import (GpuSpec, ModelInfo, PlanError, fill_pool, hot_route_share,
                                      plan_residency, split_layers)
from ostinatod.residency.traces import Trace

MiB = 1 << 20


def _zipf_counts(n_layer, n_expert, seed, skew=1.1):
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, n_expert + 1) ** skew
    out = np.zeros((n_layer, n_expert), np.int64)
    for l in range(n_layer):
        p = base[rng.permutation(n_expert)]
        out[l] = rng.multinomial(20000, p / p.sum())
    return out


def _shape(n_layer=8, n_expert=16, k=4, expert_bytes=None):
    eb = expert_bytes or [1000] * n_layer
    return ModelInfo(fingerprint="f" * 64, name="t", arch="qwen3moe", n_layer=n_layer,
                      n_expert=n_expert, n_expert_used=k, n_embd=64, n_vocab=1000, n_head=4,
                      n_ff_exp=32, expert_bytes=list(eb),
                      size_class=[f"c{b}" for b in eb], dense_layer_bytes=[5000] * n_layer,
                      other_bytes=10000, kv_bytes_per_token=256)


def _trace(shape, counts, max_tokens=3000):
    t = Trace.empty(shape.model_block(), "coding")
    t.add_counts(counts // 2, counts - counts // 2)
    t.max_request_tokens = max_tokens
    return t


def test_fill_equal_sizes_is_optimal_rule1():
    """With equal slots, the fill covers the most routes of any set of that size (Prop. 3.1)."""
    counts = _zipf_counts(2, 5, seed=3)
    hot, used = fill_pool(counts, [10, 10], [0, 1], budget_bytes=40)
    assert used == 40 and sum(len(v) for v in hot.values()) == 4
    got = sum(counts[l, e] for l, es in hot.items() for e in es)
    best = max(sum(counts[l, e] for l, e in comb)
               for comb in itertools.combinations([(l, e) for l in range(2) for e in range(5)], 4))
    assert got == best


def test_fill_is_across_layers_not_per_layer_quota():
    counts = np.zeros((2, 4), np.int64)
    counts[0] = [100, 90, 80, 70]
    counts[1] = [5, 1, 0, 0]
    hot, _ = fill_pool(counts, [1, 1], [0, 1], budget_bytes=5)
    assert hot[0] == [0, 1, 2, 3] and hot[1] == [0]


def test_fill_mixed_sizes_respects_budget_and_ranks_per_byte():
    counts = np.array([[100, 60, 10], [90, 50, 40]], np.int64)
    hot, used = fill_pool(counts, [100, 50], [0, 1], budget_bytes=200)
    assert used <= 200
    # per byte: l1e0 1.8, l0e0 1.0, l1e1 1.0 -> 50 + 100 + 50 = 200
    assert hot == {0: [0], 1: [0, 1]}


def test_fill_only_layers_of_the_gpu_and_skips_dense_layers():
    counts = _zipf_counts(4, 8, seed=1)
    hot, _ = fill_pool(counts, [0, 10, 10, 10], [0, 1], budget_bytes=10**6)
    assert set(hot) == {1} and hot[1] == list(range(8))


@pytest.mark.parametrize("n_gpu", [1, 2, 3, 4])
def test_split_layers_contiguous_and_proportional(n_gpu):
    weights = [1.0, 3.0, 2.0, 2.0][:n_gpu]
    ranges = split_layers(24, weights)
    assert [l for r in ranges for l in r] == list(range(24))
    assert all(r for r in ranges)
    for r, w in zip(ranges, weights):
        assert abs(len(r) - 24 * w / sum(weights)) <= 1


@pytest.mark.parametrize("n_gpu", [1, 2, 3, 4])
def test_plan_any_number_of_gpus(n_gpu):
    shape = _shape(n_layer=12, n_expert=16)
    dev = _trace(shape, _zipf_counts(12, 16, seed=0))
    held = _trace(shape, _zipf_counts(12, 16, seed=0) // 3 + _zipf_counts(12, 16, seed=7) // 10)
    res = plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(i) for i in range(n_gpu)],
                         budget_frac=0.45, heldout=held)
    assert res["format"] == "ostinato-residency/1" and len(res["gpus"]) == n_gpu
    seen = []
    for g in res["gpus"]:
        seen += g["layers"]
        assert set(int(l) for l in g["hot"]) <= set(g["layers"])
        pool = sum(len(es) * 1000 for es in g["hot"].values())
        assert pool <= g["budget_bytes"] and g["budget_bytes"] - pool < 1000
    assert seen == list(range(12))
    p = res["plan"]
    assert p["pool_bytes_total"] <= 0.45 * shape.total_expert_bytes
    # Frequency-ranked residency beats the 45% of routes a random pool would get on skewed traffic.
    assert p["dev_hot_route_share"] > 0.6
    assert 0.45 < p["heldout_hot_route_share"] <= 1.0
    assert p["expected_hot_route_share"] == p["heldout_hot_route_share"]


def test_plan_unequal_gpus_get_unequal_ranges_and_capacity_caps_budget():
    shape = _shape(n_layer=12, n_expert=16)
    dev = _trace(shape, _zipf_counts(12, 16, seed=2), max_tokens=1000)
    big, small = 400 * MiB, 200 * MiB
    res = plan_residency(shape, dev, workload="coding", margin_mb=0,
                         gpus=[GpuSpec(0, big), GpuSpec(1, small)], budget_frac=1.0)
    l0, l1 = (len(g["layers"]) for g in res["gpus"])
    assert l0 == 8 and l1 == 4
    # Budget 1.0 fits on these GPUs: all experts hot.
    assert hot_route_share(dev.counts, res["gpus"]) == pytest.approx(1.0)


def test_prefetch_reserves_a_second_staging_region():
    """With the prefill prefetch the pool has a second staging region: the capacity test reserves
    two staging buffers, so the same free memory holds exactly one layer's experts fewer."""
    shape = _shape(n_layer=4, n_expert=8, expert_bytes=[MiB] * 4)
    dev = _trace(shape, _zipf_counts(4, 8, seed=4), max_tokens=4096)
    one = planner.estimate_gpu_need(shape, range(4), 4096, last=True)
    two = planner.estimate_gpu_need(shape, range(4), 4096, last=True, staging_regions=2)
    assert two["staging"] == 2 * one["staging"] == 2 * 8 * MiB
    assert two["total"] - one["total"] == one["staging"]
    free = one["total"] + 12 * MiB
    hot = {r: sum(len(v) for v in plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0, free)],
                                                 budget_frac=1.0, margin_mb=0, staging_regions=r
                                                 )["gpus"][0]["hot"].values()) for r in (1, 2)}
    assert hot == {1: 12, 2: 4}


def test_compute_estimate_keeps_the_router_ids_of_each_moe_layer():
    """The count op of all-resident layers keeps each MoE layer's sorted router ids (i32
    [n_expert, n_ubatch]) until the end of the graph: the compute estimate holds them, per MoE layer
    of the GPU, and grows with the ubatch."""
    shape = _shape(n_layer=4, n_expert=8, expert_bytes=[MiB] * 4)
    all4 = planner.estimate_gpu_need(shape, range(4), 4096, n_ubatch=512)
    two = planner.estimate_gpu_need(shape, range(2), 4096, n_ubatch=512)
    assert all4["compute"] - two["compute"] == 2 * 4 * 512 * 8
    big = planner.estimate_gpu_need(shape, range(4), 4096, n_ubatch=1024)
    assert big["compute"] == 2 * all4["compute"]


def test_prefetch_depth_is_cut_to_the_staging_regions_a_set_has_room_for():
    """A set planned with fewer staging regions than the prefetch depth needs (1 + depth) against a
    GPU's free memory (the pool filled to the capacity) gets the depth its room allows: none with one
    region and no spare memory, depth 1 with two regions when depth 2 is asked for, the full depth
    with every region planned or memory to spare, or for a hand-made set (options.prefetch_for)."""
    from ostinatod.engine.options import prefetch_for
    from ostinatod.residency.sets import ResidencySet
    shape = _shape(n_layer=4, n_expert=8, expert_bytes=[MiB] * 4)
    dev = _trace(shape, _zipf_counts(4, 8, seed=4), max_tokens=4096)
    one = planner.estimate_gpu_need(shape, range(4), 4096, last=True)   # one region: 8 MiB

    def plan(free, regions):
        return plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0, free)], budget_frac=1.0,
                              margin_mb=0, staging_regions=regions)["plan"]
    tight = plan(one["total"] + 12 * MiB, 1)          # 12 of 32 experts: the capacity binds
    assert tight["staging_regions"] == 1 and planner.prefetch_room(tight, 2) == 0
    two = plan(one["total"] + 20 * MiB, 2)            # room for a second region, not a third
    assert planner.prefetch_room(two, 1) == 1 and planner.prefetch_room(two, 2) == 1
    assert planner.prefetch_room(plan(one["total"] + 28 * MiB, 3), 2) == 2
    spare = plan(one["total"] + 64 * MiB, 1)          # every expert (32 MiB) and 32 MiB spare: 4 regions
    assert planner.prefetch_room(spare, 2) == 2
    assert planner.prefetch_room({}, 2) == 2 and planner.prefetch_room({"capacity": [{"capacity_bytes": None}]}, 2) == 2
    assert planner.prefetch_room(tight, 0) == 0
    res = ResidencySet(path=None, model={}, workload="coding", raw={"plan": tight})
    assert prefetch_for(2, res) == 0 and prefetch_for(0, res) == 0
    assert prefetch_for(2, ResidencySet(path=None, model={}, workload="coding", raw={"plan": two})) == 1
    assert prefetch_for(2, None) == 2
    assert prefetch_for(1, ResidencySet(path=None, model={}, workload="coding", raw={})) == 1


def test_staging_regions_follow_the_prefetch_settings():
    """The planner reserves 1 + the prefetch depth staging regions: 3 by default, 2 at depth 1, 1
    with the prefetch off; the settings refuse depths outside 1..2."""
    from ostinatod.settings import Settings
    assert planner.staging_regions_for(Settings()) == 3
    assert planner.staging_regions_for(Settings(engine={"prefill_prefetch_depth": 1})) == 2
    assert planner.staging_regions_for(Settings(engine={"prefill_prefetch": False})) == 1
    for bad in (0, 3):
        with pytest.raises(ValueError):
            Settings(engine={"prefill_prefetch_depth": bad})


def test_capacity_test_fails_with_clear_error_and_caps_pool():
    shape = _shape(n_layer=4, n_expert=8, expert_bytes=[MiB] * 4)
    dev = _trace(shape, _zipf_counts(4, 8, seed=4), max_tokens=4096)
    need = planner.estimate_gpu_need(shape, range(4), 4096, last=True)["total"]
    with pytest.raises(PlanError, match="capacity test failed"):
        plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0, need // 2)],
                       budget_frac=0.5, margin_mb=0)
    # Free memory for exactly 5 experts beyond the need: the pool gets 5 despite budget 1.0.
    res = plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0, need + 5 * MiB)],
                         budget_frac=1.0, margin_mb=0)
    assert sum(len(v) for v in res["gpus"][0]["hot"].values()) == 5
    # A longer development request needs more KV cache, so fewer experts fit.
    dev.max_request_tokens = 4096 + 2 * MiB // 256
    res = plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0, need + 5 * MiB)],
                         budget_frac=1.0, margin_mb=0)
    assert sum(len(v) for v in res["gpus"][0]["hot"].values()) == 3


def test_plan_refuses_foreign_traces_and_missing_budget():
    shape = _shape()
    dev = _trace(shape, _zipf_counts(8, 16, seed=0))
    dev.model["fingerprint"] = "0" * 64
    with pytest.raises(PlanError, match="traces are for model"):
        plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0)], budget_frac=0.5)
    dev.model["fingerprint"] = shape.fingerprint
    with pytest.raises(PlanError, match="budget"):
        plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0)])


def _write_tiny_moe(path: Path) -> Path:
    from helpers import write_moe_gguf  # the one metadata-only MoE GGUF writer of the tests

    return write_moe_gguf(path, n_layer=3, n_expert=8, k=2, n_embd=32, n_ff=16)


def test_read_model_shape(tmp_path):
    shape = planner.read_model_shape(_write_tiny_moe(tmp_path / "m.gguf"))
    assert (shape.arch, shape.n_layer, shape.n_expert, shape.n_expert_used) == ("qwen3moe", 3, 8, 2)
    assert shape.expert_bytes == [3 * 16 * 32 * 2] * 3
    assert shape.moe_layers == [0, 1, 2] and len(shape.fingerprint) == 64
    with pytest.raises(ValueError, match="not a readable GGUF"):
        (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
        planner.read_model_shape(tmp_path / "bad.gguf")


def test_cli_writes_residency_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    model = _write_tiny_moe(tmp_path / "m.gguf")
    shape = planner.read_model_shape(model)
    tr = tmp_path / "dev.json"
    _trace(shape, _zipf_counts(3, 8, seed=5), max_tokens=500).save(tr)
    rc = planner.main(["--model", str(model), "--traces", str(tr), "--heldout-traces", str(tr),
                       "--budget-frac", "0.5", "--gpus", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    path = tmp_path / "home" / "data" / "residency" / shape.fingerprint / "coding.json"
    res = json.loads(path.read_text())
    assert res["model"]["fingerprint"] == shape.fingerprint and res["workload"] == "coding"
    assert sum(len(v) for v in res["gpus"][0]["hot"].values()) == 12  # half of 3 x 8
    # The engine's own reader accepts it for this model.
    from ostinatod.residency.sets import model_block, read_residency

    assert read_residency(path, model_block(model)).n_hot == 12
    assert shape.model_block() == model_block(model)
    assert "hot-route share" in out
    # No traces for another workload: a clear error, exit code 1.
    assert planner.main(["--model", str(model), "--workload", "service", "--budget-frac", "0.5"]) == 1
    assert "no routing traces" in capsys.readouterr().err


def test_no_gpu_memory_names_the_settings_of_residency_plan():
    """`ostinato residency plan` takes its budget from the settings, so the
    error names them (not only `ostinato plan`'s flags)."""
    shape = _shape()
    dev = _trace(shape, _zipf_counts(8, 16, seed=0))
    with pytest.raises(PlanError, match="expert_budget_frac"):
        plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0)])
