"""llama-server's own HTTP API, for the clients written for it (llama.vscode, llama.vim, the
llama.cpp web UI, token counters, scripts): ``/completion`` (and ``/completions``), ``/infill``,
``/tokenize``, ``/detokenize``, ``/apply-template``, ``/chat/completions/input_tokens``,
``/props`` (read-only) and ``/slots`` (read-only). Its extensions of the OpenAI chat body are in
:mod:`.llama_chat`.

Request and answer shapes follow llama-server (llama.cpp's tools/server); the answers are written
by :mod:`.encoders.llama_native`. Generation goes through the same :class:`~.common.Generation` as
every other protocol.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..engine.types import EngineError, GenRequest
from .common import Generation, apply_logit_bias, ensure_engine, fill_common, respond
from .encoders import new_id
from .encoders import llama_native as enc
from .errors import ApiError
from .openai_api import ChatBody, chat_request
from .request_input import read_json, validate
from .state import DaemonState

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "random seed" value, reported when none is set
# prompts of one /completion request: each is a generation of its own, and one request must not
# queue more work than many clients could (the connection cap bounds those)
MAX_PROMPTS = 64


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    n_predict: Optional[int] = None  # -1 (or absent): the max_tokens_default setting
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=20)
    ignore_eos: bool = False
    logit_bias: Union[dict[str, Any], list[Any], None] = None
    grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    response_fields: Optional[list[str]] = None
    timings_per_token: bool = False
    return_progress: bool = False


class CompletionBody(_Sampling):
    """llama-server's ``/completion`` body (the fields Ostinato acts on; others are accepted and
    ignored, as ``cache_prompt`` and ``id_slot``: the engine picks slots and caches itself).
    ``prompt``: see :func:`prompts`."""

    prompt: Any = ""


class InfillBody(_Sampling):
    """llama-server's ``/infill`` body."""

    input_prefix: str
    input_suffix: str
    input_extra: list[Any] = Field(default_factory=list)
    prompt: str = ""


# ---- /completion and /infill -----------------------------------------------------------------


async def _logit_bias(state: DaemonState, bias: Any) -> Optional[dict[str, float]]:
    """llama-server's ``logit_bias`` forms as OpenAI's ``{"token id": bias}``: ``[[token, bias],
    ...]`` or ``{token: bias}`` where a token is an id or a text (every token of the text gets
    the bias) and a bias of ``false`` bans the token."""
    if not bias:
        return None
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    out: dict[str, float] = {}
    for p in pairs:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ApiError("invalid_request", "logit_bias entries must be [token, bias] pairs", 400,
                           param="logit_bias")
        tok, b = p
        value = -100.0 if b is False else b
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ApiError("invalid_request", "a logit_bias value must be a number or false", 400,
                           param="logit_bias")
        if isinstance(tok, str) and not tok.lstrip("-").isdigit():
            eng = await ensure_engine(state)
            ids = await eng.tokenize(tok, False, False, False)
        else:
            ids = [int(tok)]
        for i in ids:
            out[str(i)] = max(-100.0, min(100.0, float(value)))
    return out


def _max_tokens(state: DaemonState, b: _Sampling) -> int:
    """Output tokens of ``n_predict`` (or ``max_tokens``): -1 or none the ``max_tokens_default``
    setting; 0 none, the prompt is only prefilled into the KV cache (llama.vscode and llama.vim
    send such requests to cache their context chunks ahead)."""
    n = b.n_predict if b.n_predict is not None else b.max_tokens
    return state.settings.max_tokens_default if n is None or n < 0 else n


async def _sampling(state: DaemonState, b: _Sampling, req: GenRequest) -> None:
    req.max_tokens = _max_tokens(state, b)
    for k in ("temperature", "top_p", "top_k", "min_p", "seed"):
        v = getattr(b, k)
        if v is not None:
            setattr(req, k, v)
    req.stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    req.ignore_eos = b.ignore_eos
    req.logprobs = b.n_probs or None
    if b.grammar and b.json_schema is not None:
        raise ApiError("invalid_request", "Cannot use both json_schema and grammar", 400, param="grammar")
    req.grammar = b.grammar or None
    req.json_schema = b.json_schema
    req.return_progress = b.return_progress
    apply_logit_bias(req, await _logit_bias(state, b.logit_bias))


