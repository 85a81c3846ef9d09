"""The aiohttp application: routes, API-key check, protocol-appropriate errors, /health, /metrics.

The handlers never block on the engine: the engine client is async and runs the model in its own
thread or subprocess. :func:`make_app` builds the app for a :class:`DaemonState`;
:func:`start_http` binds it and records the actual URL in ``state.http_url``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from . import anthropic_api, llama_api, openai_api, responses_api
from .request_input import BODIES, INPUT_PHASE
from .errors import ApiError, error_response, is_anthropic_path
from .http_errors import JsonErrorsHandler
from .metrics import CONTENT_TYPE
from .state import DaemonState

log = logging.getLogger("ostinatod.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN_PATHS = ("/health", "/")
METRICS_ENGINE_WAIT_S = 1.0  # /metrics waits this long for the engine's counters, then answers without


def _key_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _key_ok(got: str, key: str) -> bool:
    """Constant-time comparison; a header that is not UTF-8 is simply a wrong key."""
    try:
        return hmac.compare_digest(got.encode("utf-8"), key.encode("utf-8"))
    except UnicodeError:
        return False


# Host names always accepted: loopback names, and Docker's name of the host (OpenHands in a
# container; no public DNS name, so no web page can rebind it). IP literals are accepted too:
# DNS rebinding needs a domain name.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "ip6-localhost", "host.docker.internal")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _hostname(value: str) -> str:
    """The host name of a Host header or an Origin (scheme, port and brackets removed, lower case)."""
    v = value.strip().lower()
    if "://" in v:
        v = v.split("://", 1)[1]
    v = v.split("/", 1)[0]
    if v.startswith("["):
        return v[1:].split("]", 1)[0]
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def _allowed_names(state: DaemonState) -> set[str]:
    names = set(LOOPBACK_NAMES) | {h.lower() for h in state.settings.allowed_hosts}
    host = state.settings.host
    if host not in ("0.0.0.0", "::", ""):
        names.add(_hostname(host))
    return names


def check_origin(state: DaemonState, request: web.Request) -> None:
    """DNS-rebinding and browser-page guard: the Host header must be an IP address, a loopback
    name, the bound address or one of ``allowed_hosts``; an Origin header (sent by browsers) must
    name one of the names (``cors = true`` allows any Origin); a POST must declare a JSON body (browsers cannot
    send ``application/json`` cross-site without a CORS preflight). Raises ApiError 403 / 415."""
    names = _allowed_names(state)
    host = request.headers.get("Host")
    if host is not None and "*" not in names and _hostname(host) not in names and not _is_ip(_hostname(host)):
        raise ApiError("forbidden_host", f"Host {host!r} is not served here (allowed: loopback names "
                       "and the allowed_hosts setting).", 403)
    origin = request.headers.get("Origin")
    if origin is not None and not state.settings.cors and "*" not in names and _hostname(origin) not in names:
        raise ApiError("forbidden_origin", f"Origin {origin!r} is not allowed (browser pages may "
                       "not use this API; see the cors and allowed_hosts settings).", 403)
    if request.method == "POST" and request.path not in _OPEN_PATHS:
        ctype = request.content_type.lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise ApiError("unsupported_media_type", f"POST bodies must be JSON: send "
                           f"'Content-Type: application/json' (got {ctype!r}).", 415)


# Exceptions that, raised while a request is being read and translated (INPUT_PHASE), come from a
# body no explicit check foresaw: the client's mistake, answered 400 invalid_request.
_INPUT_ERRORS = (ValidationError, ValueError, TypeError, AttributeError, LookupError, RecursionError)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn ApiError, unknown routes, malformed input and unexpected bugs into the protocol's JSON
    error body (never a response once a stream has started: see common.respond)."""
    state: DaemonState = request.app["state"]
    INPUT_PHASE.set(True)
    try:
        check_origin(state, request)
        key = state.settings.api_key
        if key and request.path not in _OPEN_PATHS and request.method != "OPTIONS":
            if not _key_ok(_key_of(request) or "", key):
                raise ApiError("invalid_api_key", "Missing or wrong API key (send 'Authorization: "
                               "Bearer KEY' or 'x-api-key: KEY').", 401)
        return await handler(request)
    except ApiError as e:
        return _refused(state, request, e)
    except web.HTTPRequestEntityTooLarge as e:
        return _refused(state, request, ApiError("request_too_large", e.text or "Request too large", 413))
    except web.HTTPMethodNotAllowed:
        return _refused(state, request, ApiError("method_not_allowed",
                                                 f"{request.method} is not allowed on {request.path}", 405))
    except web.HTTPNotFound:
        return _refused(state, request, ApiError("not_found", not_found_message(state, request), 404))
    except web.HTTPException:
        raise
    except (ConnectionResetError, ConnectionError):
        raise
    except _INPUT_ERRORS as e:
        if not INPUT_PHASE.get():
            log.exception("internal error on %s %s", request.method, request.path)
            return error_response(request.path, ApiError("internal_error", f"Internal error: {e!r}", 500))
        err = _input_error(e)
        state.metrics.http_errors.labels(_protocol(request.path), err.code).inc()
        log.info("%s %s -> 400 %s: %s", request.method, request.path, err.code, err.message)
        return error_response(request.path, err)
    except Exception as e:  # a bug in the daemon, never model output: logged with traceback
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(request.path, ApiError("internal_error", f"Internal error: {e!r}", 500))


