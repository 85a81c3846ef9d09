"""Anthropic Messages adapter: ``/v1/messages`` (also ``?beta=true``) and
``/v1/messages/count_tokens``.

Wire format from docs.anthropic.com/en/api/messages and .../messages-streaming. Anthropic content
blocks become OpenAI-shaped messages (the engine's one message shape): ``tool_use`` ->
assistant ``tool_calls``, ``tool_result`` -> ``tool`` messages (placed before the user's text of
the same turn), ``thinking`` -> ``reasoning_content``. ``system`` messages inside ``messages``
are accepted and kept as system messages in place.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..engine.types import EngineError, GenRequest
from .common import apply_logit_bias, ensure_engine, fill_common, open_generation, respond
from .request_input import read_json, validate
from .encoders import anthropic as enc
from .encoders import new_id
from .errors import ApiError
from .state import DaemonState

class MessagesBody(BaseModel):
    """Validated subset of an Anthropic Messages request."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = Field(None, ge=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    thinking: Optional[dict[str, Any]] = None
    ignore_eos: bool = False
    logit_bias: Optional[dict[str, float]] = None  # extension (OpenAI semantics)
    seed: Optional[int] = None  # extension (as in chat completions): the sampler's random stream


def _text_of(content: Any) -> str:
    """Concatenated text of a str or a list of blocks (non-text blocks are described briefly)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for blk in content:
        if not isinstance(blk, dict):
            continue
        if blk.get("type") == "text":
            parts.append(blk.get("text") or "")
        elif blk.get("type") in ("image", "document"):
            parts.append(f"[{blk['type']} omitted: not supported by this model server]")
    return "\n".join(parts)


def convert_messages(body: MessagesBody) -> list[dict[str, Any]]:
    """Anthropic system + messages -> OpenAI-shaped messages. Raises ApiError 400 on bad blocks."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system)})
    for i, m in enumerate(body.messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise ApiError("invalid_request", f"messages.{i}.role must be user, assistant or system", 400,
                           param=f"messages.{i}.role")
        content = m.get("content")
        if role == "system":
            out.append({"role": "system", "content": _text_of(content)})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError("invalid_request", f"messages.{i}.content must be a string or a list of "
                           "content blocks", 400, param=f"messages.{i}.content")
        texts: list[str] = []
        if role == "user":
            for j, blk in enumerate(content):
                t = blk.get("type") if isinstance(blk, dict) else None
                if t == "tool_result":
                    if not blk.get("tool_use_id"):
                        raise ApiError("invalid_request", f"messages.{i}.content.{j}.tool_use_id "
                                       "is required", 400, param=f"messages.{i}.content.{j}")
                    text = _text_of(blk.get("content"))
                    if blk.get("is_error"):
                        text = f"Error: {text}"
                    out.append({"role": "tool", "tool_call_id": blk["tool_use_id"], "content": text})
                elif t == "text":
                    texts.append(blk.get("text") or "")
                elif t in ("image", "document"):
                    texts.append(_text_of([blk]))
                elif t is None:
                    raise ApiError("invalid_request", f"messages.{i}.content.{j} is not a content "
                                   "block", 400, param=f"messages.{i}.content.{j}")
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
        else:
            reasoning: list[str] = []
            calls = []
            for j, blk in enumerate(content):
                t = blk.get("type") if isinstance(blk, dict) else None
                if t == "text":
                    texts.append(blk.get("text") or "")
                elif t == "thinking":
                    reasoning.append(blk.get("thinking") or "")
                elif t == "tool_use":
                    if not blk.get("name"):
                        raise ApiError("invalid_request", f"messages.{i}.content.{j}.name is "
                                       "required", 400, param=f"messages.{i}.content.{j}")
                    calls.append({"id": blk.get("id") or new_id("toolu_"), "type": "function",
                                  "function": {"name": blk["name"],
                                               "arguments": json.dumps(blk.get("input") or {},
                                                                       ensure_ascii=False)}})
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def loaded_tool_names(messages: list[Any]) -> set[str]:
    """Names of deferred tools the conversation has loaded: ``tool_reference`` blocks (the result of
    a tool search, inside ``tool_result`` content) and tools already called (``tool_use``)."""
    names: set[str] = set()

    def walk(blocks: Any) -> None:
        if not isinstance(blocks, list):
            return
        for blk in blocks:
            if not isinstance(blk, dict):
                continue
            if blk.get("type") == "tool_reference" and isinstance(blk.get("tool_name"), str):
                names.add(blk["tool_name"])
            elif blk.get("type") == "tool_use" and isinstance(blk.get("name"), str):
                names.add(blk["name"])
            elif blk.get("type") == "tool_result":
                walk(blk.get("content"))

    for m in messages:
        if isinstance(m, dict):
            walk(m.get("content"))
    return names


def convert_tools(tools: Optional[list[dict[str, Any]]], messages: Optional[list[Any]] = None
                  ) -> Optional[list[dict[str, Any]]]:
    """Anthropic client tools -> OpenAI function tools; server tools (no input_schema) are dropped,
    and so are tools with ``defer_loading: true`` until the conversation loads them (as the
    Anthropic API does: :func:`loaded_tool_names`), which keeps them out of the prompt."""
    out = []
    loaded: Optional[set[str]] = None
    for t in tools or []:
        if not isinstance(t, dict) or "input_schema" not in t:
            continue
        if not t.get("name"):
            raise ApiError("invalid_request", "every tool needs a name", 400, param="tools")
        if t.get("defer_loading") is True:
            if loaded is None:
                loaded = loaded_tool_names(messages or [])
            if t["name"] not in loaded:
                continue
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                     "parameters": t["input_schema"]}})
    return out or None


