"""OpenAI adapters: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``.

Follows the OpenAI wire format (platform.openai.com/docs/api-reference/chat). Extensions accepted
as extra body fields, as llama-server does: ``top_k``, ``min_p``, ``ignore_eos`` (the replay
benchmark), ``chat_template_kwargs.enable_thinking``. Reasoning text streams as
``delta.reasoning_content``. ``logprobs`` / ``top_logprobs`` (chat) and ``logprobs`` (legacy
completions) are computed by the engine from the model's logits (:mod:`..engine.logprobs`).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..engine.logprobs import MAX_TOP_CHAT, MAX_TOP_LEGACY
from ..engine.types import GenRequest
from . import llama_chat
from .common import Generation, apply_logit_bias, fill_common, open_generation, resolve_model, respond
from .request_input import read_json, validate
from .encoders import new_id
from .encoders import openai_chat as enc
from .errors import ApiError
from .state import DaemonState


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    n: Optional[int] = Field(1, ge=1, le=1)  # null: the default (clients send it)
    ignore_eos: bool = False
    logit_bias: Optional[dict[str, float]] = None


class ChatBody(_Base):
    """Validated subset of a chat completion request."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_CHAT)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any], None] = None
    functions: Optional[list[dict[str, Any]]] = None  # legacy: tools of type function
    function_call: Union[Literal["auto", "none"], dict[str, Any], None] = None  # legacy tool_choice
    parallel_tool_calls: bool = True
    response_format: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class CompletionBody(_Base):
    """Validated subset of a legacy completion request (``prompt``: a string, token ids, or a list
    of one of those)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LEGACY)  # alternatives per token
    echo: bool = False
    # llama-server's output constraints on its /v1/completions (the same as on /completion)
    grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None


def _sampling(state: DaemonState, b: _Base, req: GenRequest) -> None:
    req.max_tokens = b.max_completion_tokens or b.max_tokens or state.settings.max_tokens_default
    for k in ("temperature", "top_p", "top_k", "min_p", "seed"):
        v = getattr(b, k)
        if v is not None:
            setattr(req, k, v)
    req.stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    req.ignore_eos = b.ignore_eos
    apply_logit_bias(req, b.logit_bias)


def json_schema_of(fmt: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """JSON schema constraint from an OpenAI ``response_format`` (None for text)."""
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        # llama-server's form {"type": "json_object", "schema": {...}}: the schema is enforced
        schema = fmt.get("schema")
        return schema if isinstance(schema, dict) else {"type": "object"}
    if fmt.get("type") == "json_schema":
        js = fmt.get("json_schema") or {}
        schema = js.get("schema", fmt.get("schema"))
        if not isinstance(schema, dict):
            raise ApiError("invalid_request", "response_format.json_schema.schema must be an object", 400,
                           param="response_format")
        return schema
    raise ApiError("invalid_request", f"Unsupported response_format type {fmt.get('type')!r}", 400,
                   param="response_format")


def check_tools(tools: Optional[list[dict[str, Any]]], tool_choice: Any) -> None:
    """Reject tool definitions without a function name and tool_choice naming an unknown tool."""
    names = set()
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError("invalid_request", f"tools[{i}] needs type 'function' and "
                           "function.name", 400, param=f"tools.{i}")
        names.add(fn["name"])
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if name not in names:
            raise ApiError("invalid_request", f"tool_choice names unknown tool {name!r}", 400,
                           param="tool_choice")
    elif tool_choice == "required" and not names:
        raise ApiError("invalid_request", "tool_choice 'required' needs tools", 400, param="tool_choice")


def legacy_functions(b: ChatBody) -> None:
    """Map the legacy ``functions`` / ``function_call`` of ``b`` onto ``tools`` / ``tool_choice``
    (``tools`` given too: the legacy fields are ignored, as OpenAI does). Raises ApiError 400 for
    a shape that is not the legacy one."""
    if b.functions is None or b.tools is not None:
        return
    for i, f in enumerate(b.functions):
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ApiError("invalid_request", f"functions[{i}] needs a name", 400, param=f"functions.{i}.name")
    b.tools = [{"type": "function", "function": f} for f in b.functions]
    fc = b.function_call
    if isinstance(fc, dict):
        if not isinstance(fc.get("name"), str):
            raise ApiError("invalid_request", "function_call must be \"auto\", \"none\" or "
                           "{\"name\": ...}", 400, param="function_call")
        b.tool_choice = {"type": "function", "function": {"name": fc["name"]}}
    elif fc is not None:
        b.tool_choice = fc
    b.parallel_tool_calls = False  # function_call carries one call


def legacy_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with the legacy function-calling shapes as tool calls: an assistant
    ``function_call`` becomes one ``tool_calls`` entry, a ``role: "function"`` message the tool
    result of the latest call of that name (ids made up: the legacy shape has none)."""
    out, last_id = [], {}
    for i, m in enumerate(msgs):
        fc = m.get("function_call")
        if m.get("role") == "assistant" and isinstance(fc, dict) and not m.get("tool_calls"):
            cid = f"call_legacy_{i}"
            last_id[fc.get("name")] = cid
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = [{"id": cid, "type": "function",
                                "function": {"name": fc.get("name") or "", "arguments": fc.get("arguments") or "{}"}}]
        elif m.get("role") == "function":
            m = {"role": "tool", "tool_call_id": last_id.get(m.get("name"), f"call_legacy_{i}"),
                 "name": m.get("name"), "content": m.get("content") or ""}
        out.append(m)
    return out


