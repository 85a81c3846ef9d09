"""Wall-clock parts of the worker loop's steps, recorded for every engine the daemon runs (the
native expert engine and stock llama.cpp alike): cheap enough to stay on (a few
``time.perf_counter_ns`` reads per step, one uncontended lock; no device sync is added).

A *step* is one forward pass of the loop (:meth:`.worker_step.StepMixin._step`): a *decode step*
carries only generated tokens (one per generating slot), a *prefill pass* carries prompt tokens
(and maybe generated tokens of other slots beside them). Each step is split into:

- **call**: the ``llama_decode`` call plus the wait for its logits: the host's first read of them
  (``llama_synchronize`` just before the first sample, the wait the sampler's own logits read would
  do at that point), so that on a GPU it is the pass as the host sees it. The worker's few
  bookkeeping lines between the call's return and that read (the slots' token lists) are not in it;
- **sample**: sampling the next token of each slot that samples (grammar included);
- **out**: from a sampled token to its delta written: end-of-generation check, detokenising, stop
  strings, the output parser, log-probabilities, and of it **pipe**: the delta event's encoding and
  write to the worker pipe (the emit callback: on the worker process, the JSON line on the protocol
  stream);
- the **wall**: from the step's start to the next step's start (the loop's other work in between:
  the inbox, admission, the batch, bookkeeping), so that a decode step's wall is the interval
  between a generating request's tokens as the worker sees it. A step after which the loop waited
  for work (the last step of a request, whose done event is sent then) has no such interval: it is
  counted in ``steps_before_idle`` and left out of the sums.

:meth:`StepClock.snapshot` gives the cumulative sums (``Worker.stats()["step_timing"]``,
:class:`.stats.StepTiming`); :func:`delta` and :func:`per_step` are the pure arithmetic the bench
uses on two snapshots."""

from __future__ import annotations

import threading
from time import perf_counter_ns
from typing import Any, Optional

# the parts summed per phase (decode_<part>_ms over decode steps, prefill_<part>_ms over prefill
# passes) and the counts
PARTS = ("wall", "call", "wait", "sample", "out", "pipe")
COUNTS = ("decode_steps", "decode_tokens", "prefill_passes", "prefill_tokens", "prefill_sampled",
          "steps_before_idle")
# the keys of a snapshot, in order: counts (int) and sums in ms (float)
STEP_TIMING_KEYS = (*COUNTS[:2], *(f"decode_{p}_ms" for p in PARTS), *COUNTS[2:5],
                    *(f"prefill_{p}_ms" for p in PARTS), COUNTS[5])

_NS_PER_MS = 1_000_000


