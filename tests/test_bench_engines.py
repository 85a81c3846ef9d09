"""``ostinato bench engines``: figures from replay turns, ratios, and the tiny end-to-end run
(real daemons on loopback, real replay client, tiny synthetic model; figures are printed, never
asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ostinatod.tools import bench_engines as be

SESSIONS = Path("/work/shared/sessions")


def _turns(ttft, tpot, total, new, after):
    return [{"session": "s", "ttft_s": a, "tpot_s": b, "total_s": c, "new_tokens": d, "after": e,
             "completion_tokens": 10, "error": None} for a, b, c, d, e in zip(ttft, tpot, total, new, after)]


def test_engine_metrics_buckets_and_ratios():
    t = _turns([2.0, 0.3, 0.5, 0.9, 1.5], [0.01, 0.012, 0.011, 0.013, 0.02], [3, 1, 1, 2, 2],
               [3000, 100, 200, 600, 2500], ["first", "tool", "tool", "user", "tool"])
    t.append({**t[1], "error": "boom"})
    m = be.engine_metrics(t)
    assert m["decode_ms_per_token"] == pytest.approx(12.0)
    assert m["ttft_after_tool_median_s"] == pytest.approx(0.5)
    assert m["ttft_after_user_median_s"] == pytest.approx(0.9)
    assert m["session_total_s"] == pytest.approx(9.0)
    b = m["prefill_by_new_tokens"]
    assert b["<128"] == {"median_s": 0.3, "turns": 1}
    assert b["128-511"]["turns"] == 1 and b["512-2047"]["turns"] == 1 and b[">=2048"]["turns"] == 2
    assert m["errors"] == 1 and m["turns"] == 6
    eng = {"ostinato": {"decode_ms_per_token": 5.0, "ttft_after_tool_median_s": 0.4, "session_total_s": 10},
           "stock-layers": {"decode_ms_per_token": 8.0, "ttft_after_tool_median_s": 1.2, "session_total_s": 25},
           "stock-cpu": {"decode_ms_per_token": 14.0, "ttft_after_tool_median_s": 1.0, "session_total_s": 30}}
    r = be.ratios(eng)
    assert r["decode"] == pytest.approx(1.6) and r["decode_best_stock"] == "stock-layers"
    assert r["ttft_after_tool"] == pytest.approx(2.5) and r["ttft_after_tool_best_stock"] == "stock-cpu"
    assert r["session_total"] == pytest.approx(2.5)
    assert be.ratios({"ostinato": {}})["decode"] is None


@pytest.mark.slow
def test_tiny_bench_end_to_end(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    argv = ["--shape", "tiny", "--turns", "2", "--sessions", "1", "--dev-sessions", "1",
            "--dev-turns", "2", "--dev-max-gen", "4", "--no-server", "--n-ctx", "16384",
            "--threads", "2", "--out-dir", str(out), "--work-dir", str(tmp_path / "work"),
            "--name", "tiny", "--sessions-dir", str(SESSIONS), "--model", str(tiny_model)]
    rc = be.main(argv)
    printed = capsys.readouterr().out
    sys.stdout.write(printed)  # the figures, for the log
    res = json.loads((out / "tiny.json").read_text())
    assert rc == 0, printed
    assert set(res["engines"]) == {"ostinato", "stock-layers", "stock-cpu"}, res["notes"]
    for name, e in res["engines"].items():
        assert e["turns"] == 2 and e["errors"] == 0, (name, e)
        for k in ("decode_ms_per_token", "ttft_after_tool_median_s", "session_total_s", "hot_route_share"):
            assert k in e
    o = res["engines"]["ostinato"]
    assert 0 < o["hot_route_share"] <= 1  # the planned pool served routes in the daemon
    assert res["engines"]["stock-cpu"]["hot_route_share"] == 0
    for k in ("machine", "command", "model", "sessions", "ratios_vs_best_stock"):
        assert k in res
    assert set(res["ratios_vs_best_stock"]) >= {"decode", "ttft_after_tool", "session_total"}
    md = (out / "tiny.md").read_text()
    assert "| decode ms/token |" in md and "stock-cpu" in md


def test_plan_over_two_gpus_and_gpu_env(tiny_model, tmp_path, monkeypatch):
    """--gpus 2: the plan has one pool per GPU over contiguous layer ranges (emulated GPUs here),
    and every engine is limited to the first two GPUs of a larger machine."""
    import argparse

    import numpy as np

    from ostinatod.residency import planner
    from ostinatod.residency.planner import read_model_shape
    from ostinatod.residency.traces import Trace

    shape = read_model_shape(tiny_model)
    counts = np.random.default_rng(0).integers(0, 50, (shape.n_layer, shape.n_expert))
    tr = Trace(model=shape.model_block(), workload="coding", counts_prefill=counts,
               counts_decode=np.zeros_like(counts), max_request_tokens=64)
    monkeypatch.setattr(planner, "detect_gpus", lambda: [])
    a = argparse.Namespace(budget_frac=0.5, gpus="2")
    res, path, stock = be.plan(tiny_model, tr, a, tmp_path, "coding")
    assert [g["device"] for g in res["gpus"]] == [0, 1] and path.exists()
    assert [g["device"] for g in stock["gpus"]] == [0, 1]
    assert sum(g["pool_bytes"] for g in stock["gpus"]) == stock["pool_bytes"]
    assert res["gpus"][0]["layers"][-1] + 1 == res["gpus"][1]["layers"][0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in be.gpu_env(a, {})  # no more GPUs than asked for
    monkeypatch.setattr(planner, "detect_gpus", lambda: [planner.GpuSpec(i) for i in range(4)])
    assert be.gpu_env(a, {})["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert be.gpu_env(a, {"CUDA_VISIBLE_DEVICES": "3"})["CUDA_VISIBLE_DEVICES"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in be.gpu_env(argparse.Namespace(gpus="auto"), {})
