"""Per-workload residency upkeep: re-plan residency sets in the background when the daemon is idle
and a workload's routing traces have moved (docs/design.md, "Planning").

Started by the control server (:func:`ostinatod.control.start_control_server`) inside the daemon,
so it needs nothing from the daemon but its :class:`~ostinatod.server.state.DaemonState`.

*Idle* means no request has run for ``settings.replan_idle_s`` seconds (0: never re-plan), counted
from the end of the last request. *Moved* means the workload's trace holds at least
``settings.replan_growth`` more routes than the set was planned from (``plan.dev_routes`` of the
residency file; 0.25: the route counts grew by >= 25%), or the workload has traces but no set yet.
Growth of the route total is the trigger because it is cheap to read and bounds how much of the
ranking can have changed: a set planned from N routes can be displaced by at most the new routes.

Each check is cheap (route totals are cached per trace file version) and runs off the event loop
(file reads and the planner, :func:`ostinatod.residency.planner.plan_for_model`, Rule 1 fill of paper
Sec. 3.1, run in the default executor), all through the daemon's residency desk
(:class:`ostinatod.desk.ResidencyDesk`). The active workload (the engine's set, else
``workload_default``) is re-planned first. When the re-planned workload is the active one and
``settings.residency_auto_switch`` is on, the new set is handed to the engine
(``engine.switch_residency``, reason "replan"), which swaps it at its next request boundary (at once
while idle). Other workloads' new sets are used by the automatic swap when their next request comes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Optional

from .engine.types import EngineError

log = logging.getLogger("ostinatod.workload")


class Replanner:
    """Background task of the daemon (see module doc). ``check_every_s``: seconds between checks
    (default: a quarter of ``replan_idle_s``, between 0.5 and 15 s). ``failed`` remembers
    workloads whose plan failed at a given route count, so a failing plan (e.g. no GPU and no
    budget set) is not retried until the traces grow again. Times are Unix seconds."""

    def __init__(self, state, check_every_s: Optional[float] = None):
        self.state = state
        self.check_every_s = check_every_s
        self.last_busy = time.time()
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

    def interval(self) -> float:
        """Seconds between two checks."""
        if self.check_every_s is not None:
            return self.check_every_s
        return min(15.0, max(0.5, self.state.settings.replan_idle_s / 4))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval())
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let upkeep take the daemon down
                log.warning("background re-plan: %s: %s", type(e).__name__, e)

    async def check_once(self, now: Optional[float] = None) -> list[dict[str, Any]]:
        """One check (``now``: Unix time, default the clock): if the daemon has been idle for
        ``replan_idle_s``, plan every stale workload, the active one first; a request arriving
        meanwhile stops the round. Returns what was planned: ``[{"workload", "routes",
        "planned_routes", "path", "expected_hot_route_share"[, "switch_seconds"]}]``."""
        st = self.state
        now = time.time() if now is None else now
        idle_s = st.settings.replan_idle_s
        if st.active or st.engine_state not in ("ready", "stopped"):
            self.last_busy = now
            return []
        if st.recent:  # a request that ran between two checks counts as activity too
            r = st.recent[-1]
            self.last_busy = max(self.last_busy, float(r.get("started") or 0) + float(r.get("total_s") or 0))
        if idle_s <= 0 or now - self.last_busy < idle_s:
            return []
        path = st.model_info.get("path")
        if not path:
            return []
        desk = st.desk
        loop = asyncio.get_running_loop()
        await desk.flush_traces()  # the worker writes its counts every few requests; idle: now
        fp = await desk.fingerprint()
        stale = await loop.run_in_executor(None, desk.stale, fp)
        active = await self._active_workload()
        stale.sort(key=lambda w: w["workload"] != active)
        done = []
        for w in stale:
            name = w["workload"]
            if self.failed.get(name) == w["routes"]:
                continue
            res = await self._plan(Path(path), name, active)
            if res is None:
                self.failed[name] = w["routes"]
                continue
            done.append({**w, **res})
            if st.active:  # a request arrived meanwhile: stop here, the rest waits for idle
                break
        self.planned += done
        return done

    async def _active_workload(self) -> str:
        """Workload of the engine's active residency set, else the default workload."""
        return await self.state.desk.active_workload() or self.state.settings.workload_default

    async def _plan(self, model: Path, workload: str, active: Optional[str] = None) -> Optional[dict[str, Any]]:
        st = self.state
        desk = st.desk
        try:
            res, out, secs = await desk.plan(model, workload)
        except (ValueError, OSError) as e:
            log.info("background re-plan of %s skipped: %s", workload, e)
            return None
        share = (res.get("plan") or {}).get("expected_hot_route_share")
        log.info("background re-plan of %s: %s (expected hot-route share %s) in %.1f s", workload, out,
                 f"{share:.1%}" if share is not None else "?", secs)
        info: dict[str, Any] = {"path": str(out), "expected_hot_route_share": share}
        if (desk.can_switch() and st.settings.residency_auto_switch
                and workload == (active or st.settings.workload_default) and not st.active):
            try:
                r = await desk.switch(out, reason="replan")
            except (EngineError, ValueError) as e:  # the old set stays in use
                log.warning("switching to the re-planned %s set failed: %s", workload, e)
            else:
                info["switch_seconds"] = r.get("seconds")
        return info
