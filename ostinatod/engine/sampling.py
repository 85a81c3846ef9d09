"""The sampler of a request: llama.cpp's ``common_sampler`` through the native shim.

Sampling values a request does not set come from the settings (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``seed``): the one place their defaults live.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..settings import Settings
from . import grammar, loading, native
from .types import EngineError, GenRequest


def sampler_params(req: GenRequest, settings: Settings) -> dict[str, Any]:
    """The shim's sampler parameters of ``req``; unset values from ``settings``."""
    def pick(v: Any, default: Any) -> Any:
        return default if v is None else v

    params = {"temperature": float(pick(req.temperature, settings.temperature)),
              "top_k": int(pick(req.top_k, settings.top_k)),
              "top_p": float(pick(req.top_p, settings.top_p)),
              "min_p": float(pick(req.min_p, settings.min_p)),
              "ignore_eos": bool(req.ignore_eos),
              "json_schema": req.json_schema is not None or req.grammar is not None,
              "logit_bias": [[int(k), float(v)] for k, v in (req.logit_bias or {}).items()]}
    seed = pick(req.seed, settings.seed)
    if seed is not None:
        params["seed"] = int(seed) & 0xFFFFFFFF
    return params


def make_sampler(model: Any, req: GenRequest, rendered: Any, settings: Settings) -> Any:
    """A ``common_sampler *`` for ``req`` (grammar of the rendered prompt or the request's own
    ``grammar``, penalties-free chain, EOG
    ban under ignore_eos). Raises EngineError("invalid_request") if e.g. the grammar does not
    compile. Free it with :func:`free_sampler`."""
    raw = (rendered.sampler_raw or rendered.raw).encode() if rendered is not None else None
    if req.grammar is not None:  # the request's own GBNF (or a raw prompt's JSON schema)
        raw = grammar.apply_result(rendered.raw if rendered is not None else None, req.grammar).encode()
    smpl = native.fn("ostinato_sampler_new")(int(model), json.dumps(sampler_params(req, settings)).encode(),
                                             raw)
    if not smpl:
        raise EngineError("invalid_request", native.last_error() or "could not create the sampler")
    return smpl


def free_sampler(smpl: Any) -> None:
    native.fn("ostinato_sampler_free")(smpl)


def sample(smpl: Any, ctx: Any, idx: int) -> int:
    """The token sampled from the logits of batch row ``idx`` (negative: sampling failed)."""
    return native.fn("ostinato_sampler_sample")(smpl, ctx, idx)


# The demo model's cap on a turn that makes a tool call (the call is grammar-driven and ends by
# itself; a call cut here ends as "length", never as a finished turn).
DEMO_CALL_MAX_TOKENS = 512
# bias on the closers of a JSON answer or a forced call with the demo model: the end-of-turn bias alone
# left random strings open for 200 tokens in 1 of 3 tries (tests/agents/test_agents_ask.py::
# test_demo_json_mode_is_json), and a forced call's arguments could run to DEMO_CALL_MAX_TOKENS
DEMO_JSON_CLOSE_BIAS = 20.0


def demo_choice(req: GenRequest) -> None:
    """The generated demo model's tool turn, set on ``req`` before it is rendered: with tools offered
    (``tool_choice`` unset or "auto") it makes one call when the conversation does not end in a tool
    result, and ends its turn in text when it does, so a new user sees an agent's loop complete
    (random weights would never write a call marker). A client's "required", named or "none"
    choice is kept; a forced call is one call."""
    if not req.tools or not req.messages or req.tool_choice not in (None, "auto"):
        if req.tools and req.tool_choice not in (None, "auto", "none"):
            req.parallel_tool_calls = False
            req.forced_by_client = True  # no demo notice before it
        return
    after_result = isinstance(req.messages[-1], dict) and req.messages[-1].get("role") == "tool"
    req.tool_choice = "none" if after_result else "required"
    req.parallel_tool_calls = False


def demo_turn(req: GenRequest, vocab: Any, settings: Settings) -> Optional[int]:
    """Make the generated demo model end its turn (random weights never choose end-of-turn): a bias
    on the end-of-turn token (``demo_end_bias``; a client's own bias on it wins) and ``max_tokens``
    capped at ``demo_max_tokens``. Returns the cap when it applies (the answer then ends as a
    finished turn), else None. A forced call (:func:`demo_choice`) and a JSON answer
    (``response_format``) are not capped that way: their closing quote, brace and bracket get a bias
    (:data:`DEMO_JSON_CLOSE_BIAS`, so random weights end them; a JSON answer keeps the end-of-turn
    bias too) and the cap is
    :data:`DEMO_CALL_MAX_TOKENS`, reached only as "length"."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    forced = bool(req.tools) and req.tool_choice not in (None, "auto", "none")
    json_answer = req.json_schema is not None
    if forced or json_answer:
        # the objects and arrays of a JSON answer or a call's arguments get the bias on their
        # closers too: random weights would otherwise add members until the cap (a forced call to
        # one of Claude Code's tools ran to the 512-token cap with the quote's bias alone)
        bias = max(settings.demo_end_bias, DEMO_JSON_CLOSE_BIAS)
        for closer in ('"', "}", "]"):
            tok = loading.tokenize(vocab, closer, add_special=False)
            if len(tok) == 1 and settings.demo_end_bias:
                req.logit_bias = dict(req.logit_bias or {})
                req.logit_bias.setdefault(tok[0], bias)
        req.max_tokens = min(req.max_tokens, DEMO_CALL_MAX_TOKENS)
        if forced:
            return None
    if settings.demo_end_bias:
        eot = llama_cpp.llama_vocab_eot(vocab)
        eot = eot if eot >= 0 else llama_cpp.llama_vocab_eos(vocab)
        if eot >= 0:
            bias = dict(req.logit_bias or {})
            bias.setdefault(eot, settings.demo_end_bias)
            req.logit_bias = bias
    # a JSON answer is not cut at the demo's cap (its grammar ends it; the cut would not be JSON)
    if settings.demo_max_tokens and settings.demo_max_tokens < req.max_tokens and not json_answer:
        req.max_tokens = settings.demo_max_tokens
        return req.max_tokens
    return None