def generation_settings(state: DaemonState, req: GenRequest) -> dict[str, Any]:
    """llama-server's ``generation_settings`` of a request: its sampling values, the settings'
    where it set none. ``logit_bias`` lists ``{"token", "bias"}``; with ``ignore_eos`` also each
    end-of-generation token with bias null (minus infinity, as llama-server writes its ban)."""
    s = state.settings
    seed = req.seed if req.seed is not None else s.seed
    bias: list[dict[str, Any]] = [{"token": int(k), "bias": v} for k, v in (req.logit_bias or {}).items()]
    if req.ignore_eos:
        bias += [{"token": t, "bias": None} for t in state.model_info.get("eog_tokens") or []]
    return {"n_predict": req.max_tokens, "max_tokens": req.max_tokens,
            "seed": LLAMA_DEFAULT_SEED if seed is None else seed,
            "temperature": s.temperature if req.temperature is None else req.temperature,
            "top_k": s.top_k if req.top_k is None else req.top_k,
            "top_p": s.top_p if req.top_p is None else req.top_p,
            "min_p": s.min_p if req.min_p is None else req.min_p,
            "stop": list(req.stop), "ignore_eos": req.ignore_eos, "n_probs": req.logprobs or 0,
            "grammar": req.grammar or "", "logit_bias": bias,
            "timings_per_token": False, "n_ctx": state.model_info.get("n_ctx")}


async def _generate(request: web.Request, req: GenRequest, b: _Sampling, prompt_text: str,
                    protocol: str) -> web.StreamResponse:
    state: DaemonState = request.app["state"]
    fill_common(state, request, req, b.model)
    settings = dict(generation_settings(state, req), stream=b.stream, timings_per_token=b.timings_per_token)
    gen = await Generation.open(state, req, protocol)
    fields = b.response_fields or None

    def open_stream():
        s = enc.CompletionStream(req.model, prompt_text, settings, b.n_probs, b.timings_per_token,
                                 b.return_progress)
        return _LiveStream(s, gen), []
    return await respond(request, gen, b.stream,
                         lambda done: enc.completion(done, req.model, prompt_text, settings, b.n_probs, fields),
                         open_stream)


class _LiveStream:
    """A :class:`~.encoders.llama_native.CompletionStream` fed the generation's live timings."""

    def __init__(self, stream: enc.CompletionStream, gen: Generation):
        self.stream, self.gen = stream, gen

    def feed(self, ev: Any, u: dict[str, int]) -> list[Any]:
        return self.stream.feed(ev, u, self.gen.timings() if self.stream.timings_per_token else None)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompts(prompt: Any) -> list[Union[str, list[Any]]]:
    """llama-server's ``/completion`` prompt forms, one entry per prompt to answer: a string; a
    list of token ids, or of ids and strings (``[12, "text", 34]``: one prompt); an object
    ``{"prompt_string": ...}`` (with ``multimodal_data``: 400, the served models are text-only);
    a list of these (several prompts, at most ``MAX_PROMPTS``, answered as a list). Entries are a
    text or a list of ids and texts. Raises ApiError 400 for any other shape, an empty prompt or
    too many prompts."""
    def one(p: Any) -> Union[str, list[Any]]:
        if isinstance(p, dict) and "prompt_string" in p:
            if p.get("multimodal_data"):
                raise ApiError("invalid_request", "Multimodal data provided, but the model does not "
                               "support multimodal requests.", 400, param="prompt")
            p = p["prompt_string"]
        if isinstance(p, str) and p:
            return p
        if isinstance(p, list) and p and any(_is_id(x) for x in p) and all(_is_id(x) or isinstance(x, str) for x in p):
            return p
        raise ApiError("invalid_request", '"prompt" elements must be a non-empty string, a list of tokens, '
                       "a JSON object containing a prompt string, or a list of mixed strings & tokens.", 400,
                       param="prompt")
    if isinstance(prompt, list) and not any(_is_id(x) for x in prompt):
        if not prompt:
            raise ApiError("invalid_request", '"prompt" must not be empty', 400, param="prompt")
        if len(prompt) > MAX_PROMPTS:
            raise ApiError("invalid_request", f"at most {MAX_PROMPTS} prompts in one request, got "
                           f"{len(prompt)}", 400, param="prompt")
        return [one(p) for p in prompt]
    return [one(prompt)]


async def _prompt_request(state: DaemonState, p: Union[str, list[Any]]) -> tuple[GenRequest, str]:
    """The request of one prompt and its text (echoed as llama-server's ``prompt``: token ids as
    their text)."""
    if isinstance(p, str):
        return GenRequest(id=new_id("cmpl-"), prompt=p), p
    eng = await ensure_engine(state)
    parts: list[Union[str, list[int]]] = []  # texts and runs of ids
    for x in p:
        if isinstance(x, str):
            parts.append(x)
        elif parts and isinstance(parts[-1], list):
            parts[-1].append(x)
        else:
            parts.append([x])
    texts: list[str] = []
    for part in parts:
        try:
            texts.append(part if isinstance(part, str) else await eng.detokenize(part))
        except EngineError as e:
            raise ApiError(e.code, e.message, e.status, param="prompt") from None
    return GenRequest(id=new_id("cmpl-"), prompt_tokens=list(p)), "".join(texts)


