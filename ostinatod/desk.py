"""The residency desk: the daemon's one place for residency sets and traces of the loaded model.

Owned by the daemon's state (``DaemonState.desk``) and used by the control API (list, plan,
switch, per-layer figures) and the background re-planner (:mod:`ostinatod.workload`). It knows
where the files are (:func:`ostinatod.paths.residency_file`), the loaded model's fingerprint
(:func:`ostinatod.residency.model.describe_model`, computed off the event loop), and how to ask
the engine to flush its traces or swap its set. The files' formats are the residency domain's
(:mod:`ostinatod.residency`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .errors import OstinatoError
from .paths import residency_file, trace_file
from .residency.model import cached_description
from .residency.planner import plan_for_model
from .residency.sets import model_fingerprint

log = logging.getLogger("ostinatod.residency")


class DeskError(OstinatoError):
    """What the desk cannot do, as the control API answers it: ``code``, ``message``, HTTP ``status``."""

    def __init__(self, code: str, message: str, status: int):
        super().__init__(code, message, status)


# --- staleness of planned sets (pure file reads) ------------------------------------------------

_routes_cache: dict[tuple, int] = {}


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_mtime_ns, st.st_size)


def trace_routes(path: Path) -> int:
    """Total routes (prefill + decode) in a trace file (``ostinato-trace/1``). Cached per file
    version (path, mtime, size). Raises OSError/ValueError for an unreadable file."""
    key = _file_key(path)
    got = _routes_cache.get(key)
    if got is None:
        d = json.loads(path.read_text())
        got = int(sum(map(sum, d.get("counts_prefill", []))) + sum(map(sum, d.get("counts_decode", []))))
        if len(_routes_cache) > 256:
            _routes_cache.clear()
        _routes_cache[key] = got
    return got


def planned_routes(path: Path) -> int:
    """Routes the residency set in ``path`` was planned from (``plan.dev_routes``; 0 if unknown)."""
    key = ("set",) + _file_key(path)
    got = _routes_cache.get(key)
    if got is None:
        try:
            got = int((json.loads(path.read_text()).get("plan") or {}).get("dev_routes") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            got = 0
        _routes_cache[key] = got
    return got


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
            planned = planned_routes(rset)
            if planned and routes < planned * (1 + growth):
                continue
        out.append({"workload": t.stem, "routes": routes, "planned_routes": planned})
    return out


def _list_json(d: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        st = f.stat()
        out.append({"workload": f.stem, "path": str(f), "modified": st.st_mtime, "bytes": st.st_size})
    return out


def per_layer_share(rpath: Path, tpath: Path) -> list[float]:
    """Per-layer hot-route share of the set in ``rpath`` over the trace in ``tpath``:
    ``sum(counts[l, hot_l]) / sum(counts[l])`` for each layer l (Rule 1's objective per layer,
    paper Sec. 3.1)."""
    res, tr = json.loads(rpath.read_text()), json.loads(tpath.read_text())
    counts = np.asarray(tr["counts_prefill"], dtype=np.float64) + np.asarray(tr["counts_decode"])
    hot = np.zeros_like(counts, dtype=bool)
    for g in res.get("gpus", []):
        for layer, ids in g.get("hot", {}).items():
            hot[int(layer), list(ids)] = True
    tot = counts.sum(axis=1)
    share = np.where(tot > 0, (counts * hot).sum(axis=1) / np.maximum(tot, 1), 0.0)
    return [round(float(x), 4) for x in share]


# --- the desk -----------------------------------------------------------------------------------

class ResidencyDesk:
    """Residency sets and traces of the model ``state`` serves (``state``: the DaemonState)."""

    def __init__(self, state: Any):
        self.state = state
        self._pending: set = set()
        self._lock = threading.Lock()
        self._layer_cache: dict[tuple, Optional[list[float]]] = {}

    # --- the model and its files -------------------------------------------------------------
    def model_path(self) -> Path:
        """The loaded (or configured) model file; DeskError 409 ``model_not_loaded`` without one."""
        st = self.state
        p = st.model_info.get("path") or st.settings.model
        if not p:
            raise DeskError("model_not_loaded", "no model is loaded", 409)
        return Path(p)

    def set_path(self, fingerprint: str, workload: str) -> Path:
        """The planned set of ``workload`` for the model ``fingerprint`` in the daemon's data dir."""
        return residency_file(fingerprint, workload, self.state.paths.data)

    def trace_path(self, fingerprint: str, workload: str) -> Path:
        return trace_file(fingerprint, workload, self.state.paths.data)

    async def fingerprint(self) -> str:
        """Fingerprint of the loaded model, computed off the event loop (cached by the model
        description). DeskError 409 ``model_not_loaded`` / ``model_unreadable``."""
        path = self.model_path()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, model_fingerprint, path)
        except (OSError, ValueError) as e:
            raise DeskError("model_unreadable", str(e), 409)

    def fingerprint_nowait(self, path: Path) -> Optional[str]:
        """The fingerprint if the model description is cached, else None while a background
        thread computes it (started here once), so live snapshots never wait the tens of seconds
        a first GGUF metadata read can take."""
        info = cached_description(path)
        if info is not None:
            return info.fingerprint
        key = str(path)
        with self._lock:
            if key in self._pending:
                return None
            self._pending.add(key)

        def work():
            try:
                model_fingerprint(path)
            except Exception as e:  # unreadable model: no per-layer figures
                log.debug("fingerprint of %s: %s", path, e)
            finally:
                with self._lock:
                    self._pending.discard(key)
        threading.Thread(target=work, name="fingerprint", daemon=True).start()
        return None

    def listing(self, fingerprint: str) -> dict[str, list[dict[str, Any]]]:
        """``{"sets", "traces"}``: the model's residency sets and traces (workload, path, modified,
        bytes)."""
        d = self.state.paths
        return {"sets": _list_json(d.residency_dir / fingerprint),
                "traces": _list_json(d.traces_dir / fingerprint)}

    def stale(self, fingerprint: str) -> list[dict[str, Any]]:
        """:func:`stale_workloads` of the model ``fingerprint`` (setting ``replan_growth``)."""
        d = self.state.paths
        return stale_workloads(d.traces_dir / fingerprint, d.residency_dir / fingerprint,
                               self.state.settings.replan_growth)

    def per_layer_from_traces(self, workload: Optional[str], residency: Optional[str] = None
                              ) -> Optional[list[float]]:
        """:func:`per_layer_share` of the current set (``residency``, the path the engine reports,
        else the workload's planned set) over the workload's trace. Used when the engine reports
        no per-layer figure. Cached per file mtimes; None when there is no model, set or trace
        (or the fingerprint is still being computed)."""
        st = self.state
        try:
            path = st.model_info.get("path")
            if not path:
                return None
            fp = self.fingerprint_nowait(Path(path))
            if fp is None:
                return None
            wl = workload or st.settings.workload_default
            rpath = Path(residency) if residency else self.set_path(fp, wl)
            tpath = self.trace_path(fp, wl)
            if not rpath.is_file() or not tpath.is_file():
                return None
            key = (str(rpath), rpath.stat().st_mtime, str(tpath), tpath.stat().st_mtime)
            if key not in self._layer_cache:
                share = per_layer_share(rpath, tpath)
                self._layer_cache.clear()
                self._layer_cache[key] = share
            return self._layer_cache[key]
        except Exception as e:  # stale/odd files must not break the live snapshot
            log.debug("per-layer share from traces: %s", e)
            return None

    # --- engine and planner ------------------------------------------------------------------
    async def flush_traces(self) -> None:
        """Ask the engine to write its pending routing counts, so a plan sees the latest requests."""
        st = self.state
        if st.engine is not None and st.engine_state == "ready":
            try:
                await asyncio.wait_for(st.engine.flush_traces(), 30)
            except Exception as e:  # plan from what is on disk
                log.warning("flushing routing traces before planning: %s", e)

    async def plan(self, model: Path, workload: str) -> tuple[dict[str, Any], Path, float]:
        """Plan ``workload``'s set for ``model`` in a worker thread (budget from the settings) and
        write it. Returns (residency dict, path, seconds). Raises PlanError/TraceError/ValueError
        or OSError as the planner does."""
        st = self.state
        t0 = time.perf_counter()
        res, path = await asyncio.get_running_loop().run_in_executor(None, lambda: plan_for_model(
            model, workload, budget_frac=st.settings.expert_budget_frac,
            budget_mb=st.settings.expert_budget_mb, data_dir=st.paths.data))
        return res, path, time.perf_counter() - t0

    def can_switch(self) -> bool:
        """Whether the engine exists and is ready to swap residency sets (every EngineClient has
        ``switch_residency``; one running stock answers 409 ``residency_unavailable``)."""
        st = self.state
        return st.engine is not None and st.engine_state == "ready"

    async def switch(self, path: Path, reason: str) -> dict[str, Any]:
        """Swap the engine's set to ``path`` (at its next request boundary) and note the swap in
        the daemon state. Returns the swap's facts; raises EngineError (the old set stays active)."""
        st = self.state
        info = await st.engine.switch_residency(path, reason=reason)
        st.note_residency_switch(info)
        return info

    async def active_workload(self) -> Optional[str]:
        """Workload of the engine's active residency set (None when the engine does not say)."""
        st = self.state
        if st.engine is not None and st.engine_state == "ready":
            try:
                stats = await asyncio.wait_for(st.engine.stats(), 5)
                wl = stats.experts.workload if stats.experts is not None else None
                if wl:
                    return str(wl)
            except Exception as e:  # restarting worker: the caller falls back to the default
                log.debug("engine stats: %s", e)
        return None