def not_found_message(state: DaemonState, request: web.Request) -> str:
    """The 404 text of an unknown route: the path, and where the API is when the path is not under
    ``/v1`` (a base URL without it); a path under ``/v1`` gets the list of routes instead."""
    base = state.http_url or ""
    if request.path == "/v1" or request.path.startswith("/v1/"):
        return (f"No route {request.method} {request.path}. Served under /v1: /v1/chat/completions, "
                "/v1/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens, "
                "/v1/models and /v1/models/{id}.")
    return (f"No route {request.method} {request.path}: the API is under /v1 (OpenAI base URL {base}/v1, "
            f"Anthropic base URL {base})")


def _refused(state: DaemonState, request: web.Request, e: ApiError) -> web.Response:
    """The error answer of a refused request: one log line with its reason, counted in /metrics
    (``ostinato_http_errors`` by protocol and code), then the protocol's error body."""
    state.metrics.http_errors.labels(_protocol(request.path), e.code).inc()
    log.info("%s %s -> %d %s: %s", request.method, request.path, e.status, e.code, e.message)
    return error_response(request.path, e)


def _input_error(e: BaseException) -> ApiError:
    """ApiError 400 for an exception raised by a malformed request body (see _INPUT_ERRORS)."""
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return ApiError("invalid_request", f"Invalid request: {loc}: {first.get('msg')}", 400, param=loc or None)
    if isinstance(e, UnicodeError):
        return ApiError("invalid_encoding", f"Invalid request: text that cannot be encoded: {e}", 400)
    if isinstance(e, RecursionError):
        return ApiError("invalid_json", "Invalid request: the body nests too deeply.", 400)
    return ApiError("invalid_request", f"Invalid request: a field has an unexpected shape ({e})", 400)


def _protocol(path: str) -> str:
    if is_anthropic_path(path):
        return "anthropic"
    if path.startswith(("/v1/responses", "/responses")):
        return "responses"
    if path.startswith("/v1/completions"):
        return "openai_completions"
    if path.startswith(("/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
                        "/slots")):
        return "llama_server"
    return "openai_chat"


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 {"status": "ok"} when ready, 503 while loading, restarting or without a
    model; with the engine's supervision facts (``restarts``, ``last_exit``, ``error``: why it
    is not serving, only while it is not: llama-server's clients take an ``error`` key for a
    failure)."""
    state: DaemonState = request.app["state"]
    es = state.engine_state
    body = {"status": "ok" if es == "ready" else es, "model": state.model_name,
            "random_weights": bool(state.model_info.get("is_demo")), **state.engine_health()}
    if body.get("error") is None:
        body.pop("error", None)
    return web.json_response(body, status=200 if es == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format; the engine's stats() flattened under ostinato_engine_."""
    state: DaemonState = request.app["state"]
    if state.engine is not None and state.engine_state == "ready":
        try:  # never blocks on the engine: a busy or stopped worker leaves the last values
            state.metrics.set_engine_stats(await asyncio.wait_for(state.engine.stats(), METRICS_ENGINE_WAIT_S))
        except Exception as e:  # noqa: BLE001 - metrics must answer even if the worker is restarting
            log.debug("engine stats unavailable: %r", e)
    state.metrics.n_ctx_slot = int(state.model_info.get("n_ctx") or 0)
    state.metrics.set_stall(state.engine_health().get("stall") if state.engine_state == "stalled" else None)
    return web.Response(body=state.metrics.render(), headers={
        "Content-Type": CONTENT_TYPE, "Process-Start-Time-Unix": str(int(state.started_at))})


