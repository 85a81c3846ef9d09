"""Anthropic Messages adapter: ``/v1/messages`` (also ``?beta=true``) and
``/v1/messages/count_tokens``.

Wire format from docs.anthropic.com/en/api/messages and .../messages-streaming. Anthropic content
blocks become OpenAI-shaped messages (the engine's one message shape): ``tool_use`` ->
assistant ``tool_calls``, ``tool_result`` -> ``tool`` messages (placed before the user's text of
the same turn), ``thinking`` -> ``reasoning_content``. ``system`` messages inside ``messages``
are accepted and kept as system messages in place.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..engine.types import EngineError, GenRequest
from .common import HEARTBEAT_S, Generation, apply_logit_bias, ensure_engine, fill_common, new_id, read_json, sse, start_sse, validate
from .errors import ApiError
from .state import DaemonState

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


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
            raise ApiError(400, "invalid_request", f"messages.{i}.role must be user, assistant or system",
                           param=f"messages.{i}.role")
        content = m.get("content")
        if role == "system":
            out.append({"role": "system", "content": _text_of(content)})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, "invalid_request", f"messages.{i}.content must be a string or a list of "
                           "content blocks", param=f"messages.{i}.content")
        texts: list[str] = []
        if role == "user":
            for j, blk in enumerate(content):
                t = blk.get("type") if isinstance(blk, dict) else None
                if t == "tool_result":
                    if not blk.get("tool_use_id"):
                        raise ApiError(400, "invalid_request", f"messages.{i}.content.{j}.tool_use_id "
                                       "is required", param=f"messages.{i}.content.{j}")
                    text = _text_of(blk.get("content"))
                    if blk.get("is_error"):
                        text = f"Error: {text}"
                    out.append({"role": "tool", "tool_call_id": blk["tool_use_id"], "content": text})
                elif t == "text":
                    texts.append(blk.get("text") or "")
                elif t in ("image", "document"):
                    texts.append(_text_of([blk]))
                elif t is None:
                    raise ApiError(400, "invalid_request", f"messages.{i}.content.{j} is not a content "
                                   "block", param=f"messages.{i}.content.{j}")
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
                        raise ApiError(400, "invalid_request", f"messages.{i}.content.{j}.name is "
                                       "required", param=f"messages.{i}.content.{j}")
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


def convert_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Anthropic client tools -> OpenAI function tools; server tools (no input_schema) are dropped."""
    out = []
    for t in tools or []:
        if not isinstance(t, dict) or "input_schema" not in t:
            continue
        if not t.get("name"):
            raise ApiError(400, "invalid_request", "every tool needs a name", param="tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
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
    raise ApiError(400, "invalid_request", f"tool_choice.type {kind!r} is not one of auto, any, tool, none",
                   param="tool_choice")


def build_request(state: DaemonState, request: web.Request, b: MessagesBody, rid: str) -> GenRequest:
    """GenRequest from a validated Messages body."""
    tools = convert_tools(b.tools)
    choice, parallel = convert_tool_choice(b.tool_choice)
    if isinstance(choice, dict):
        names = {t["function"]["name"] for t in tools or []}
        if choice["function"]["name"] not in names:
            raise ApiError(400, "invalid_request", f"tool_choice names unknown tool "
                           f"{choice['function']['name']!r}", param="tool_choice")
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


def _signature(text: str) -> str:
    """Stand-in thinking signature (clients only echo it back; we ignore it on input)."""
    return "ostinato-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _usage(gen: Generation) -> dict[str, int]:
    u = gen.usage
    return {"input_tokens": max(u["prompt_tokens"] - u["cached_tokens"], 0),
            "cache_read_input_tokens": u["cached_tokens"], "cache_creation_input_tokens": 0,
            "output_tokens": u["completion_tokens"]}


def _blocks(done: dict[str, Any]) -> list[dict[str, Any]]:
    m = done.get("message") or {}
    blocks: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": m["reasoning_content"],
                       "signature": _signature(m["reasoning_content"])})
    if m.get("content"):
        blocks.append({"type": "text", "text": m["content"]})
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or tc
        args = fn.get("arguments") or "{}"
        try:
            inp = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            inp = None
        if not isinstance(inp, dict):  # malformed call from the model: keep it visible as text
            blocks.append({"type": "text", "text": f"{fn.get('name')}({args})"})
            continue
        blocks.append({"type": "tool_use", "id": tc.get("id") or new_id("toolu_"),
                       "name": fn.get("name", ""), "input": inp})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    state: DaemonState = request.app["state"]
    b = validate(MessagesBody, await read_json(request))
    if b.max_tokens is None:
        raise ApiError(400, "invalid_request", "max_tokens: Field required", param="max_tokens")
    rid = new_id("msg_")
    req = build_request(state, request, b, rid)
    gen = await Generation.open(state, req, "anthropic")
    try:
        if not b.stream:
            done = await gen.result(request)
            blocks = _blocks(done)
            stop = _STOP.get(done.get("finish_reason") or "stop", "end_turn")
            if any(bl["type"] == "tool_use" for bl in blocks):
                stop = "tool_use"
            return web.json_response({"id": rid, "type": "message", "role": "assistant", "model": req.model,
                                      "content": blocks, "stop_reason": stop, "stop_sequence": None,
                                      "usage": _usage(gen)})
        return await _stream(request, gen, req, rid)
    finally:
        await gen.aclose()
        gen.close()


