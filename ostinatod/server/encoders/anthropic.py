"""Anthropic Messages encoder (docs.anthropic.com/en/api/messages and .../messages-streaming).

:func:`message_body` is the non-streaming answer; :class:`MessageStream` turns engine events into
the stream's events: ``message_start``, ``ping``, per content block (thinking, text, tool_use)
``content_block_start`` / ``content_block_delta`` / ``content_block_stop``, then
``message_delta`` and ``message_stop`` (or ``error``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from ...engine.types import EngineEvent
from . import Frame, IdFactory, new_id

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def signature(text: str) -> str:
    """Stand-in thinking signature (clients only echo it back; we ignore it on input)."""
    return "ostinato-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def usage(u: dict[str, int]) -> dict[str, int]:
    """Anthropic usage from the engine's ``{"prompt_tokens", "completion_tokens", "cached_tokens"}``."""
    return {"input_tokens": max(u["prompt_tokens"] - u["cached_tokens"], 0),
            "cache_read_input_tokens": u["cached_tokens"], "cache_creation_input_tokens": 0,
            "output_tokens": u["completion_tokens"]}


def content_blocks(done: dict[str, Any], ids: IdFactory = new_id) -> list[dict[str, Any]]:
    """Content blocks of the final message: thinking, text, tool_use (a call whose arguments are
    not a JSON object stays visible as text)."""
    m = done.get("message") or {}
    blocks: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": m["reasoning_content"],
                       "signature": signature(m["reasoning_content"])})
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
        blocks.append({"type": "tool_use", "id": tc.get("id") or ids("toolu_"),
                       "name": fn.get("name", ""), "input": inp})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


def message_body(rid: str, model: Optional[str], done: dict[str, Any], u: dict[str, int],
                 ids: IdFactory = new_id) -> dict[str, Any]:
    """The non-streaming answer of ``POST /v1/messages``."""
    blocks = content_blocks(done, ids)
    stop = STOP_REASONS.get(done.get("finish_reason") or "stop", "end_turn")
    if any(bl["type"] == "tool_use" for bl in blocks):
        stop = "tool_use"
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop, "stop_sequence": None, "usage": usage(u)}


class MessageStream:
    """The SSE events of one streamed message. Call :meth:`start` once, then :meth:`feed` with
    every engine event (and the usage known then); each returns the frames to send."""

    def __init__(self, rid: str, model: Optional[str], ids: IdFactory = new_id):
        self.rid, self.model, self.ids = rid, model, ids
        self.index = -1
        self.open_kind: Optional[str] = None  # "thinking" | "text" | "tool"
        self.open_tool: Optional[int] = None  # engine tool index of the open tool block
        self.thinking_text: list[str] = []
        self.pending_tools: dict[int, dict[str, Any]] = {}  # engine index -> {"id","name","args"}
        self.opened_tools: set[int] = set()
        self.saw_tool = False
        self.out: list[Frame] = []

    def _emit(self, event: str, data: dict[str, Any]) -> None:
        self.out.append(Frame(dict(type=event, **data), event=event))

    def _take(self) -> list[Frame]:
        out, self.out = self.out, []
        return out

    def start(self, u: dict[str, int]) -> list[Frame]:
        """``message_start`` (input usage known after the prompt was matched) and a ``ping``."""
        u0 = usage(u)
        self._emit("message_start", {"message": {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": u0["input_tokens"],
                      "cache_read_input_tokens": u0["cache_read_input_tokens"],
                      "cache_creation_input_tokens": 0, "output_tokens": 0}}})
        self._emit("ping", {})
        return self._take()

    def _close_block(self) -> None:
        if self.open_kind is None:
            return
        if self.open_kind == "thinking":
            self._emit("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": signature("".join(self.thinking_text))}})
        self._emit("content_block_stop", {"index": self.index})
        self.open_kind, self.open_tool = None, None

    def _open_block(self, kind: str, block: dict[str, Any]) -> None:
        self._close_block()
        self.index += 1
        self.open_kind = kind
        self._emit("content_block_start", {"index": self.index, "content_block": block})

    def _json_delta(self, text: str) -> None:
        self._emit("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": text}})

    def _tool_delta(self, tc: dict[str, Any]) -> None:
        idx = int(tc.get("index", 0))
        p = self.pending_tools.setdefault(idx, {"id": None, "name": None, "args": ""})
        p["id"] = p["id"] or tc.get("id")
        p["name"] = p["name"] or tc.get("name")
        p["args"] += tc.get("arguments") or ""
        if idx not in self.opened_tools:
            if not p["name"]:
                return  # wait for the name before opening the block
            self._open_block("tool", {"type": "tool_use", "id": p["id"] or self.ids("toolu_"),
                                      "name": p["name"], "input": {}})
            self.opened_tools.add(idx)
            self.open_tool = idx
            self.saw_tool = True
            if p["args"]:
                self._json_delta(p["args"])
            p["args"] = ""
        elif self.open_tool == idx and p["args"]:
            self._json_delta(p["args"])
            p["args"] = ""
        # deltas of an earlier, already closed tool block cannot be reopened; they stay buffered

    def _delta(self, d: dict[str, Any]) -> None:
        if d.get("reasoning"):
            if self.open_kind != "thinking":
                self.thinking_text.clear()
                self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking_text.append(d["reasoning"])
            self._emit("content_block_delta", {"index": self.index, "delta": {
                "type": "thinking_delta", "thinking": d["reasoning"]}})
        if d.get("content"):
            if self.open_kind != "text":
                self._open_block("text", {"type": "text", "text": ""})
            self._emit("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": d["content"]}})
        for tc in d.get("tool_calls") or []:
            self._tool_delta(tc)

    def _done(self, data: dict[str, Any], u: dict[str, int]) -> None:
        # tools whose name arrived only in the final message
        final_calls = (data.get("message") or {}).get("tool_calls") or []
        for i, tc in enumerate(final_calls):
            if i not in self.opened_tools:
                fn = tc.get("function") or tc
                self._tool_delta({"index": i, "id": tc.get("id"), "name": fn.get("name"),
                                  "arguments": "" if i in self.pending_tools else fn.get("arguments") or ""})
        if self.index < 0:
            self._open_block("text", {"type": "text", "text": ""})
        self._close_block()
        stop = ("tool_use" if self.saw_tool
                else STOP_REASONS.get(data.get("finish_reason") or "stop", "end_turn"))
        uu = usage(u)
        self._emit("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                     "usage": {"output_tokens": uu["output_tokens"],
                                               "input_tokens": uu["input_tokens"],
                                               "cache_read_input_tokens": uu["cache_read_input_tokens"]}})
        self._emit("message_stop", {})

    def feed(self, ev: EngineEvent, u: dict[str, int]) -> list[Frame]:
        """The frames of one engine event (``ping``, ``delta``, ``done`` or ``error``)."""
        if ev.type == "ping":
            self._emit("ping", {})
        elif ev.type == "delta":
            self._delta(ev.data)
        elif ev.type == "done":
            self._done(ev.data, u)
        elif ev.type == "error":
            self._close_block()
            self._emit("error", {"error": {"type": "api_error",
                                           "message": f"{ev.data.get('message')} ({ev.data.get('code')})"}})
        return self._take()