async def root(request: web.Request) -> web.Response:
    """GET /: a short pointer for humans."""
    state: DaemonState = request.app["state"]
    return web.json_response({"name": "ostinatod", "model": state.model_name,
                              "engine_state": state.engine_state,
                              "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/models",
                                            "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                                            "/health", "/metrics"],
                              "llama_server_endpoints": ["/completion", "/infill", "/tokenize",
                                                         "/detokenize", "/apply-template", "/props",
                                                         "/slots", "/chat/completions", "/models"]})


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
    r.add_get("/v1/models/{model_id:.+}", openai_api.model)  # ids may hold "/" (a GGUF path's stem does not)
    r.add_post("/v1/chat/completions", openai_api.chat_completions)
    r.add_post("/v1/completions", openai_api.completions)
    r.add_post("/v1/responses", responses_api.responses)
    r.add_post("/v1/messages", anthropic_api.messages)
    r.add_post("/v1/messages/count_tokens", anthropic_api.count_tokens)
    add_llama_server_routes(r)
    # ANTHROPIC_BASE_URL ending in /v1 (the client appends /v1/messages itself): served, with a hint
    r.add_post("/v1/v1/messages", _doubled_v1(anthropic_api.messages))
    r.add_post("/v1/v1/messages/count_tokens", _doubled_v1(anthropic_api.count_tokens))
    # a client that appends only /messages to a base URL without /v1: served, with a hint
    r.add_post("/messages", _doubled_v1(anthropic_api.messages, _NO_V1_HINT))
    r.add_post("/messages/count_tokens", _doubled_v1(anthropic_api.count_tokens, _NO_V1_HINT))
    return app


def add_llama_server_routes(r: web.UrlDispatcher) -> None:
    """llama-server's routes beside ours (docs/api.md "llama-server's API"): the OpenAI routes
    without ``/v1`` (the same handlers; ``/completions`` is llama-server's native completion, as
    there), and its own endpoints (:mod:`.llama_api`)."""
    r.add_get("/v1/health", health)
    r.add_get("/models", openai_api.models)
    r.add_get("/models/{model_id:.+}", openai_api.model)
    r.add_post("/chat/completions", openai_api.chat_completions)
    r.add_post("/responses", responses_api.responses)
    r.add_post("/completion", llama_api.completion)
    r.add_post("/completions", llama_api.completion)
    r.add_post("/infill", llama_api.infill)
    r.add_post("/tokenize", llama_api.tokenize)
    r.add_post("/detokenize", llama_api.detokenize)
    r.add_post("/apply-template", llama_api.apply_template)
    r.add_post("/chat/completions/input_tokens", llama_api.input_tokens)
    r.add_post("/v1/chat/completions/input_tokens", llama_api.input_tokens)
    r.add_get("/props", llama_api.props)
    r.add_post("/props", llama_api.props_post)
    r.add_get("/slots", llama_api.slots)


