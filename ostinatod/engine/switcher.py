"""Residency-set swaps in the engine worker, at request boundaries only (docs/design.md "Planning").

- an explicit switch (control API, background re-plan) is queued; the loop runs it as soon as no
  request is generating and admits no new request while it waits, so it cannot be starved; after
  :data:`SWITCH_WAIT_S` of running requests it is refused (409 ``residency_busy``) instead;
- the automatic per-workload swap (setting ``residency_auto_switch``): before a request is admitted
  while no other request is generating, if its workload differs from the workload of the active set
  (or the active set is that workload's planned file and the file was re-planned since) and a
  planned set ``<data>/residency/<fingerprint>/<workload>.json`` exists, that set is swapped in
  first and the request's "start" event carries ``residency_switch`` (the swap's facts). A set the
  engine refuses (malformed, another model's) is skipped, said once in ``residency_switch_skipped``
  of the start event, and not tried again until its file changes. A request that arrives while
  another one generates runs with the current set; it is never held back for a swap.

All methods run on the worker's loop thread.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional

from . import native
from .native import ExpertEngineError
from .placement import check_devices
from ..paths import residency_file
from ..residency.sets import ResidencyError, ResidencySet, read_residency
from .runtime import SUPPORTED_ARCHS
from .types import EngineError

log = logging.getLogger("ostinatod.engine")

SwitchDone = Callable[[Optional[dict[str, Any]], Optional[EngineError]], None]

# A queued explicit switch waits for the running requests at most this long (s); then it is refused
# (409 residency_busy) and new requests are admitted again, so one endless generation cannot hold
# the daemon behind a switch.
SWITCH_WAIT_S = 30.0

# workload names that may name a residency file (the HTTP header is free text)
_WORKLOAD_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

def _reply(done: SwitchDone, info: Optional[dict[str, Any]], err: Optional[EngineError]) -> None:
    try:
        done(info, err)
    except Exception:
        log.exception("residency switch consumer failed")


class ResidencySwitcher:
    """The active set, the queued explicit switches and the history of swaps of one worker.

    ``worker`` gives ``rt`` (the ExpertRuntime or None), ``settings``, ``gguf`` (the ModelInfo) and
    ``model_path``."""

    def __init__(self, worker: Any):
        self.w = worker
        self.active_set: dict[str, Any] = {}  # {"workload", "path", "key", "hot_experts", "pool_bytes", "pools"}
        self.queued: list[tuple[Path, str, SwitchDone, Optional[ResidencySet]]] = []
        self.queued_at = 0.0  # monotonic time the oldest queued switch arrived
        self.count = 0
        self.last: Optional[dict[str, Any]] = None
        self.failed_sets: set = set()  # (path, mtime_ns, size) of planned sets an auto swap refused

    # ---- state ----------------------------------------------------------------------------------
    def note_active(self, path: Optional[Path], workload: Optional[str]) -> None:
        """Remember the active set (file identity for the re-plan check, pool facts for stats)."""
        key = None
        if path is not None:
            try:
                st = Path(path).stat()
                key = (str(path), st.st_mtime_ns, st.st_size)
            except OSError:
                pass
        hot = pool = pools = prefill = None
        if self.w.rt is not None:
            try:
                inf = self.w.rt.info()
                hot, pool, prefill = inf.get("hot_experts"), inf.get("pool_bytes"), inf.get("prefill")
                pools = [{k: p.get(k) for k in ("gpu", "device", "bytes", "hot_experts")}
                         for p in inf.get("pools") or []]
            except Exception as e:  # stats only
                log.debug("expert info: %s", e)
        self.active_set = {"workload": workload or None, "path": str(path) if path else None,
                           "key": key, "hot_experts": hot, "pool_bytes": pool, "pools": pools,
                           "prefill": prefill}

    def state(self) -> dict[str, Any]:
        """See :meth:`ostinatod.engine.worker.Worker.residency_state`."""
        a = self.active_set
        return {"workload": a.get("workload"), "residency": a.get("path"),
                "hot_experts": a.get("hot_experts"), "pool_bytes": a.get("pool_bytes"),
                "pools": a.get("pools"), "prefill": a.get("prefill"),
                "switches": self.count, "last_switch": self.last,
                "auto_switch": bool(self.w.settings.residency_auto_switch)}

    def no_engine_reason(self) -> str:
        w = self.w
        g = w.gguf
        if w.settings.experts == "stock":
            why = "the model was loaded with stock llama.cpp placement (experts = 'stock')"
        elif g is not None and g.n_expert <= 0:
            why = f"{w.model_path.name} is a dense model (no routed experts)"
        elif g is not None and g.arch not in SUPPORTED_ARCHS:
            why = f"architecture {g.arch or 'unknown'} is not supported by the expert engine (runs stock)"
        else:
            why = "the expert engine is not active for this model (see the engine log: not built, or it failed at load)"
        return (f"cannot swap residency sets: {why}. The expert pool can only be created while the model "
                "loads (routed experts kept in host memory, CPU weight repacking off), so load the model "
                "again with the expert engine (experts = 'auto' or 'ostinato', residency = PATH)")

    # ---- swaps ----------------------------------------------------------------------------------
    def switch_now(self, path: Path, reason: str, res: Optional[ResidencySet] = None) -> dict[str, Any]:
        """Swap to the set in ``path`` (``res``: already read from it) now (no request generating).
        Returns the swap's facts (see :meth:`ostinatod.engine.worker.Worker.switch_residency`);
        raises EngineError (the old set stays active)."""
        rt = self.w.rt
        if rt is None:
            raise EngineError("residency_unavailable", self.no_engine_reason(), 409)
        prev = self.active_set.get("workload")
        try:
            secs = rt.switch(path, res)
        except ResidencyError as e:
            raise EngineError("residency_refused", f"{e} (the previous set stays active)", 400) from e
        except ExpertEngineError as e:
            raise EngineError("residency_switch_failed", f"the native engine refused the residency set "
                              f"{path}: {e} (the previous set stays active)", 500) from e
        res = rt.residency
        self.note_active(Path(path), res.workload if res else None)
        a = self.active_set
        info = {"seconds": round(secs, 6), "workload": a["workload"], "path": a["path"],
                "previous_workload": prev, "hot_experts": a["hot_experts"], "pool_bytes": a["pool_bytes"],
                "reason": reason, "at": time.time()}
        self.count += 1
        self.last = info
        log.info("residency set switched (%s) to %s (workload %s, was %s) in %.3f s: %s hot experts, "
                 "pool %s bytes", reason, a["path"], a["workload"], prev, secs, a["hot_experts"],
                 a["pool_bytes"])
        return info

    def precheck(self, path: Path) -> tuple[Optional[ResidencySet], Optional[EngineError]]:
        """Read and validate the set in ``path`` for this model: (the set, None), or (None, the
        error a switch to it would end with that needs no idle engine to find: no expert engine, an
        unreadable or malformed file, another model's set)."""
        if self.w.rt is None:
            return None, EngineError("residency_unavailable", self.no_engine_reason(), 409)
        try:
            res = read_residency(Path(path), self.w.rt.model)
            check_devices(res.devices, native.gpu_count(), f"{path}: ")
            return res, None
        except ResidencyError as e:
            return None, EngineError("residency_refused", f"{e} (the previous set stays active)", 400)

    def queue(self, path: Path, reason: str, done: SwitchDone) -> None:
        """Queue an explicit switch (refused at once when :meth:`precheck` finds a problem; the
        set it read is what the switch uses)."""
        res, err = self.precheck(path)
        if err is not None:  # refused at once: nothing to wait for
            _reply(done, None, err)
            return
        if not self.queued:
            self.queued_at = time.monotonic()
        self.queued.append((path, reason, done, res))

    def overdue(self) -> bool:
        return bool(self.queued) and time.monotonic() - self.queued_at > SWITCH_WAIT_S

    def refuse_queued(self, n_active: int) -> None:
        """Refuse the queued switches that waited SWITCH_WAIT_S for the running requests."""
        pending, self.queued = self.queued, []
        for path, _, done, _ in pending:
            log.warning("residency switch to %s refused: %d request(s) still generating after %.0f s",
                        path, n_active, SWITCH_WAIT_S)
            _reply(done, None, EngineError(
                "residency_busy", f"{n_active} request(s) kept generating for {SWITCH_WAIT_S:.0f} s; the "
                "switch runs only between requests: try again when the daemon is idle (the previous set "
                "stays active)", 409))

    def run_queued(self) -> None:
        """Run the queued explicit switches in order (the last one ends up active)."""
        pending, self.queued = self.queued, []
        for path, reason, done, res in pending:
            try:
                info = self.switch_now(path, reason, res)
            except EngineError as e:
                log.warning("residency switch to %s refused: %s", path, e.message)
                _reply(done, None, e)
            except Exception as e:  # a bug must not take down the loop
                log.exception("residency switch to %s failed", path)
                _reply(done, None, EngineError("internal_error", f"residency switch failed: {e}", 500))
            else:
                _reply(done, info, None)

    def stop(self) -> None:
        """The engine stopped: the queued switches end with ``engine_stopped``."""
        for _, _, done, _ in self.queued:
            _reply(done, None, EngineError("engine_stopped", "the engine stopped", 503))
        self.queued.clear()

    def planned_set(self, workload: str) -> Optional[tuple[Path, tuple]]:
        """(path, file key) of the planned set of ``workload`` for this model, or None."""
        if self.w.rt is None or not _WORKLOAD_NAME.fullmatch(workload):
            return None
        path = residency_file(self.w.rt.model["fingerprint"], workload)
        try:
            st = path.stat()
        except OSError:
            return None
        return path, (str(path), st.st_mtime_ns, st.st_size)

    def auto_switch(self, t: Any) -> None:
        """The automatic per-workload swap before task ``t`` is admitted (see module docstring).
        Never fails the request: a refused set is logged once and skipped until its file changes."""
        w = self.w
        if w.rt is None or not w.settings.residency_auto_switch:
            return
        workload = t.req.workload or w.settings.workload_default
        found = self.planned_set(workload)
        if found is None:
            return
        path, key = found
        a = self.active_set
        if a.get("workload") == workload and (a.get("path") != str(path) or a.get("key") == key):
            return  # the workload's set is active (a pinned file, or the planned file unchanged)
        if key in self.failed_sets:
            return
        try:
            t.residency_switch = self.switch_now(path, "auto")
        except EngineError as e:
            self.failed_sets.add(key)
            t.residency_skipped = f"automatic swap to the {workload} set skipped: {e.message}"
            log.warning("request %s: %s", t.req.id, t.residency_skipped)
