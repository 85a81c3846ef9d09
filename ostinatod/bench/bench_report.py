"""``ostinato bench engines``: the figures of a run and their reporting: per-engine metrics from the
replay turns, ratios to the best stock engine and to the limit, the machine, and the markdown
tables (the per-step breakdown of the Ostinato engine is :mod:`.bench_breakdown`, the worker's step
timing of every daemon engine :mod:`.bench_steps`)."""

from __future__ import annotations

import platform
import statistics
from pathlib import Path
from typing import Any, Optional

import psutil

from ..residency import planner
from .bench_breakdown import breakdown_md
from .bench_common import LIMIT, METRICS, ONE_GPU, STOCK, fmt, is_peer
from .bench_steps import worker_md


BUCKETS = ((0, 128, "<128"), (128, 512, "128-511"), (512, 2048, "512-2047"), (2048, 1 << 62, ">=2048"))


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------

def _med(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def replay_turns(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Flatten a replay JSON into turn dicts: {session, ttft_s, tpot_s, total_s, new_tokens,
    completion_tokens, after (tool|user|first), error}."""
    out = []
    for s in data.get("sessions", []):
        for i, t in enumerate(s.get("turns", [])):
            u = t.get("usage") or {}
            prompt = t.get("prompt_tokens", u.get("prompt_tokens"))
            cached = t.get("cached_tokens", u.get("cached_tokens")) or 0
            new = t.get("new_tokens", t.get("prefilled_tokens"))
            if new is None and prompt is not None:
                new = prompt - cached
            after = t.get("after") or t.get("kind") or ("first" if i == 0 else None)
            out.append({"session": s.get("id"), "ttft_s": t.get("ttft_s"), "tpot_s": t.get("tpot_s"),
                        "total_s": t.get("total_s"), "new_tokens": new,
                        "completion_tokens": t.get("completion_tokens", u.get("completion_tokens")),
                        "after": after, "error": t.get("error")})
    return out


def engine_metrics(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-engine figures from its replay turns (see module docstring)."""
    ok = [t for t in turns if not t.get("error")]
    buckets = {}
    for lo, hi, name in BUCKETS:
        xs = [t["ttft_s"] for t in ok if t["new_tokens"] is not None and lo <= t["new_tokens"] < hi]
        buckets[name] = {"median_s": _med(xs), "turns": len(xs)}
    tpot = _med([t["tpot_s"] for t in ok])
    sessions: dict[str, float] = {}
    for t in ok:
        sessions[t["session"]] = sessions.get(t["session"], 0.0) + (t["total_s"] or 0.0)
    return {
        "decode_ms_per_token": tpot * 1e3 if tpot is not None else None,
        "ttft_after_tool_median_s": _med([t["ttft_s"] for t in ok if t["after"] == "tool"]),
        "ttft_after_user_median_s": _med([t["ttft_s"] for t in ok if t["after"] == "user"]),
        "ttft_median_s": _med([t["ttft_s"] for t in ok]),
        "new_tokens_median": _med([t["new_tokens"] for t in ok if t["new_tokens"] is not None]),
        "prefill_by_new_tokens": buckets,
        "session_total_s": sum(sessions.values()) if ok else None,
        "turns": len(turns), "errors": len(turns) - len(ok),
    }


def ratios_vs_limit(engines: dict[str, dict[str, Any]], o: Optional[dict[str, Any]] = None
                    ) -> dict[str, Any]:
    """Ostinato (``o``, default ``engines["ostinato"]``) divided by ``stock-all-gpu`` per metric: the
    slowdown factor against every expert on the GPU (1 = the limit; docs/design.md's targets at a 45% pool:
    decode <= 1.4, TTFT after tool <= 1.6, session <= 1.5). None where either figure is missing."""
    o = engines.get("ostinato") or {} if o is None else o
    lim = engines.get(LIMIT) or {}
    return {key: (round(o[m] / lim[m], 3) if o.get(m) and lim.get(m) else None) for key, m in METRICS}


def gpus_vs_one_gpu(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The Ostinato engine on one GPU (``ostinato-1gpu``) divided by the Ostinato engine on the run's
    GPUs per metric (> 1: the GPUs together are faster than one; docs/design.md's target: decode >= 1). None
    where either figure is missing."""
    o, one = engines.get("ostinato") or {}, engines.get(ONE_GPU) or {}
    return {key: (round(one[m] / o[m], 3) if o.get(m) and one.get(m) else None) for key, m in METRICS}


def best_of(engines: dict[str, dict[str, Any]], metric: str, among=is_peer) -> tuple[Optional[str], Optional[float]]:
    """(name, value) of the engine ``among(name)`` accepts with the lowest ``metric``, or (None, None)."""
    vals = {n: e.get(metric) for n, e in engines.items() if among(n) and e.get(metric)}
    if not vals:
        return None, None
    n = min(vals, key=vals.get)
    return n, vals[n]


def ratios(engines: dict[str, dict[str, Any]], o: Optional[dict[str, Any]] = None,
           peers: bool = False) -> dict[str, Any]:
    """Ostinato (``o``, default ``engines["ostinato"]``) against the best other engine at equal
    memory per metric (> 1: Ostinato faster), with the name of that engine under
    ``<metric>_best_stock``: among the stock llama.cpp engines (:data:`STOCK`), or with ``peers``
    among every engine but Ostinato's and the limit (:func:`is_peer`: ik-llama-server too), under
    ``<metric>_best_peer``. ``stock-all-gpu`` is never one of them."""
    o = engines.get("ostinato") or {} if o is None else o
    among, tag = (is_peer, "best_peer") if peers else (STOCK.__contains__, "best_stock")
    out: dict[str, Any] = {}
    for key, metric in METRICS:
        best, v = best_of(engines, metric, among)
        if best is None or not o.get(metric):
            out[key] = None
            continue
        out[key] = round(v / o[metric], 3)
        out[f"{key}_{tag}"] = best
    return out


def machine_info() -> dict[str, Any]:
    """CPU, RAM and GPUs of this machine (psutil, pynvml)."""

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "physical_cores": psutil.cpu_count(logical=False),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpus": [{"name": g.name, "free_gib": round((g.free_bytes or 0) / 2**30, 1)} for g in planner.detect_gpus()],
            "platform": platform.platform()}


def markdown(result: dict[str, Any]) -> str:
    """Markdown table of a result (written next to the JSON)."""
    eng = result["engines"]
    names = list(eng)
    lines = [f"# {result['name']}", "", f"Command: `{result['command']}`", "",
             f"Model: {result['model']['name']} ({result['model']['file']}), "
             f"{result['model']['n_layer']} layers x {result['model']['n_expert']} experts, "
             f"k = {result['model']['n_expert_used']}; pool budget "
             f"{result['plan']['budget_frac']:.0%} of expert bytes; stock-layers n_cpu_moe = "
             f"{result['plan']['stock']['n_cpu_moe']}; GPUs planned: "
             f"{len(result['plan']['stock'].get('gpus') or [None])}.", "",
             f"Machine: {result['machine']['cpu']} ({result['machine']['physical_cores']} cores), "
             f"GPUs: {', '.join(g['name'] for g in result['machine']['gpus']) or 'none'}.", "",
             f"Held-out sessions: {', '.join(result['sessions']['held_out'])} "
             f"({result['sessions']['turns_per_session']} turns each).", "",
             *[f"**Warning:** {w}\n" for w in result.get("warnings") or []],
             "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    rows = [("decode ms/token", "decode_ms_per_token", "", 2),
            ("median TTFT after tool (s)", "ttft_after_tool_median_s", "", 3),
            ("median TTFT after user (s)", "ttft_after_user_median_s", "", 3),
            ("session total (s)", "session_total_s", "", 2),
            ("hot-route share", "hot_route_share", "", 3)]
    for label, key, unit, nd in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(eng[n].get(key), unit, nd) for n in names) + " |")
    for _, _, b in BUCKETS:
        lines.append(f"| prefill {b} new tokens (s) | " + " | ".join(
            fmt((eng[n].get("prefill_by_new_tokens") or {}).get(b, {}).get("median_s"), "", 3)
            + f" ({(eng[n].get('prefill_by_new_tokens') or {}).get(b, {}).get('turns', 0)})"
            for n in names) + " |")
    lines.append("| turns (errors) | " + " | ".join(f"{eng[n].get('turns')} ({eng[n].get('errors')})"
                                                   for n in names) + " |")
    r = result["ratios_vs_best_stock"]
    lim = result.get("ratios_vs_limit") or {}
    o, le = eng.get("ostinato") or {}, eng.get(LIMIT) or {}
    lines += ["", "Ratios to the best stock engine at equal memory (best stock / Ostinato, > 1: "
              f"Ostinato faster) and to the limit `{LIMIT}` (Ostinato / {LIMIT}: the slowdown "
              "factor, 1 = every expert on the GPU):", "",
              "| metric | ostinato | best stock | ratio vs best stock | " + LIMIT + " | ratio vs limit |",
              "|---|---:|---|---:|---:|---:|"]
    for (k, m), nd in zip(METRICS, (2, 3, 2)):
        best = r.get(k + "_best_stock")
        lines.append(f"| {k} | {fmt(o.get(m), '', nd)} | "
                     + (f"{best} {fmt(eng[best].get(m), '', nd)}" if best in eng else "n/a")
                     + f" | {fmt(r.get(k), 'x')} | {fmt(le.get(m), '', nd)} | {fmt(lim.get(k), 'x')} |")
    peer = result.get("ratios_vs_best_peer") or {}
    if any(is_peer(n) and n not in STOCK for n in eng):   # a peer beside stock llama.cpp ran
        lines += ["", "Against the best peer (every engine but Ostinato's and the limit; best peer / "
                  "Ostinato, > 1: Ostinato faster): " + ", ".join(
                      f"{k} {fmt(peer.get(k), 'x')} ({peer.get(k + '_best_peer') or 'n/a'})"
                      for k, _ in METRICS) + "."]
    two = result.get("ratios_gpus_vs_one_gpu")
    if two:
        lines += ["", f"Ostinato on {len(result['plan']['stock'].get('gpus') or [None])} GPUs against "
                  f"`{ONE_GPU}` (the same pool budget on the first GPU alone; {ONE_GPU} / ostinato, "
                  "> 1: the GPUs together are faster): "
                  + ", ".join(f"{k} {fmt(two.get(k), 'x')}" for k, _ in METRICS) + "."]
    lines += breakdown_md(o.get("step_breakdown"), "Ostinato")
    # the variants' own breakdowns: an A/B of an option reads per step what it changed
    for name in sorted(n for n in eng if n.startswith("ostinato-")):
        lines += breakdown_md((eng.get(name) or {}).get("step_breakdown"), name)
    lines += worker_md(eng)   # every daemon engine, Ostinato's beside stock llama.cpp's
    lines += _sweep_md(result)
    lines.append("")
    for n in result.get("notes", []):
        if n in (result.get("warnings") or []):
            continue
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


def timeline_summary(tl: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Per decode step and per layer from the engine's cumulative ``decode_timeline`` stats
    (docs/engine.md, "Decode timeline": the GPU time from one MoE layer's route op to the next's in
    the one-token passes sampled). Returns None without sampled passes, else ``{"passes",
    "span_ms" (first to last MoE layer's route, per step), "cpu_layers" (layers per step whose
    routes went to the CPU branch), "cpu_layer_us" (an interval from such a layer, mean us),
    "cpu_wait_us" (of it the join's wait), "gpu_layer_us" (an interval from a layer without them),
    "gpu_work_ms" (per step: the adjacent-layer intervals less their waits, the GPU's own work
    between the first and last route; an interval across an all-resident layer is not among them)}``;
    with decode prefetch's chains marked also ``"chain_layers"`` (per step), ``"chain_us"`` (a chain
    from its router product to the end of its copies, mean), ``"chain_copy_us"`` (of it the copies),
    ``"chain_wait_ms"`` (per step: the time the main stream waited for copies after a route op) and
    ``"chain_late_share"`` (the chains that ended after their layer's route op)."""
    if not tl or not tl.get("passes"):
        return None
    n = tl["passes"]
    cl, gl, cpu, wait, gpu = (tl.get(k) or 0 for k in ("cpu_layers", "gpu_layers", "cpu_ms", "cpu_wait_ms", "gpu_ms"))
    us = lambda ms, k: round(1000 * ms / k, 1) if k else None   # noqa: E731
    out = {"passes": n, "span_ms": round(tl["span_ms"] / n, 3), "cpu_layers": round(cl / n, 2),
           "cpu_layer_us": us(cpu, cl), "cpu_wait_us": us(wait, cl), "gpu_layer_us": us(gpu, gl),
           "gpu_work_ms": round((cpu - wait + gpu) / n, 3)}
    ch = tl.get("chain_layers") or 0
    if ch:
        out.update(chain_layers=round(ch / n, 2), chain_us=us(tl.get("chain_ms") or 0, ch),
                   chain_copy_us=us(tl.get("chain_copy_ms") or 0, ch),
                   chain_wait_ms=round((tl.get("chain_wait_ms") or 0) / n, 3),
                   chain_late_share=round((tl.get("chain_late") or 0) / ch, 3))
    return out


def _sweep_md(result: dict[str, Any]) -> list[str]:
    """Markdown lines for the budget sweep (Ostinato per pool budget; baselines and limit once)."""
    sw = result.get("sweep")
    if not sw:
        return []
    out = ["", f"Budget sweep (Ostinato per pool budget; {sw['note']}):", "",
           "| pool budget | pool MiB | hot-route share | decode ms/token | TTFT after tool s | "
           "session s | decode / TTFT / session vs limit | vs baselines |",
           "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in sw["runs"]:
        o = r.get("ostinato") or {}
        lv, bv = r.get("ratios_vs_limit") or {}, r.get("ratios_vs_baselines") or {}
        out.append(f"| {r['budget_frac']:.0%} | {r['pool_bytes'] / 2**20:.1f} | "
                   f"{fmt(o.get('hot_route_share'), '', 3)} | {fmt(o.get('decode_ms_per_token'))} | "
                   f"{fmt(o.get('ttft_after_tool_median_s'), '', 3)} | {fmt(o.get('session_total_s'))} | "
                   + " / ".join(fmt(lv.get(k), "x") for k, _ in METRICS) + " | "
                   + " / ".join(fmt(bv.get(k), "x") for k, _ in METRICS) + " |")
    for n, e in result["engines"].items():
        if n != "ostinato":
            out.append(f"| {n} (once) | | {fmt(e.get('hot_route_share'), '', 3)} | "
                       f"{fmt(e.get('decode_ms_per_token'))} | {fmt(e.get('ttft_after_tool_median_s'), '', 3)}"
                       f" | {fmt(e.get('session_total_s'))} | | |")
    return out