class _ConnectionGuard(asyncio.Protocol):
    """Wraps aiohttp's protocol of one connection: closes it when a request's headers have not
    arrived within ``header_timeout`` seconds of the connection's start or of the first bytes of
    a later request (slow or half-open clients; aiohttp's keep-alive timeout closes connections
    idle between requests). At most ``cap`` connections are open at once: at the cap a new
    connection closes the oldest idle kept-alive one (served, now waiting for nothing), else the
    oldest that has not sent a whole request yet, else the one whose request body is furthest
    behind the minimum body rate, or is refused when every one is busy with a request (a file
    descriptor each)."""

    open_now = 0
    # connections whose first request is not complete yet, oldest first (evicted at the cap)
    waiting: "dict[_ConnectionGuard, None]" = {}
    # every counted connection, oldest first (idle kept-alive ones are evicted first at the cap)
    opened: "dict[_ConnectionGuard, None]" = {}

    def __init__(self, inner: asyncio.Protocol, cap: int, header_timeout: float, min_body_rate: float = 0):
        self.inner, self.cap, self.header_timeout = inner, cap, header_timeout
        self.min_body_rate = min_body_rate
        self.transport: asyncio.BaseTransport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.armed_at = 0  # requests complete when the header timer was armed
        self.counted = False
        self.inner_connected = False  # aiohttp's protocol has the connection (made, not yet lost)

    def _requests(self) -> int:
        return getattr(self.inner, "_request_count", 0)

    def _idle_kept_alive(self) -> bool:
        """Served at least one request and handling none now: aiohttp's request loop is parked on
        its waiter for the next one. Not idle between taking a request off its queue and starting
        the request's handler task: before Python 3.12 that task starts a loop turn later, and the
        rest of the request's body can arrive in between (it did, on a 2-core CI machine: taken for
        the first bytes of a next request, it armed the header timeout, which then closed the
        connection while the answer was being generated). The loop parks only with no request
        queued or running, so its waiter says both (a missing one: never idle)."""
        waiter = getattr(self.inner, "_waiter", None)
        return self._requests() > 0 and waiter is not None and not waiter.done()

    def _victim(self) -> "_ConnectionGuard | None":
        for c in _ConnectionGuard.opened:
            if c._idle_kept_alive():
                return c
        waiting = next(iter(_ConnectionGuard.waiting), None)
        if waiting is not None:
            return waiting
        return self._slowest_body()

    def _slowest_body(self) -> "_ConnectionGuard | None":
        """The connection whose request body is furthest behind ``min_body_rate`` (bytes/s since
        its reading began), if one is behind at all: a flood of slow bodies cannot hold the cap."""
        if not self.min_body_rate:
            return None
        now = time.monotonic()
        worst, most = None, 0.0
        for c in _ConnectionGuard.opened:
            prog = BODIES.get(c.transport) if c.transport is not None else None
            if prog is not None:
                behind = prog.deficit(self.min_body_rate, now)
                if behind > most:
                    worst, most = c, behind
        return worst

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        victim = self._victim() if _ConnectionGuard.open_now >= self.cap else None
        if victim is not None:
            what = ("request body furthest behind the minimum rate" if BODIES.get(victim.transport)
                    else "idle kept-alive connection" if victim._requests() else "connection without a request")
            log.info("connection cap %d reached: closing the %s", self.cap, what)
            victim._drop()
        if _ConnectionGuard.open_now >= self.cap:
            log.warning("connection refused: %d connections open (cap %d)", _ConnectionGuard.open_now, self.cap)
            transport.close()
            return
        _ConnectionGuard.open_now += 1
        self.counted = True
        _ConnectionGuard.waiting[self] = None
        _ConnectionGuard.opened[self] = None
        self._arm()
        self.inner.connection_made(transport)
        self.inner_connected = True

    def _arm(self) -> None:
        """The next request's headers must be complete within ``header_timeout`` from now."""
        if self.header_timeout > 0 and self.timer is None:
            self.armed_at = self._requests()
            self.timer = asyncio.get_running_loop().call_later(self.header_timeout, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if self._requests() == self.armed_at and self.transport is not None:
            log.info("connection closed: no complete request headers within %.0f s", self.header_timeout)
            self._drop()

    def _drop(self) -> None:
        """Close the connection: counted as gone at once; aiohttp's protocol learns it from the
        transport's own connection_lost, a loop turn later (after its request loop has started:
        a connection evicted in the turn it was made would otherwise fail an assertion there)."""
        transport = self.transport
        self._forget()
        if transport is not None:
            transport.abort()

    def _forget(self) -> None:
        """Stop counting this connection (its timer, the cap's books)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        _ConnectionGuard.waiting.pop(self, None)
        _ConnectionGuard.opened.pop(self, None)
        if self.counted:
            self.counted = False
            _ConnectionGuard.open_now -= 1

    def data_received(self, data: bytes) -> None:
        if not self.counted:
            return
        idle, before = self._idle_kept_alive(), self._requests()
        self.inner.data_received(data)  # type: ignore[attr-defined]
        n = self._requests()
        if n > 0:
            _ConnectionGuard.waiting.pop(self, None)
        if self.timer is not None and n > self.armed_at:  # the headers it waited for are complete
            self.timer.cancel()
            self.timer = None
        elif idle and n == before:  # the first bytes of a later request on a kept-alive connection
            self._arm()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.counted else None  # dropped: nothing to hand on

    def connection_lost(self, exc: BaseException | None) -> None:
        self._forget()
        if self.inner_connected:
            self.inner_connected = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _JsonErrorsHandler(JsonErrorsHandler):
    """The HTTP API's connections: malformed HTTP answered in the protocol's JSON error shape."""

    __slots__ = ()

    def error_body(self, path: str, status: int, text: str) -> web.Response:
        return error_response(path, ApiError("invalid_http", f"Malformed HTTP request: {text}", status))


class _GuardedSite(web.TCPSite):
    """A TCPSite whose connections go through :class:`_ConnectionGuard`."""

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        st = self._runner.app["state"]  # type: ignore[union-attr]
        cap, timeout = st.settings.http_max_connections, st.settings.http_header_timeout_s
        rate = st.settings.http_body_min_rate
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _ConnectionGuard(_JsonErrorsHandler(server, loop=server._loop, **server._kwargs), cap,
                                     timeout, rate), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address, reuse_port=self._reuse_port)


def raise_fd_limit(want: int = 65536) -> int:
    """Raise this process's soft limit of open files towards the hard limit (at most ``want``);
    returns the soft limit now in force."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)
    return soft


_DOUBLED_V1_HINT = ("the client's base URL ends in /v1; served anyway, but drop /v1 from "
                    "ANTHROPIC_BASE_URL (Anthropic clients append /v1/messages themselves)")
_NO_V1_HINT = ("the client posts to /messages (its base URL lacks /v1); served anyway, but give it "
               "the base URL ending in /v1 if it appends only /messages")


def _doubled_v1(handler: Handler, hint: str = _DOUBLED_V1_HINT) -> Handler:
    """``handler`` for a path off the Anthropic client's usual ``/v1/messages`` (a doubled
    ``/v1``, or none); logs ``hint``, the fix, once per daemon."""
    async def served(request: web.Request) -> web.StreamResponse:
        state: DaemonState = request.app["state"]
        state.warn_once([hint], f"request to {request.path}")
        return await handler(request)
    return served


def is_loopback(host: str) -> bool:
    """True for a loopback bind address (127.0.0.0/8, ::1, localhost)."""
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


def cors_refusal(cors: bool, api_key: str | None, allow_cors_without_key: bool) -> str | None:
    """Why the HTTP API must not start with ``cors`` on (None when it may): without an api_key any
    web page the user opens could call the model and read its answers, unless
    allow_cors_without_key."""
    if not cors or api_key or allow_cors_without_key:
        return None
    return ("refusing to start with cors = true and no api_key: any web page you open could call the "
            "model and read its answers. Set api_key (settings.toml, OSTINATO_API_KEY), or "
            "allow_cors_without_key = true to start anyway")


async def start_http(state: DaemonState, host: str | None = None, port: int | None = None) -> web.AppRunner:
    """Bind the app on ``host:port`` (settings by default; port 0 = free port). Sets
    ``state.http_url`` to the bound address and returns the runner (``await runner.cleanup()``).

    Connections are guarded (:class:`_ConnectionGuard`): settings ``http_max_connections`` and
    ``http_header_timeout_s``; bodies must arrive within ``http_body_timeout_s`` (read_json); an
    idle kept-alive connection is closed after ``http_keepalive_timeout_s``."""
    s = state.settings
    runner = web.AppRunner(make_app(state), access_log=None, handler_cancellation=False,
                           keepalive_timeout=s.http_keepalive_timeout_s)
    await runner.setup()

    host = host or state.settings.host
    port = state.settings.port if port is None else port
    site = _GuardedSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]  # actual port when 0 was asked
    bound_port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    state.http_url = f"http://{shown}:{bound_port}"  # what local clients use
    bound = sock.getsockname()[0]
    state.bind_address = f"[{bound}]:{bound_port}" if ":" in bound else f"{bound}:{bound_port}"
    return runner