def chat_request(state: DaemonState, request: web.Request, b: ChatBody) -> GenRequest:
    """GenRequest from a validated chat body (messages pass through in OpenAI shape; the legacy
    function-calling fields are mapped onto tools, :func:`legacy_functions`)."""
    for i, m in enumerate(b.messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool",
                                                            "function"):
            raise ApiError("invalid_request", f"messages[{i}].role must be system, developer, "
                           "user, assistant, tool or function", 400, param=f"messages.{i}.role")
    legacy_functions(b)
    msgs = [dict(m, role="system") if m["role"] == "developer" else dict(m) for m in legacy_messages(b.messages)]
    check_tools(b.tools, b.tool_choice)
    if b.top_logprobs is not None and not b.logprobs:  # OpenAI's rule
        raise ApiError("invalid_request", "top_logprobs needs logprobs: true", 400, param="top_logprobs")
    req = GenRequest(id=new_id("chatcmpl-"), messages=msgs, tools=b.tools or None,
                     tool_choice=b.tool_choice, parallel_tool_calls=b.parallel_tool_calls,
                     json_schema=json_schema_of(b.response_format),
                     logprobs=(b.top_logprobs or 0) if b.logprobs else None)
    _sampling(state, b, req)
    llama_chat.chat_extensions(b, req)  # llama-server's grammar, json_schema, continue_final_message
    ctk = b.chat_template_kwargs or {}
    if "enable_thinking" in ctk:
        req.enable_thinking = bool(ctk["enable_thinking"])
    elif b.reasoning_effort is not None:
        req.enable_thinking = b.reasoning_effort not in ("none", "minimal")
    fill_common(state, request, req, b.model)
    return req


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    b, req, gen = await open_generation(request, ChatBody, chat_request, "openai_chat")
    created = int(time.time())
    include_usage = bool((b.stream_options or {}).get("include_usage"))

    legacy = b.functions is not None and b.tools is not None and b.tools == [
        {"type": "function", "function": f} for f in b.functions]

    def open_stream():
        s = enc.ChatStream(req.id, req.model, created, include_usage, legacy=legacy)
        s.timings, (s.timings_per_token, s.return_progress) = gen.timings, llama_chat.stream_extensions(b)
        return s, s.start()
    return await respond(request, gen, b.stream,
                         lambda done: dict(enc.chat_completion(req.id, req.model, created, done, gen.usage,
                                                               legacy=legacy),
                                           timings=gen.timings()),
                         open_stream)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (raw prompt, no chat template)."""
    state: DaemonState = request.app["state"]
    b = validate(CompletionBody, await read_json(request))
    prompt: Any = b.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a list of prompts
        if len(prompt) != 1:
            raise ApiError("invalid_request", "Only one prompt per request is supported.", 400, param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        if not prompt:
            raise ApiError("invalid_request", "prompt holds no tokens", 400, param="prompt")
        n_vocab = int(state.model_info.get("n_vocab") or 0)
        bad = next((t for t in prompt if t < 0 or (n_vocab and t >= n_vocab)), None)
        if bad is not None:
            raise ApiError("invalid_request", f"prompt token id {bad} is not in the vocabulary "
                           f"(0..{n_vocab - 1})", 400, param="prompt")
    if b.echo:  # the prompt's own logprobs would need a prompt pass with logits on every row
        raise ApiError("invalid_request", "echo is not supported", 400, param="echo")
    req = GenRequest(id=new_id("cmpl-"), logprobs=b.logprobs,
                     **({"prompt_tokens": prompt} if isinstance(prompt, list) else {"prompt": prompt}))
    _sampling(state, b, req)
    schema = b.json_schema if b.json_schema is not None else json_schema_of(b.response_format)
    if b.grammar and schema is not None:
        raise ApiError("invalid_request", "Cannot use both json_schema and grammar", 400, param="grammar")
    req.grammar, req.json_schema = b.grammar or None, schema
    fill_common(state, request, req, b.model)
    gen = await Generation.open(state, req, "openai_completions")
    created = int(time.time())
    include_usage = bool((b.stream_options or {}).get("include_usage"))
    def open_stream():
        s = enc.CompletionStream(req.id, req.model, created, include_usage)
        s.timings, (s.timings_per_token, _) = gen.timings, llama_chat.stream_extensions(b)
        return s, []
    return await respond(request, gen, b.stream,
                         lambda done: dict(enc.text_completion(req.id, req.model, created, done, gen.usage),
                                           timings=gen.timings()),
                         open_stream)


def model_entry(state: DaemonState, name: Optional[str] = None) -> dict[str, Any]:
    """The served model as one entry of ``/v1/models`` under ``name`` (default: the served id):
    OpenAI's fields (``id``, ``object``, ``created``, ``owned_by``), Anthropic's (``type``,
    ``display_name``, ``created_at`` RFC 3339), ``random_weights`` true for the generated demo
    model, ``context_length`` / ``max_model_len`` (and ``meta.n_ctx``, llama-server's) the served
    context per slot in tokens."""
    info = state.model_info
    created = int(state.started_at)
    entry = {"id": name or state.model_name, "object": "model", "created": created,
             "owned_by": "ostinato", "type": "model", "display_name": state.model_name,
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
             "random_weights": bool(info.get("is_demo")),
             "engine_state": state.engine_state,
             "meta": {k: info.get(k) for k in ("path", "arch", "n_ctx", "n_ctx_train", "n_params",
                                               "n_layer", "n_expert", "n_expert_used", "experts_mode")
                      if info.get(k) is not None}}
    if info.get("n_ctx"):  # the served context per slot, under the names clients read
        entry["context_length"] = entry["max_model_len"] = int(info["n_ctx"])  # LM Studio / vLLM
    if info.get("is_demo"):
        entry["description"] = "Generated demo MoE model with RANDOM WEIGHTS: output is gibberish."
    return entry


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the list of :func:`model_entry` (one model), with the Anthropic list's
    ``has_more``, ``first_id`` and ``last_id``."""
    state: DaemonState = request.app["state"]
    entry = model_entry(state)
    return web.json_response({"object": "list", "data": [entry], "has_more": False,
                              "first_id": entry["id"], "last_id": entry["id"]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: :func:`model_entry` under any name a request may use (the served id,
    the GGUF file name or stem, the demo id, with an ``@workload`` suffix; ``claude-*`` names when
    the request carries ``anthropic-version``, as the anthropic SDK's does). Raises ApiError 404
    ``model_not_found`` for other names."""
    state: DaemonState = request.app["state"]
    name = request.match_info["model_id"]
    resolve_model(state, name, anthropic="anthropic-version" in request.headers)
    return web.json_response(model_entry(state, name))
