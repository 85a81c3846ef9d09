"""API errors and their protocol-appropriate JSON bodies.

OpenAI (chat, completions, responses, models): ``{"error": {"message", "type", "code", "param"}}``.
Anthropic (/v1/messages*): ``{"type": "error", "error": {"type", "message"}}``.
The HTTP status carries the class (400 bad request, 401 auth, 404 unknown model/route, 413 body
too large, 503 not loaded, 500 only for bugs in the daemon itself, never for model output).
"""

from __future__ import annotations

from typing import Any, Optional

from aiohttp import web

from ..errors import OstinatoError

# OpenAI error "type" by HTTP status.
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 500: "server_error", 501: "not_supported_error",
                502: "server_error"}
# Anthropic error "type" by HTTP status (docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
                   429: "rate_limit_error",
                   500: "api_error", 502: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class ApiError(OstinatoError):
    """An error answered to the client. ``code`` is a stable machine string
    (e.g. "invalid_json", "model_not_found", "context_length_exceeded", "engine_crashed");
    ``extra``: further fields of the error object (n_prompt_tokens, n_ctx); ``param``: the
    offending parameter (else taken from ``extra["param"]``, where the engine names it)."""

    def __init__(self, code: str, message: str, status: int, extra: Optional[dict[str, Any]] = None,
                 param: Optional[str] = None):
        super().__init__(code, message, status, extra)
        self.param = param if param is not None else self.extra.pop("param", None)


def openai_error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI-shaped error object (with the error's ``extra`` fields, e.g. llama-server's
    ``n_prompt_tokens`` and ``n_ctx`` of a context overflow)."""
    return {"error": {**err.extra, "message": err.message, "type": _OPENAI_TYPE.get(err.status, "server_error"),
                      "code": err.code, "param": err.param}}


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    """Anthropic-shaped error object (the message names our stable code too)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPE.get(err.status, "api_error"),
                                       "message": f"{err.message} ({err.code})"}}


def is_anthropic_path(path: str) -> bool:
    """True for the Anthropic Messages routes (``/v1/messages``, ``/v1/v1/messages``,
    ``/messages`` and their ``count_tokens``)."""
    return path.startswith(("/v1/messages", "/v1/v1/messages", "/messages"))


def error_response(path: str, err: ApiError) -> web.Response:
    """JSON error response in the wire format of the protocol of ``path``."""
    body = anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)
    headers = {"Retry-After": "5"} if err.status == 503 else None
    return web.json_response(body, status=err.status, headers=headers)
