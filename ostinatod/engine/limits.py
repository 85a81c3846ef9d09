"""Size bounds of a request's template and grammar work, checked before any of it is done (pure
functions; the worker applies them off its loop thread, so that one request's schema cannot
stall the other slots).

Why: llama.cpp's chat layer turns tool and response schemas into a grammar whose cost grows
much faster than the property count of one object (measured on this project's CI machine:
string properties in one tool 250: 0.29 s, 500: 1.0 s, 1,000: 7.6 s; the same 1,000 spread over
10 tools: 0.21 s), and a prompt far larger than the context is only found too long after it is
tokenized in full (60 MiB: 28 s). Both are refused here with a 400 that names the limit.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from .types import EngineError


def schema_size(values: Iterable[Any], cap: int) -> tuple[int, int]:
    """(JSON objects, arrays and array members, most ``properties`` of one object) in ``values``
    (tool definitions, a response schema), counted without recursion; counting stops once the
    first passes ``cap`` (it is then ``cap + 1``). Every member of an array counts, scalars too:
    an ``enum`` of 20,000 integers is 20,000 alternatives of the grammar and 20,000 values in the
    prompt, not one node."""
    n = widest = 0
    stack = [v for v in values if isinstance(v, (dict, list))]
    while stack:
        v = stack.pop()
        n += 1
        if n > cap:
            break
        if isinstance(v, dict):
            props = v.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
            items: Iterable[Any] = v.values()
        else:
            n += sum(1 for x in v if not isinstance(x, (dict, list)))  # scalars: enum values
            if n > cap:
                break
            items = v
        stack.extend(x for x in items if isinstance(x, (dict, list)))
    return min(n, cap + 1), widest


def check_schema_size(tools: Optional[list[Any]], json_schema: Optional[Any], max_nodes: int,
                      max_properties: int) -> None:
    """Raise EngineError 400 ``schema_too_large`` when the request's tool definitions and response
    schema hold more than ``max_nodes`` JSON objects, arrays and array members (setting
    ``max_schema_nodes``; :func:`schema_size`) or
    an object with more than ``max_properties`` properties (``max_schema_properties``: llama.cpp's
    grammar of an object grows faster than its property count, measured in the module doc)."""
    vals = list(tools or []) + ([json_schema] if json_schema is not None else [])
    n, widest = schema_size(vals, max_nodes)
    if n > max_nodes:
        raise EngineError("schema_too_large", f"the request's tool definitions and response schema hold "
                          f"more than {max_nodes} JSON objects, arrays and array values such as enum "
                          f"members (limit max_schema_nodes = {max_nodes}); send fewer or smaller tools",
                          400)
    if widest > max_properties:
        raise EngineError("schema_too_large", f"an object in the request's tool definitions or response "
                          f"schema has {widest} properties (limit max_schema_properties = {max_properties}): "
                          "its grammar would take too long to build; split it or send fewer fields", 400)


def message_text_bytes(messages: Optional[list[Any]], prompt: Optional[str]) -> int:
    """UTF-8 bytes of the text a rendered prompt contains at least: every message's ``content``
    (strings and text parts) and a raw ``prompt``. Counted from string lengths (a character is at
    least one byte), so a lower bound of the rendered prompt's bytes."""
    n = len(prompt) if isinstance(prompt, str) else 0
    for m in messages or []:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def min_tokens(n_bytes: int, max_piece_bytes: int) -> int:
    """Fewest tokens any tokenization of ``n_bytes`` bytes of text can have: no token's text is
    longer than ``max_piece_bytes`` (the vocabulary's longest piece, special tokens included)."""
    return -(-n_bytes // max(1, max_piece_bytes))


def check_text_fits(n_bytes: int, max_piece_bytes: int, n_ctx_slot: int) -> None:
    """Raise EngineError 400 ``context_length_exceeded`` when ``n_bytes`` of text cannot fit in a
    slot's context whatever its tokenization (:func:`min_tokens`), before it is tokenized."""
    least = min_tokens(n_bytes, max_piece_bytes)
    if least >= n_ctx_slot:
        raise EngineError("context_length_exceeded",
                          f"prompt is too long: {n_bytes} bytes of text are at least {least} tokens > "
                          f"{n_ctx_slot - 1} maximum (the context holds {n_ctx_slot} tokens per slot; no "
                          f"token of this model is longer than {max_piece_bytes} bytes)", 400,
                          {"n_prompt_tokens": least, "n_ctx": n_ctx_slot})
