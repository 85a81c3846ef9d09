"""``ostinato bench engines``: the tiny end-to-end runs (real daemons on loopback, real replay
client, tiny synthetic model; figures are printed, never asserted), the plan over two GPUs, the
variants' settings, the step recorder, option errors and the crash watch. The figures and reports
without a run are in test_bench_figures.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ostinatod.bench import bench_engines as be
from ostinatod.bench import bench_launch, bench_prepare, bench_report


SESSIONS = Path("/work/shared/sessions")


@pytest.mark.slow
def test_tiny_bench_end_to_end(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    # a sweep of two budgets, one of them the main budget (its Ostinato run is reused)
    argv = ["--shape", "tiny", "--turns", "2", "--sessions", "1", "--dev-sessions", "1",
            "--dev-turns", "2", "--dev-max-gen", "4", "--no-server", "--n-ctx", "16384",
            "--threads", "2", "--out-dir", str(out), "--work-dir", str(tmp_path / "work"),
            "--name", "tiny", "--sessions-dir", str(SESSIONS), "--model", str(tiny_model),
            "--budget-frac", "0.3", "--budget-sweep", "0.3,0.6"]
    rc = be.main(argv)
    printed = capsys.readouterr().out
    sys.stdout.write(printed)  # the figures, for the log
    res = json.loads((out / "tiny.json").read_text())
    assert rc == 0, printed
    # the engines and the dev traces ran without the disk prefix cache: a rerun in this work dir
    # restores nothing of this run (its prefills would count no routes and take no time)
    assert not [p for p in tmp_path.rglob("prefix-cache") if any(p.iterdir())]
    # --model: the file names the model; the synthetic defaults are not written as its shape
    assert res["model"]["file"] == tiny_model.name and res["model"]["shape"] is None
    # stock-all-gpu runs (CPU-only here, noted) or is skipped with a note when the model cannot fit
    fit = res["plan"]["limit_fit"]
    if fit["run"]:
        assert set(res["engines"]) == {"ostinato", "stock-all-gpu", "stock-layers", "stock-cpu"}, res["notes"]
        assert res["engines"]["stock-all-gpu"]["hot_route_share"] == 1.0
        assert all(v is not None for v in res["ratios_vs_limit"].values())
    else:
        assert set(res["engines"]) == {"ostinato", "stock-layers", "stock-cpu"}, res["notes"]
        assert any(n.startswith("stock-all-gpu: skipped") for n in res["notes"])
    if not fit["gpu"]:
        assert any(n.startswith("stock-all-gpu: no GPU found") for n in res["notes"])
    assert set(res["ratios_vs_limit"]) == {"decode", "ttft_after_tool", "session_total"}
    assert res["ratios_vs_best_stock"].get("decode_best_stock") != "stock-all-gpu"
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
    assert "| decode ms/token |" in md and "stock-cpu" in md and "ratio vs limit" in md
    # per-step breakdown of the Ostinato engine from the native per-pass stats
    b = o["step_breakdown"]
    assert b["turns"] == 2 and b["turns_with_stats"] == 2, b
    assert b["decode_step"]["steps"] > 0 and "total_ms" in b["decode_step"]["mean_ms"]
    assert b["prefill"]["prefills"] >= 1 and "cpu_branch_ms" in b["prefill"]["mean_ms"]
    # per-phase hot share and cold routes, counted by the engine; the phase check ran
    assert 0 <= b["decode_step"]["hot_route_share"] <= 1 and b["decode_step"]["routes"] > 0
    assert 0 <= b["prefill"]["hot_route_share"] <= 1 and b["prefill"]["cold_routes_per_prefill"] is not None
    assert isinstance(res["warnings"], list) and "| hot-route share |" in md
    assert set(b["prefill"]["mean_counts"]) == {"upload_bytes", "upload_copies", "distinct_cold_experts", "prefetch_hits",
                                                "prefetch_misses", "prefetch_wasted"}
    # the worker's step timing of every daemon engine, ours and stock llama.cpp's alike (bench_steps)
    daemons = ["ostinato", "stock-layers", "stock-cpu"] + (["stock-all-gpu"] if fit["run"] else [])
    for name in daemons:
        w = res["engines"][name]["step_breakdown"]["worker"]
        d, pre = w["decode"], w["prefill"]
        assert w["turns_with_stats"] == 2 and d["steps"] > 0 and d["turns"] > 0, (name, w)
        for k in ("wall_ms", "call_ms", "sample_ms", "out_ms", "client_ms"):
            assert d[k] > 0, (name, k, d)
        # the parts of a decode step do not exceed its wall at the worker
        assert d["call_ms"] + d["sample_ms"] + d["out_ms"] <= d["wall_ms"] + 1e-6, (name, d)
        assert 0 <= d["wait_ms"] <= d["call_ms"] and 0 <= d["pipe_ms"] <= d["out_ms"], (name, d)
        assert d["other_ms"] >= -1e-6 and d["outside_ms"] is not None, (name, d)
        assert pre["passes"] > 0 and 0 < pre["call_ms"] <= pre["wall_ms"], (name, pre)
        assert ("native_pass_ms" in d) == (name == "ostinato"), (name, d)   # native rows: ours only
    assert 0 < o["step_breakdown"]["worker"]["decode"]["native_pass_ms"]
    for label in ("decode: wall at the worker per step", "decode: llama_decode call to logits",
                  "decode: sampling", "decode: other worker (batch, bookkeeping, loop)",
                  "decode: outside the worker (client - worker wall)",
                  "decode: of it the native pass (total_ms)", "prefill pass: wall"):
        assert f"| {label} |" in md, label
    head = next(line for line in md.splitlines() if line.startswith("| ms | ostinato"))
    assert all(f" {n} |" in head for n in daemons), head
    # the sweep: two budgets, each with its Ostinato figures and ratios; the main one reused
    sw = res["sweep"]
    assert sw["budgets"] == [0.3, 0.6] and sw["baselines_budget_frac"] == 0.3
    assert [r["budget_frac"] for r in sw["runs"]] == [0.3, 0.6]
    assert sw["runs"][0]["pool_bytes"] < sw["runs"][1]["pool_bytes"]
    for r in sw["runs"]:
        assert r["ostinato"]["turns"] == 2 and r["ostinato"]["errors"] == 0, r
        assert set(r["ratios_vs_limit"]) == {"decode", "ttft_after_tool", "session_total"}
        assert "decode" in r["ratios_vs_baselines"]
    assert sw["runs"][0]["ostinato"]["decode_ms_per_token"] == o["decode_ms_per_token"]
    assert "Budget sweep" in md and "| 60% |" in md
    assert (out / "tiny.svg").read_text().startswith("<svg")
    # the plot again from the stored JSON alone (no engine needed)
    from ostinatod.bench import bench_plot

    svg = tmp_path / "again.svg"
    assert bench_plot.main([str(out / "tiny.json"), "-o", str(svg)]) == 0
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<circle") == 4 and "stock-layers" in text


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
    res, path, stock = bench_prepare.plan(tiny_model, tr, a, tmp_path, "coding")
    assert [g["device"] for g in res["gpus"]] == [0, 1] and path.exists()
    assert [g["device"] for g in stock["gpus"]] == [0, 1]
    assert sum(g["pool_bytes"] for g in stock["gpus"]) == stock["pool_bytes"]
    assert res["gpus"][0]["layers"][-1] + 1 == res["gpus"][1]["layers"][0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in bench_launch.gpu_env(a, {})  # no more GPUs than asked for
    monkeypatch.setattr(planner, "detect_gpus", lambda: [planner.GpuSpec(i) for i in range(4)])
    assert bench_launch.gpu_env(a, {})["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert bench_launch.gpu_env(a, {"CUDA_VISIBLE_DEVICES": "3"})["CUDA_VISIBLE_DEVICES"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in bench_launch.gpu_env(argparse.Namespace(gpus="auto"), {})


def test_gpus_vs_one_gpu_ratios_and_when_the_one_gpu_engine_runs(tiny_model, tmp_path, monkeypatch):
    """ostinato-1gpu / ostinato per metric (> 1: the GPUs together are faster); the one-GPU engine
    is planned only for --gpus N > 1, on one GPU at the same budget fraction."""
    import argparse

    import numpy as np

    from ostinatod.residency import planner
    from ostinatod.residency.planner import read_model_shape
    from ostinatod.residency.traces import Trace

    eng = {"ostinato": {"decode_ms_per_token": 8.0, "ttft_after_tool_median_s": 0.2, "session_total_s": 10},
           "ostinato-1gpu": {"decode_ms_per_token": 10.0, "ttft_after_tool_median_s": 0.1}}
    r = bench_report.gpus_vs_one_gpu(eng)
    assert r == {"decode": 1.25, "ttft_after_tool": 0.5, "session_total": None}
    shape = read_model_shape(tiny_model)
    counts = np.random.default_rng(0).integers(0, 50, (shape.n_layer, shape.n_expert))
    tr = Trace(model=shape.model_block(), workload="coding", counts_prefill=counts,
               counts_decode=np.zeros_like(counts), max_request_tokens=64)
    monkeypatch.setattr(planner, "detect_gpus", lambda: [])
    notes: list[str] = []
    a1 = argparse.Namespace(budget_frac=0.5, gpus="1")
    assert bench_prepare.one_gpu_plan(tiny_model, tr, a1, tmp_path, "coding", notes) is None
    assert notes and "skipped" in notes[0]
    a2 = argparse.Namespace(budget_frac=0.5, gpus="2")
    res1, path1, _ = bench_prepare.one_gpu_plan(tiny_model, tr, a2, tmp_path, "coding", notes)
    res2, _, _ = bench_prepare.plan(tiny_model, tr, a2, tmp_path, "coding")
    assert [g["device"] for g in res1["gpus"]] == [0] and path1.name == "residency-1gpu.json"
    assert [g["device"] for g in res2["gpus"]] == [0, 1]
    assert a2.gpus == "2"  # the caller's namespace is left as it was
    # the same budget: the one pool holds about what the two hold together
    assert res1["plan"]["pool_bytes_total"] == pytest.approx(res2["plan"]["pool_bytes_total"], rel=0.2)


@pytest.mark.slow
def test_tiny_bench_two_gpus_with_the_one_gpu_engine(tiny_model, tmp_path, monkeypatch, capsys):
    """`--gpus 2 --engines ostinato,ostinato-1gpu,stock-layers` in one run (emulated GPUs on a CPU
    build: two pools as CPU buffers for ostinato, one for ostinato-1gpu): both Ostinato engines
    serve every turn and the result carries the two-vs-one-GPU ratios."""
    from ostinatod.residency import planner

    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    if planner.detect_gpus():
        pytest.skip("emulated GPUs only: this machine has real ones (the device run covers them)")
    out = tmp_path / "out"
    argv = ["--shape", "tiny", "--turns", "2", "--sessions", "1", "--dev-sessions", "1",
            "--dev-turns", "2", "--dev-max-gen", "4", "--n-ctx", "16384", "--threads", "2",
            "--out-dir", str(out), "--work-dir", str(tmp_path / "work"), "--name", "two",
            "--sessions-dir", str(SESSIONS), "--model", str(tiny_model), "--budget-frac", "0.5",
            "--gpus", "2", "--engines", "ostinato,ostinato-1gpu,stock-layers"]
    rc = be.main(argv)
    printed = capsys.readouterr().out
    sys.stdout.write(printed)
    res = json.loads((out / "two.json").read_text())
    assert rc == 0, printed
    assert set(res["engines"]) == {"ostinato", "ostinato-1gpu", "stock-layers"}, res["notes"]
    for name in ("ostinato", "ostinato-1gpu"):
        e = res["engines"][name]
        assert e["turns"] == 2 and e["errors"] == 0, (name, e)
        assert 0 < e["hot_route_share"] <= 1
    pools2 = res["engines"]["ostinato"]["expert_stats"]
    assert pools2.get("hot_route_share") is not None
    assert set(res["ratios_gpus_vs_one_gpu"]) == {"decode", "ttft_after_tool", "session_total"}
    assert res["ratios_gpus_vs_one_gpu"]["decode"] is not None
    assert res["plan"]["one_gpu"]["pool_bytes"] > 0
    assert len(res["plan"]["stock"]["gpus"]) == 2
    md = (out / "two.md").read_text()
    assert "ostinato-1gpu" in md and "the GPUs together are faster" in md


def test_ostinato_variants_are_valid_daemon_settings(tmp_path, monkeypatch):
    """The bench's Ostinato variants start the daemon with these settings (as OSTINATO_* variables):
    each must be a setting the daemon accepts, and differ from its default (else the A/B is void)."""
    from ostinatod.settings import ENGINE_KEYS, Settings
    from ostinatod.bench.bench_common import CHOICES, VARIANTS, variant_settings
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    default = Settings()

    def get(st, k):
        return getattr(st.engine if k in ENGINE_KEYS else st, k)

    for name in VARIANTS:
        assert name in CHOICES
        opts = variant_settings(name)
        s = Settings(**{k: v for k, v in opts.items() if k not in ENGINE_KEYS},
                     engine={k: v for k, v in opts.items() if k in ENGINE_KEYS})
        assert any(get(s, k) != get(default, k) for k in opts), name


def test_step_recorder_polls_only_after_the_first_token(tmp_path):
    """The per-turn breakdown must not touch the measured engine during its prefill: the recorder
    asks the control socket (a real HTTP server on a Unix socket here) only between turns until
    the turn's first token has arrived, then until a snapshot shows the turn's first decode step."""
    import socketserver
    import threading
    import time
    from http.server import BaseHTTPRequestHandler

    (tmp_path / "run").mkdir()
    calls: list[float] = []
    state = {"decode": 0}

    class Handler(BaseHTTPRequestHandler):
        def address_string(self):  # a Unix socket has no client address
            return "unix"

        def log_message(self, *a):
            pass

        def do_GET(self):
            calls.append(time.monotonic())
            body = json.dumps({"engine": {"experts": {"passes": 1 + state["decode"], "last_passes": [],
                                                      "paths": {"decode": state["decode"]}}}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    srv = Server(str(tmp_path / "run" / "control.sock"), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        rec = bench_launch.StepRecorder(tmp_path, poll_s=0.01)
        rec.start()
        assert len(calls) == 1          # the snapshot before the first turn
        time.sleep(0.2)                 # the turn's prefill: 20 poll periods
        assert len(calls) == 1, "polled before the first token"
        rec.first_token()
        time.sleep(0.1)                 # polling now, no decode step yet
        n_waiting = len(calls)
        assert n_waiting >= 3
        state["decode"] = 1             # the turn's first decode step
        time.sleep(0.1)
        n_done = len(calls)
        assert n_done > n_waiting and rec.mid is not None and rec.mid["paths"]["decode"] == 1
        time.sleep(0.1)
        assert len(calls) == n_done     # stopped at the snapshot with the decode step
        rec.turn()                      # the snapshot after the turn; the next turn's poller waits again
        assert rec.mid is None
        time.sleep(0.1)
        assert len(calls) == n_done + 1
        th = rec._th
        rec.turn()                      # a turn that streamed no token: its poller never asked
        assert len(calls) == n_done + 2 and not th.is_alive()
        rec.stop()
        assert len(rec.rows) == 2 and rec._th is None
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("args, words", [
    (["--turns", "0"], "must be at least 1"),
    (["--sessions", "-1"], "must be at least 1"),
    (["--budget-frac", "1.5"], "must be in (0, 1]"),
    (["--budget-frac", "x"], "not a number"),
    (["--gpus", "zero"], "not a whole number"),
    (["--shape", "huge"], "invalid choice"),
])
def test_bad_options_are_one_line_errors(args, words, capsys):
    """Options the run could only reject late (after the dev traces) or with a traceback are refused
    by the parser at once: exit 2, the reason on stderr."""
    with pytest.raises(SystemExit) as e:
        be.main(args + ["--no-server"])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_watch_stops_a_server_whose_log_shows_a_crash_and_one_past_the_deadline(tmp_path):
    # real processes: one prints an abort line and then hangs (as a wedged engine would), one only
    # hangs; the watch stops the first for its log line and the second at its deadline
    import sys
    import time as _time

    from ostinatod.bench.bench_launch import Server

    code = "import sys, time; print('x.cpp:1: GGML_ASSERT(n > 0) failed', flush=True); time.sleep(120)"
    # an earlier run's crash in the same log is not this server's
    (tmp_path / "ok.log").write_text("old.cpp:9: GGML_ASSERT(old) failed\n")
    srv = Server("crashy", [sys.executable, "-c", code], dict(os.environ), tmp_path / "crashy.log")
    w = srv.watch(None, poll_s=0.1)
    try:
        t0 = _time.monotonic()
        while srv.proc.poll() is None and _time.monotonic() - t0 < 30:
            _time.sleep(0.1)
        assert srv.proc.poll() is not None
        assert w.reason == "crashy crashed: x.cpp:1: GGML_ASSERT(n > 0) failed" and w.crashed
    finally:
        w.stop()
        srv.stop()
    srv = Server("slow", [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ),
                 tmp_path / "slow.log")
    w = srv.watch(_time.monotonic() + 0.5, poll_s=0.1)
    try:
        t0 = _time.monotonic()
        while srv.proc.poll() is None and _time.monotonic() - t0 < 30:
            _time.sleep(0.1)
        assert srv.proc.poll() is not None and "time limit" in (w.reason or "") and not w.crashed
    finally:
        w.stop()
        srv.stop()
    # a healthy server is left running when the watch ends; an earlier run's crash in its log and
    # in its daemon log (extra_logs, read from the watch's start) are not its own, a new line is
    state = tmp_path / "state.log"
    state.write_text("2026-12-01 10:00:00,000 ERROR ostinatod.engine: engine worker exited with code -6\n")
    srv = Server("ok", [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ),
                 tmp_path / "ok.log")
    srv.extra_logs = (state,)
    w = srv.watch(None, poll_s=0.1)
    try:
        _time.sleep(0.5)
        assert w.reason is None and srv.proc.poll() is None
        with open(state, "a") as f:   # half a line first: read once it is whole
            f.write("2026-12-01 10:00:05,000 ERROR ostinatod.engine: engine worker exited")
        _time.sleep(0.5)
        assert w.reason is None
        with open(state, "a") as f:
            f.write(" with code -11 (1 crash in 120 s)\n")
        t0 = _time.monotonic()
        while srv.proc.poll() is None and _time.monotonic() - t0 < 30:
            _time.sleep(0.1)
        assert w.crashed and w.reason.endswith("engine worker exited with code -11 (1 crash in 120 s)"), w.reason
    finally:
        w.stop()
        srv.stop()