async def _stream(request: web.Request, gen: Generation, req: GenRequest, rid: str) -> web.StreamResponse:
    resp = await start_sse(request)

    async def emit(event: str, data: dict[str, Any]) -> None:
        await resp.write(sse(dict(type=event, **data), event=event))

    u0 = _usage(gen)
    await emit("message_start", {"message": {
        "id": rid, "type": "message", "role": "assistant", "model": req.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": u0["input_tokens"], "cache_read_input_tokens": u0["cache_read_input_tokens"],
                  "cache_creation_input_tokens": 0, "output_tokens": 0}}})
    await emit("ping", {})

    index = -1
    open_kind: Optional[str] = None  # "thinking" | "text" | "tool"
    open_tool: Optional[int] = None  # engine tool index of the open tool block
    thinking_text: list[str] = []
    pending_tools: dict[int, dict[str, Any]] = {}  # engine index -> {"id","name","args"} not yet opened
    opened_tools: set[int] = set()
    saw_tool = False

    async def close_block() -> None:
        nonlocal open_kind, open_tool
        if open_kind is None:
            return
        if open_kind == "thinking":
            await emit("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": _signature("".join(thinking_text))}})
        await emit("content_block_stop", {"index": index})
        open_kind, open_tool = None, None

    async def open_block(kind: str, block: dict[str, Any]) -> None:
        nonlocal index, open_kind
        await close_block()
        index += 1
        open_kind = kind
        await emit("content_block_start", {"index": index, "content_block": block})

    async def tool_delta(tc: dict[str, Any]) -> None:
        nonlocal open_tool, saw_tool
        idx = int(tc.get("index", 0))
        p = pending_tools.setdefault(idx, {"id": None, "name": None, "args": ""})
        p["id"] = p["id"] or tc.get("id")
        p["name"] = p["name"] or tc.get("name")
        p["args"] += tc.get("arguments") or ""
        if idx not in opened_tools:
            if not p["name"]:
                return  # wait for the name before opening the block
            await open_block("tool", {"type": "tool_use", "id": p["id"] or new_id("toolu_"),
                                      "name": p["name"], "input": {}})
            opened_tools.add(idx)
            open_tool = idx
            saw_tool = True
            if p["args"]:
                await emit("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": p["args"]}})
            p["args"] = ""
        elif open_tool == idx and p["args"]:
            await emit("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": p["args"]}})
            p["args"] = ""
        # deltas of an earlier, already closed tool block cannot be reopened; they stay buffered

    async for ev in gen.events(heartbeat=HEARTBEAT_S):
        if ev.type == "ping":
            await emit("ping", {})
        elif ev.type == "delta":
            d = ev.data
            if d.get("reasoning"):
                if open_kind != "thinking":
                    thinking_text.clear()
                    await open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                thinking_text.append(d["reasoning"])
                await emit("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": d["reasoning"]}})
            if d.get("content"):
                if open_kind != "text":
                    await open_block("text", {"type": "text", "text": ""})
                await emit("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": d["content"]}})
            for tc in d.get("tool_calls") or []:
                await tool_delta(tc)
        elif ev.type == "done":
            # tools whose name arrived only in the final message
            final_calls = (ev.data.get("message") or {}).get("tool_calls") or []
            for i, tc in enumerate(final_calls):
                if i not in opened_tools:
                    fn = tc.get("function") or tc
                    await tool_delta({"index": i, "id": tc.get("id"), "name": fn.get("name"),
                                      "arguments": "" if i in pending_tools else fn.get("arguments") or ""})
            if index < 0:
                await open_block("text", {"type": "text", "text": ""})
            await close_block()
            stop = "tool_use" if saw_tool else _STOP.get(ev.data.get("finish_reason") or "stop", "end_turn")
            u = _usage(gen)
            await emit("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": u["output_tokens"],
                                                   "input_tokens": u["input_tokens"],
                                                   "cache_read_input_tokens": u["cache_read_input_tokens"]}})
            await emit("message_stop", {})
        elif ev.type == "error":
            await close_block()
            await emit("error", {"error": {"type": "api_error",
                                           "message": f"{ev.data.get('message')} ({ev.data.get('code')})"}})
    return resp


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
        raise ApiError(e.status, e.code, e.message) from None
    return web.json_response({"input_tokens": int(n)})

