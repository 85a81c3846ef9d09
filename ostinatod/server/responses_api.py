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
from .common import apply_logit_bias, fill_common, open_generation, respond
from .encoders import new_id
from .encoders import responses as enc
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
    # llama-server's extensions: timings on every delta event, prompt_progress events while prefilling
    timings_per_token: bool = False
    return_progress: bool = False


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


def _flat_name(item: dict[str, Any]) -> str:
    """An item's ``name``, joined to its ``namespace`` as :func:`convert_tools` flattens a namespace
    tool's functions (``<namespace>__<name>``)."""
    ns = item.get("namespace")
    return f"{ns}{enc.NAMESPACE_SEP}{item['name']}" if isinstance(ns, str) and ns else item["name"]


def convert_input(b: ResponsesBody) -> list[dict[str, Any]]:
    """Responses input items -> OpenAI-shaped chat messages. Raises ApiError 400 on bad items."""
    msgs: list[dict[str, Any]] = []
    if b.instructions:
        msgs.append({"role": "system", "content": b.instructions})
    if isinstance(b.input, str):
        msgs.append({"role": "user", "content": b.input})
        return msgs
    if not b.input:
        raise ApiError("invalid_request", "input must be a string or a non-empty list of items", 400,
                       param="input")
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
            raise ApiError("invalid_request", f"input.{i} must be an object", 400, param=f"input.{i}")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError("invalid_request", f"input.{i}.role {role!r} is not supported", 400,
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
                raise ApiError("invalid_request", f"input.{i}: function_call needs name and call_id", 400,
                               param=f"input.{i}")
            m = last_assistant()
            m.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": _flat_name(item), "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            out = item.get("output")
            tool = {"role": "tool", "content": out if isinstance(out, str) else _part_text(out)}
            if item.get("call_id"):
                tool["tool_call_id"] = item["call_id"]
            elif isinstance(item.get("name"), str) and item["name"]:
                # Codex adds outputs no call asked for (after create_goal: name "goal_objective",
                # namespace "agent"); the model reads them as that tool's output.
                tool["name"] = _flat_name(item)
            else:
                raise ApiError("invalid_request",
                               f"input.{i}: function_call_output needs call_id (or, for an output no call "
                               "asked for, name)", 400, param=f"input.{i}")
            msgs.append(tool)
        elif kind == "reasoning":
            text = _part_text(item.get("content")) or "".join(
                s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict))
            pending_reasoning = (pending_reasoning or "") + text if text else pending_reasoning
        else:
            raise ApiError("invalid_request", f"input.{i}.type {kind!r} is not supported", 400,
                           param=f"input.{i}.type")
    return msgs


def convert_tools(tools: Optional[list[dict[str, Any]]], warnings: Optional[list[str]] = None
                  ) -> Optional[list[dict[str, Any]]]:
    """Responses tools -> chat tools: flat function tools as they are, the functions of a
    ``namespace`` tool flattened to ``<namespace>__<name>`` (calls go back with ``namespace`` and
    ``name``: :func:`.encoders.responses.namespaced_names`). Tools this server cannot run
    (``web_search``, ``custom``, ...) are left out, each named in ``warnings``."""
    out = []
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        if t.get("type") == "function":
            out.append(_function_tool(t.get("name"), t))
        elif t.get("type") == "namespace" and isinstance(t.get("name"), str):
            for sub in t.get("tools") or []:
                if isinstance(sub, dict) and sub.get("type", "function") == "function" and sub.get("name"):
                    out.append(_function_tool(f"{t['name']}{enc.NAMESPACE_SEP}{sub['name']}", sub,
                                              f"[{t['name']}] "))
                elif warnings is not None:
                    warnings.append(f"tool {t['name']}.{sub.get('name') if isinstance(sub, dict) else sub!r} "
                                    f"({sub.get('type') if isinstance(sub, dict) else '?'}) left out: not a function")
        elif warnings is not None:
            warnings.append(f"tool {t.get('name') or t.get('type')!s} ({t.get('type')}) left out: "
                            "this server runs only function tools")
    return out or None


def _function_tool(name: Any, t: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    desc = t.get("description") or ""
    return {"type": "function", "function": {
        "name": name, "description": prefix + desc if desc else desc,
        "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}


def convert_tool_choice(tc: Any) -> Any:
    """Responses tool_choice -> chat tool_choice."""
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


# request fields a response object echoes
_ECHOED = ("instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
           "max_output_tokens", "reasoning", "text")


def _echoed(b: ResponsesBody) -> dict[str, Any]:
    return {k: getattr(b, k) for k in _ECHOED}


def responses_request(state: DaemonState, request: web.Request, b: ResponsesBody) -> GenRequest:
    """The internal request of a validated Responses body. Raises ApiError."""
    if b.previous_response_id:
        raise ApiError("invalid_request", "previous_response_id is not supported: this server is "
                       "stateless; send the whole conversation in 'input'.", 400, param="previous_response_id")
    warnings: list[str] = []
    tools = convert_tools(b.tools, warnings)
    choice = convert_tool_choice(b.tool_choice)
    check_tools(tools, choice)
    fmt = (b.text or {}).get("format")
    req = GenRequest(id=new_id("resp_"), messages=convert_input(b), tools=tools, tool_choice=choice,
                     parallel_tool_calls=b.parallel_tool_calls,
                     max_tokens=b.max_output_tokens or state.settings.max_tokens_default,
                     json_schema=json_schema_of(fmt), ignore_eos=b.ignore_eos, warnings=warnings,
                     return_progress=b.return_progress)
    for k in ("temperature", "top_p", "seed"):
        if getattr(b, k) is not None:
            setattr(req, k, getattr(b, k))
    apply_logit_bias(req, b.logit_bias)
    if b.reasoning and b.reasoning.get("effort") is not None:
        req.enable_thinking = b.reasoning["effort"] not in ("none", "minimal")
    fill_common(state, request, req, b.model)
    return req


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    b, req, gen = await open_generation(request, ResponsesBody, responses_request, "responses")
    created = int(time.time())

    def open_stream():
        s = enc.ResponseStream(_echoed(b), req.id, req.model, created)
        s.timings, s.timings_per_token, s.return_progress = gen.timings, b.timings_per_token, b.return_progress
        return s, s.start()
    return await respond(request, gen, b.stream,
                         lambda done: enc.response_body(_echoed(b), req.id, req.model, created, done, gen.usage),
                         open_stream)