def convert_tool_choice(tc: Optional[dict[str, Any]]) -> tuple[Any, bool]:
    """Anthropic tool_choice -> (OpenAI tool_choice, parallel_tool_calls)."""
    if not tc:
        return None, True
    parallel = not tc.get("disable_parallel_tool_use", False)
    kind = tc.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}, parallel
    raise ApiError("invalid_request", f"tool_choice.type {kind!r} is not one of auto, any, tool, none", 400,
                   param="tool_choice")


def build_request(state: DaemonState, request: web.Request, b: MessagesBody, rid: str) -> GenRequest:
    """GenRequest from a validated Messages body."""
    tools = convert_tools(b.tools, b.messages)
    choice, parallel = convert_tool_choice(b.tool_choice)
    if isinstance(choice, dict):
        names = {t["function"]["name"] for t in tools or []}
        if choice["function"]["name"] not in names:
            raise ApiError("invalid_request", f"tool_choice names unknown tool "
                           f"{choice['function']['name']!r}", 400, param="tool_choice")
    req = GenRequest(id=rid, messages=convert_messages(b), tools=tools, tool_choice=choice,
                     parallel_tool_calls=parallel,
                     max_tokens=b.max_tokens or state.settings.max_tokens_default,
                     stop=list(b.stop_sequences or []), ignore_eos=b.ignore_eos)
    for k in ("temperature", "top_p", "top_k", "seed"):
        v = getattr(b, k)
        if v is not None:
            setattr(req, k, v)
    apply_logit_bias(req, b.logit_bias)
    if b.thinking:
        req.enable_thinking = b.thinking.get("type") in ("enabled", "adaptive")
    fill_common(state, request, req, b.model, anthropic=True)
    return req


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    def build(state: DaemonState, request: web.Request, b: MessagesBody) -> GenRequest:
        if b.max_tokens is None:
            raise ApiError("invalid_request", "max_tokens: Field required", 400, param="max_tokens")
        return build_request(state, request, b, new_id("msg_"))
    b, req, gen = await open_generation(request, MessagesBody, build, "anthropic")
    rid = req.id

    def open_stream():
        s = enc.MessageStream(rid, req.model)
        return s, s.start(gen.usage)
    return await respond(request, gen, b.stream,
                         lambda done: enc.message_body(rid, req.model, done, gen.usage), open_stream)


class CountBody(BaseModel):
    """Validated subset of a count_tokens request."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]]
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens -> {"input_tokens": n} (chat template applied)."""
    state: DaemonState = request.app["state"]
    cb = validate(CountBody, await read_json(request))
    b = MessagesBody(**{**cb.model_dump(), "max_tokens": 1, "stream": False})
    req = build_request(state, request, b, new_id("msg_"))
    eng = await ensure_engine(state)
    try:
        n = await eng.count_tokens(req)
    except EngineError as e:
        raise ApiError(e.code, e.message, e.status) from None
    return web.json_response({"input_tokens": int(n)})

