"""OpenAI Responses adapter: ``POST /v1/responses``, stateless (enough for Codex, which re-sends the
whole history every turn).

Input items understood: messages (``{"type": "message"|absent, "role", "content": str | parts}``,
role ``developer`` = system), ``function_call``, ``function_call_output`` and ``reasoning``;
``instructions`` becomes the leading system message. ``previous_response_id`` is refused (nothing
is stored). Streaming events follow platform.openai.com/docs/api-reference/responses-streaming:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta/.done, response.reasoning_text.delta/.done,
response.function_call_arguments.delta/.done, response.output_item.done, response.completed.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..engine.types import GenRequest
from .common import HEARTBEAT_S, SSE_COMMENT_PING, Generation, apply_logit_bias, fill_common, new_id, read_json, sse, start_sse, validate
from .errors import ApiError
from .openai_api import check_tools, json_schema_of
from .state import DaemonState


class ResponsesBody(BaseModel):
    """Validated subset of a Responses request."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    stream: bool = False
    reasoning: Optional[dict[str, Any]] = None
    text: Optional[dict[str, Any]] = None
    previous_response_id: Optional[str] = None
    ignore_eos: bool = False
    logit_bias: Optional[dict[str, float]] = None  # extension (OpenAI chat semantics)
    seed: Optional[int] = None  # extension (as in chat completions): the sampler's random stream


def _part_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        if isinstance(p, dict) and isinstance(p.get("text"), str):
            out.append(p["text"])
    return "".join(out)


def convert_input(b: ResponsesBody) -> list[dict[str, Any]]:
    """Responses input items -> OpenAI-shaped chat messages. Raises ApiError 400 on bad items."""
    msgs: list[dict[str, Any]] = []
    if b.instructions:
        msgs.append({"role": "system", "content": b.instructions})
    if isinstance(b.input, str):
        msgs.append({"role": "user", "content": b.input})
        return msgs
    pending_reasoning: Optional[str] = None

    def last_assistant() -> dict[str, Any]:
        nonlocal pending_reasoning
        if not msgs or msgs[-1]["role"] != "assistant":
            msgs.append({"role": "assistant", "content": ""})
        if pending_reasoning:
            msgs[-1]["reasoning_content"] = pending_reasoning
            pending_reasoning = None
        return msgs[-1]

    for i, item in enumerate(b.input):
        if not isinstance(item, dict):
            raise ApiError(400, "invalid_request", f"input.{i} must be an object", param=f"input.{i}")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, "invalid_request", f"input.{i}.role {role!r} is not supported",
                               param=f"input.{i}.role")
            text = _part_text(item.get("content"))
            if role == "assistant":
                m = last_assistant() if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls") \
                    else None
                if m is None:
                    msgs.append({"role": "assistant", "content": text})
                    if pending_reasoning:
                        msgs[-1]["reasoning_content"], pending_reasoning = pending_reasoning, None
                else:
                    m["content"] = (m.get("content") or "") + text
            else:
                msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not item.get("name") or not item.get("call_id"):
                raise ApiError(400, "invalid_request", f"input.{i}: function_call needs name and call_id",
                               param=f"input.{i}")
            m = last_assistant()
            m.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise ApiError(400, "invalid_request", f"input.{i}: function_call_output needs call_id",
                               param=f"input.{i}")
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": out if isinstance(out, str) else _part_text(out)})
        elif kind == "reasoning":
            text = _part_text(item.get("content")) or "".join(
                s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict))
            pending_reasoning = (pending_reasoning or "") + text if text else pending_reasoning
        else:
            raise ApiError(400, "invalid_request", f"input.{i}.type {kind!r} is not supported",
                           param=f"input.{i}.type")
    return msgs