async def completion(request: web.Request) -> web.StreamResponse:
    """POST /completion and /completions: llama-server's native completion (raw prompt, no chat
    template; the prompt forms of :func:`prompts`). Several prompts are run side by side and
    answered as a list, each with its ``index``; they cannot be streamed (400)."""
    state: DaemonState = request.app["state"]
    b = validate(CompletionBody, await read_json(request))
    ps = prompts(b.prompt)
    if len(ps) == 1:
        req, text = await _prompt_request(state, ps[0])
        await _sampling(state, b, req)
        return await _generate(request, req, b, text, "llama_completion")
    if b.stream:
        raise ApiError("invalid_request", "several prompts in one request cannot be streamed here: "
                       "send one request per prompt", 400, param="stream")
    reqs = [await _prompt_request(state, p) for p in ps]
    for req, _ in reqs:
        await _sampling(state, b, req)
        fill_common(state, request, req, b.model)
    return web.json_response(await asyncio.gather(*(_one_of_several(request, b, req, text, i)
                                                     for i, (req, text) in enumerate(reqs))))


async def _one_of_several(request: web.Request, b: _Sampling, req: GenRequest, text: str, index: int) -> dict[str, Any]:
    state: DaemonState = request.app["state"]
    settings = dict(generation_settings(state, req), stream=False, timings_per_token=b.timings_per_token)
    gen = await Generation.open(state, req, "llama_completion")
    try:
        done = await gen.result(request)
    finally:
        await gen.aclose()
        gen.close()
    res = enc.completion(done, req.model, text, settings, b.n_probs, b.response_fields or None)
    return dict(res, index=index) if not b.response_fields else res


