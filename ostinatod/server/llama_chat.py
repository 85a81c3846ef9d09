"""llama-server's extensions of the OpenAI chat body (``grammar``, top-level ``json_schema``,
``continue_final_message``, ``timings_per_token``, ``return_progress``) and its 400s for
contradictory chat options (llama.cpp's tools/server/server-common.cpp,
``oaicompat_chat_params_parse``)."""

from __future__ import annotations

from typing import Any

from ..engine.types import GenRequest
from .errors import ApiError


def chat_extensions(body: Any, req: GenRequest) -> None:
    """Apply llama-server's extensions of a chat body to ``req`` and refuse its contradictions
    with llama-server's 400s: ``grammar`` with ``json_schema`` or ``response_format``, ``grammar``
    with tools, ``continue_final_message`` with ``add_generation_prompt`` (true by default) or
    with a final assistant message that calls tools, two assistant messages at the end. A
    top-level ``json_schema`` is enforced as ``response_format`` is. ``body``: the validated chat
    body (its extra fields are llama-server's)."""
    x = body.model_extra or {}
    grammar, schema = x.get("grammar"), x.get("json_schema")
    if grammar is not None and not isinstance(grammar, str):
        raise ApiError("invalid_request", "grammar must be a string (GBNF)", 400, param="grammar")
    if schema is not None and not isinstance(schema, dict):
        raise ApiError("invalid_request", "json_schema must be an object", 400, param="json_schema")
    if grammar and (schema is not None or req.json_schema is not None):
        raise ApiError("invalid_request", "Cannot use both json_schema and grammar", 400, param="grammar")
    if grammar and req.tools and req.tool_choice != "none":
        raise ApiError("invalid_request", "Cannot use custom grammar constraints with tools.", 400,
                       param="grammar")
    msgs = req.messages or []
    cont = x.get("continue_final_message")
    if cont:
        if x.get("add_generation_prompt", True):
            raise ApiError("invalid_request", "Cannot set both add_generation_prompt and "
                           "continue_final_message to true.", 400, param="continue_final_message")
        if msgs and msgs[-1].get("role") == "assistant" and msgs[-1].get("tool_calls"):
            raise ApiError("invalid_request", "Cannot continue an assistant message that contains "
                           "tool calls.", 400, param="continue_final_message")
    elif len(msgs) >= 2 and msgs[-1].get("role") == "assistant" and msgs[-2].get("role") == "assistant":
        raise ApiError("invalid_request", "Cannot have 2 or more assistant messages at the end of "
                       "the list.", 400, param="messages")
    if grammar:
        req.grammar = grammar
    if schema is not None and req.json_schema is None:
        req.json_schema = schema or {"type": "object"}
    req.return_progress = bool(x.get("return_progress"))


def stream_extensions(body: Any) -> tuple[bool, bool]:
    """(``timings_per_token``, ``return_progress``) of a body's llama-server fields."""
    x = body.model_extra or {}
    return bool(x.get("timings_per_token")), bool(x.get("return_progress"))
