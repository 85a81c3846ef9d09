"""Live snapshots of the daemon for the UIs: ``GET /metrics``, ``GET /events``, ``GET /status``.

:func:`metrics_snapshot` is what the TUI and the tray show; :func:`expert_view` the expert-path
figures of the engine's stats. Built from the daemon state, the engine's ``stats()``, the
residency desk (per-layer figures from traces) and :mod:`ostinatod.hardware` (GPU memory).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import psutil

from ..engine.stats import EngineStats
from ..hardware import gpu_memory


def expert_view(stats: Optional[EngineStats]) -> dict[str, Any]:
    """The expert-path figures the UIs show, from the engine's parsed ``stats()`` (None or without
    ``experts``: stock llama.cpp, or no stats).

    Returns ``{"hot_route_share" (0..1 or None), "per_layer_hot_share" (None: the engine has no
    per-layer figures; :func:`metrics_snapshot` fills it from the routing traces), "paths"
    ({"decode", "split", "upload", "stock"} counts), "routes", "hot_routes", "cold_routes",
    "residency" (path of the active set or None), "workload" (of the active set or None),
    "hot_experts", "pool_bytes", "pools" (per device: ``{gpu, device, bytes, hot_experts,
    routes, hot_routes, hot_route_share}`` or None), "switches" (swaps since the model was loaded),
    "auto_switch" (setting residency_auto_switch)}``.
    """
    ex = stats.experts if stats is not None else None
    if ex is None:
        return {"hot_route_share": None, "per_layer_hot_share": None,
                "paths": {k: 0 for k in ("decode", "split", "upload", "stock")},
                "routes": None, "hot_routes": None, "cold_routes": None, "residency": None,
                "workload": None, "hot_experts": None, "pool_bytes": None, "pools": None,
                "switches": None, "auto_switch": None}
    share = ex.hot_route_share
    if share is None and ex.routes:
        share = (ex.hot_routes or 0) / ex.routes
    return {
        "hot_route_share": share,
        "per_layer_hot_share": None,
        "paths": {k: int(ex.paths.get(k, 0) or 0) for k in ("decode", "split", "upload", "stock")},
        "routes": ex.routes, "hot_routes": ex.hot_routes, "cold_routes": ex.cold_routes,
        "residency": ex.residency, "workload": ex.workload,
        "hot_experts": ex.hot_experts, "pool_bytes": ex.pool_bytes,
        "pools": [p.wire for p in ex.pools] if ex.pools is not None else None,
        "switches": ex.switches, "auto_switch": ex.auto_switch,
    }


# the keys of expert_view's answer (the TUI, the tray and the control API read these)
EXPERT_VIEW_KEYS = ("hot_route_share", "per_layer_hot_share", "paths", "routes", "hot_routes",
                    "cold_routes", "residency", "workload", "hot_experts", "pool_bytes", "pools",
                    "switches", "auto_switch")


def pool_lines(pools: Optional[list[dict[str, Any]]],
               gpus: Optional[list[dict[str, Any]]] = None) -> list[str]:
    """One line per expert pool (GPU) from :func:`expert_view`'s ``pools``: ``GPU 1 (CUDA1): 3.4 GiB,
    1,382 hot experts, 95.1% hot routes`` and, when ``gpus`` (:func:`gpu_memory`) names that GPU's
    index, ``, memory 61.2/139.8 GiB`` (used by every process); [] for one pool or none (the
    totals say it all). The pool's ``gpu`` is a CUDA index, NVML's order is the PCI bus order: the
    same on machines of identical GPUs (CUDA orders the fastest first)."""
    if not pools or len(pools) < 2:
        return []
    mem = {g.get("index"): g for g in gpus or []}
    out = []
    for p in pools:
        share = p.get("hot_route_share")
        routes = p.get("routes")
        m = mem.get(p.get("gpu"))
        out.append(f"GPU {p.get('gpu')} ({p.get('device')}): {(p.get('bytes') or 0) / (1 << 30):.1f} GiB, "
                   f"{p.get('hot_experts') or 0:,} hot experts, "
                   + (f"{share:.1%} hot routes" if routes else "no routes yet")
                   + (f", memory {m['used_bytes'] / (1 << 30):.1f}/{m['total_bytes'] / (1 << 30):.1f} GiB"
                      if m else ""))
    return out


async def metrics_snapshot(state, recent: int = 60) -> dict[str, Any]:
    """One JSON snapshot for the TUI/tray: ``{"time", "engine_state", "model", "workload",
    "paused", "requests": {"active", "total", "recent": [{"id", "workload", "status", "ttft_s",
    "tpot_s", "prompt_tokens", "cached_tokens", "completion_tokens", "residency_switch_s"}]},
    "experts": :func:`expert_view`, "last_residency_switch": the last swap (see
    DaemonState.note_residency_switch) or None, "engine": ``stats()`` as the engine sent it, "memory": {"host":
    {"total_bytes", "available_bytes", "daemon_rss_bytes" (daemon + engine worker)}, "gpus":
    :func:`gpu_memory`}}``. Times in seconds."""
    stats: Optional[EngineStats] = None
    engine: dict[str, Any] = {}
    if state.engine is not None and state.engine_state == "ready":
        try:
            stats = await asyncio.wait_for(state.engine.stats(), 2)
            engine = stats.wire
            state.metrics.set_engine_stats(stats)
        except Exception as e:  # a crashed/restarting worker: report, do not fail the snapshot
            stats, engine = None, {"error": f"{type(e).__name__}: {e}"}
    keys = ("id", "workload", "status", "ttft_s", "tpot_s", "prompt_tokens", "cached_tokens",
            "completion_tokens", "client", "residency_switch_s")
    rec = [{k: r.get(k) for k in keys} for r in list(state.recent)[-recent:]]
    vm = psutil.virtual_memory()
    ex = expert_view(stats)
    # the engine has no per-layer figures: the routing traces do (file reads off the loop)
    ex["per_layer_hot_share"] = await asyncio.get_running_loop().run_in_executor(
        None, state.desk.per_layer_from_traces, ex.get("workload"), ex.get("residency"))
    ex["per_layer_source"] = "traces" if ex["per_layer_hot_share"] else None
    return {
        "time": time.time(),
        "engine_state": state.engine_state,
        "model": {"id": state.model_name, **state.model_info},
        **_current_workload(state, ex),
        "paused": state.paused_model is not None,
        "phase": getattr(state, "phase", None),
        "engine_health": state.engine_health(),  # restarts, last_exit, error (why it does not serve)
        "last_residency_switch": state.last_residency_switch,
        "requests": {"active": len(state.active), "total": len(state.recent) + len(state.active),
                     "active_list": [{k: r.get(k) for k in keys} for r in state.active.values()],
                     "recent": rec},
        "experts": ex,
        "engine": engine,
        "memory": {"host": {"total_bytes": vm.total, "available_bytes": vm.available,
                            "daemon_rss_bytes": _rss_with_children()},
                   "gpus": gpu_memory()},
    }


def _current_workload(state, ex: dict[str, Any]) -> dict[str, Any]:
    """``{"workload", "workload_source", "workload_counts"}``: the workload the engine's residency
    set serves if it says, else that of the running/latest request, else the default; and how many
    of the recent requests each workload had."""
    counts: dict[str, int] = {}
    for r in state.recent:
        w = r.get("workload") or "?"
        counts[w] = counts.get(w, 0) + 1
    latest = [r for r in state.active.values()] or list(state.recent)[-1:]
    if ex.get("workload"):
        cur, src = ex["workload"], "engine"
    elif latest and latest[-1].get("workload"):
        cur, src = latest[-1]["workload"], "requests"
    else:
        cur, src = state.settings.workload_default, "default"
    return {"workload": cur, "workload_source": src, "workload_counts": counts}


def _rss_with_children() -> int:
    """Resident bytes of the daemon and its children (the engine worker subprocess)."""
    me = psutil.Process()
    total = me.memory_info().rss
    for c in me.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return total