async def infill(request: web.Request) -> web.StreamResponse:
    """POST /infill: fill-in-the-middle (``input_prefix``, ``input_suffix``, optional
    ``input_extra`` chunks ``{"filename", "text"}`` and ``prompt``), for models whose vocabulary
    has FIM tokens; 400 ``infill_not_supported`` naming the missing tokens otherwise."""
    state: DaemonState = request.app["state"]
    b = validate(InfillBody, await read_json(request))
    for i, chunk in enumerate(b.input_extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ApiError("invalid_request", 'extra_context chunk must contain a "text" field with '
                           "a string value", 400, param=f"input_extra.{i}")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise ApiError("invalid_request", "extra_context chunk's \"filename\" field must be a "
                           "string", 400, param=f"input_extra.{i}.filename")
    req = GenRequest(id=new_id("cmpl-"), infill={"input_prefix": b.input_prefix, "input_suffix": b.input_suffix,
                                                 "input_extra": b.input_extra, "prompt": b.prompt})
    await _sampling(state, b, req)
    return await _generate(request, req, b, b.prompt, "llama_infill")


# ---- tokens and templates --------------------------------------------------------------------


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: ``{"content", "add_special" (false), "parse_special" (true),
    "with_pieces" (false)}`` -> ``{"tokens": [id]}`` or ``[{"id", "piece"}]``."""
    state: DaemonState = request.app["state"]
    body = await read_json(request)
    content = body.get("content")
    if content is None:
        return web.json_response({"tokens": []})
    if not isinstance(content, (str, list)) or (isinstance(content, list) and not all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in content)):
        raise ApiError("invalid_request", "content must be a string or a list of strings and token ids", 400,
                       param="content")
    eng = await ensure_engine(state)
    try:
        toks = await eng.tokenize(content, bool(body.get("add_special", False)),
                                  bool(body.get("parse_special", True)), bool(body.get("with_pieces", False)))
    except EngineError as e:
        raise ApiError(e.code, e.message, e.status) from None
    return web.json_response({"tokens": toks})


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: ``{"tokens": [id]}`` -> ``{"content": text}``."""
    state: DaemonState = request.app["state"]
    body = await read_json(request)
    tokens = body.get("tokens") or []
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError("invalid_request", "tokens must be a list of token ids", 400, param="tokens")
    eng = await ensure_engine(state)
    try:
        text = await eng.detokenize(tokens)
    except EngineError as e:
        raise ApiError(e.code, e.message, e.status) from None
    return web.json_response({"content": text})


async def _chat_request(request: web.Request) -> GenRequest:
    state: DaemonState = request.app["state"]
    b = validate(ChatBody, await read_json(request))
    return chat_request(state, request, b)


async def apply_template(request: web.Request) -> web.Response:
    """POST /apply-template: a chat body -> ``{"prompt": the text the chat template makes}``."""
    state: DaemonState = request.app["state"]
    req = await _chat_request(request)
    eng = await ensure_engine(state)
    try:
        prompt = await eng.apply_template(req)
    except EngineError as e:
        raise ApiError(e.code, e.message, e.status, extra=e.extra) from None
    return web.json_response({"prompt": prompt})


async def input_tokens(request: web.Request) -> web.Response:
    """POST /chat/completions/input_tokens: a chat body -> ``{"input_tokens": n}`` (the prompt's
    tokens, chat template applied)."""
    state: DaemonState = request.app["state"]
    req = await _chat_request(request)
    eng = await ensure_engine(state)
    try:
        n = await eng.count_tokens(req)
    except EngineError as e:
        raise ApiError(e.code, e.message, e.status, extra=e.extra) from None
    return web.json_response({"input_tokens": int(n)})


# ---- server facts ----------------------------------------------------------------------------


# llama-server's marker of an image or audio part in a prompt; served models take none
MEDIA_MARKER = "<__media__>"


async def props(request: web.Request) -> web.Response:
    """GET /props (read-only; query parameters such as the web UI's ``autoload=false`` are
    ignored): llama-server's server properties, as the llama.cpp web UI reads them:
    ``default_generation_settings`` (``n_ctx``: the served context per slot, ``params``),
    ``total_slots``, ``model_alias``, ``model_ftype``, ``model_path``, ``modalities`` (none),
    ``media_marker``, ``endpoint_slots``, ``endpoint_props`` (false: read-only),
    ``endpoint_metrics``, ``ui`` (false: no web page is served), ``ui_settings``,
    ``chat_template`` (the model's), ``chat_template_caps``, ``bos_token``, ``eos_token``,
    ``build_info``, ``is_sleeping`` (false), ``cors_proxy_enabled`` (false); and
    ``random_weights`` (the generated demo model)."""
    state: DaemonState = request.app["state"]
    info = state.model_info
    s = state.settings
    params = generation_settings(state, GenRequest(id="props", max_tokens=s.max_tokens_default))
    return web.json_response({
        "default_generation_settings": {"params": params, "n_ctx": info.get("n_ctx")},
        "total_slots": info.get("n_slots") or s.n_slots, "model_alias": state.model_name,
        "model_ftype": info.get("ftype") or "",
        "model_path": info.get("path") or (str(s.model) if s.model else ""),
        "modalities": {"vision": False, "video": False, "audio": False}, "media_marker": MEDIA_MARKER,
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "ui": False, "ui_settings": {},
        "chat_template": info.get("chat_template") or "",
        "chat_template_caps": info.get("chat_template_caps") or {},
        "bos_token": info.get("bos_token") or "", "eos_token": info.get("eos_token") or "",
        "build_info": _build_info(), "is_sleeping": False, "cors_proxy_enabled": False,
        "random_weights": bool(info.get("is_demo"))})


def _build_info() -> str:
    try:
        return f"ostinato {version('ostinato')} (llama-cpp-python {version('llama_cpp_python')})"
    except PackageNotFoundError:
        return "ostinato"


async def props_post(request: web.Request) -> web.Response:
    """POST /props: refused as llama-server refuses it without ``--props`` (501, the properties
    are read-only; the settings change them)."""
    raise ApiError("not_supported", "This server does not support changing global properties: "
                   "change them with the settings (docs/settings.md).", 501)


async def slots(request: web.Request) -> web.Response:
    """GET /slots (read-only): one entry per KV slot, llama-server's ``id``, ``n_ctx``,
    ``is_processing``, plus ``n_tokens`` (tokens in its cache). ``?fail_on_no_slot=1``: 503 when
    every slot is busy."""
    state: DaemonState = request.app["state"]
    eng = await ensure_engine(state)
    st = await eng.stats()
    n_ctx = state.model_info.get("n_ctx")
    out = [{"id": sl.id, "n_ctx": n_ctx, "is_processing": sl.busy, "n_tokens": sl.n_tokens}
           for sl in st.slots]
    if request.query.get("fail_on_no_slot") and out and all(s["is_processing"] for s in out):
        raise ApiError("no_slot_available", "no slot available", 503)
    return web.json_response(out)
