"""``ostinato bench cpu-branch`` (ostinatod/bench/bench_cpu.py): the fit of a kernel's time against the
bytes it reads, the summary, and one tiny run of the real command on a synthetic model (no timing
is asserted: speed is what the stored H200 runs in docs/benchmarks report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ostinatod.residency.cost import fit_cpu_bandwidth
from ostinatod.bench import bench_cpu
from ostinatod.engine.options import EngineOptions


def _team() -> dict:
    """The CPU branch's thread team settings (process-wide; the engine's info says them)."""
    from ostinatod.engine import native

    return native.experts_json("ostinato_experts_info")["cpu_team"]


def test_fit_recovers_fixed_cost_and_bandwidth():
    # t = 20 us + bytes / 50 GB/s, exactly
    rows = [{"kernel": True, "bytes": b, "kernel_ms": 0.020 + b / 50e9 * 1e3} for b in (2e6, 4e6, 8e6, 16e6)]
    f = fit_cpu_bandwidth(rows)
    assert f["alpha_us"] == pytest.approx(20.0, abs=1e-6) and f["bw_gbps"] == pytest.approx(50.0, rel=1e-9)
    assert f["points"] == 4
    # one byte count: alpha and bw are confounded
    assert fit_cpu_bandwidth(rows[:1] * 3) is None
    # rows the kernel left to ggml do not count
    assert fit_cpu_bandwidth([dict(r, kernel=False) for r in rows]) is None


def test_summary_gives_shares_of_the_read_bandwidth_and_speedups():
    res = {"read_bw": [{"threads": 1, "gbps": 10.0}, {"threads": 4, "gbps": 40.0}],
           "rows": [{"experts": e, "tokens": 1, "threads": t, "bytes": e * 1e6, "kernel": True,
                     "kernel_ms": 0.01 + e * 1e6 / (t * 8e9) * 1e3, "kernel_gbps": e * 1e6 / (0.01 + e * 1e6 / (t * 8e9) * 1e3) / 1e6,
                     "ggml_ms": 1.0} for e in (1, 2, 4) for t in (1, 4)]}
    out = bench_cpu.summarize(res)
    r = out["rows"][0]
    assert r["kernel_share_of_read_bw"] == pytest.approx(r["kernel_gbps"] / 10.0)
    assert r["speedup_vs_ggml"] == pytest.approx(1.0 / r["kernel_ms"])
    fits = {f["threads"]: f for f in out["fits"]}
    assert fits[4]["bw_gbps"] == pytest.approx(32.0) and fits[1]["alpha_us"] == pytest.approx(10.0)
    assert fits[4]["host_read_gbps"] == 40.0


def _bench_q4_0(tmp_path, *grid):
    """``ostinato bench cpu-branch`` on a tiny synthetic Q4_0 file with the grid ``grid`` (2 reps, tiny
    read and flush buffers); returns its exit code and the file's result."""
    out = tmp_path / "cpu.json"
    rc = bench_cpu.main(["--quants", "q4_0", *grid, "--reps", "2", "--read-bw-mib", "4", "--flush-mib", "4",
                         "--work-dir", str(tmp_path), "--json", str(out)])
    return rc, json.loads(out.read_text())["results"][0] if rc == 0 else None


