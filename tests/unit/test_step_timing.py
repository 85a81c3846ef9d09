"""The worker's per-step wall-clock parts (ostinatod/engine/step_timing.py): what a step's wall is,
which steps are summed, the phases, and the arithmetic on two snapshots the bench uses."""

from __future__ import annotations

import pytest

from ostinatod.engine.step_timing import STEP_TIMING_KEYS, StepClock, delta, per_step

MS = 1_000_000  # ns


def _step(clk: StepClock, start: int, n_prompt: int = 0, n: int = 1, call: int = 4, wait: int = 1,
          sample: int = 1, out: int = 1, pipe: int = 0) -> None:
    """One step starting at ``start`` ms: call (of it wait) ms, one token sampled and handed out."""
    clk.begin(start * MS)
    clk.called(start * MS, (start + call - wait) * MS)
    t = start + call - wait + 0.5   # bookkeeping between the call's return and the logits read
    clk.logits(int(t * MS), int((t + wait) * MS))
    clk.token(sample * MS, out * MS, pipe * MS)
    clk.end(n_prompt, n)


def test_a_decode_steps_wall_runs_to_the_next_steps_start_and_parts_sum():
    clk = StepClock()
    _step(clk, 0, n_prompt=100, n=100, call=20, wait=0, out=1, pipe=1)   # prefill pass samples token 1
    _step(clk, 30, pipe=1)      # decode steps 10 ms apart
    _step(clk, 40)
    _step(clk, 50)              # the request's last step: the loop waits after it
    clk.idle()
    s = clk.snapshot()
    assert list(s) == list(STEP_TIMING_KEYS)
    assert (s["prefill_passes"], s["prefill_tokens"], s["prefill_sampled"]) == (1, 100, 0)
    assert s["prefill_wall_ms"] == 30 and s["prefill_call_ms"] == 20 and s["prefill_pipe_ms"] == 1
    # two decode steps closed by the next step; the last one is counted apart, not summed
    assert (s["decode_steps"], s["decode_tokens"], s["steps_before_idle"]) == (2, 2, 1)
    assert s["decode_wall_ms"] == 20 and s["decode_call_ms"] == 8 and s["decode_wait_ms"] == 2
    assert (s["decode_sample_ms"], s["decode_out_ms"], s["decode_pipe_ms"]) == (2, 2, 1)
    m = per_step(s, "decode")
    assert m == pytest.approx({"wall_ms": 10, "call_ms": 4, "wait_ms": 1, "sample_ms": 1, "out_ms": 1,
                               "pipe_ms": 0.5, "other_ms": 4})
    assert m["call_ms"] + m["sample_ms"] + m["out_ms"] + m["other_ms"] == pytest.approx(m["wall_ms"])
    p = per_step(s, "prefill")
    assert p["wall_ms"] == 30 and p["other_ms"] == pytest.approx(30 - 20 - 1 - 1)


def test_idle_drops_only_an_open_step_and_a_failed_step_is_not_counted():
    clk = StepClock()
    clk.idle()                  # nothing open: nothing counted
    _step(clk, 0)
    clk.drop()                  # llama_decode failed
    _step(clk, 10)
    clk.idle()
    clk.idle()                  # the loop waits on: counted once
    _step(clk, 1000)            # a new request's first decode step: no wall from the idle time
    _step(clk, 1010)
    s = clk.snapshot()
    assert (s["decode_steps"], s["steps_before_idle"], s["decode_wall_ms"]) == (1, 1, 10)


def test_a_step_with_prompt_tokens_beside_generated_ones_is_a_prefill_pass():
    clk = StepClock()
    _step(clk, 0, n_prompt=32, n=34)   # two generating slots' tokens beside a prompt chunk
    _step(clk, 50, n=2)
    _step(clk, 60)
    s = clk.snapshot()
    assert (s["prefill_passes"], s["prefill_tokens"], s["prefill_sampled"]) == (1, 32, 2)
    assert (s["decode_steps"], s["decode_tokens"]) == (1, 2) and s["decode_wall_ms"] == 10


def test_delta_and_per_step_of_two_snapshots():
    clk = StepClock()
    _step(clk, 0)
    _step(clk, 10)
    a = clk.snapshot()
    _step(clk, 22)
    _step(clk, 34)
    b = clk.snapshot()
    d = delta(a, b)
    assert (d["decode_steps"], d["decode_wall_ms"]) == (2, 24)
    assert per_step(d, "decode")["wall_ms"] == 12
    assert per_step(d, "prefill") is None      # no prefill pass in between
    assert delta(None, b) is None and delta(a, {"decode_steps": 1}) is None
    assert per_step(None, "decode") is None
