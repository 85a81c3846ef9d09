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

from ...engine.events import EngineEvent, ErrorEvent
from . import Frame, IdFactory, new_id
from .calls import TOOL_DELTAS_PER_PING, final_message, unsent_text

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
    """Content blocks of the final message: thinking, text, tool_use (a call cut by the length limit
    or whose arguments are not a JSON object is text: :func:`.final_message`)."""
    m, _ = final_message(done)
    blocks: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": m["reasoning_content"],
                       "signature": signature(m["reasoning_content"])})
    if m.get("content"):
        blocks.append({"type": "text", "text": m["content"]})
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or tc
        args = fn.get("arguments") or "{}"
        blocks.append({"type": "tool_use", "id": tc.get("id") or ids("toolu_"), "name": fn.get("name", ""),
                       "input": json.loads(args) if isinstance(args, str) else args})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


def stop_of(done: dict[str, Any], has_tool_use: bool) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished message."""
    if has_tool_use:
        return "tool_use", None
    if done.get("stop_sequence"):
        return "stop_sequence", done["stop_sequence"]
    _, finish = final_message(done)
    return STOP_REASONS.get(finish, "end_turn"), None


def message_body(rid: str, model: Optional[str], done: dict[str, Any], u: dict[str, int],
                 ids: IdFactory = new_id) -> dict[str, Any]:
    """The non-streaming answer of ``POST /v1/messages``."""
    blocks = content_blocks(done, ids)
    stop, seq = stop_of(done, any(bl["type"] == "tool_use" for bl in blocks))
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop, "stop_sequence": seq, "usage": usage(u)}


class MessageStream:
    """The SSE events of one streamed message. Call :meth:`start` once, then :meth:`feed` with
    every engine event (and the usage known then); each returns the frames to send."""

    def __init__(self, rid: str, model: Optional[str], ids: IdFactory = new_id):
        self.rid, self.model, self.ids = rid, model, ids
        self.index = -1
        self.open_kind: Optional[str] = None  # "thinking" | "text" | "tool"
        self.thinking_text: list[str] = []
        self.sent = ""  # text streamed so far
        self.held_tool_deltas = 0
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
        self.open_kind = None

    def _open_block(self, kind: str, block: dict[str, Any]) -> None:
        self._close_block()
        self.index += 1
        self.open_kind = kind
        self._emit("content_block_start", {"index": self.index, "content_block": block})

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
            self.sent += d["content"]
        for _ in d.get("tool_calls") or []:  # held back: sent whole at the end (see encoders)
            self.held_tool_deltas += 1
            if self.held_tool_deltas % TOOL_DELTAS_PER_PING == 0:
                self._emit("ping", {})

    def _done(self, data: dict[str, Any], u: dict[str, int]) -> None:
        msg, _ = final_message(data)
        rest = unsent_text(msg.get("content"), self.sent)
        if rest:
            if self.open_kind != "text":
                self._open_block("text", {"type": "text", "text": ""})
            self._emit("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": rest}})
        calls = msg.get("tool_calls") or []
        for tc in calls:
            fn = tc.get("function") or tc
            self._open_block("tool", {"type": "tool_use", "id": tc.get("id") or self.ids("toolu_"),
                                      "name": fn.get("name") or "", "input": {}})
            self._emit("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": fn.get("arguments") or "{}"}})
        if self.index < 0:
            self._open_block("text", {"type": "text", "text": ""})
        self._close_block()
        stop, seq = stop_of(data, bool(calls))
        uu = usage(u)
        self._emit("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq},
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
        elif isinstance(ev, ErrorEvent):
            self._close_block()
            self._emit("error", {"error": {"type": "api_error", "message": f"{ev.message} ({ev.code})"}})
        return self._take()
