"""Reading a request: the body as a JSON object within the limits (nesting, encoding, NaN, time) and
the pydantic validation of it; the input-phase flag that makes an unforeseen error while reading a
request the client's mistake (400), not the daemon's (500). Pure of the engine."""

from __future__ import annotations

import asyncio
import contextvars
import json
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
    raise ApiError(400, "invalid_json", f"Request body is not valid JSON: {name} is not a JSON number.")


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
                raise ApiError(400, "invalid_encoding", "Request body holds a string that is not valid "
                               "Unicode (a lone surrogate such as \\ud800).") from None
        elif isinstance(v, (dict, list)):
            if depth > max_depth:
                raise ApiError(400, "invalid_json", f"Request body nests deeper than {max_depth} levels.")
            items = list(v.keys()) + list(v.values()) if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


async def read_json(request: web.Request) -> dict[str, Any]:
    """Parse the body as a JSON object. Raises ApiError 400: ``invalid_json`` (not JSON, NaN or
    Infinity, nested deeper than MAX_JSON_DEPTH, not an object), ``invalid_encoding`` (a body that
    cannot be decoded: bad Content-Encoding, invalid UTF-8 or lone surrogates)."""
    enc = request.headers.get("Content-Encoding", "")
    if enc.lower() not in DECODED_ENCODINGS:  # aiohttp would pass the body on undecoded
        raise ApiError(400, "invalid_encoding", f"Content-Encoding {enc!r} is not supported "
                       f"(one of {', '.join(e for e in DECODED_ENCODINGS if e)}, or none).")
    try:
        state = request.app["state"]
        raw = await asyncio.wait_for(request.read(), state.settings.http_body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, "request_timeout", "The request body did not arrive within "
                       f"{state.settings.http_body_timeout_s:.0f} s.") from None
    except RequestPayloadError as e:
        raise ApiError(400, "invalid_encoding", f"Request body cannot be read: {one_line(e)}") from None
    try:
        body = json.loads(raw, parse_constant=no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"Request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", f"Request body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "Request body must be a JSON object.")
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
        raise ApiError(400, "invalid_request", f"Invalid request: {loc}: {first.get('msg')}",
                       param=loc or None) from None
