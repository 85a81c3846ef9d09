"""Per-workload residency upkeep: re-plan residency sets in the background when the daemon is idle
and a workload's routing traces have moved (issue "desktop daemon", part 2).

Started by the control server (:func:`ostinatod.control.start_control_server`) inside the daemon,
so it needs nothing from the daemon but its :class:`~ostinatod.server.state.DaemonState`.

"Moved" means the workload's trace holds at least ``settings.replan_growth`` more routes than the
set was planned from (``plan.dev_routes`` of the residency file), or the workload has traces but no
set yet. Planning is the planner's (:func:`ostinatod.engine.planner.plan_for_model`, Rule 1 fill of
paper Sec. 3.1) and runs in a worker thread. When the re-planned workload is the current one and the
engine can swap sets (``engine.switch_residency``), the new set is swapped in at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("ostinatod.workload")


def trace_routes(path: Path) -> int:
    """Total routes (prefill + decode) in a trace file (``ostinato-trace/1``)."""
    d = json.loads(path.read_text())
    return int(sum(map(sum, d.get("counts_prefill", []))) + sum(map(sum, d.get("counts_decode", []))))


def stale_workloads(traces_dir: Path, residency_dir: Path, growth: float) -> list[dict[str, Any]]:
    """Workloads of one model (``traces_dir``/``residency_dir`` are its ``<fingerprint>`` dirs)
    whose set is missing or was planned from fewer than ``1/(1+growth)`` of the routes now traced.
    Returns ``[{"workload", "routes", "planned_routes" (None: no set)}]``; traces without routes
    are skipped."""
    out = []
    for t in sorted(traces_dir.glob("*.json")) if traces_dir.is_dir() else []:
        try:
            routes = trace_routes(t)
        except (OSError, ValueError, TypeError) as e:
            log.debug("trace %s unreadable: %s", t, e)
            continue
        if routes <= 0:
            continue
        rset = residency_dir / t.name
        planned: Optional[int] = None
        if rset.is_file():
            try:
                planned = int((json.loads(rset.read_text()).get("plan") or {}).get("dev_routes") or 0)
            except (OSError, ValueError):
                planned = 0
            if planned and routes < planned * (1 + growth):
                continue
        out.append({"workload": t.stem, "routes": routes, "planned_routes": planned})
    return out


class Replanner:
    """Background task of the daemon (see module doc). ``check_every_s``: seconds between checks.
    ``failed`` remembers workloads whose plan failed at a given route count, so a failing plan
    (e.g. no GPU and no budget set) is not retried until the traces grow again."""

    def __init__(self, state, check_every_s: float = 15.0):
        self.state = state
        self.check_every_s = check_every_s
        self.last_busy = time.monotonic()
        self.failed: dict[str, int] = {}
        self.planned: list[dict[str, Any]] = []  # what this task planned (status, tests)
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start the checking task on the running event loop."""
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Cancel the checking task and wait for it."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_every_s)
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let upkeep take the daemon down
                log.warning("background re-plan: %s: %s", type(e).__name__, e)

    async def check_once(self, now: Optional[float] = None) -> list[dict[str, Any]]:
        """One check: if idle long enough, plan every stale workload. Returns what was planned."""
        st = self.state
        now = time.monotonic() if now is None else now
        idle_s = st.settings.replan_idle_s
        if st.active or st.engine_state not in ("ready", "stopped"):
            self.last_busy = now
            return []
        if idle_s <= 0 or now - self.last_busy < idle_s:
            return []
        path = st.model_info.get("path")
        if not path:
            return []
        from .control import _cached_fingerprint
        loop = asyncio.get_running_loop()
        fp = await loop.run_in_executor(None, _cached_fingerprint, Path(path))
        stale = stale_workloads(st.paths.traces_dir / fp, st.paths.residency_dir / fp,
                                st.settings.replan_growth)
        done = []
        for w in stale:
            name = w["workload"]
            if self.failed.get(name) == w["routes"]:
                continue
            res = await self._plan(Path(path), name)
            if res is None:
                self.failed[name] = w["routes"]
                continue
            done.append({**w, **res})
            if st.active:  # a request arrived meanwhile: stop here, the rest waits for idle
                break
        self.planned += done
        return done

    async def _plan(self, model: Path, workload: str) -> Optional[dict[str, Any]]:
        from .engine.planner import plan_for_model
        st = self.state
        t0 = time.perf_counter()
        try:
            res, out = await asyncio.get_running_loop().run_in_executor(None, lambda: plan_for_model(
                model, workload, budget_frac=st.settings.expert_budget_frac,
                budget_mb=st.settings.expert_budget_mb, data_dir=st.paths.data))
        except (ValueError, OSError) as e:
            log.info("background re-plan of %s skipped: %s", workload, e)
            return None
        share = (res.get("plan") or {}).get("expected_hot_route_share")
        log.info("background re-plan of %s: %s (expected hot-route share %s) in %.1f s", workload, out,
                 f"{share:.1%}" if share is not None else "?", time.perf_counter() - t0)
        info: dict[str, Any] = {"path": str(out), "expected_hot_route_share": share}
        switch = getattr(st.engine, "switch_residency", None) if st.engine is not None else None
        if switch is not None and workload == st.settings.workload_default and not st.active:
            try:
                r = await switch(out)
                info["switch_seconds"] = r.get("seconds") if isinstance(r, dict) else r
            except Exception as e:  # the old set stays in use
                log.warning("switching to the re-planned %s set failed: %s", workload, e)
        return info