def convert_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Flat Responses function tools -> chat tools; built-in tools (web_search, ...) are dropped."""
    out = []
    for t in tools or []:
        if isinstance(t, dict) and t.get("type") == "function":
            out.append({"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description", ""),
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
    return out or None


def convert_tool_choice(tc: Any) -> Any:
    """Responses tool_choice -> chat tool_choice."""
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


def _response_obj(b: ResponsesBody, rid: str, model: str, created: int, status: str,
                  output: list[dict[str, Any]], usage: Optional[dict[str, Any]],
                  incomplete: Optional[str] = None, error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls, "temperature": b.temperature, "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens, "metadata": {}, "store": False,
            "previous_response_id": None, "reasoning": b.reasoning or {"effort": None, "summary": None},
            "text": b.text or {"format": {"type": "text"}}, "truncation": "disabled"}


def _usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _output_items(done: dict[str, Any]) -> list[dict[str, Any]]:
    m = done.get("message") or {}
    items: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs_"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
    if m.get("content") or not m.get("tool_calls"):
        items.append({"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": m.get("content") or "", "annotations": [],
                                   "logprobs": []}]})
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or tc
        items.append({"type": "function_call", "id": new_id("fc_"), "call_id": tc.get("id") or new_id("call_"),
                      "name": fn.get("name", ""), "arguments": fn.get("arguments") or "{}", "status": "completed"})
    return items


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    state: DaemonState = request.app["state"]
    b = validate(ResponsesBody, await read_json(request))
    if b.previous_response_id:
        raise ApiError(400, "invalid_request", "previous_response_id is not supported: this server is "
                       "stateless; send the whole conversation in 'input'.", param="previous_response_id")
    tools = convert_tools(b.tools)
    choice = convert_tool_choice(b.tool_choice)
    check_tools(tools, choice)
    fmt = (b.text or {}).get("format")
    req = GenRequest(id=new_id("resp_"), messages=convert_input(b), tools=tools, tool_choice=choice,
                     parallel_tool_calls=b.parallel_tool_calls,
                     max_tokens=b.max_output_tokens or state.settings.max_tokens_default,
                     json_schema=json_schema_of(fmt), ignore_eos=b.ignore_eos)
    for k in ("temperature", "top_p", "seed"):
        if getattr(b, k) is not None:
            setattr(req, k, getattr(b, k))
    apply_logit_bias(req, b.logit_bias)
    if b.reasoning and b.reasoning.get("effort") is not None:
        req.enable_thinking = b.reasoning["effort"] not in ("none", "minimal")
    fill_common(state, request, req, b.model)
    gen = await Generation.open(state, req, "responses")
    created = int(time.time())
    try:
        if not b.stream:
            done = await gen.result(request)
            inc = "max_output_tokens" if done.get("finish_reason") == "length" else None
            return web.json_response(_response_obj(b, req.id, req.model, created,
                                                   "incomplete" if inc else "completed",
                                                   _output_items(done), _usage(gen), inc))
        return await _stream(request, b, gen, req, created)
    finally:
        await gen.aclose()
        gen.close()


async def _stream(request: web.Request, b: ResponsesBody, gen: Generation, req: GenRequest,
                  created: int) -> web.StreamResponse:
    resp = await start_sse(request)
    seq = 0

    async def emit(event: str, data: dict[str, Any]) -> None:
        nonlocal seq
        await resp.write(sse(dict(type=event, sequence_number=seq, **data), event=event))
        seq += 1

    model = req.model or ""
    await emit("response.created", {"response": _response_obj(b, req.id, model, created, "in_progress", [], None)})
    await emit("response.in_progress", {"response": _response_obj(b, req.id, model, created, "in_progress", [], None)})

    output: list[dict[str, Any]] = []
    cur: Optional[dict[str, Any]] = None  # open item: {"kind", "item", "text", "tool_index"}
    tools_by_index: dict[int, dict[str, Any]] = {}

    async def close_item() -> None:
        nonlocal cur
        if cur is None:
            return
        oi, item = len(output), cur["item"]
        if cur["kind"] == "message":
            part = {"type": "output_text", "text": cur["text"], "annotations": [], "logprobs": []}
            await emit("response.output_text.done", {"item_id": item["id"], "output_index": oi,
                                                     "content_index": 0, "text": cur["text"], "logprobs": []})
            await emit("response.content_part.done", {"item_id": item["id"], "output_index": oi,
                                                      "content_index": 0, "part": part})
            item.update(status="completed", content=[part])
        elif cur["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": cur["text"]}
            await emit("response.reasoning_text.done", {"item_id": item["id"], "output_index": oi,
                                                        "content_index": 0, "text": cur["text"]})
            await emit("response.content_part.done", {"item_id": item["id"], "output_index": oi,
                                                      "content_index": 0, "part": part})
            item.update(content=[part])
        else:
            item.update(arguments=cur["text"] or "{}", status="completed")
            await emit("response.function_call_arguments.done", {"item_id": item["id"], "output_index": oi,
                                                                 "name": item["name"],
                                                                 "arguments": item["arguments"]})
        await emit("response.output_item.done", {"output_index": oi, "item": item})
        output.append(item)
        cur = None

    async def open_item(kind: str, item: dict[str, Any], part: Optional[dict[str, Any]] = None,
                        tool_index: Optional[int] = None) -> None:
        nonlocal cur
        await close_item()
        oi = len(output)
        await emit("response.output_item.added", {"output_index": oi, "item": dict(item)})
        if part is not None:
            await emit("response.content_part.added", {"item_id": item["id"], "output_index": oi,
                                                       "content_index": 0, "part": part})
        cur = {"kind": kind, "item": item, "text": "", "tool_index": tool_index}

    async for ev in gen.events(heartbeat=HEARTBEAT_S):
        if ev.type == "ping":
            await resp.write(SSE_COMMENT_PING)
        elif ev.type == "delta":
            d = ev.data
            if d.get("reasoning"):
                if cur is None or cur["kind"] != "reasoning":
                    await open_item("reasoning", {"type": "reasoning", "id": new_id("rs_"), "summary": [],
                                                  "content": []}, {"type": "reasoning_text", "text": ""})
                cur["text"] += d["reasoning"]
                await emit("response.reasoning_text.delta", {"item_id": cur["item"]["id"], "output_index": len(output),
                                                             "content_index": 0, "delta": d["reasoning"]})
            if d.get("content"):
                if cur is None or cur["kind"] != "message":
                    await open_item("message", {"type": "message", "id": new_id("msg_"), "status": "in_progress",
                                                "role": "assistant", "content": []},
                                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                cur["text"] += d["content"]
                await emit("response.output_text.delta", {"item_id": cur["item"]["id"], "output_index": len(output),
                                                          "content_index": 0, "delta": d["content"], "logprobs": []})
            for tc in d.get("tool_calls") or []:
                idx = int(tc.get("index", 0))
                t = tools_by_index.setdefault(idx, {"id": None, "name": None, "args": "", "opened": False})
                t["id"] = t["id"] or tc.get("id")
                t["name"] = t["name"] or tc.get("name")
                t["args"] += tc.get("arguments") or ""
                if not t["opened"] and t["name"]:
                    t["opened"] = True
                    await open_item("tool", {"type": "function_call", "id": new_id("fc_"),
                                             "call_id": t["id"] or new_id("call_"), "name": t["name"],
                                             "arguments": "", "status": "in_progress"}, tool_index=idx)
                if t["opened"] and cur is not None and cur.get("tool_index") == idx and t["args"]:
                    cur["text"] += t["args"]
                    await emit("response.function_call_arguments.delta", {"item_id": cur["item"]["id"],
                                                                          "output_index": len(output),
                                                                          "delta": t["args"]})
                    t["args"] = ""
        elif ev.type == "done":
            await close_item()
            if not output:  # nothing streamed: use the final message
                for item in _output_items(ev.data):
                    await emit("response.output_item.added", {"output_index": len(output), "item": item})
                    await emit("response.output_item.done", {"output_index": len(output), "item": item})
                    output.append(item)
            inc = "max_output_tokens" if ev.data.get("finish_reason") == "length" else None
            await emit("response.completed", {"response": _response_obj(
                b, req.id, model, created, "incomplete" if inc else "completed", output, _usage(gen), inc)})
        elif ev.type == "error":
            await close_item()
            err = {"code": ev.data.get("code", "engine_error"), "message": ev.data.get("message") or "engine error"}
            await emit("response.failed", {"response": _response_obj(b, req.id, model, created, "failed",
                                                                     output, _usage(gen), error=err)})
    return resp

