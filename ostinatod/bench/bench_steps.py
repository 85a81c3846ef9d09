"""``ostinato bench engines``: where a step's time goes at the engine worker, for every daemon engine
(``ostinato``, its variants and the ``stock-*`` engines alike): the worker's wall-clock parts of
each step (``engine.step_timing`` of the control API's snapshots, docs/engine.md "Stats"; the
arithmetic is :mod:`ostinatod.engine.step_timing`'s) per turn and per run, beside the client's
decode ms/token and, for Ostinato's engines, the native pass times; and their markdown table."""

from __future__ import annotations

import statistics
from typing import Any, Optional

from ..engine.step_timing import COUNTS, PARTS, delta, per_step
from .bench_common import fmt


def timing_turn(prev: Optional[dict[str, Any]], cur: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """One turn's step timing: the difference of the engine's ``step_timing`` snapshots taken
    before (``prev``) and after (``cur``) it (:func:`ostinatod.engine.step_timing.delta`); None
    when either is missing."""
    return delta(prev, cur)


def _sum(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [*COUNTS, *(f"{ph}_{p}_ms" for ph in ("decode", "prefill") for p in PARTS)]
    return {k: sum(r[k] for r in rows) for k in keys}


def _r(x: Optional[float], nd: int = 4) -> Optional[float]:
    return None if x is None else round(x, nd)


def _decode(pairs: list[tuple[dict[str, Any], dict[str, Any]]], native_ms: Optional[float]) -> dict[str, Any]:
    # the turns whose client ms/token is known: the worker's means and the client's over the same steps
    pairs = [(r, t) for r, t in pairs if r["decode_steps"] > 0 and t.get("tpot_s") is not None
             and not t.get("error")]
    tot = _sum([r for r, _ in pairs]) if pairs else None
    m = per_step(tot, "decode") or {}
    out: dict[str, Any] = {"steps": tot["decode_steps"] if tot else 0, "tokens": tot["decode_tokens"] if tot else 0,
                           **{k: _r(v) for k, v in m.items()}, "turns": len(pairs)}
    if pairs:
        n = tot["decode_steps"]
        client = sum(1e3 * t["tpot_s"] * r["decode_steps"] for r, t in pairs) / n
        per_turn = [1e3 * t["tpot_s"] - r["decode_wall_ms"] / r["decode_steps"] for r, t in pairs]
        out.update(client_ms=_r(client), outside_ms=_r(client - m["wall_ms"]),
                   outside_turn_median_ms=_r(statistics.median(per_turn)))
    if native_ms is not None and m:
        out["native_pass_ms"] = _r(native_ms)
        out["call_outside_native_ms"] = _r(m["call_ms"] - native_ms)
    return out


def _prefill(rows: list[dict[str, Any]], native_ms: Optional[float]) -> dict[str, Any]:
    rows = [r for r in rows if r["prefill_passes"] > 0]
    if not rows:
        return {"prefills": 0, "passes": 0}
    tot = _sum(rows)
    m = per_step(tot, "prefill") or {}
    n = len(rows)
    out: dict[str, Any] = {"prefills": n, "passes": tot["prefill_passes"],
                           "tokens_per_pass": _r(tot["prefill_tokens"] / tot["prefill_passes"], 1),
                           **{k: _r(v) for k, v in m.items()},
                           "per_prefill": {"wall_ms": _r(tot["prefill_wall_ms"] / n),
                                           "call_ms": _r(tot["prefill_call_ms"] / n)}}
    if native_ms is not None:
        out["per_prefill"]["native_pass_ms"] = _r(native_ms)
        out["per_prefill"]["call_outside_native_ms"] = _r(tot["prefill_call_ms"] / n - native_ms)
    return out


def summarize_worker(rows: list[Optional[dict[str, Any]]], turns: list[dict[str, Any]],
                     native: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The worker's step timing of one engine's run, from per-turn rows (:func:`timing_turn`;
    None: no snapshot) aligned with its replay turns (``tpot_s``, ``after``, ``error``;
    :func:`.bench_report.replay_turns`), and for an Ostinato engine its native ``step_breakdown``
    (:func:`.bench_breakdown.summarize_breakdown`: the native pass's ``total_ms``).

    Returns ``{"decode": {"steps", "tokens", "wall_ms", "call_ms", "wait_ms", "sample_ms",
    "out_ms", "pipe_ms", "other_ms" (means per decode step over the turns with the client's
    ms/token, ms; :func:`.step_timing.per_step`), "client_ms" (the client's ms/token of those turns,
    weighted by their decode steps: a mean over the same steps), "outside_ms" (``client_ms`` minus
    ``wall_ms``), "outside_turn_median_ms" (per turn the client's ms/token minus the worker's wall
    per step, median over the turns), "turns", and with native stats "native_pass_ms" (the native
    pass's ``total_ms`` per decode step, :func:`.bench_breakdown.summarize_breakdown`'s mean over
    every decode step of the turns, the last of each included) and "call_outside_native_ms"
    (``call_ms`` minus it)}, "prefill" and
    "prefill_after_tool": {"prefills", "passes", "tokens_per_pass", the same means per prefill pass,
    "per_prefill": {"wall_ms", "call_ms"[, "native_pass_ms", "call_outside_native_ms"]}},
    "turns", "turns_with_stats", "source"}``."""
    pairs = [(r, t) for r, t in zip(rows, turns) if r]
    nat = native or {}

    def native_ms(part: str) -> Optional[float]:
        return ((nat.get(part) or {}).get("mean_ms") or {}).get("total_ms")

    after = [r for r, t in pairs if t.get("after") == "tool"]
    return {"decode": _decode(pairs, native_ms("decode_step")),
            "prefill": _prefill([r for r, _ in pairs], native_ms("prefill")),
            "prefill_after_tool": _prefill(after, native_ms("prefill_after_tool")),
            "turns": len(rows), "turns_with_stats": len(pairs),
            "source": "the engine worker's step timing (control API /metrics, engine.step_timing) before "
                      "and after every turn: perf_counter in the worker's loop; the client's ms/token "
                      "from the replay"}


# (label, section, key, digits): the markdown's rows; a row without a value in any engine is left out
ROWS = (("decode: client ms/token (mean over the same steps)", "decode", "client_ms", 3),
        ("decode: wall at the worker per step", "decode", "wall_ms", 3),
        ("decode: llama_decode call to logits", "decode", "call_ms", 3),
        ("decode: of it the wait for the logits", "decode", "wait_ms", 3),
        ("decode: of it the native pass (total_ms)", "decode", "native_pass_ms", 3),
        ("decode: of it outside the native pass", "decode", "call_outside_native_ms", 3),
        ("decode: sampling", "decode", "sample_ms", 3),
        ("decode: token out (detokenise, stops, parser, delta)", "decode", "out_ms", 3),
        ("decode: of it the delta's write to the pipe", "decode", "pipe_ms", 3),
        ("decode: other worker (batch, bookkeeping, loop)", "decode", "other_ms", 3),
        ("decode: outside the worker (client - worker wall)", "decode", "outside_ms", 3),
        ("prefill pass: wall", "prefill", "wall_ms", 2),
        ("prefill pass: llama_decode call (to logits at the last)", "prefill", "call_ms", 2),
        ("prefill pass: around the call (wall - call)", "prefill", "around_ms", 2),
        ("prefill: passes / tokens per pass", "prefill", "passes_tokens", 0),
        ("prefill: llama_decode calls per prefill", "prefill", "per_prefill.call_ms", 2),
        ("prefill: of it the native passes (total_ms)", "prefill", "per_prefill.native_pass_ms", 2),
        ("prefill: of it outside the native passes", "prefill", "per_prefill.call_outside_native_ms", 2))


def _cell(w: dict[str, Any], section: str, key: str, nd: int) -> Optional[str]:
    s = w.get(section) or {}
    if key == "around_ms":
        v = None if s.get("wall_ms") is None or s.get("call_ms") is None else s["wall_ms"] - s["call_ms"]
    elif key == "passes_tokens":
        return f"{s['passes']} / {fmt(s.get('tokens_per_pass'), '', 1)}" if s.get("passes") else None
    elif "." in key:
        a, b = key.split(".")
        v = (s.get(a) or {}).get(b)
    else:
        v = s.get(key)
    return None if v is None else fmt(v, "", nd)


def worker_md(engines: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines of the worker's step timing of every engine that has it (``step_breakdown``
    ``["worker"]``, :func:`summarize_worker`), an engine per column; a value an engine does not have
    (the native pass for stock llama.cpp) is an empty cell, a row no engine has is left out."""
    ws = {n: e["step_breakdown"]["worker"] for n, e in engines.items()
          if isinstance((e.get("step_breakdown") or {}).get("worker"), dict)}
    if not ws:
        return []
    names = list(ws)
    out = ["", "Per-step time at the engine worker (every daemon engine; the worker's perf_counter around "
           "the parts of its loop, mean ms per decode step (one token of the request) and per prefill pass; "
           "the client's figures from the replay):", "",
           "| ms | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, section, key, nd in ROWS:
        cells = [_cell(ws[n], section, key, nd) for n in names]
        if any(c is not None for c in cells):
            out.append(f"| {label} | " + " | ".join(c or "" for c in cells) + " |")
    return out
