"""The aiohttp application: routes, API-key check, protocol-appropriate errors, /health, /metrics.

The handlers never block on the engine: the engine client is async and runs the model in its own
thread or subprocess. :func:`make_app` builds the app for a :class:`DaemonState`;
:func:`start_http` binds it and records the actual URL in ``state.http_url``.
"""

from __future__ import annotations

import hmac
import logging
from typing import Awaitable, Callable

from aiohttp import web

from . import anthropic_api, openai_api, responses_api
from .errors import ApiError, error_response
from .metrics import CONTENT_TYPE
from .state import DaemonState

log = logging.getLogger("ostinatod.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN_PATHS = ("/health", "/")


def _key_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn ApiError, unknown routes and unexpected bugs into the protocol's JSON error body."""
    state: DaemonState = request.app["state"]
    try:
        key = state.settings.api_key
        if key and request.path not in _OPEN_PATHS and request.method != "OPTIONS":
            got = _key_of(request) or ""
            if not hmac.compare_digest(got.encode(), key.encode()):
                raise ApiError(401, "invalid_api_key", "Missing or wrong API key (send 'Authorization: "
                               "Bearer KEY' or 'x-api-key: KEY').")
        return await handler(request)
    except ApiError as e:
        state.metrics.http_errors.labels(_protocol(request.path), e.code).inc()
        if e.status >= 500 or e.code not in ("model_not_found",):
            log.info("%s %s -> %d %s: %s", request.method, request.path, e.status, e.code, e.message)
        return error_response(request.path, e)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(request.path, ApiError(413, "request_too_large", e.text or "Request too large"))
    except web.HTTPMethodNotAllowed as e:
        return error_response(request.path, ApiError(405, "method_not_allowed",
                                                     f"{request.method} is not allowed on {request.path}"))
    except web.HTTPNotFound:
        return error_response(request.path, ApiError(404, "not_found", f"No route {request.path}"))
    except web.HTTPException:
        raise
    except (ConnectionResetError, ConnectionError):
        raise
    except Exception as e:  # a bug in the daemon, never model output: logged with traceback
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(request.path, ApiError(500, "internal_error", f"Internal error: {e!r}"))


def _protocol(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/responses"):
        return "responses"
    if path.startswith("/v1/completions"):
        return "openai_completions"
    return "openai_chat"


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 {"status": "ok"} when ready, 503 while loading or without a model."""
    state: DaemonState = request.app["state"]
    es = state.engine_state
    body = {"status": "ok" if es == "ready" else es, "model": state.model_name,
            "random_weights": bool(state.model_info.get("is_demo"))}
    return web.json_response(body, status=200 if es == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format; the engine's stats() flattened under ostinato_engine_."""
    state: DaemonState = request.app["state"]
    if state.engine is not None and state.engine_state == "ready":
        try:
            state.metrics.set_engine_stats(await state.engine.stats())
        except Exception as e:  # noqa: BLE001 - metrics must answer even if the worker is restarting
            log.debug("engine stats unavailable: %r", e)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def root(request: web.Request) -> web.Response:
    """GET /: a short pointer for humans."""
    state: DaemonState = request.app["state"]
    return web.json_response({"name": "ostinatod", "model": state.model_name,
                              "engine_state": state.engine_state,
                              "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/models",
                                            "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                                            "/health", "/metrics"]})


@web.middleware
async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer CORS preflights and tag responses (only installed when settings.cors)."""
    if request.method == "OPTIONS":
        resp: web.StreamResponse = web.Response(status=204)
    else:
        resp = await handler(request)
    if not resp.prepared:
        resp.headers["Access-Control-Allow-Origin"] = "*"
        resp.headers["Access-Control-Allow-Headers"] = "*"
        resp.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
    return resp


def make_app(state: DaemonState, client_max_size: int = 64 * 1024 * 1024) -> web.Application:
    """Build the HTTP app for ``state`` (body limit ``client_max_size`` bytes: agents send long
    histories)."""
    mws = [errors_middleware] + ([cors_middleware] if state.settings.cors else [])
    app = web.Application(middlewares=mws, client_max_size=client_max_size)
    app["state"] = state
    r = app.router
    r.add_get("/", root)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/models", openai_api.models)
    r.add_post("/v1/chat/completions", openai_api.chat_completions)
    r.add_post("/v1/completions", openai_api.completions)
    r.add_post("/v1/responses", responses_api.responses)
    r.add_post("/v1/messages", anthropic_api.messages)
    r.add_post("/v1/messages/count_tokens", anthropic_api.count_tokens)
    # ANTHROPIC_BASE_URL ending in /v1 (the client appends /v1/messages itself): served, with a hint
    r.add_post("/v1/v1/messages", _doubled_v1(anthropic_api.messages))
    r.add_post("/v1/v1/messages/count_tokens", _doubled_v1(anthropic_api.count_tokens))
    return app


def _doubled_v1(handler: Handler) -> Handler:
    """``handler`` for a path with a doubled ``/v1`` (a base URL that ends in /v1); logs the fix
    once per daemon."""
    async def served(request: web.Request) -> web.StreamResponse:
        state: DaemonState = request.app["state"]
        state.warn_once(["the client's base URL ends in /v1; served anyway, but drop /v1 from "
                         "ANTHROPIC_BASE_URL (Anthropic clients append /v1/messages themselves)"],
                        f"request to {request.path}")
        return await handler(request)
    return served


def is_loopback(host: str) -> bool:
    """True for a loopback bind address (127.0.0.0/8, ::1, localhost)."""
    import ipaddress
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def open_bind_refusal(host: str, api_key: str | None, allow_open_bind: bool) -> str | None:
    """Why the HTTP API must not bind ``host`` (None when it may): a non-loopback address without
    an api_key serves the model to anyone who can reach the port, unless allow_open_bind."""
    if is_loopback(host) or api_key or allow_open_bind:
        return None
    return (f"refusing to bind {host!r} without an api_key: anyone who can reach the port could use "
            "the model. Set api_key (settings.toml, OSTINATO_API_KEY), or allow_open_bind = true "
            "(--allow-open-bind) to start anyway; host 127.0.0.1 is the default")


async def start_http(state: DaemonState, host: str | None = None, port: int | None = None) -> web.AppRunner:
    """Bind the app on ``host:port`` (settings by default; port 0 = free port). Sets
    ``state.http_url`` to the bound address and returns the runner (``await runner.cleanup()``)."""
    runner = web.AppRunner(make_app(state), access_log=None, handler_cancellation=False)
    await runner.setup()
    host = host or state.settings.host
    port = state.settings.port if port is None else port
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]  # actual port when 0 was asked
    bound_port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    state.http_url = f"http://{shown}:{bound_port}"  # what local clients use
    bound = sock.getsockname()[0]
    state.bind_address = f"[{bound}]:{bound_port}" if ":" in bound else f"{bound}:{bound_port}"
    return runner
