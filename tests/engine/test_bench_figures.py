"""``ostinato bench engines``: the figures and their reports without a run -- metrics and ratios from
replay turns, the per-step breakdown and its warnings, budgets and estimates, the timeline summary,
the plots of stored results and the crash lines of an engine's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ostinatod.bench import bench_breakdown, bench_fit, bench_report, bench_sweep
from ostinatod.bench.bench_common import BenchError


def _turns(ttft, tpot, total, new, after):
    return [{"session": "s", "ttft_s": a, "tpot_s": b, "total_s": c, "new_tokens": d, "after": e,
             "completion_tokens": 10, "error": None} for a, b, c, d, e in zip(ttft, tpot, total, new, after)]


def test_engine_metrics_buckets_and_ratios():
    t = _turns([2.0, 0.3, 0.5, 0.9, 1.5], [0.01, 0.012, 0.011, 0.013, 0.02], [3, 1, 1, 2, 2],
               [3000, 100, 200, 600, 2500], ["first", "tool", "tool", "user", "tool"])
    t.append({**t[1], "error": "boom"})
    m = bench_report.engine_metrics(t)
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
    r = bench_report.ratios(eng)
    assert r["decode"] == pytest.approx(1.6) and r["decode_best_stock"] == "stock-layers"
    assert r["ttft_after_tool"] == pytest.approx(2.5) and r["ttft_after_tool_best_stock"] == "stock-cpu"
    assert r["session_total"] == pytest.approx(2.5)
    assert bench_report.ratios({"ostinato": {}})["decode"] is None
    # the limit is never a baseline at equal memory; ratios_vs_limit = Ostinato / limit
    eng["stock-all-gpu"] = {"decode_ms_per_token": 2.5, "ttft_after_tool_median_s": 0.1, "session_total_s": 5}
    r = bench_report.ratios(eng)
    assert r["decode_best_stock"] == "stock-layers" and r["decode"] == pytest.approx(1.6)
    lim = bench_report.ratios_vs_limit(eng)
    assert lim == {"decode": 2.0, "ttft_after_tool": 4.0, "session_total": 2.0}
    assert bench_report.ratios_vs_limit({"ostinato": eng["ostinato"]})["decode"] is None
    assert bench_report.ratios_vs_limit(eng, {"decode_ms_per_token": 5.0})["ttft_after_tool"] is None


def _pass(path, tokens, hot=None, **ms):
    # 2 routes per token; all but one hot unless told (``hot``: the hot routes)
    hot = 2 * tokens - 1 if hot is None else hot
    return {"path": path, "tokens": tokens, "routes": 2 * tokens, "hot_routes": hot,
            "cold_routes": 2 * tokens - hot, "gpu_timed": False, **ms}


def test_turn_breakdown_exact_estimated_and_unknown_keys():
    """Per-turn split of the native pass times into prefill and decode steps from two snapshots;
    unknown *_ms keys (wait_ms) pass through."""
    prev = {"passes": 10, "tokens": 500, "paths": {"decode": 8, "split": 2}, "total_ms": 100.0,
            "cpu_branch_ms": 40.0, "last_passes": [_pass("decode", 1, total_ms=5.0)] * 8}
    turn = [_pass("upload", 300, total_ms=30.0, cpu_branch_ms=0.0, wait_ms=1.0, upload_bytes=4096,
                  prefetch_hits=7, prefetch_misses=2)] + \
        [_pass("decode", 1, total_ms=4.0, cpu_branch_ms=2.0, wait_ms=0.5)] * 5
    cur = {"passes": 16, "tokens": 805, "paths": {"decode": 13, "split": 2, "upload": 1},
           "total_ms": 150.0, "cpu_branch_ms": 50.0, "last_passes": (prev["last_passes"] + turn)[-32:]}
    r = bench_breakdown.turn_breakdown(prev, cur)
    assert r["exact"] and r["passes"] == 6 and r["decode_steps"] == 5 and r["prefill_passes"] == 1
    assert r["prefill_paths"] == {"upload": 1} and r["prefill_tokens"] == 300
    assert r["prefill_ms"]["total_ms"] == pytest.approx(30.0)
    assert r["decode_ms"]["total_ms"] == pytest.approx(20.0)
    assert r["decode_ms"]["wait_ms"] == pytest.approx(2.5) and r["prefill_ms"]["wait_ms"] == pytest.approx(1.0)
    assert r["prefill_sums"] == {"upload_bytes": 4096, "upload_copies": 0, "distinct_cold_experts": 0, "prefetch_hits": 7,
                                 "prefetch_misses": 2, "prefetch_wasted": 0}
    # a turn longer than the ring of 32 passes: decode from the steps seen, prefill = delta - decode
    long_turn = [_pass("decode", 1, total_ms=4.0)] * 32
    cur2 = {"passes": 16 + 41, "tokens": 805 + 200 + 40, "paths": {"decode": 13 + 40, "split": 3, "upload": 1},
            "total_ms": 150.0 + 50.0 + 160.0, "cpu_branch_ms": 50.0, "last_passes": long_turn}
    r2 = bench_breakdown.turn_breakdown(cur, cur2)
    assert not r2["exact"] and r2["decode_steps"] == 40 and r2["decode_seen"] == 32
    assert r2["decode_ms"]["total_ms"] == pytest.approx(160.0)
    assert r2["prefill_ms"]["total_ms"] == pytest.approx(50.0) and r2["prefill_tokens"] == 200
    # the same turn with a snapshot taken after its first decode steps: the prefill pass is known,
    # the split exact (decode = delta - prefill), whatever the decode steps did meanwhile
    mid = {"passes": 16 + 1 + 3, "last_passes": (cur["last_passes"] + [_pass("split", 200, total_ms=45.0)]
                                                 + [_pass("decode", 1, total_ms=9.0)] * 3)[-32:]}
    r3 = bench_breakdown.turn_breakdown(cur, cur2, mid)
    assert r3["exact"] and r3["seen"] == 36 and r3["prefill_tokens"] == 200
    assert r3["prefill_ms"]["total_ms"] == pytest.approx(45.0)
    assert r3["decode_ms"]["total_ms"] == pytest.approx(360.0 - 150.0 - 45.0)
    s = bench_breakdown.summarize_breakdown([r, None, r2], [{"after": "tool"}, {"after": "tool"}, {"after": "user"}])
    assert s["decode_step"]["steps"] == 45 and s["decode_step"]["mean_ms"]["total_ms"] == pytest.approx(4.0)
    assert s["prefill"]["prefills"] == 2 and s["prefill"]["mean_ms"]["total_ms"] == pytest.approx(40.0)
    assert s["prefill"]["exact_share"] == 0.5 and s["prefill"]["paths"] == {"upload": 1, "split": 1}
    assert s["prefill_after_tool"]["prefills"] == 1 and s["turns_with_stats"] == 2
    # counts per prefill only from turns whose prefill passes were all seen (r, not r2)
    assert r2["prefill_sums"] == {} and s["prefill"]["mean_counts"]["prefetch_hits"] == 7
    assert "wait_ms" in s["decode_step"]["mean_ms"]
    md = "\n".join(bench_breakdown.breakdown_md(s, "Ostinato"))
    assert "| total_ms |" in md and "| wait_ms |" in md
    # hot share per phase: decode over the 37 steps seen (1 cold of 2 routes each), prefill over
    # the prefill of r only (r2's were not all seen)
    assert s["decode_step"]["hot_route_share"] == 0.5 and s["decode_step"]["routes"] == 74
    assert s["prefill"]["hot_route_share"] == pytest.approx(599 / 600, abs=1e-4)
    assert s["prefill"]["cold_routes_per_prefill"] == 1 and s["prefill"]["cold_routes_per_token"] == pytest.approx(0.003)
    assert "| hot-route share | 0.500 | 0.998 | 0.998 |" in md
    # decode hotter or colder than prefill by more than 5 points: a warning; within 5 points: none
    assert "0.500 is 49.8 points below the prefill after tool" in bench_breakdown.phase_skew_warning(s)
    hot_decode = {**s, "decode_step": {**s["decode_step"], "hot_route_share": 0.99},
                  "prefill_after_tool": {**s["prefill_after_tool"], "hot_route_share": 0.90}}
    w = bench_breakdown.phase_skew_warning(hot_decode, "ostinato")
    assert w.startswith("ostinato: decode hot-route share 0.990 is 9.0 points above the prefill after tool")
    near = {**hot_decode, "decode_step": {**s["decode_step"], "hot_route_share": 0.94}}
    assert bench_breakdown.phase_skew_warning(near) is None


def test_decode_path_warning_names_steps_outside_the_graph_and_the_kernel():
    ok = {"paths": {"decode": 671}, "decode_graph_steps": 671,
          "decode_graph": {"mode": "auto", "broken": False, "failed": False, "active": True,
                           "cpu_kernel": {"on": True, "layers_kernel": 40, "layers_ggml": 0}}}
    assert bench_breakdown.decode_path_warning(ok) is None
    # a CPU build: no graph, no step in it
    assert bench_breakdown.decode_path_warning({"paths": {"decode": 9}, "decode_graph_steps": 0,
                                             "decode_graph": {"mode": "auto", "broken": False,
                                                              "failed": False}}) is None
    assert bench_breakdown.decode_path_warning({"error": "control API: refused"}) is None
    # what the run with the unexplained 54 ms decode could not say: which path its steps took
    bad = {"paths": {"decode": 671}, "decode_graph_steps": 12,
           "decode_graph": {"mode": "auto", "broken": True, "failed": False, "active": True,
                            "cpu_kernel": {"on": True, "layers_kernel": 0, "layers_ggml": 40,
                                           "unmatched": "ids not contiguous I32"}}}
    w = bench_breakdown.decode_path_warning(bad, "ostinato-x")
    assert w == ("ostinato-x: a lost wait turned the decode graph off; 659 of 671 decode steps ran outside the "
                 "decode graph; a CPU-branch graph the kernel does not match (ids not contiguous I32): its "
                 "decode figures are not the kernel's")
    # layers ggml computed by design (experts with >= 8 routes of a tiled type in a short prefill
    # through the graph) are no warning
    tiled = {**ok, "decode_graph": {**ok["decode_graph"], "cpu_kernel": {"on": True, "layers_kernel": 900,
                                                                         "layers_ggml": 31}}}
    assert bench_breakdown.decode_path_warning(tiled) is None


def test_parse_budgets_and_estimates():
    assert bench_sweep.parse_budgets("0.85,0.25, 0.45,0.25") == [0.25, 0.45, 0.85]
    assert bench_sweep.parse_budgets(None) == []
    for bad in ("0,0.5", "1.2", "x"):
        with pytest.raises(BenchError):
            bench_sweep.parse_budgets(bad)
    est = bench_fit.Estimator(16, 48)
    s, how = est("ostinato")
    assert s == pytest.approx(16 * 1.6 + bench_fit.PRIOR_LOAD_S) and "scaled" in how
    est.add("ostinato", 32.0, 10.0)  # 2 s/turn measured: others rescaled by PRIOR_TURN_S's ratios
    assert est("ostinato")[0] == pytest.approx(16 * 2.0 + 10.0)
    assert est("stock-layers")[0] == pytest.approx(16 * 2.0 * 3.6 / 1.6 + 10.0)


def test_plot_from_stored_json_without_sweep(tmp_path):
    """`ostinato bench plot` on a JSON stored before the sweep existed: one Ostinato point, the
    baselines as lines (no engine, no GPU needed)."""
    from ostinatod.bench import bench_plot

    runs = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "runs"
    stored = runs / "2026-11-29-engines-h200-L24.json"
    out = tmp_path / "p.svg"
    assert bench_plot.main([str(stored), "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<svg") and text.count("<circle") == 2  # one point per panel
    assert "llama-server" in text and "stock-layers" in text
    assert "ratio vs limit" in bench_report.markdown(json.loads(stored.read_text()))  # old JSONs still render


def test_report_gives_each_variant_its_breakdown_and_the_decode_prefetch():
    """The stored H200 run of the decode prefetch A/B (docs/benchmarks/runs): the report shows each
    ``ostinato-*`` variant's own per-step breakdown beside Ostinato's, with the decode prefetch's
    staged experts, cold routes on the GPU and MB copied per decode step where it staged any."""
    runs = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "runs"
    result = json.loads((runs / "2026-12-03-engines-h200-qwen35moe-45-dprefetch.json").read_text())
    md = bench_report.markdown(result)
    assert "Ostinato per-step breakdown" in md and "ostinato-no-dprefetch per-step breakdown" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| decode prefetch: experts staged")]
    assert len(rows) == 1 and rows[0].split("|")[2].strip() == "49.1 / 45.0 / 95.4"   # only where it staged
    means = result["engines"]["ostinato"]["step_breakdown"]["decode_step"]["means"]
    assert set(bench_breakdown.DECODE_MEAN_KEYS) <= set(means)


def test_plot_refuses_what_is_not_a_bench_result(tmp_path, capsys):
    from ostinatod.bench import bench_plot

    other = tmp_path / "calibration.json"
    other.write_text(json.dumps({"decode_sweep": []}))
    text = tmp_path / "x.md"
    text.write_text("# not json")
    assert bench_plot.main([str(other), "-o", str(tmp_path / "a.svg")]) == 1
    assert "not an 'ostinato bench engines' result" in capsys.readouterr().err
    assert bench_plot.main([str(text), "-o", str(tmp_path / "b.svg")]) == 1
    assert "x.md: not a readable JSON" in capsys.readouterr().err
    assert not (tmp_path / "a.svg").exists() and not (tmp_path / "b.svg").exists()


def test_crash_lines_find_aborts_and_the_daemons_crash_lines_only():
    from ostinatod.bench.bench_common import crash_lines

    log = "\n".join([
        "llama_model_load: loaded meta data with 40 key-value pairs",
        "2026-12-01 22:42:20,126 WARNING ostinatod.engine: engine worker (pid 7) has not answered a ping for 5 s: stalled",
        "2026-12-01 22:42:21,126 INFO ostinatod.engine: engine worker (pid 7) answers again",
        # a daemon line that quotes a request or model output is never a crash
        "2026-12-01 22:42:22,000 WARNING ostinatod.server: -> 400 invalid_request: GGML_ASSERT(x) CUDA error",
        "/src/ggml/src/ggml-cuda/ggml-cuda.cu:90: CUDA error",
        "  current device: 0, in function ggml_cuda_op at ggml-cuda.cu:1234",
        "/src/native/paths/split_upload_ops.cpp:570: GGML_ASSERT(used <= ol.n_stage) failed",
        "/src/native/paths/split_upload_ops.cpp:570: GGML_ASSERT(used <= ol.n_stage) failed",
        "2026-12-01 22:42:23,000 ERROR ostinatod.engine: engine worker exited with code -6 (1 crash in 120 s); "
        "restarting in 0.2 s",
    ])
    assert crash_lines(log) == [
        "/src/ggml/src/ggml-cuda/ggml-cuda.cu:90: CUDA error",
        "/src/native/paths/split_upload_ops.cpp:570: GGML_ASSERT(used <= ol.n_stage) failed",
        "2026-12-01 22:42:23,000 ERROR ostinatod.engine: engine worker exited with code -6 (1 crash in 120 s); "
        "restarting in 0.2 s"]
    assert crash_lines(log, limit=1) == ["/src/ggml/src/ggml-cuda/ggml-cuda.cu:90: CUDA error"]
    assert crash_lines("2026-12-01 22:42:20,126 INFO ostinatod: model ready\nINFO requests: status=ok\n") == []


def test_plot_redraws_a_stored_skew_sweep(tmp_path):
    """`ostinato bench plot` on a stored ``--skew-sweep`` JSON (the H200 run of
    docs/benchmarks/runs) writes the plot against skew and the sweep's table beside it: one point per
    skew for Ostinato, the best peer and the limit, the figures of the JSON in the table."""
    from ostinatod.bench import bench_plot

    stored = Path(__file__).resolve().parents[2] / "docs/benchmarks/runs/2026-12-03-engines-h200-L8-skew-sweep.json"
    sweep = json.loads(stored.read_text())
    rows = sweep["skew_sweep"]["rows"]
    src = tmp_path / "sweep.json"
    src.write_text(stored.read_text())
    assert bench_plot.main([str(src)]) == 0
    svg, md = tmp_path / "sweep.svg", tmp_path / "sweep.md"
    text = svg.read_text()
    assert text.count("<polyline") == 6   # two panels x (Ostinato, best peer, limit)
    for r in rows:
        assert f">{r['skew']:g}<" in text
        assert f"{r['decode']['ostinato']:.2f} / {r['decode']['best_peer']:.2f}" in md.read_text()
    assert "best peer (llama-server)" in text
    # several JSONs stay the pool-size plot, which a sweep is not
    assert bench_plot.main([str(src), str(src), "-o", str(tmp_path / "two.svg")]) == 1


def test_timeline_summary_gives_per_step_and_per_layer_figures():
    """The decode timeline's cumulative stats become per-step and per-layer means, the GPU's own work
    being every interval less the joins' waits; nothing sampled gives None (no table row)."""
    from ostinatod.bench.bench_report import breakdown_md, timeline_summary

    assert timeline_summary(None) is None and timeline_summary({"passes": 0}) is None
    tl = {"passes": 10, "span_ms": 62.0, "cpu_layers": 130, "cpu_ms": 26.0, "cpu_wait_ms": 13.0,
          "gpu_layers": 260, "gpu_ms": 36.4}
    s = timeline_summary(tl)
    assert s == {"passes": 10, "span_ms": 6.2, "cpu_layers": 13.0, "cpu_layer_us": 200.0, "cpu_wait_us": 100.0,
                 "gpu_layer_us": 140.0, "gpu_work_ms": 4.94}
    b = {"decode_step": {"steps": 10, "mean_ms": {"total_ms": 7.0}}, "prefill": {}, "prefill_after_tool": {},
         "decode_timeline": s}
    row = [x for x in breakdown_md(b, "ostinato") if x.startswith("| decode timeline")]
    assert row == ["| decode timeline (10 steps): route to route ms / GPU work ms / layers with CPU routes: us "
                   "each (of it wait) / other layers: us each | 6.20 / 4.94 / 13.0: 200 (100) / 140 | | |"]
    assert not [x for x in breakdown_md(b, "ostinato") if "chains" in x]
    # decode prefetch's chains marked: per step and per chain, the late ones as a share
    tl.update(chain_layers=380, chain_ms=38.0, chain_copy_ms=30.4, chain_wait_ms=1.9, chain_late=95)
    s = timeline_summary(tl)
    assert (s["chain_layers"], s["chain_us"], s["chain_copy_us"], s["chain_wait_ms"], s["chain_late_share"]) == \
        (38.0, 100.0, 80.0, 0.19, 0.25)
    b["decode_timeline"] = s
    row = [x for x in breakdown_md(b, "ostinato") if "chains" in x]
    assert row == ["| decode prefetch chains: per step / us each (of it copies) / main stream's wait for the copies "
                   "ms per step / share ending after the route | 38.0 / 100 (80) / 0.190 / 0.25 | | |"]
