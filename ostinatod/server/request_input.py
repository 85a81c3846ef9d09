"""Reading a request: the body as a JSON object within the limits (nesting, encoding, NaN, time) and
the pydantic validation of it; the input-phase flag that makes an unforeseen error while reading a
request the client's mistake (400), not the daemon's (500). Pure of the engine."""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from .errors import ApiError
from .http_errors import one_line

# Deepest JSON nesting accepted in a request body (agents' tool schemas stay far below it; deeper
# bodies would reach recursion limits of the parser, the worker pipe or the chat template).
MAX_JSON_DEPTH = 64

# Content-Encoding values aiohttp decodes (one value only; "": none given)
DECODED_ENCODINGS = ("", "identity", "gzip", "deflate", "br", "zstd")

# True while a request is being read and turned into a GenRequest (set by the HTTP middleware,
# cleared by ensure_engine): an unexpected ValueError/TypeError/... then is the client's mistake
# (a body of a shape no check foresaw) and answers 400, never 500.
INPUT_PHASE: contextvars.ContextVar[bool] = contextvars.ContextVar("ostinato_input_phase", default=False)


def no_constant(name: str) -> Any:
    """``json.loads`` parse_constant: NaN and Infinity are not JSON numbers (ApiError 400)."""
    raise ApiError("invalid_json", f"Request body is not valid JSON: {name} is not a JSON number.", 400)


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ApiError 400 when a parsed JSON value nests deeper than ``max_depth`` (``invalid_json``)
    or holds a string that is not valid Unicode, e.g. a lone surrogate ``"\\ud800"``
    (``invalid_encoding``: it could not be encoded for the model)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError("invalid_encoding", "Request body holds a string that is not valid "
                               "Unicode (a lone surrogate such as \\ud800).", 400) from None
        elif isinstance(v, (dict, list)):
            if depth > max_depth:
                raise ApiError("invalid_json", f"Request body nests deeper than {max_depth} levels.", 400)
            items = list(v.keys()) + list(v.values()) if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


BODY_GRACE_S = 2.0  # the minimum body rate is measured from this long after the headers


class BodyProgress:
    """How far a request body has come: ``t0`` (monotonic, when reading began) and ``n`` (bytes
    so far). The connection guard reads it to close the bodies furthest behind first."""

    __slots__ = ("t0", "n")

    def __init__(self) -> None:
        self.t0, self.n = time.monotonic(), 0

    def deficit(self, min_rate: float, now: float) -> float:
        """Bytes this body is behind ``min_rate`` (counted from ``t0``; negative: ahead)."""
        return min_rate * (now - self.t0) - self.n


# bodies being read, by the transport of their connection (the connection guard's view)
BODIES: dict[Any, BodyProgress] = {}


async def read_body(request: web.Request) -> bytes:
    """The whole body of ``request`` within ``http_body_timeout_s`` and at ``http_body_min_rate``
    bytes per second at least (after :data:`BODY_GRACE_S`); its progress is published in
    :data:`BODIES` under the connection's transport while it arrives. Raises ApiError 408
    ``request_timeout`` (the connection is closed after the answer), 499 ``client_disconnected``
    (the connection closed meanwhile) or 413 (over the app's client_max_size)."""
    s = request.app["state"].settings
    limit = request.client_max_size
    prog = BodyProgress()
    proto = request.protocol
    transport = request.transport
    if transport is not None:
        BODIES[transport] = prog
    buf = bytearray()
    try:
        while True:
            now = time.monotonic()
            elapsed = now - prog.t0
            why = None
            if elapsed >= s.http_body_timeout_s:
                why = f"did not arrive within {s.http_body_timeout_s:.0f} s"
            elif s.http_body_min_rate and elapsed > BODY_GRACE_S and \
                    prog.n < s.http_body_min_rate * (elapsed - BODY_GRACE_S):
                why = (f"arrived slower than {s.http_body_min_rate} bytes/s ({prog.n} bytes in "
                       f"{elapsed:.0f} s; setting http_body_min_rate)")
            if why is not None:
                if proto is not None:
                    proto.keep_alive(False)  # closed after the answer: its body is not read on
                raise ApiError("request_timeout", f"The request body {why}.", 408)
            try:
                chunk = await asyncio.wait_for(request.content.readany(),
                                               min(1.0, s.http_body_timeout_s - elapsed))
            except asyncio.TimeoutError:
                continue
            except ConnectionError:  # the client went, or the cap closed it for being behind
                raise ApiError("client_disconnected", "The connection closed before the request "
                               f"body arrived ({prog.n} bytes).", 499) from None
            if not chunk:
                return bytes(buf)
            buf += chunk
            prog.n = len(buf)
            if limit and len(buf) > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(buf))
    finally:
        if transport is not None and BODIES.get(transport) is prog:
            del BODIES[transport]


async def read_json(request: web.Request) -> dict[str, Any]:
    """Parse the body as a JSON object. Raises ApiError 400: ``invalid_json`` (not JSON, NaN or
    Infinity, nested deeper than MAX_JSON_DEPTH, not an object), ``invalid_encoding`` (a body that
    cannot be decoded: bad Content-Encoding, invalid UTF-8 or lone surrogates)."""
    enc = request.headers.get("Content-Encoding", "")
    if enc.lower() not in DECODED_ENCODINGS:  # aiohttp would pass the body on undecoded
        raise ApiError("invalid_encoding", f"Content-Encoding {enc!r} is not supported "
                       f"(one of {', '.join(e for e in DECODED_ENCODINGS if e)}, or none).", 400)
    try:
        raw = await read_body(request)
    except RequestPayloadError as e:
        raise ApiError("invalid_encoding", f"Request body cannot be read: {one_line(e)}", 400) from None
    try:
        body = json.loads(raw, parse_constant=no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError("invalid_json", f"Request body is not valid JSON: {e}", 400) from None
    except RecursionError:
        raise ApiError("invalid_json", f"Request body nests deeper than {MAX_JSON_DEPTH} levels.", 400) from None
    if not isinstance(body, dict):
        raise ApiError("invalid_json", "Request body must be a JSON object.", 400)
    check_json_value(body)
    return body


def validate(model_cls: type[BaseModel], body: dict[str, Any]) -> Any:
    """Validate ``body`` with a pydantic model; errors become ApiError 400 ``invalid_request``
    naming the first bad field."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise ApiError("invalid_request", f"Invalid request: {loc}: {first.get('msg')}", 400,
                       param=loc or None) from None
