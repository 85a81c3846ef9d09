"""The bench's worker step timing (ostinatod/bench/bench_steps.py): per-turn rows from snapshots,
the run's summary beside the client's ms/token and the native pass, and its markdown rows (native
rows only for engines that have them, never zeros for those that do not)."""

from __future__ import annotations

import pytest

from ostinatod.bench.bench_steps import summarize_worker, timing_turn, worker_md
from ostinatod.engine.step_timing import STEP_TIMING_KEYS, COUNTS


def _snap(**kw) -> dict:
    d = {k: (0 if k in COUNTS else 0.0) for k in STEP_TIMING_KEYS}
    d.update(kw)
    return d


def _turn(steps: int, wall: float, call: float, sample: float, out: float, passes: int = 1,
          pre_wall: float = 50.0, pre_call: float = 40.0) -> dict:
    """A turn's row: ``steps`` decode steps of the given per-step ms, ``passes`` prefill passes."""
    return timing_turn(_snap(), _snap(
        decode_steps=steps, decode_tokens=steps, decode_wall_ms=steps * wall, decode_call_ms=steps * call,
        decode_wait_ms=steps * 0.1, decode_sample_ms=steps * sample, decode_out_ms=steps * out,
        decode_pipe_ms=steps * out / 2, prefill_passes=passes, prefill_tokens=300 * passes,
        prefill_wall_ms=pre_wall * passes, prefill_call_ms=pre_call * passes))


def test_summary_means_per_step_and_outside_the_worker_per_turn():
    rows = [_turn(10, 6.0, 5.0, 0.3, 0.2), _turn(30, 7.0, 5.5, 0.3, 0.2, passes=2), None]
    turns = [{"tpot_s": 0.0065, "after": "first"}, {"tpot_s": 0.0080, "after": "tool"}, {"tpot_s": 0.009}]
    w = summarize_worker(rows, turns)
    d = w["decode"]
    assert (d["steps"], d["tokens"], d["turns"]) == (40, 40, 2)
    assert d["wall_ms"] == pytest.approx((60 + 210) / 40) and d["call_ms"] == pytest.approx((50 + 165) / 40)
    assert d["other_ms"] == pytest.approx(d["wall_ms"] - d["call_ms"] - d["sample_ms"] - d["out_ms"])
    assert d["call_ms"] + d["sample_ms"] + d["out_ms"] <= d["wall_ms"]
    # the client's ms/token over the same steps (6.5 x 10 + 8.0 x 30) / 40, minus the worker's wall;
    # per turn 6.5 - 6.0 and 8.0 - 7.0, median 0.75; the turn without a snapshot is left out
    assert d["client_ms"] == pytest.approx(7.625) and d["outside_ms"] == pytest.approx(7.625 - 6.75)
    assert d["outside_turn_median_ms"] == pytest.approx(0.75)
    assert "native_pass_ms" not in d   # no native stats: the row is absent, not 0
    p = w["prefill"]
    assert (p["prefills"], p["passes"], p["tokens_per_pass"]) == (2, 3, 300.0)
    assert p["wall_ms"] == 50 and p["per_prefill"] == {"wall_ms": 75.0, "call_ms": 60.0}
    assert w["prefill_after_tool"]["prefills"] == 1 and (w["turns"], w["turns_with_stats"]) == (3, 2)


def test_native_pass_rows_and_the_markdown():
    rows = [_turn(10, 6.0, 5.0, 0.3, 0.2)]
    turns = [{"tpot_s": 0.007, "after": "tool"}]
    native = {"decode_step": {"mean_ms": {"total_ms": 4.5}}, "prefill": {"mean_ms": {"total_ms": 30.0}},
              "prefill_after_tool": {"mean_ms": {"total_ms": 30.0}}}
    ours = summarize_worker(rows, turns, native)
    assert ours["decode"]["native_pass_ms"] == 4.5 and ours["decode"]["call_outside_native_ms"] == pytest.approx(0.5)
    assert ours["prefill"]["per_prefill"]["call_outside_native_ms"] == pytest.approx(10.0)
    stock = summarize_worker([_turn(10, 4.0, 3.5, 0.3, 0.1)], [{"tpot_s": 0.0045, "after": "tool"}])
    eng = {"ostinato": {"step_breakdown": {"decode_step": {}, "worker": ours}},
           "stock-all-gpu": {"step_breakdown": {"worker": stock}}, "llama-server": {}}
    md = worker_md(eng)
    assert md[3] == "| ms | ostinato | stock-all-gpu |"
    row = {line.split(" | ")[0][2:]: line for line in md if line.startswith("| ")}
    assert row["decode: wall at the worker per step"].endswith("| 6.000 | 4.000 |")
    assert row["decode: of it the native pass (total_ms)"].endswith("| 4.500 |  |")   # empty for stock
    assert row["decode: outside the worker (client - worker wall)"].endswith("| 1.000 | 0.500 |")
    assert row["prefill: passes / tokens per pass"].endswith("| 1 / 300.0 | 1 / 300.0 |")
    assert worker_md({"llama-server": {}}) == []
