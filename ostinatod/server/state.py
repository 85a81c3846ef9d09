"""Shared state of one running daemon: settings, engine, metrics, active and recent requests.

The HTTP front end (ostinatod/server/app.py) and the control API (ostinatod/control/server.py) both read
it; only the event loop thread touches it, so there is no locking.

Request record (a plain dict, JSON-serialisable; ``recent`` keeps the last
``settings.recent_requests`` of them, ``active`` the running ones by id)::

    {"id", "protocol", "model", "client", "workload", "status", "prompt_tokens", "cached_tokens",
     "prefilled_tokens", "completion_tokens", "ttft_s", "tpot_s", "total_s", "error", "started",
     "residency_switch_s"}

and ``warnings`` (a list of strings) when the adapter could not honour part of the request (a tool
left out, ...).

``residency_switch_s`` is the time of the residency-set swap the engine made right before the
request (its workload's set; None when there was none).

``status`` is "running", "ok", or an error code ("context_length_exceeded", "engine_crashed",
"client_disconnected", ...); ``started`` is a Unix time in seconds; times are seconds.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from ..desk import ResidencyDesk
from ..engine.types import EngineClient
from ..paths import Paths, get_paths
from ..settings import Settings
from ..workload import Replanner
from .metrics import Metrics

log = logging.getLogger("ostinatod.requests")
rlog = logging.getLogger("ostinatod.residency")
WARNED_MAX = 1000  # distinct warnings remembered by warn_once


@dataclass
class DaemonState:
    """Everything the front end and the control API share.

    ``engine`` may be None before the first model is loaded. ``reload`` is set by the daemon:
    ``await state.reload(path_or_None)`` replaces the engine with one serving ``path`` (None:
    unload); the control API's load/unload use it. ``model_info`` is the engine's ``info()``
    cached at load (name, path, arch, n_ctx, is_demo, ...). ``http_url`` is set once the HTTP
    site is bound (the actual port when port 0 was asked). ``paused_model`` is the model path the
    control API's /pause unloaded (None when not paused); ``replanner`` the daemon's background
    re-planner (None when the daemon runs none, e.g. a control server alone in a test).
    """

    settings: Settings
    engine: Optional[EngineClient] = None
    metrics: Metrics = field(default_factory=Metrics)
    paths: Paths = field(default_factory=get_paths)
    started_at: float = field(default_factory=time.time)
    model_info: dict[str, Any] = field(default_factory=dict)
    http_url: Optional[str] = None
    bind_address: Optional[str] = None  # "ADDR:PORT" the HTTP API is bound to (0.0.0.0 included)
    demo: bool = False  # serving the generated demo model (listed as "ostinato-demo-random-weights")
    phase: Optional[str] = None  # what the daemon is doing before an engine exists ("generating demo model")
    reload: Optional[Callable[[Optional[Path]], Awaitable[None]]] = None
    active: dict[str, dict[str, Any]] = field(default_factory=dict)
    recent: deque = field(default=None)  # type: ignore[assignment]
    # the last residency-set swap the daemon learnt of (see note_residency_switch)
    last_residency_switch: Optional[dict[str, Any]] = None
    # residency sets and traces of the served model (control API, re-planner); made here
    desk: Optional[ResidencyDesk] = None
    # why the last model load failed (None after a successful load): /health, status, the TUI
    model_error: Optional[str] = None
    warned: set = field(default_factory=set)  # warnings logged once (see warn_once)
    workloads: set = field(default_factory=set)  # workload names learnt from requests (admit_workload)
    paused_model: Optional[str] = None  # set by /pause, cleared by /resume and /models/load
    replanner: Optional[Replanner] = None  # set by the daemon (Daemon.start_upkeep)

    def __post_init__(self) -> None:
        if self.recent is None:
            self.recent = deque(maxlen=self.settings.recent_requests)
        if self.desk is None:
            self.desk = ResidencyDesk(self)

    # --- names -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The served model id: the model_alias setting, else "ostinato-demo-random-weights" for
        the generated demo model (``demo``), else the GGUF file name without ``.gguf``. Other
        random-weight files keep their name; ``model_info["is_demo"]`` flags them."""
        if self.settings.model_alias:
            return self.settings.model_alias
        if self.demo or (not self.settings.model and not self.model_info.get("path")):
            return "ostinato-demo-random-weights"
        path = self.model_info.get("path") or self.settings.model
        return Path(str(path)).stem

    @property
    def engine_state(self) -> str:
        """Engine lifecycle state; "loading" while the daemon prepares one (``phase``), "error"
        when there is none because the last load failed (``model_error``), else "stopped"."""
        if self.engine is None:
            return "loading" if self.phase else ("error" if self.model_error else "stopped")
        return getattr(self.engine, "state", "stopped")

    def warn_once(self, warnings: list[str], where: str) -> None:
        """Log each of ``warnings`` at WARNING level the first time this daemon sees it (agents send
        the same tools every turn; the request records keep them all)."""
        for w in warnings:
            if w not in self.warned:
                if len(self.warned) < WARNED_MAX:  # bounded: distinct warnings past it are logged each time
                    self.warned.add(w)
                log.warning("%s: %s", where, w)

    def admit_workload(self, name: str) -> str:
        """The workload a request naming ``name`` is served as: ``name`` when it is the default or
        one of the first ``max_workloads`` names learnt from requests (each gets a trace file
        and, later, a residency set), else the default (``workload_default``; logged once per
        daemon)."""
        default = self.settings.workload_default
        if name == default or name in self.workloads:
            return name
        if len(self.workloads) < self.settings.max_workloads:
            self.workloads.add(name)
            return name
        self.warn_once([f"more than {self.settings.max_workloads} workload names (max_workloads): "
                        f"requests naming new ones are served as the default workload {default!r}"],
                       f"workload {name!r}")
        return default

    # --- request records ----------------------------------------------------------------------
    def begin_request(self, rid: str, protocol: str, model: Optional[str], client: Optional[str],
                      workload: Optional[str]) -> dict[str, Any]:
        """Create and register the record of a starting generation request; returns it."""
        rec = {"id": rid, "protocol": protocol, "model": model, "client": client,
               "workload": workload, "status": "running", "prompt_tokens": None,
               "cached_tokens": None, "prefilled_tokens": None, "completion_tokens": 0,
               "ttft_s": None, "tpot_s": None, "total_s": None, "error": None,
               "started": time.time(), "residency_switch_s": None}
        self.active[rid] = rec
        self.metrics.in_flight.inc()
        return rec

    def finish_request(self, rec: dict[str, Any], status: str = "ok",
                       error: Optional[str] = None) -> None:
        """Close a record: move it to ``recent``, update metrics, write the one log line."""
        if rec.get("total_s") is None:
            rec["total_s"] = round(time.time() - rec["started"], 4)
        rec["status"] = status
        rec["error"] = error
        if self.active.pop(rec["id"], None) is not None:
            self.metrics.in_flight.dec()
        self.recent.append(rec)
        self.metrics.observe_request(rec)

        def f(v: Any, unit: str = "") -> str:
            return "-" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

        sw = rec.get("residency_switch_s")
        log.info("%s %s %s client=%s workload=%s status=%s ttft=%s tpot=%s total=%s prompt=%s "
                 "cached=%s prefilled=%s completion=%s%s%s", rec["id"], rec["protocol"], rec["model"],
                 rec["client"], rec["workload"], status, f(rec["ttft_s"], "s"), f(rec["tpot_s"], "s"),
                 f(rec["total_s"], "s"), f(rec["prompt_tokens"]), f(rec["cached_tokens"]),
                 f(rec["prefilled_tokens"]), f(rec["completion_tokens"]),
                 f" switch={sw:.3f}s" if isinstance(sw, (int, float)) else "",
                 f" error={error!r}" if error else "")

    # --- residency swaps ----------------------------------------------------------------------
    def note_residency_switch(self, info: dict[str, Any], request_id: Optional[str] = None) -> None:
        """Account one residency-set swap reported by the engine (``switch_residency``'s answer
        or a request's ``start.residency_switch``): ``{"seconds", "workload", "path",
        "previous_workload", "hot_experts", "pool_bytes", "reason" ("control" | "auto" |
        "replan"), "at"}``. Keeps it as ``last_residency_switch`` (control ``status``, TUI),
        counts it in ``ostinato_residency_switches_total{reason}``, sets
        ``ostinato_residency_last_switch_seconds`` and writes one log line."""
        rec = dict(info)
        if request_id:
            rec["request_id"] = request_id
        self.last_residency_switch = rec
        reason = str(rec.get("reason") or "control")
        self.metrics.residency_switches.labels(reason).inc()
        secs = rec.get("seconds")
        if isinstance(secs, (int, float)):
            self.metrics.residency_last_switch.set(secs)
        rlog.info("residency set switched (%s%s): workload %s -> %s in %s s, %s hot experts, pool %s "
                  "bytes, %s", reason, f", before request {request_id}" if request_id else "",
                  rec.get("previous_workload"), rec.get("workload"),
                  f"{secs:.3f}" if isinstance(secs, (int, float)) else "?", rec.get("hot_experts"),
                  rec.get("pool_bytes"), rec.get("path"))

    # --- engine supervision -------------------------------------------------------------------
    def engine_health(self) -> dict[str, Any]:
        """What /health and status say about the engine besides its state: ``restarts``,
        ``last_exit`` ({"code", "at", "reason"}), ``error`` (why it does not serve: the last crash
        while restarting, the load failure of the configured model, ...), ``next_restart_in_s``."""
        out: dict[str, Any] = {"restarts": 0, "last_exit": None, "error": self.model_error}
        eng = self.engine
        if eng is not None:
            sup = eng.status() if hasattr(eng, "status") else {}
            out.update({k: v for k, v in sup.items() if v is not None or k != "error"})
            if out.get("error") is None and getattr(eng, "error", None) is not None:
                out["error"] = getattr(eng.error, "message", str(eng.error))
            if self.engine_state == "ready":
                out["error"] = None
        return out

    # --- snapshots for status -----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Status summary (the control API's ``status`` and ``ostinatod status``)."""
        info = dict(self.model_info)
        return {
            "pid": os.getpid(),
            "started_at": self.started_at,
            "uptime_s": round(time.time() - self.started_at, 1),
            "http_url": self.http_url,
            "engine_state": self.engine_state,
            "phase": self.phase,
            "model": {"id": self.model_name, **info},
            "random_weights": bool(info.get("is_demo")),
            "engine": self.engine_health(),
            "active_requests": len(self.active),
            "requests_total": len(self.recent) + len(self.active),
        }
