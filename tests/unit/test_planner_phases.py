"""Phase-aware planner ranking: what a resident expert saves in decode (per route, over the CPU
branch) and in prefill (split path per route, upload path per distinct expert per pass), paper
arXiv 2611.11533 Sec. 3.2-3.3; :func:`ostinatod.residency.cost.expert_time_savings`.

Synthetic counts only; no model file, no engine.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from ostinatod.residency.cost import (DEFAULT_CPU_BRANCH_GBPS, DEFAULT_H2D_GBPS, PhaseCosts,
                                      expert_time_savings, prefill_passes, upload_pass_cost)
from ostinatod.residency.planner import (GpuSpec, ModelInfo, fill_pool, phase_costs_for, plan_residency,
                                         plan_values, summary)
from ostinatod.residency.traces import Trace


def _shape(n_layer=3, n_expert=8, expert_bytes=None):
    eb = expert_bytes or [1000] * n_layer
    return ModelInfo(fingerprint="f" * 64, name="t", arch="glm4moe", n_layer=n_layer,
                     n_expert=n_expert, n_expert_used=2, n_embd=64, n_vocab=1000, n_head=4,
                     n_ff_exp=32, expert_bytes=list(eb), size_class=[f"c{b}" for b in eb],
                     dense_layer_bytes=[5000] * n_layer, other_bytes=10000, kv_bytes_per_token=256)


def _trace(shape, prefill, decode, new_tokens=()):
    t = Trace.empty(shape.model_block(), "coding")
    t.add_counts(np.asarray(prefill, np.int64), np.asarray(decode, np.int64))
    for n in new_tokens:
        t.add_request(n, n, 48, 0)
    return t


def _last_layer_workload(shape, rng):
    """Layers 0..L-2 see every prefill row; the last layer (as llama.cpp computes a standard
    transformer's) only the one row per request that gives logits. Decode routes reach every layer."""
    L, E = shape.n_layer, shape.n_expert
    pop = 1.0 / np.arange(1, E + 1) ** 1.2
    pre = np.zeros((L, E), np.int64)
    dec = np.zeros((L, E), np.int64)
    n_req, tokens, steps = 12, 800, 48
    for l in range(L):
        p = pop[rng.permutation(E)]
        p = p / p.sum()
        rows = n_req if l == L - 1 else n_req * tokens
        pre[l] = rng.multinomial(rows * 2, p)
        dec[l] = rng.multinomial(n_req * steps * 2, p)
    return _trace(shape, pre, dec, [tokens] * n_req)


def test_a_layer_with_decode_routes_only_gets_experts_in_the_pool():
    shape = _shape(n_layer=4, n_expert=16)
    dev = _last_layer_workload(shape, np.random.default_rng(0))
    budget = int(0.45 * shape.total_expert_bytes)
    # route counts (as before): the last layer's few routes never make the cut
    by_routes, _ = fill_pool(dev.counts, shape.expert_bytes, range(shape.n_layer), budget)
    assert 3 not in by_routes
    values, info = plan_values(shape, dev, PhaseCosts())
    assert info["ranking"] == "time" and info["upload_passes"] == 12
    by_time, used = fill_pool(values, shape.expert_bytes, range(shape.n_layer), budget)
    assert len(by_time.get(3, [])) >= 2 and used <= budget
    # the decode steps' hot share rises, and the expected time saved is at least the count ranking's
    # (equal sizes: the greedy fill by value is the optimum of its budget)
    share = lambda c, hot: sum(c[l, es].sum() for l, es in hot.items()) / c.sum()   # noqa: E731
    assert share(dev.counts_decode, by_time) > share(dev.counts_decode, by_routes) + 0.03
    assert share(values, by_time) >= share(values, by_routes)


def test_pure_prefill_below_np_plans_as_route_counts():
    """Split-path passes only: every cold route costs the same, so the ranking is Rule 1's."""
    shape = _shape(n_layer=3, n_expert=8)
    rng = np.random.default_rng(1)
    pre = rng.integers(0, 500, size=(3, 8))
    dev = _trace(shape, pre, np.zeros((3, 8), np.int64), [300, 120, 511, 64])
    values, info = plan_values(shape, dev, PhaseCosts(np_tokens=512))
    assert info["ranking"] == "time" and info["upload_passes"] == 0
    for budget in (3000, 8000, 12000, 20000):
        assert fill_pool(values, shape.expert_bytes, range(3), budget) == \
            fill_pool(dev.counts, shape.expert_bytes, range(3), budget)


def test_traces_without_request_sizes_keep_the_route_count_ranking():
    shape = _shape()
    dev = _trace(shape, np.full((3, 8), 5), np.full((3, 8), 1))   # no requests recorded
    values, info = plan_values(shape, dev)
    assert info["ranking"] == "routes" and "request sizes" in info["why"]
    assert np.array_equal(values, dev.counts)


def test_decode_only_traces_rank_by_decode_routes():
    shape = _shape()
    dec = np.arange(24).reshape(3, 8)
    dev = _trace(shape, np.zeros((3, 8), np.int64), dec)
    values, info = plan_values(shape, dev, PhaseCosts(cpu_gbps=50.0))
    assert info["ranking"] == "time" and info["prefill_passes"] == 0
    # ms: routes x 1000 bytes / 50e9 B/s
    assert np.allclose(values, dec * 1000 / 50e9 * 1e3)


def test_prefill_passes_split_by_ubatch():
    assert prefill_passes([0, 100, 2048, 5000], 2048) == [100, 2048, 2048, 2048, 904]
    with pytest.raises(ValueError):
        prefill_passes([10], 0)


def test_upload_pass_cost_is_the_expected_cheaper_choice():
    cpu_s, up_s = 1.0, 2.5   # two routes on the CPU cost less than an upload, three more
    lam = np.array([0.0, 1e-6, 0.7, 3.0, 40.0])
    got = upload_pass_cost(lam, cpu_s, up_s)
    want = []
    for x in lam:
        pmf = [math.exp(-x + c * math.log(x) - math.lgamma(c + 1)) if x else float(c == 0) for c in range(200)]
        want.append(sum(p * min(c * cpu_s, up_s if c else 0.0) for c, p in enumerate(pmf)))
    assert np.allclose(got, want, rtol=1e-9, atol=1e-12)
    assert got[1] == pytest.approx(1e-6 * cpu_s, rel=1e-3)   # a rare expert: its one route on the CPU
    assert got[-1] == pytest.approx(up_s)                      # touched in every pass: one upload


def test_time_per_byte_does_not_depend_on_the_expert_size():
    shape_counts = np.array([[10, 0], [10, 0]])
    v = expert_time_savings(shape_counts, shape_counts, [1000, 4000], [600, 100], PhaseCosts())
    assert v[1, 0] == pytest.approx(4 * v[0, 0])
    assert v[0, 1] == 0 and v[1, 1] == 0
    with pytest.raises(ValueError):
        expert_time_savings(shape_counts, shape_counts, [1000], [100], PhaseCosts())
    with pytest.raises(ValueError):
        expert_time_savings(shape_counts, shape_counts, [1, 1], [100], PhaseCosts(h2d_gbps=0))


def test_phase_costs_from_the_calibration_else_defaults(tmp_path):
    settings = SimpleNamespace(prefill_threshold=None, n_ubatch=0, n_batch=2048)
    missing = tmp_path / "none.json"
    c = phase_costs_for(settings, missing)
    assert (c.cpu_gbps, c.h2d_gbps, c.np_tokens, c.ubatch) == (DEFAULT_CPU_BRANCH_GBPS, DEFAULT_H2D_GBPS,
                                                                512, 2048)
    assert c.source["cpu_gbps"].startswith("default") and c.source["np_tokens"] == "default"
    prof = tmp_path / "hw.json"
    prof.write_text(json.dumps({"calibration": {
        "format": "ostinato-calibration/1", "np_tokens": 700, "h2d_pinned_gbps": 50.0,
        "cpu_branch_bandwidth": [{"threads": 4, "alpha_us": 3, "bw_gbps": 40.0},
                                 {"threads": 16, "alpha_us": 5, "bw_gbps": 90.0}]}}))
    c = phase_costs_for(SimpleNamespace(prefill_threshold=None, n_ubatch=1024, n_batch=2048), prof)
    assert (c.cpu_gbps, c.h2d_gbps, c.np_tokens, c.ubatch) == (90.0, 50.0, 700, 1024)
    assert c.source == {"cpu_gbps": "calibration", "h2d_gbps": "calibration",
                        "np_tokens": "calibration", "ubatch": "settings"}
    c = phase_costs_for(settings, prof, np_tokens=256, ubatch=4096)
    assert (c.np_tokens, c.ubatch) == (256, 4096)
    # the CPU branch's bandwidth of another model's calibration does not price this one (the link's does)
    cal = json.loads(prof.read_text())
    cal["calibration"]["model"] = {"fingerprint": "aaa", "name": "other"}
    prof.write_text(json.dumps(cal))
    c = phase_costs_for(settings, prof, model_fingerprint="bbb", np_tokens=256)
    assert (c.cpu_gbps, c.h2d_gbps) == (DEFAULT_CPU_BRANCH_GBPS, 50.0)
    assert "another model" in c.source["cpu_gbps"]
    assert phase_costs_for(settings, prof, model_fingerprint="aaa", np_tokens=256).cpu_gbps == 90.0


def test_plan_reports_hot_shares_per_phase_and_the_ranking():
    shape = _shape(n_layer=4, n_expert=16)
    dev = _last_layer_workload(shape, np.random.default_rng(2))
    res = plan_residency(shape, dev, workload="coding", gpus=[GpuSpec(0)], budget_frac=0.45,
                         heldout=dev, costs=PhaseCosts())
    p = res["plan"]
    assert p["ranking"]["ranking"] == "time" and p["ranking"]["costs"]["np_tokens"] == 512
    assert set(p["heldout_hot_route_share_per_phase"]) == {"prefill", "decode"}
    assert "3" in res["gpus"][0]["hot"]
    assert "per phase" in summary(res) and "ranked by time saved" in summary(res)
    json.dumps(res)   # the plan file stays JSON
