"""Control API: JSON over HTTP on a Unix socket (runtime dir, mode 0600).

Only the user who runs the daemon can reach it (socket mode 0600 in a 0700 runtime dir), so it
carries no token. The TUI, the tray and ``ostinato status|ps|load|unload|residency`` use it; none of
them imports the engine (docs/design.md, "UI clients").

Routes (all answers JSON; errors are ``{"error": {"code", "message"}}`` with a 4xx/5xx status):

=========================  ==================================================================
GET  /status               :meth:`DaemonState.status` + workload, paused, residency summary
GET  /models               loaded model and the GGUF files in the models dir
POST /models/load          ``{"path": "/x.gguf"}`` -> reloads the engine with that file
POST /models/unload        unloads (frees RAM and GPU memory)
POST /pause, /resume       unload keeping the model path / load it again (tray Pause/Resume)
GET  /residency            current workload, residency sets and traces of the loaded model
POST /residency/plan       ``{"workload": "coding"}`` -> plans a set from the traces (planner)
POST /residency/switch     ``{"workload": "..."}`` or ``{"path": "..."}`` -> swaps the set at the
                           engine's next request boundary; answers the swap's facts
GET  /profile              the stored hardware profile (404 before ``ostinato profile``)
GET  /metrics              :func:`metrics_snapshot` (JSON; Prometheus text is on HTTP /metrics)
GET  /requests?limit=N     active and recent request records
GET  /connection           HTTP URL, served model, context and API key for agents (ostinato launch)
GET  /events?interval=S    live stream: one :func:`metrics_snapshot` per line (NDJSON)
=========================  ==================================================================

Residency routes go through the daemon's residency desk (:class:`ostinatod.desk.ResidencyDesk`);
snapshots are built by :mod:`.snapshots`. A residency switch on an engine that runs without the
expert engine (stock placement) answers 409 ``residency_unavailable`` saying why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from ..desk import DeskError
from ..engine.types import EngineError
from ..errors import OstinatoError
from ..files import NotRegularFile, WriteFailed, regular_file
from ..hardware import gpu_memory
from ..profile import load_profile
from ..residency.traces import valid_workload
from ..server.errors import ApiError
from ..server.http_errors import JsonErrorsHandler, JsonErrorsUnixSite, one_line
from ..server.request_input import check_json_value
from .snapshots import expert_view, metrics_snapshot

log = logging.getLogger("ostinatod.control")

STATE_KEY = web.AppKey("state", object)
# set when the control server shuts down: open /events streams end at once (a TUI attached must
# not hold the daemon's exit until aiohttp's shutdown timeout)
STOPPING_KEY = web.AppKey("stopping", asyncio.Event)
CONTROL_SHUTDOWN_S = 5.0  # what is still open this long after the shutdown began is closed


class ControlError(OstinatoError):
    """An error answered as ``{"error": {"code", "message"}}`` with HTTP ``status``."""

    def __init__(self, code: str, message: str, status: int):
        super().__init__(code, message, status)


def _err(e: ControlError | DeskError) -> web.Response:
    return web.json_response({"error": {"code": e.code, "message": e.message}}, status=e.status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except (ControlError, DeskError) as e:
        return _err(e)
    except web.HTTPException as e:  # unknown route / method: JSON too
        if e.status < 400:
            raise
        return _err(ControlError("not_found" if e.status == 404 else "bad_request", e.reason, e.status))
    except Exception as e:  # a bug here must not kill the daemon; say what it was
        log.exception("control API %s %s failed", request.method, request.path)
        return _err(ControlError("internal_error", f"{type(e).__name__}: {e}", 500))


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ControlError("invalid_json", f"request body is not valid JSON: {e}", 400)
    except RequestPayloadError as e:  # a Content-Encoding the body does not have, a cut body
        raise ControlError("invalid_encoding", f"request body cannot be read: {one_line(e)}", 400) from None
    except RecursionError:
        raise ControlError("invalid_json", "request body nests too deeply", 400) from None
    if not isinstance(data, dict):
        raise ControlError("invalid_request", "request body must be a JSON object", 400)
    try:
        check_json_value(data)
    except ApiError as e:
        raise ControlError(e.code, e.message, 400) from None
    return data


def _state(request: web.Request):
    return request.app[STATE_KEY]


# --- residency helpers ---------------------------------------------------------------------------

def _workload_name(name: Any) -> str:
    if not valid_workload(name):  # the one rule of workload names (1-64 plain characters)
        raise ControlError("invalid_workload", "workload must be 1-64 letters, digits, '.', '_' or "
                           f"'-', starting with a letter or digit; got {str(name)[:80]!r}", 400)
    return name


# --- handlers ------------------------------------------------------------------------------------

async def h_status(request: web.Request) -> web.Response:
    """GET /status: DaemonState.status() + workload (the default of requests that name none),
    paused, socket/log paths, ``last_residency_switch`` and ``residency`` (the active set as
    :func:`expert_view` reports it: workload, residency path, hot_experts, pool_bytes, switches,
    auto_switch, hot_route_share; None without an engine or when it runs stock) and ``gpus``
    (:func:`ostinatod.hardware.gpu_memory`)."""
    st = _state(request)
    out = st.status()
    out["workload"] = st.settings.workload_default
    out["paused"] = st.paused_model is not None
    out["control_socket"] = str(st.paths.control_socket)
    out["log_file"] = str(st.paths.log_file)
    out["last_residency_switch"] = st.last_residency_switch
    out["residency"] = None
    out["gpus"] = gpu_memory()   # per GPU used/total bytes (NVML; [] without): the pool lines show it
    if st.engine is not None and st.engine_state == "ready":
        try:
            stats = await asyncio.wait_for(st.engine.stats(), 5)
            if stats.experts is not None:  # stock engines have no residency set
                ex = expert_view(stats)
                out["residency"] = {k: ex.get(k) for k in ("workload", "residency", "hot_experts",
                                                            "pool_bytes", "pools", "switches",
                                                            "auto_switch", "hot_route_share")}
        except Exception as e:  # a restarting worker: status still answers
            log.debug("status: engine stats: %s", e)
    return web.json_response(out)


async def h_models(request: web.Request) -> web.Response:
    """GET /models: the loaded model and the GGUF files under the models dir."""
    st = _state(request)
    files = []
    d = st.paths.models_dir
    if d.is_dir():
        for f in sorted(d.rglob("*.gguf")):
            files.append({"path": str(f), "bytes": f.stat().st_size})
    return web.json_response({"loaded": {"id": st.model_name, "state": st.engine_state, **st.model_info}
                              if st.engine is not None else None,
                              "available": files, "models_dir": str(d)})


def _file(path: Any, missing_code: str, hint: str = "") -> Path:
    """``path`` when it names a regular file; else ControlError: 404 ``missing_code`` (no such
    file), 400 ``invalid_path`` (a name too long or with a NUL byte) or 400 ``not_a_file``
    (a directory, FIFO, device or socket, named as such)."""
    try:
        return regular_file(path)
    except NotRegularFile as e:
        if e.kind == "missing":
            what = "no residency set" if missing_code == "residency_not_found" else "no such file:"
            raise ControlError(missing_code, f"{what} {e.shown}{hint}", 404) from None
        code = "invalid_path" if e.kind in ("name too long", "invalid name") else (
            "file_unreadable" if e.kind == "unreadable" else "not_a_file")
        raise ControlError(code, str(e), 400) from None


def _check_gguf(path: Path) -> Path:
    path = _file(path, "model_not_found")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ControlError("model_unreadable", f"cannot read {path}: {e}", 400)
    if magic != b"GGUF":
        raise ControlError("not_gguf", f"{path} is not a GGUF file (magic {magic!r})", 400)
    return path.resolve()


async def _reload(st, path: Optional[Path]) -> None:
    if st.reload is None:
        raise ControlError("not_implemented", "this daemon cannot load or unload models", 501)
    try:
        await st.reload(path)
    except EngineError as e:  # the daemon keeps running without a model; say why
        raise ControlError(e.code, e.message, e.status if 400 <= e.status < 600 else 400)


async def h_load(request: web.Request) -> web.Response:
    """POST /models/load {"path"}: check the file is a GGUF, then reload the engine with it."""
    st = _state(request)
    body = await _body(request)
    if not isinstance(body.get("path"), str):
        raise ControlError("invalid_request", "body must be {\"path\": \"/path/to/model.gguf\"}", 400)
    path = _check_gguf(Path(body["path"]))
    await _reload(st, path)
    st.paused_model = None
    return web.json_response({"ok": True, "state": st.engine_state, "model": {"id": st.model_name,
                                                                              **st.model_info}})


async def h_unload(request: web.Request) -> web.Response:
    """POST /models/unload: drop the engine (frees RAM and GPU memory)."""
    st = _state(request)
    await _reload(st, None)
    return web.json_response({"ok": True, "state": st.engine_state})


async def h_pause(request: web.Request) -> web.Response:
    """POST /pause: unload, remembering the model path for /resume (idempotent)."""
    st = _state(request)
    if st.paused_model is None:
        path = st.model_info.get("path") or st.settings.model
        if st.engine is None or not path:
            raise ControlError("model_not_loaded", "no model is loaded; nothing to pause", 409)
        await _reload(st, None)
        st.paused_model = str(path)
    return web.json_response({"ok": True, "paused": True, "state": st.engine_state})


async def h_resume(request: web.Request) -> web.Response:
    """POST /resume: load the model unloaded by /pause (no-op when not paused)."""
    st = _state(request)
    p = st.paused_model
    if p is not None:
        await _reload(st, Path(p))
        st.paused_model = None
    return web.json_response({"ok": True, "paused": False, "state": st.engine_state})


async def h_residency(request: web.Request) -> web.Response:
    """GET /residency: current workload and expert figures, sets, traces, background re-plans."""
    st = _state(request)
    out: dict[str, Any] = {"workload": st.settings.workload_default, "last_switch": st.last_residency_switch}
    stats = None
    if st.engine is not None and st.engine_state == "ready":
        try:
            stats = await st.engine.stats()
        except Exception:
            stats = None
    out["current"] = expert_view(stats)
    rp = st.replanner
    out["background_replan"] = {"idle_s": st.settings.replan_idle_s, "growth": st.settings.replan_growth,
                                "planned": rp.planned[-10:] if rp else []}
    try:
        fp = await st.desk.fingerprint()
    except DeskError as e:
        out["sets"], out["traces"], out["note"] = [], [], e.message
        return web.json_response(out)
    out["fingerprint"] = fp
    out.update(st.desk.listing(fp))
    return web.json_response(out)


async def h_plan(request: web.Request) -> web.Response:
    """POST /residency/plan {"workload"}: flush the engine's pending routing counts, then
    plan_for_model() in a worker thread; 404 without traces, 507 ``disk_full`` / ``write_failed``
    when the set cannot be written (naming the path and the errno). The new set takes effect at the next
    request of that workload (automatic swap) or on POST /residency/switch."""
    st = _state(request)
    body = await _body(request)
    workload = _workload_name(body.get("workload") or st.settings.workload_default)
    model = st.desk.model_path()
    await st.desk.flush_traces()
    try:
        res, path, secs = await st.desk.plan(model, workload)
    except ValueError as e:  # PlanError / TraceError: missing traces, budget too small, ...
        code = "no_traces" if "no routing traces" in str(e) else "plan_failed"
        raise ControlError(code, str(e), 404 if code == "no_traces" else 400)
    except WriteFailed as e:  # disk full, read-only, ...: the earlier set stays, no temp file left
        raise ControlError("disk_full" if e.no_space else "write_failed", str(e), 507) from None
    out = {"ok": True, "workload": workload, "path": str(path),
           "seconds": round(secs, 3),
           "expected_hot_route_share": (res.get("plan") or {}).get("expected_hot_route_share")}
    return web.json_response(out)


async def h_switch(request: web.Request) -> web.Response:
    """POST /residency/switch {"workload"} | {"path"[, "workload"]}: swap the engine's residency
    set (engine.switch_residency; it runs at the engine's next request boundary, so this waits for
    the running requests). Answers ``{"ok", "seconds", "workload", "path", "previous_workload",
    "hot_experts", "pool_bytes", "reason", "at"}``. Errors: 400 ``invalid_workload``, 404
    ``residency_not_found`` (no planned set), 409 ``model_not_loaded``, 409
    ``residency_unavailable`` (the model runs without the expert engine), 400
    ``residency_refused`` (malformed, or a set for another model: the old set stays active), 500
    ``residency_switch_failed``. A switch naming a workload also makes it the default workload of
    requests that name none (setting workload_default, in memory)."""
    st = _state(request)
    body = await _body(request)
    if body.get("path"):
        path = body["path"] if isinstance(body["path"], str) else str(body["path"])
        workload = body.get("workload") and _workload_name(body["workload"])
    else:
        workload = _workload_name(body.get("workload"))
        path = st.desk.set_path(await st.desk.fingerprint(), workload)
    path = _file(path, "residency_not_found", f"; plan one first: ostinato residency plan {workload}"
                 if workload else "")
    if st.engine is None or st.engine_state != "ready":
        raise ControlError("model_not_loaded", f"engine is {st.engine_state}", 409)
    try:
        info = await st.desk.switch(path, reason="control")
    except EngineError as e:  # refused (another model's set, stock engine, ...): old set stays active
        raise ControlError(e.code, e.message, e.status if 400 <= e.status < 600 else 500)
    if workload:
        st.settings.workload_default = workload
    return web.json_response({"ok": True, **info})


async def h_profile(request: web.Request) -> web.Response:
    """GET /profile: the stored hardware profile (404 before the first one)."""
    p = load_profile(_state(request).paths.hardware_profile)
    if p is None:
        raise ControlError("no_profile", "no hardware profile yet; run 'ostinato profile'", 404)
    return web.json_response(p)


async def h_metrics(request: web.Request) -> web.Response:
    """GET /metrics: one metrics_snapshot() as JSON."""
    return web.json_response(await metrics_snapshot(_state(request)))


async def h_connection(request: web.Request) -> web.Response:
    """GET /connection: how a local agent reaches the HTTP API -- ``{"http_url" (for local
    clients: 127.0.0.1 when bound to 0.0.0.0), "bind_address", "model" (the served id), "n_ctx"
    (context per slot, None before a model is loaded), "n_ctx_reason" (why it is below the n_ctx
    setting: memory; None when it is not), "api_key" (None when unset), "random_weights"}``.
    The key is in it because ``ostinato launch`` hands it to the agent; the socket is 0600."""
    st = _state(request)
    return web.json_response({"http_url": st.http_url, "bind_address": st.bind_address,
                              "model": st.model_name, "n_ctx": st.model_info.get("n_ctx"),
                              "n_ctx_reason": st.model_info.get("n_ctx_reason"),
                              "api_key": st.settings.api_key,
                              "random_weights": bool(st.model_info.get("is_demo"))})


async def h_requests(request: web.Request) -> web.Response:
    """GET /requests?limit=N: active request records and the last N finished ones (newest first)."""
    st = _state(request)
    try:
        limit = max(1, int(request.query.get("limit", "50")))
    except ValueError:
        raise ControlError("invalid_request", "limit must be an integer", 400)
    return web.json_response({"active": list(st.active.values()), "recent": list(st.recent)[-limit:][::-1]})


async def h_events(request: web.Request) -> web.StreamResponse:
    """GET /events?interval=S[&count=N]: NDJSON stream of metrics snapshots."""
    st = _state(request)
    try:
        interval = min(60.0, max(0.05, float(request.query.get("interval", "1"))))
        count = int(request.query["count"]) if "count" in request.query else None
    except ValueError:
        raise ControlError("invalid_request", "interval must be a number, count an integer", 400)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    n = 0
    try:
        while count is None or n < count:
            try:
                snap = await metrics_snapshot(st)
                snap.pop("engine", None)  # raw counters can be large; /metrics has them
                line = json.dumps(snap, default=str)
            except Exception as e:  # one bad tick must not end the stream
                log.warning("events snapshot: %s: %s", type(e).__name__, e)
                line = json.dumps({"time": time.time(), "error": f"{type(e).__name__}: {e}"})
            await resp.write((line + "\n").encode())
            n += 1
            if count is not None and n >= count:
                break
            try:
                await asyncio.wait_for(request.app[STOPPING_KEY].wait(), interval)
                break  # the daemon is shutting down: end the stream
            except asyncio.TimeoutError:
                pass
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return resp


ROUTES = [("GET", "/status", h_status), ("GET", "/models", h_models),
          ("POST", "/models/load", h_load), ("POST", "/models/unload", h_unload),
          ("POST", "/pause", h_pause), ("POST", "/resume", h_resume),
          ("GET", "/residency", h_residency), ("POST", "/residency/plan", h_plan),
          ("POST", "/residency/switch", h_switch), ("GET", "/profile", h_profile),
          ("GET", "/metrics", h_metrics), ("GET", "/requests", h_requests), ("GET", "/events", h_events),
          ("GET", "/connection", h_connection)]


def make_app(state) -> web.Application:
    """The control API as an aiohttp application bound to ``state`` (a DaemonState)."""
    app = web.Application(middlewares=[_errors])
    app[STATE_KEY] = state
    app[STOPPING_KEY] = asyncio.Event()

    async def _stopping(_app):
        _app[STOPPING_KEY].set()
    app.on_shutdown.append(_stopping)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


class _ControlErrorsHandler(JsonErrorsHandler):
    """The control socket's connections: malformed HTTP answered ``{"error": {"code", "message"}}``."""

    __slots__ = ()

    def error_body(self, path: str, status: int, text: str) -> web.Response:
        return _err(ControlError("invalid_http", f"malformed HTTP request: {text}", status))


async def start_control_server(state, path: Optional[Path] = None) -> web.AppRunner:
    """Serve the control API on the Unix socket ``path`` (default ``state.paths.control_socket``).
    It only serves routes: the background re-planner and the first-start hardware profile are the
    daemon's (:meth:`ostinatod.daemon.Daemon.start_upkeep`).

    A stale socket file is replaced; the socket is made mode 0600 and its directory 0700.
    Returns the started runner; ``await runner.cleanup()`` stops it (the socket file is removed).
    Raises OSError when the path cannot be bound (e.g. longer than the ~107-byte AF_UNIX limit).
    """
    path = Path(path or state.paths.control_socket)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() or path.is_symlink():
        path.unlink()
    app = make_app(state)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=CONTROL_SHUTDOWN_S)
    await runner.setup()
    old = os.umask(0o177)  # no window where the socket is reachable by others
    try:
        await JsonErrorsUnixSite(runner, str(path), _ControlErrorsHandler).start()
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    log.info("control API on %s", path)
    return runner