class StepClock:
    """Accumulates the parts of the worker's steps (module docstring), on the loop thread;
    :meth:`snapshot` may be called from any thread.

    Per step the loop calls :meth:`begin` at its start, :meth:`called` around ``llama_decode``,
    :meth:`logits` around its first logits read, :meth:`token` per sampled token
    and :meth:`end`; :meth:`idle` when the loop is about to wait for work. Times are
    ``perf_counter_ns`` values (ns)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ns = {f"{ph}_{p}": 0 for ph in ("decode", "prefill") for p in PARTS}
        self._n = dict.fromkeys(COUNTS, 0)
        # the last step, until the next begins: (phase, its tokens, generated tokens beside prompt ones)
        self._open: Optional[tuple[str, int, int]] = None
        self._start = 0
        self._parts = dict.fromkeys(PARTS[1:], 0)

    def begin(self, now: Optional[int] = None) -> None:
        """A step starts (``now``: ns; default the clock): the step before it, if the loop did
        not wait since, gets its wall and joins the sums."""
        now = perf_counter_ns() if now is None else now
        if self._open is not None:
            self._close(now)
        self._start = now
        p = self._parts
        p["call"] = p["wait"] = p["sample"] = p["out"] = p["pipe"] = 0

    def called(self, t0: int, t1: int) -> None:
        """``llama_decode`` ran from ``t0`` to ``t1`` (ns)."""
        self._parts["call"] += t1 - t0

    def logits(self, t0: int, t1: int) -> None:
        """The first logits read of the step waited from ``t0`` to ``t1`` (ns): part of the call."""
        self._parts["call"] += t1 - t0
        self._parts["wait"] += t1 - t0

    def token(self, sample_ns: int, out_ns: int, pipe_ns: int) -> None:
        """One token sampled in ``sample_ns`` and handed out in ``out_ns``, of which ``pipe_ns``
        writing its delta events (ns)."""
        p = self._parts
        p["sample"] += sample_ns
        p["out"] += out_ns
        p["pipe"] += pipe_ns

    def end(self, n_prompt: int, n_tokens: int) -> None:
        """The step's forward pass carried ``n_prompt`` prompt tokens (0: a decode step) and
        ``n_tokens`` tokens in all; it is closed by the next :meth:`begin` or :meth:`idle`."""
        if n_prompt:
            self._open = ("prefill", n_prompt, n_tokens - n_prompt)
        else:
            self._open = ("decode", n_tokens, 0)

    def drop(self) -> None:
        """The step failed (no figures): it is not counted."""
        self._open = None

    def idle(self) -> None:
        """The loop is about to wait for work: the open step has no following step (not summed)."""
        if self._open is not None:
            self._open = None
            with self._lock:
                self._n["steps_before_idle"] += 1

    def _close(self, now: int) -> None:
        phase, n, sampled = self._open  # type: ignore[misc]
        self._open = None
        p, ns = self._parts, self._ns
        with self._lock:
            ns[phase + "_wall"] += now - self._start
            for k, v in p.items():
                ns[f"{phase}_{k}"] += v
            if phase == "decode":
                self._n["decode_steps"] += 1
                self._n["decode_tokens"] += n
            else:
                self._n["prefill_passes"] += 1
                self._n["prefill_tokens"] += n
                self._n["prefill_sampled"] += sampled

    def snapshot(self) -> dict[str, Any]:
        """The cumulative figures since the worker started, keys :data:`STEP_TIMING_KEYS`:
        ``decode_steps`` (decode steps summed), ``decode_tokens`` (tokens they computed: one per
        generating slot), ``decode_{wall,call,wait,sample,out,pipe}_ms`` (sums over those steps,
        ms; module docstring), ``prefill_passes``, ``prefill_tokens`` (prompt tokens in them),
        ``prefill_sampled`` (generated tokens beside them), ``prefill_*_ms`` (the same sums over
        prefill passes) and ``steps_before_idle`` (steps not summed: the loop waited after them)."""
        with self._lock:
            ns, n = dict(self._ns), dict(self._n)
        out: dict[str, Any] = {}
        for k in STEP_TIMING_KEYS:
            out[k] = n[k] if k in n else round(ns[k[:-3]] / _NS_PER_MS, 4)
        return out


def delta(prev: Optional[dict[str, Any]], cur: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``cur - prev`` per key of two :meth:`StepClock.snapshot` dicts (the figures of the steps in
    between, same units); None when either is missing or a key is absent from either."""
    if not prev or not cur or any(k not in prev or k not in cur for k in STEP_TIMING_KEYS):
        return None
    return {k: (cur[k] - prev[k]) if k in COUNTS else round(cur[k] - prev[k], 4) for k in STEP_TIMING_KEYS}


def per_step(d: Optional[dict[str, Any]], phase: str) -> Optional[dict[str, float]]:
    """Means per step of ``phase`` ("decode": per decode step; "prefill": per prefill pass) of a
    snapshot or :func:`delta` ``d``, in ms: ``{"wall_ms", "call_ms", "wait_ms", "sample_ms",
    "out_ms", "pipe_ms", "other_ms"}`` (``other_ms`` = wall - call - sample - out: the loop's work
    outside those parts; ``wait_ms`` is part of ``call_ms``, ``pipe_ms`` of ``out_ms``). None
    without such steps."""
    if not d:
        return None
    n = d.get("decode_steps" if phase == "decode" else "prefill_passes") or 0
    if n <= 0:
        return None
    m = {f"{p}_ms": d[f"{phase}_{p}_ms"] / n for p in PARTS}
    m["other_ms"] = m["wall_ms"] - m["call_ms"] - m["sample_ms"] - m["out_ms"]
    return m
