"""Pieces shared by the protocol adapters: model names, client and workload
detection, volatile-prefix neutralisation, and the generation driver that keeps the request
record (TTFT, TPOT, token counts) while an adapter turns engine events into its wire format.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any, AsyncIterator, Callable, Optional

from aiohttp import web
from pydantic import BaseModel

from ..engine.events import DoneEvent, EngineEvent, ErrorEvent, PingEvent, StartEvent
from ..engine.types import EngineError, GenRequest
from ..residency.traces import valid_workload
from .encoders import Frame
from .encoders.llama_native import timings
from .errors import ApiError
from .request_input import INPUT_PHASE, no_constant, read_json, validate
from .state import DaemonState

WORKLOAD_HEADER = "x-ostinato-workload"
# JSON {"token id": bias} merged under the body's logit_bias: for clients that cannot add body fields
# but can add headers (Claude Code: ANTHROPIC_CUSTOM_HEADERS); tests use it on random-weight models.
LOGIT_BIAS_HEADER = "x-ostinato-logit-bias"
WORKLOAD_SEP = "@"  # model alias suffix: "<model>@<workload>"
DEMO_MODEL_ID = "ostinato-demo-random-weights"

# Claude Code (>= 2.1.36) puts a per-request line like
#   x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli; cch=1f2e3;
# at the top of the system prompt. It changes every call, so it would break the prefix cache.
_VOLATILE_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*$", re.MULTILINE)
NEUTRAL_LINE = "x-anthropic-billing-header: (neutralized by ostinato)"

# User-Agent substrings -> (client name, implied workload). First match wins.
_CLIENTS: list[tuple[str, str, Optional[str]]] = [
    ("claude-cli/", "claude-code", "coding"), ("claude-code", "claude-code", "coding"),
    ("opencode", "opencode", "coding"), ("openhands", "openhands", "coding"),
    ("litellm", "litellm", "coding"), ("codex", "codex", "coding"),
    ("openai/python", "openai-python", None), ("anthropic/python", "anthropic-python", None),
    ("ostinato", "ostinato", None),
]


# Agents that reach us through LiteLLM (which calls the openai SDK: "OpenAI/Python" user agent) or
# another generic client, recognised by a marker of their own system prompt (first system message,
# its first SYSTEM_MARKER_CHARS characters): marker -> client name; their workload is "coding".
_SYSTEM_MARKERS: list[tuple[str, str]] = [
    ("You are OpenHands agent", "openhands"),  # OpenHands (software-agent SDK and app)
    ("mswea_bash_command", "mini-swe-agent"),  # mini-swe-agent's command block
    ("mini-swe-agent", "mini-swe-agent"),
    ("SWE-agent", "swe-agent"),
    # mini-swe-agent 2.x: a generic system prompt; its task template (first user message) ends
    # every run with this command
    ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "mini-swe-agent"),
]
SYSTEM_MARKER_CHARS = 4000
_GENERIC_CLIENTS = ("openai-python", "litellm", None)


def neutralize_text(text: str) -> str:
    """Replace per-request volatile lines (Claude Code's billing header) by a constant line."""
    return _VOLATILE_LINE.sub(NEUTRAL_LINE, text) if "x-anthropic-billing-header" in text else text


def neutralize_messages(messages: list[dict[str, Any]]) -> None:
    """In place: neutralise volatile lines in every system message (str or text parts)."""
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            continue
        c = m.get("content")
        if isinstance(c, str):
            m["content"] = neutralize_text(c)
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = neutralize_text(part["text"])


def printable_header(value: str) -> str:
    """A header value as text that can be logged and stored: bytes that were not UTF-8 (aiohttp
    keeps them as surrogate escapes) become U+FFFD."""
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that escapes no byte
        return value.encode("utf-8", "replace").decode("utf-8")


def detect_client(request: web.Request) -> tuple[Optional[str], Optional[str]]:
    """(client name, implied workload) from the User-Agent; (product token, None) if unknown."""
    ua = printable_header(request.headers.get("User-Agent", ""))
    low = ua.lower()
    for needle, name, workload in _CLIENTS:
        if needle in low:
            return name, workload
    return (ua.split("/")[0][:40] or None), None


def client_from_system_prompt(messages: Optional[list[dict[str, Any]]]) -> Optional[str]:
    """The agent whose system prompt starts ``messages`` (:data:`_SYSTEM_MARKERS`), or None. When
    the first system message has no marker, the first user message (an agent's task template) is
    looked at too."""
    for m in (messages or [])[:2]:
        role = m.get("role")
        if role not in ("system", "developer", "user"):
            return None
        c = m.get("content")
        text = c if isinstance(c, str) else "".join(
            p.get("text", "") for p in c or [] if isinstance(p, dict) and isinstance(p.get("text"), str))
        head = text if role == "user" else text[:SYSTEM_MARKER_CHARS]  # the task text comes first
        for marker, name in _SYSTEM_MARKERS:
            if marker in head:
                return name
        if role == "user":
            return None
    return None


def resolve_model(state: DaemonState, requested: Optional[str], anthropic: bool = False
                  ) -> tuple[str, Optional[str]]:
    """Map the client's model name to the served model.

    Accepted: the served id, the GGUF file name/stem, the demo id, any of those with an
    ``@<workload>`` suffix, for Anthropic clients any ``claude-*`` name, and any name at all with
    the ``any_model_name`` setting. Returns
    ``(echoed name, workload from the suffix or None)``. Raises ApiError 404 ``model_not_found``.
    """
    if not requested:
        if anthropic:
            raise ApiError("invalid_request", "Field 'model' is required.", 400, param="model")
        return state.model_name, None
    base, workload = requested, None
    if WORKLOAD_SEP in requested:
        base, workload = requested.rsplit(WORKLOAD_SEP, 1)
        workload = workload or None
    names = {state.model_name}
    path = state.model_info.get("path") or state.settings.model
    if path:
        p = str(path).rsplit("/", 1)[-1]
        names |= {p, p[:-5] if p.endswith(".gguf") else p}
    if state.demo or not state.settings.model:
        names.add(DEMO_MODEL_ID)
    if base in names or (anthropic and base.startswith("claude")) or state.settings.any_model_name:
        return requested, workload
    raise ApiError("model_not_found", f"Model {requested!r} is not served here; "
                   f"this daemon serves {state.model_name!r} (GET /v1/models).", 404, param="model")


def request_workload(state: DaemonState, request: web.Request, suffix_workload: Optional[str],
                     client_workload: Optional[str]) -> str:
    """Workload: header ``x-ostinato-workload`` > model suffix > known client > default, within
    the cap of workload names (:meth:`DaemonState.admit_workload`). Raises ApiError 400 ``invalid_workload`` for a name that is not a plain file name
    (``residency.traces.valid_workload``: letters, digits, ``.``, ``_``, ``-``, no ``..``)."""
    header = request.headers.get(WORKLOAD_HEADER)
    for given, where in ((header, WORKLOAD_HEADER), (suffix_workload, "model")):
        if given and not valid_workload(given):
            raise ApiError("invalid_workload", f"Invalid workload name {given!r} (in {where}): use "
                           "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit.", 400,
                           param=where)
    return state.admit_workload(header or suffix_workload or client_workload or state.settings.workload_default)


def fill_common(state: DaemonState, request: web.Request, req: GenRequest, requested_model: Optional[str],
                anthropic: bool = False) -> None:
    """Set ``model``, ``client`` and ``workload`` of ``req`` from the HTTP request."""
    echoed, suffix = resolve_model(state, requested_model, anthropic)
    client, cw = detect_client(request)
    if client in _GENERIC_CLIENTS or cw is None:
        agent = client_from_system_prompt(req.messages)
        if agent is not None:  # e.g. mini-swe-agent or OpenHands through LiteLLM
            client, cw = agent, "coding"
    req.model = echoed
    req.client = client
    req.workload = request_workload(state, request, suffix, cw)
    hdr = request.headers.get(LOGIT_BIAS_HEADER)
    if hdr:
        try:
            extra = json.loads(hdr, parse_constant=no_constant)
        except (json.JSONDecodeError, RecursionError):
            extra = None
        if not isinstance(extra, dict):
            raise ApiError("invalid_request", f"{LOGIT_BIAS_HEADER} must be a JSON object", 400,
                           param=LOGIT_BIAS_HEADER)
        body_bias = getattr(req, "logit_bias", None) or {}
        apply_logit_bias(req, extra)
        req.logit_bias = {**(getattr(req, "logit_bias", None) or {}), **body_bias}  # type: ignore[attr-defined]
    if req.messages and state.settings.neutralize_volatile:
        neutralize_messages(req.messages)
    req.demo = bool(state.demo)


async def ensure_engine(state: DaemonState) -> Any:
    """The engine, waiting while it loads/restarts. Raises ApiError 503 ``model_not_loaded``.
    Ends the request's input phase (see INPUT_PHASE): errors from here on are not the client's."""
    INPUT_PHASE.set(False)
    eng = state.engine
    if state.phase == "stopping":
        raise ApiError("engine_stopped", "The daemon is shutting down.", 503)
    if eng is None:
        raise ApiError("model_not_loaded", "No model is loaded.", 503)
    if eng.state in ("loading", "restarting", "stalled"):
        try:
            await eng.wait_ready(timeout=600)
        except (EngineError, asyncio.TimeoutError) as e:
            if state.phase == "stopping" or getattr(e, "code", None) == "engine_stopped":
                raise ApiError("engine_stopped", "The daemon is shutting down.", 503) from None
            raise ApiError("model_not_loaded", f"Model failed to load: {e}", 503) from None
    if eng.state not in ("ready",):
        raise ApiError("model_not_loaded", f"Engine is {eng.state}; no model to serve.", 503)
    return eng


# the request field that holds the conversation / the output cap, by protocol
_MESSAGES_FIELD = {"responses": "input", "openai_completions": "prompt", "llama_server": "prompt"}
_MAX_TOKENS_FIELD = {"responses": "max_output_tokens", "llama_server": "n_predict"}


def engine_error_param(protocol: str, code: str, message: str) -> Optional[str]:
    """The request field an engine's refusal is about (the ``param`` of the error), in the terms
    of ``protocol``'s request; None when it names none."""
    msgs = _MESSAGES_FIELD.get(protocol, "messages")
    text = message.lower()
    if code == "schema_too_large" or text.startswith("tools") or "tool definition" in text:
        return "tools"
    if text.startswith("tool_choice"):
        return "tool_choice"
    if text.startswith(("response_format", "json_schema")):
        return "text.format" if protocol == "responses" else "response_format"
    if code == "invalid_grammar" or text.startswith("grammar"):
        return "grammar"
    if text.startswith("max_tokens"):
        return _MAX_TOKENS_FIELD.get(protocol, "max_tokens")
    if code in ("context_length_exceeded", "infill_not_supported") or any(
            w in text for w in ("messages", "prompt", "content part", "token id", "tool call")):
        return msgs
    return None


class Generation:
    """Drives one engine generation for an adapter and keeps its request record.

    Usage: ``gen = await Generation.open(state, req, protocol)`` — raises ApiError if the engine
    refuses the request before producing anything (context too long, bad params), so the adapter
    can still answer a plain HTTP error; then ``async for ev in gen.events()`` yields the
    remaining "delta"/"done"/"error" events (the "start" event is consumed and kept in
    ``gen.start``). ``gen.close(status)`` must be called at the end (the adapters use
    ``try/finally``). TTFT is measured from the request's arrival to the first delta; the
    engine's own timings replace the measurement when the "done" event carries them.
    """

    def __init__(self, state: DaemonState, req: GenRequest, protocol: str):
        self.state = state
        self.req = req
        self.protocol = protocol
        self.rec = state.begin_request(req.id, protocol, req.model, req.client, req.workload)
        if req.warnings:
            self.rec["warnings"] = list(req.warnings)
            state.warn_once(req.warnings, f"request {req.id} ({req.client or 'unknown client'})")
        self.t0 = time.monotonic()
        self.t_first: Optional[float] = None
        self.n_deltas = 0
        self.start: Optional[StartEvent] = None
        self.done: Optional[dict[str, Any]] = None
        self.error: Optional[ErrorEvent] = None
        self._it: Optional[AsyncIterator[EngineEvent]] = None
        self._pending: Optional[EngineEvent] = None
        self._next_task: Optional[asyncio.Future] = None
        self._closed = False

    @classmethod
    async def open(cls, state: DaemonState, req: GenRequest, protocol: str) -> "Generation":
        """Start generating; raises ApiError for errors reported before any output."""
        gen = cls(state, req, protocol)
        try:
            eng = await ensure_engine(state)
            gen._it = eng.generate(req).__aiter__()
            first = await gen._next()
        except ApiError as e:
            gen.close(e.code, e.message)
            raise
        except EngineError as e:
            gen.close(e.code, e.message)
            extra = dict(e.extra)
            param = extra.pop("param", None) or engine_error_param(protocol, e.code, e.message)
            raise ApiError(e.code, e.message, e.status, param=param if e.status < 500 else None,
                           extra=extra) from None
        except BaseException as e:  # every record is closed, whatever fails (then re-raised)
            gen.close("internal_error", repr(e))
            raise
        if first is None:
            gen.close("engine_crashed", "engine ended the stream without a result")
            raise ApiError("engine_crashed", "The engine ended the stream without a result.", 503)
        if isinstance(first, ErrorEvent):
            gen.close(first.code, first.message)
            status, code, message = first.status, first.code, first.message
            extra = dict(first.extra)
            param = extra.pop("param", None) or engine_error_param(protocol, code, message)
            raise ApiError(code, message, status, param=param if status < 500 else None, extra=extra)
        if isinstance(first, StartEvent):
            gen._on_start(first)
        else:
            gen._pending = first
        return gen

    def timings(self) -> dict[str, Any]:
        """llama-server's ``timings`` of this generation so far (:func:`.encoders.llama_native.timings`):
        the engine's own figures once it is done, the ones measured here before."""
        if self.done is not None:
            return timings(self.done)
        now = time.monotonic()
        u = self.usage
        first = self.t_first or now
        return timings({"usage": dict(u, prefilled_tokens=u["prompt_tokens"] - u["cached_tokens"]),
                        "timings": {"prefill_s": first - self.t0, "decode_s": now - first}})

    async def _next(self) -> Optional[EngineEvent]:
        try:
            return await self._it.__anext__()  # type: ignore[union-attr]
        except StopAsyncIteration:
            return None

    def _on_start(self, ev: StartEvent) -> None:
        self.start = ev
        sw = ev.residency_switch
        if isinstance(sw, dict):  # the engine swapped this request's workload set in first
            self.rec["residency_switch_s"] = sw.get("seconds")
            self.state.note_residency_switch(sw, request_id=self.req.id)
        if ev.residency_switch_skipped:
            logging.getLogger("ostinatod.residency").warning("request %s: %s", self.req.id,
                                                             ev.residency_switch_skipped)
        self.rec["prompt_tokens"] = ev.prompt_tokens
        self.rec["cached_tokens"] = ev.cached_tokens
        self.rec["prefilled_tokens"] = ev.prompt_tokens - ev.cached_tokens

    async def _next_or_ping(self, heartbeat: Optional[float]) -> Optional[EngineEvent]:
        """Next engine event, or a PingEvent after ``heartbeat`` s without one (the pending
        read is kept, not cancelled, so no event is lost)."""
        if heartbeat is None:
            return await self._next()
        if self._next_task is None:
            self._next_task = asyncio.ensure_future(self._next())
        done, _ = await asyncio.wait({self._next_task}, timeout=heartbeat)
        if not done:
            return PingEvent()
        task, self._next_task = self._next_task, None
        return task.result()

    async def result(self, request: Optional[web.Request] = None) -> dict[str, Any]:
        """Run to the end (non-streaming responses): the ``done`` data, or ApiError with the
        engine's status and code when the stream ends in an error.

        With ``request``, a client that closes its connection stops the generation (checked on
        every event and at least once a second): the engine request is cancelled and ApiError 499
        ``client_disconnected`` is raised (nobody is left to read it; the record says so)."""
        async for ev in self.events(heartbeat=1.0 if request is not None else None):
            if request is not None and (request.transport is None or request.transport.is_closing()):
                await self.aclose()
                raise ApiError("client_disconnected", "the client closed the connection", 499)
            if ev.type == "ping":
                continue
            if isinstance(ev, ErrorEvent):
                raise ApiError(ev.code, ev.message, ev.status, extra=dict(ev.extra))
        return self.done or {}

    async def events(self, heartbeat: Optional[float] = None) -> AsyncIterator[EngineEvent]:
        """Remaining events; ends after "done" or "error" (a vanished stream becomes an error).

        With ``heartbeat`` (seconds), a ``PingEvent`` is yielded whenever the engine is
        silent that long (long prefills), so streaming adapters can keep the connection alive."""
        while True:
            if self._pending is not None:
                ev, self._pending = self._pending, None
            else:
                try:
                    ev = await self._next_or_ping(heartbeat)
                except EngineError as e:
                    ev = ErrorEvent(e.code, e.message, e.status)
                if ev is None:
                    ev = ErrorEvent("engine_crashed", "The engine ended the stream without a result.", 503)
            if isinstance(ev, StartEvent):
                self._on_start(ev)
                continue
            if ev.type == "ping":
                yield ev
                continue
            if ev.type == "delta":
                if self.t_first is None:
                    self.t_first = time.monotonic()
                    self.rec["ttft_s"] = round(self.t_first - self.t0, 4)
                self.n_deltas += 1
                # live progress for `ostinato ps` / the TUI: deltas so far, a lower bound of the
                # tokens (a delta can hold several); the exact count replaces it at "done"
                self.rec["completion_tokens"] = self.n_deltas
            elif isinstance(ev, DoneEvent):
                self._on_done(ev)
            elif isinstance(ev, ErrorEvent):
                self.error = ev
            yield ev
            if ev.type in ("done", "error"):
                return

    def _on_done(self, ev: DoneEvent) -> None:
        self.done = ev.data  # what the wire encoders take (the message is in OpenAI shape)
        u, t = ev.usage, ev.timings
        for k in ("prompt_tokens", "cached_tokens", "prefilled_tokens", "completion_tokens"):
            if u.get(k) is not None:
                self.rec[k] = u[k]  # type: ignore[literal-required]
        if self.rec["prefilled_tokens"] is None and self.rec["prompt_tokens"] is not None:
            self.rec["prefilled_tokens"] = self.rec["prompt_tokens"] - (self.rec["cached_tokens"] or 0)
        now = time.monotonic()
        if t.get("ttft_s") is not None:
            self.rec["ttft_s"] = round(float(t["ttft_s"]), 4)
        if t.get("tpot_s") is not None:
            self.rec["tpot_s"] = round(float(t["tpot_s"]), 5)
        elif self.t_first is not None and (self.rec["completion_tokens"] or 0) > 1:
            self.rec["tpot_s"] = round((now - self.t_first) / (self.rec["completion_tokens"] - 1), 5)

    @property
    def usage(self) -> dict[str, int]:
        """{"prompt_tokens", "completion_tokens", "cached_tokens"} as known so far (0 if unknown)."""
        return {"prompt_tokens": int(self.rec["prompt_tokens"] or 0),
                "completion_tokens": int(self.rec["completion_tokens"] or 0),
                "cached_tokens": int(self.rec["cached_tokens"] or 0)}

    async def aclose(self) -> None:
        """Stop the engine stream early (client went away); safe to call twice."""
        task, self._next_task = self._next_task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - abandoning the stream
                pass
        it, self._it = self._it, None
        if it is not None and hasattr(it, "aclose"):
            try:
                await it.aclose()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - the stream is being abandoned anyway
                pass

    def close(self, status: Optional[str] = None, error: Optional[str] = None) -> None:
        """Finish the record once: status "ok" after done, else the error code."""
        if self._closed:
            return
        self._closed = True
        if status is None:
            if self.error is not None:
                status, error = self.error.code, self.error.message
            elif self.done is not None:
                status = "ok"
            else:
                status, error = "client_disconnected", error or "stream abandoned"
        self.state.finish_request(self.rec, status, error)


HEARTBEAT_S = 10.0  # keep-alive interval of streams while the engine is silent (long prefill)
WATCH_S = 1.0  # how often a silent stream checks that its client is still connected


def apply_logit_bias(req: GenRequest, bias: Any) -> None:
    """Set ``req.logit_bias`` from an OpenAI-style ``{"token id": bias}`` map (bias -100..100).
    Raises ApiError 400 ``invalid_request`` on non-integer ids or out-of-range values."""
    if not bias:
        return
    if not isinstance(bias, dict):
        raise ApiError("invalid_request", "logit_bias must map token ids to numbers", 400, param="logit_bias")
    try:
        out = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise ApiError("invalid_request", "logit_bias must map token ids to numbers", 400,
                       param="logit_bias") from None
    if any(not -100 <= v <= 100 for v in out.values()) or any(k < 0 for k in out):
        raise ApiError("invalid_request", "logit_bias values must be in [-100, 100]", 400, param="logit_bias")
    req.logit_bias = out  # type: ignore[attr-defined]


def sse_headers() -> dict[str, str]:
    """Headers of an SSE answer (no proxy buffering)."""
    return {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"}


async def start_sse(request: web.Request) -> web.StreamResponse:
    """Prepare a streaming SSE response."""
    resp = web.StreamResponse(status=200, headers=sse_headers())
    await resp.prepare(request)
    return resp


async def respond(request: web.Request, gen: Generation, stream: bool,
                  body: Callable[[dict[str, Any]], dict[str, Any]],
                  open_stream: Callable[[], tuple[Any, list[Frame]]]) -> web.StreamResponse:
    """Answer one generation and close it: the JSON ``body(done)``, or, with ``stream``, the SSE
    frames of the encoder that ``open_stream()`` returns with its first frames (then the frames of
    every engine event, then the encoder's ``end()`` frames if it has any).

    Once a stream has started (status 200 sent), nothing can become an HTTP error any more: a
    failure is sent as the protocol's error event in the stream (the encoder's frames for an
    engine "error" event) and the stream is ended."""
    resp: Optional[web.StreamResponse] = None
    enc: Any = None
    try:
        if not stream:
            return web.json_response(body(await gen.result(request)))
        enc, first = open_stream()
        resp = await start_sse(request)
        for f in first:
            await resp.write(f.encode())
        last_write = time.monotonic()
        # a tick every second while the engine is silent (long prefill): a client that went away
        # is noticed within a second and its request cancelled between ubatches; a keep-alive
        # frame goes out every HEARTBEAT_S seconds of silence
        async for ev in gen.events(heartbeat=WATCH_S):
            if ev.type == "ping":
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("the client closed the connection")
                if time.monotonic() - last_write < HEARTBEAT_S:
                    continue
            for f in enc.feed(ev, gen.usage):
                await resp.write(f.encode())
            last_write = time.monotonic()
        for f in (enc.end() if hasattr(enc, "end") else []):
            await resp.write(f.encode())
        return resp
    except ConnectionError:  # the client went away (an ordinary event: one log line, no traceback)
        gen.close("client_disconnected", "the client closed the connection")
        return resp if resp is not None else web.Response(status=499)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - inside a started stream errors are stream events
        if resp is None or not resp.prepared or enc is None:
            raise
        code = e.code if isinstance(e, ApiError) else "internal_error"
        status = e.status if isinstance(e, ApiError) else 500
        logging.getLogger("ostinatod.http").warning("request %s: error inside its stream: %r", gen.req.id, e)
        gen.error = ErrorEvent(code, str(e), status)
        try:
            for f in enc.feed(gen.error, gen.usage):
                await resp.write(f.encode())
            for f in (enc.end() if hasattr(enc, "end") else []):
                await resp.write(f.encode())
        except Exception:  # noqa: BLE001 - the client may be gone as well
            pass
        return resp
    finally:
        await gen.aclose()
        gen.close()


async def open_generation(request: web.Request, body_cls: type[BaseModel],
                          build: Callable[[DaemonState, web.Request, Any], GenRequest],
                          protocol: str) -> tuple[Any, GenRequest, Generation]:
    """What every generating route does first: validate the JSON body as ``body_cls``, ``build``
    the internal request, start the generation. Returns (body, request, generation)."""
    state: DaemonState = request.app["state"]
    b = validate(body_cls, await read_json(request))
    req = build(state, request, b)
    return b, req, await Generation.open(state, req, protocol)
