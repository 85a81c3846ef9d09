"""OpenAI Responses encoder (platform.openai.com/docs/api-reference/responses).

:func:`response_obj` is the response object (also the non-streaming answer); :class:`ResponseStream`
turns engine events into the stream's typed, numbered events: ``response.created``,
``response.in_progress``, per output item (reasoning, message, function_call) ``added`` / deltas /
``done``, then ``response.completed`` (or ``response.failed``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ...engine.events import EngineEvent, ErrorEvent
from . import PING_COMMENT, Frame, IdFactory, new_id
from .calls import TOOL_DELTAS_PER_PING, final_message, unsent_text
from .llama_native import progress_timings, prompt_progress


NAMESPACE_SEP = "__"  # a namespace tool's functions are offered as "<namespace>__<name>"


def namespaced_names(tools: Any) -> dict[str, tuple[str, str]]:
    """Flat function name -> (namespace, name) for the functions of the request's ``namespace``
    tools (Codex groups some tools so: ``{"type": "namespace", "name", "tools": [functions]}``)."""
    out: dict[str, tuple[str, str]] = {}
    for t in tools or []:
        if isinstance(t, dict) and t.get("type") == "namespace" and isinstance(t.get("name"), str):
            for sub in t.get("tools") or []:
                if isinstance(sub, dict) and sub.get("type", "function") == "function" \
                        and isinstance(sub.get("name"), str):
                    out[f"{t['name']}{NAMESPACE_SEP}{sub['name']}"] = (t["name"], sub["name"])
    return out


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


def output_items(done: dict[str, Any], ids: IdFactory = new_id,
                 namespaces: Optional[dict[str, tuple[str, str]]] = None) -> list[dict[str, Any]]:
    """Output items of the final message: reasoning, message, function calls (a call of a
    namespace tool's function carries its ``namespace`` and own ``name``)."""
    m, _ = final_message(done)
    items: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        items.append({"type": "reasoning", "id": ids("rs_"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
    if m.get("content") or not m.get("tool_calls"):
        items.append({"type": "message", "id": ids("msg_"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": m.get("content") or "", "annotations": [],
                                   "logprobs": []}]})
    for tc in m.get("tool_calls") or []:
        items.append(function_call_item(tc, ids, namespaces))
    return items


def function_call_item(tc: dict[str, Any], ids: IdFactory = new_id,
                       namespaces: Optional[dict[str, tuple[str, str]]] = None) -> dict[str, Any]:
    """A ``function_call`` output item of a final tool call."""
    fn = tc.get("function") or tc
    item = {"type": "function_call", "id": ids("fc_"), "call_id": tc.get("id") or ids("call_"),
            "name": fn.get("name", ""), "arguments": fn.get("arguments") or "{}", "status": "completed"}
    ns = (namespaces or {}).get(item["name"])
    if ns is not None:
        item["namespace"], item["name"] = ns
    return item


def response_body(body: dict[str, Any], rid: str, model: Optional[str], created: int,
                  done: dict[str, Any], u: dict[str, int], ids: IdFactory = new_id) -> dict[str, Any]:
    """The non-streaming answer of ``POST /v1/responses``."""
    inc = "max_output_tokens" if final_message(done)[1] == "length" else None
    return response_obj(body, rid, model, created, "incomplete" if inc else "completed",
                        output_items(done, ids, namespaced_names(body.get("tools"))), usage(u), inc)


class ResponseStream:
    """The events of one streamed response: :meth:`start`, then :meth:`feed` per engine event."""

    def __init__(self, body: dict[str, Any], rid: str, model: Optional[str], created: int,
                 ids: IdFactory = new_id):
        self.body, self.rid, self.model, self.created, self.ids = body, rid, model or "", created, ids
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.cur: Optional[dict[str, Any]] = None  # open item: {"kind", "item", "text", "tool_index"}
        self.sent = ""  # message text streamed so far
        self.held_tool_deltas = 0
        self.out: list[Frame] = []
        # llama-server's extensions: ``timings`` (a function giving them) on response.completed,
        # and with ``timings_per_token`` on the last event of each delta; response.in_progress
        # events with ``prompt_progress`` while the prompt is prefilled with ``return_progress``
        self.timings: Optional[Callable[[], dict[str, Any]]] = None
        self.timings_per_token = False
        self.return_progress = False

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
            self._text(d["content"])
        for _ in d.get("tool_calls") or []:  # held back: sent whole at the end (see encoders)
            self.held_tool_deltas += 1
            if self.held_tool_deltas % TOOL_DELTAS_PER_PING == 0:
                self.out.append(PING_COMMENT)

    def _text(self, text: str) -> None:
        if self.cur is None or self.cur["kind"] != "message":
            self._open_item("message", {"type": "message", "id": self.ids("msg_"), "status": "in_progress",
                                        "role": "assistant", "content": []},
                            {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        if not text:
            return
        self.cur["text"] += text
        self.sent += text
        self._emit("response.output_text.delta", {"item_id": self.cur["item"]["id"],
                                                  "output_index": len(self.output),
                                                  "content_index": 0, "delta": text, "logprobs": []})

    def _calls(self, msg: dict[str, Any]) -> None:
        for tc in msg.get("tool_calls") or []:
            item = function_call_item(tc, self.ids, namespaced_names(self.body.get("tools")))
            self._open_item("tool", dict(item, arguments="", status="in_progress"))
            self.cur["text"] = item["arguments"]
            self._emit("response.function_call_arguments.delta", {"item_id": item["id"],
                                                                  "output_index": len(self.output),
                                                                  "delta": item["arguments"]})
        self._close_item()

    def _add_timings(self, data: dict[str, Any]) -> None:
        """``timings`` on the last event emitted since the last take (none: nothing to add to)."""
        for f in reversed(self.out):
            if f is not PING_COMMENT and isinstance(f.data, dict):
                f.data["timings"] = data
                return

    def feed(self, ev: EngineEvent, u: dict[str, int]) -> list[Frame]:
        if ev.type == "ping":
            self.out.append(PING_COMMENT)
        elif ev.type == "progress":
            if self.return_progress:
                self._emit("response.in_progress", {"response": self._obj("in_progress", None),
                                                    "prompt_progress": prompt_progress(ev.data)})
                if self.timings_per_token:
                    self._add_timings(progress_timings(ev.data))
        elif ev.type == "delta":
            self._delta(ev.data)
            if self.timings_per_token and self.timings is not None:
                self._add_timings(self.timings())
        elif ev.type == "done":
            msg, finish = final_message(ev.data)
            rest = unsent_text(msg.get("content"), self.sent)
            if rest or (not self.output and self.cur is None and not msg.get("tool_calls")):
                self._text(rest)
            self._calls(msg)
            inc = "max_output_tokens" if finish == "length" else None
            self._emit("response.completed", {"response": self._obj(
                "incomplete" if inc else "completed", usage(u), inc)})
            if self.timings is not None:
                self._add_timings(self.timings())
        elif isinstance(ev, ErrorEvent):
            self._close_item()
            err = {"code": ev.code, "message": ev.message or "engine error"}
            self._emit("response.failed", {"response": self._obj("failed", usage(u), error=err)})
        return self._take()