def test_cpu_branch_bench_command_runs_and_checks_bitwise(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    rc = bench_cpu.main(["--quants", "q8_0,q4_0", "--experts", "1,2", "--tokens", "1,2", "--threads", "1,2",
                         "--reps", "2", "--read-bw-mib", "4", "--flush-mib", "4", "--work-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["type_up"] for r in data["results"]] == ["q8_0", "q4_0"]
    rows = [r for res in data["results"] for r in res["rows"]]
    assert len(rows) == 2 * 2 * 2 * 2 and all(r["bitwise_equal"] for r in rows)
    assert all(r["kernel_gbps"] > 0 and r["ggml_gbps"] > 0 for r in rows)
    assert all(f["points"] == 2 for res in data["results"] for f in res["fits"])
    text = capsys.readouterr().out
    assert "host read bandwidth: 1 threads" in text and "| alpha us |" in text


def test_cpu_branch_bench_runs_the_kernel_at_each_prefetch_distance_bitwise(tmp_path):
    # the software prefetch moves fetches only: every distance's rows are llama.cpp's bit for bit,
    # each distance gets its own fit, and the engine's own setting is back afterwards
    from ostinatod.engine import native

    rc, res = _bench_q4_0(tmp_path, "--experts", "1,3", "--tokens", "1,3", "--threads", "2", "--prefetch-rows", "0,1,3")
    assert rc == 0
    assert sorted({r["prefetch_rows"] for r in res["rows"]}) == [0, 1, 3]
    assert len(res["rows"]) == 2 * 2 * 3 and all(r["bitwise_equal"] for r in res["rows"])
    assert sorted({(f["tokens"], f["prefetch_rows"]) for f in res["fits"]}) == \
        [(n, pf) for n in (1, 3) for pf in (0, 1, 3)]
    # ggml timed once per shape and thread count, at the first distance; every distance compared with it
    assert all(("ggml_ms" in r) == (r["prefetch_rows"] == 0) for r in res["rows"])
    assert all(r["speedup_vs_ggml"] > 0 for r in res["rows"])
    assert _team()["prefetch_rows"] == 0   # the team's distance is back: 0 again, not 3
    with pytest.raises(ValueError):
        EngineOptions(cpu_branch_prefetch_rows=65)


def test_cpu_branch_bench_runs_the_kernel_with_claims_and_with_barriers_bitwise(tmp_path):
    # the claim board (threads take a layer's items one at a time, the thread completing a phase opens
    # the next) and the barrier team compute the same rows: both llama.cpp's bit for bit, on 1 and 3
    # tokens (3: the input's quantisation is a phase of its own), 1 and 3 experts, 3 threads; each
    # gets its own fit, the phases end within the run, and the engine's mode is back afterwards
    rc, res = _bench_q4_0(tmp_path, "--experts", "1,3", "--tokens", "1,3", "--threads", "3", "--claims", "1,0")
    assert rc == 0
    assert sorted({r["claims"] for r in res["rows"]}) == [0, 1]
    assert len(res["rows"]) == 2 * 2 * 2 and all(r["bitwise_equal"] for r in res["rows"])
    assert all(("ggml_ms" in r) == (r["claims"] == 1) for r in res["rows"])
    assert sorted({(f["tokens"], f["claims"]) for f in res["fits"]}) == [(n, c) for n in (1, 3) for c in (0, 1)]
    for r in res["rows"]:
        ph = r["phases_us"]
        assert ph["gate_up"] > 0 and ph["down"] > 0 and max(ph["gate_up"], ph["down"]) <= ph["total"]
        # with barriers every thread takes part; on the board at least the caller
        assert r["threads_used"] == 3 if r["claims"] == 0 else 1 <= r["threads_used"] <= 3
    from ostinatod.engine import native

    assert _team()["claims"] is True   # the team's mode is back after the bench


def test_cpu_branch_bench_runs_the_kernel_at_each_spin_count_bitwise(tmp_path):
    # how long a waiting team thread spins before it yields changes when threads run, never what
    # they compute: every spin count's rows are llama.cpp's bit for bit, each gets its own fit, and
    # ggml is timed at the first only
    rc, res = _bench_q4_0(tmp_path, "--experts", "1,3", "--tokens", "1,3", "--threads", "2", "--spins", "0,100000")
    assert rc == 0
    assert sorted({r["spins"] for r in res["rows"]}) == [0, 100000]
    assert len(res["rows"]) == 2 * 2 * 2 and all(r["bitwise_equal"] for r in res["rows"])
    assert all(("ggml_ms" in r) == (r["spins"] == 0) for r in res["rows"])
    assert sorted({(f["tokens"], f["spins"]) for f in res["fits"]}) == [(n, sp) for n in (1, 3) for sp in (0, 100000)]
    from ostinatod.engine import native

    assert _team()["spins"] == 256   # the team's count is back after the bench, not 100000
    with pytest.raises(ValueError):
        EngineOptions(cpu_branch_spins=-1)


def test_cpu_branch_bench_reads_each_memory_kind_bitwise_and_times_the_phases(tmp_path, capsys):
    # the same experts from the model's memory, a 4 KiB-page copy and a huge-page copy: outputs are
    # llama.cpp's bit for bit from each, each kind gets its read bandwidth, its page sizes and its
    # own fit, ggml is timed once (on the model's memory), and every kernel row says where its time
    # went, phase by phase, within the run's total
    rc, res = _bench_q4_0(tmp_path, "--experts", "1,3", "--tokens", "1,3", "--threads", "1,2", "--memory", "model,anon,huge")
    assert rc == 0
    assert [m["memory"] for m in res["memories"]] == ["model", "anon", "huge"]
    assert all(len(m["read_bw"]) == 2 and all(b["gbps"] > 0 for b in m["read_bw"]) for m in res["memories"])
    assert all(m["info"]["smaps"]["Rss_kib"] > 0 for m in res["memories"])
    assert res["memories"][0]["info"]["smaps"]["mapping"].endswith(".gguf")   # the model's own map
    assert res["memories"][1]["info"]["smaps"]["mapping"] == "[anonymous]"
    assert len(res["rows"]) == 3 * 2 * 2 * 2 and all(r["bitwise_equal"] for r in res["rows"])
    assert all(("ggml_ms" in r) == (r["memory"] == "model") for r in res["rows"])
    assert sorted({f["memory"] for f in res["fits"]}) == ["anon", "huge", "model"]
    for r in res["rows"]:
        ph = r["phases_us"]
        assert ph["gate_up"] > 0 and ph["down"] > 0 and min(ph.values()) >= 0
        # each run's phases lie within its total, so each phase's median within the total's (their
        # sum need not: medians of different runs)
        assert max(ph["prepare"], ph["quant"], ph["gate_up"], ph["act"], ph["down"]) <= ph["total"]
        # the team's start: none on one thread; on the claim board only threads that took an item count
        assert 1 <= r["threads_used"] <= r["threads"] and (r["threads"] > 1 or ph["wake"] == 0)
        assert (ph["quant"] > 0) == (r["tokens"] > 1 and r["threads"] > 1)   # one token: quantised by prepare
    text = capsys.readouterr().out
    assert "where the kernel's time went" in text and "| huge |" in text


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--experts", "x"], ["--model", "/nonexistent.gguf"],
                                  ["--reps", "0"], ["--prefetch-rows", "-1"], ["--prefetch-rows", "65"],
                                  ["--memory", "model,disk"]])
def test_cpu_branch_bench_refuses_bad_arguments(argv, capsys):
    try:
        rc = bench_cpu.main(argv)
    except SystemExit as e:   # argparse's own refusal
        rc = e.code
    assert rc == 2
    assert "cpu-branch" in capsys.readouterr().err


def test_cpu_branch_bench_runs_the_kernel_with_each_row_pairs_mode_bitwise(tmp_path):
    # the row-pair dot products (native/src/cpu_branch/dot.h) change how many rows one pass takes,
    # never what is computed: vec_dot row by row, AVX2 pairs and AVX-512 pairs (AVX2 where the CPU
    # lacks AVX-512) give llama.cpp's rows bit for bit; the engine's mode is back afterwards
    from ostinatod.engine import native

    rc, res = _bench_q4_0(tmp_path, "--experts", "1,3", "--tokens", "1,3", "--threads", "2", "--row-pairs", "0,1,2")
    assert rc == 0
    assert sorted({r["row_pairs"] for r in res["rows"]}) == [0, 1, 2]
    assert len(res["rows"]) == 2 * 2 * 3 and all(r["bitwise_equal"] for r in res["rows"])
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "avx2" in cpuinfo.read_text().split():   # x86 with AVX2: the pairs run
        assert all((r["row_pairs_isa"] == "off") == (r["row_pairs"] == 0) for r in res["rows"])
        assert all("q4_0" in r["row_pairs_types"] for r in res["rows"] if r["row_pairs"] > 0)
    else:   # elsewhere every mode falls back to vec_dot row by row
        assert all(r["row_pairs_isa"] == "off" for r in res["rows"])
    assert all(("ggml_ms" in r) == (r["row_pairs"] == 0) for r in res["rows"])
    assert _team()["row_pairs"] == 0   # the team's mode is back: off again, not 2
    with pytest.raises(ValueError):
        EngineOptions(cpu_branch_row_pairs="avx1024")
