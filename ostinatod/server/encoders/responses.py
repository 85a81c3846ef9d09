"""OpenAI Responses encoder (platform.openai.com/docs/api-reference/responses).

:func:`response_obj` is the response object (also the non-streaming answer); :class:`ResponseStream`
turns engine events into the stream's typed, numbered events: ``response.created``,
``response.in_progress``, per output item (reasoning, message, function_call) ``added`` / deltas /
``done``, then ``response.completed`` (or ``response.failed``).
"""

from __future__ import annotations

from typing import Any, Optional

from ...engine.types import EngineEvent
from . import PING_COMMENT, Frame, IdFactory, new_id


def usage(u: dict[str, int]) -> dict[str, Any]:
    """Responses usage from the engine's ``{"prompt_tokens", "completion_tokens", "cached_tokens"}``."""
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def response_obj(body: dict[str, Any], rid: str, model: Optional[str], created: int, status: str,
                 output: list[dict[str, Any]], u: Optional[dict[str, Any]],
                 incomplete: Optional[str] = None, error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The response object; ``body`` is the request's echoed fields (instructions, tools,
    tool_choice, parallel_tool_calls, temperature, top_p, max_output_tokens, reasoning, text);
    ``u`` the Responses usage (None while in progress)."""
    b = body
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": u, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"), "tools": b.get("tools") or [],
            "tool_choice": b.get("tool_choice") or "auto",
            "parallel_tool_calls": b.get("parallel_tool_calls"), "temperature": b.get("temperature"),
            "top_p": b.get("top_p"), "max_output_tokens": b.get("max_output_tokens"), "metadata": {},
            "store": False, "previous_response_id": None,
            "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
            "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled"}


def output_items(done: dict[str, Any], ids: IdFactory = new_id) -> list[dict[str, Any]]:
    """Output items of the final message: reasoning, message, function calls."""
    m = done.get("message") or {}
    items: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        items.append({"type": "reasoning", "id": ids("rs_"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
    if m.get("content") or not m.get("tool_calls"):
        items.append({"type": "message", "id": ids("msg_"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": m.get("content") or "", "annotations": [],
                                   "logprobs": []}]})
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or tc
        items.append({"type": "function_call", "id": ids("fc_"), "call_id": tc.get("id") or ids("call_"),
                      "name": fn.get("name", ""), "arguments": fn.get("arguments") or "{}", "status": "completed"})
    return items


def response_body(body: dict[str, Any], rid: str, model: Optional[str], created: int,
                  done: dict[str, Any], u: dict[str, int], ids: IdFactory = new_id) -> dict[str, Any]:
    """The non-streaming answer of ``POST /v1/responses``."""
    inc = "max_output_tokens" if done.get("finish_reason") == "length" else None
    return response_obj(body, rid, model, created, "incomplete" if inc else "completed",
                        output_items(done, ids), usage(u), inc)


class ResponseStream:
    """The events of one streamed response: :meth:`start`, then :meth:`feed` per engine event."""

    def __init__(self, body: dict[str, Any], rid: str, model: Optional[str], created: int,
                 ids: IdFactory = new_id):
        self.body, self.rid, self.model, self.created, self.ids = body, rid, model or "", created, ids
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.cur: Optional[dict[str, Any]] = None  # open item: {"kind", "item", "text", "tool_index"}
        self.tools_by_index: dict[int, dict[str, Any]] = {}
        self.out: list[Frame] = []

    def _emit(self, event: str, data: dict[str, Any]) -> None:
        self.out.append(Frame(dict(type=event, sequence_number=self.seq, **data), event=event))
        self.seq += 1

    def _take(self) -> list[Frame]:
        out, self.out = self.out, []
        return out

    def _obj(self, status: str, u: Optional[dict[str, Any]], incomplete: Optional[str] = None,
             error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return response_obj(self.body, self.rid, self.model, self.created, status, self.output, u,
                            incomplete, error)

    def start(self) -> list[Frame]:
        self._emit("response.created", {"response": response_obj(
            self.body, self.rid, self.model, self.created, "in_progress", [], None)})
        self._emit("response.in_progress", {"response": response_obj(
            self.body, self.rid, self.model, self.created, "in_progress", [], None)})
        return self._take()

    def _close_item(self) -> None:
        cur = self.cur
        if cur is None:
            return
        oi, item = len(self.output), cur["item"]
        if cur["kind"] == "message":
            part = {"type": "output_text", "text": cur["text"], "annotations": [], "logprobs": []}
            self._emit("response.output_text.done", {"item_id": item["id"], "output_index": oi,
                                                     "content_index": 0, "text": cur["text"], "logprobs": []})
            self._emit("response.content_part.done", {"item_id": item["id"], "output_index": oi,
                                                      "content_index": 0, "part": part})
            item.update(status="completed", content=[part])
        elif cur["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": cur["text"]}
            self._emit("response.reasoning_text.done", {"item_id": item["id"], "output_index": oi,
                                                        "content_index": 0, "text": cur["text"]})
            self._emit("response.content_part.done", {"item_id": item["id"], "output_index": oi,
                                                      "content_index": 0, "part": part})
            item.update(content=[part])
        else:
            item.update(arguments=cur["text"] or "{}", status="completed")
            self._emit("response.function_call_arguments.done", {"item_id": item["id"], "output_index": oi,
                                                                 "name": item["name"],
                                                                 "arguments": item["arguments"]})
        self._emit("response.output_item.done", {"output_index": oi, "item": item})
        self.output.append(item)
        self.cur = None

    def _open_item(self, kind: str, item: dict[str, Any], part: Optional[dict[str, Any]] = None,
                   tool_index: Optional[int] = None) -> None:
        self._close_item()
        oi = len(self.output)
        self._emit("response.output_item.added", {"output_index": oi, "item": dict(item)})
        if part is not None:
            self._emit("response.content_part.added", {"item_id": item["id"], "output_index": oi,
                                                       "content_index": 0, "part": part})
        self.cur = {"kind": kind, "item": item, "text": "", "tool_index": tool_index}

    def _delta(self, d: dict[str, Any]) -> None:
        if d.get("reasoning"):
            if self.cur is None or self.cur["kind"] != "reasoning":
                self._open_item("reasoning", {"type": "reasoning", "id": self.ids("rs_"), "summary": [],
                                              "content": []}, {"type": "reasoning_text", "text": ""})
            self.cur["text"] += d["reasoning"]
            self._emit("response.reasoning_text.delta", {"item_id": self.cur["item"]["id"],
                                                         "output_index": len(self.output),
                                                         "content_index": 0, "delta": d["reasoning"]})
        if d.get("content"):
            if self.cur is None or self.cur["kind"] != "message":
                self._open_item("message", {"type": "message", "id": self.ids("msg_"), "status": "in_progress",
                                            "role": "assistant", "content": []},
                                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.cur["text"] += d["content"]
            self._emit("response.output_text.delta", {"item_id": self.cur["item"]["id"],
                                                      "output_index": len(self.output),
                                                      "content_index": 0, "delta": d["content"], "logprobs": []})
        for tc in d.get("tool_calls") or []:
            idx = int(tc.get("index", 0))
            t = self.tools_by_index.setdefault(idx, {"id": None, "name": None, "args": "", "opened": False})
            t["id"] = t["id"] or tc.get("id")
            t["name"] = t["name"] or tc.get("name")
            t["args"] += tc.get("arguments") or ""
            if not t["opened"] and t["name"]:
                t["opened"] = True
                self._open_item("tool", {"type": "function_call", "id": self.ids("fc_"),
                                         "call_id": t["id"] or self.ids("call_"), "name": t["name"],
                                         "arguments": "", "status": "in_progress"}, tool_index=idx)
            if t["opened"] and self.cur is not None and self.cur.get("tool_index") == idx and t["args"]:
                self.cur["text"] += t["args"]
                self._emit("response.function_call_arguments.delta", {"item_id": self.cur["item"]["id"],
                                                                      "output_index": len(self.output),
                                                                      "delta": t["args"]})
                t["args"] = ""

    def feed(self, ev: EngineEvent, u: dict[str, int]) -> list[Frame]:
        if ev.type == "ping":
            self.out.append(PING_COMMENT)
        elif ev.type == "delta":
            self._delta(ev.data)
        elif ev.type == "done":
            self._close_item()
            if not self.output:  # nothing streamed: use the final message
                for item in output_items(ev.data, self.ids):
                    self._emit("response.output_item.added", {"output_index": len(self.output), "item": item})
                    self._emit("response.output_item.done", {"output_index": len(self.output), "item": item})
                    self.output.append(item)
            inc = "max_output_tokens" if ev.data.get("finish_reason") == "length" else None
            self._emit("response.completed", {"response": self._obj(
                "incomplete" if inc else "completed", usage(u), inc)})
        elif ev.type == "error":
            self._close_item()
            err = {"code": ev.data.get("code", "engine_error"), "message": ev.data.get("message") or "engine error"}
            self._emit("response.failed", {"response": self._obj("failed", usage(u), error=err)})
        return self._take()
