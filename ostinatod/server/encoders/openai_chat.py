"""OpenAI Chat Completions and legacy Completions encoders (platform.openai.com/docs/api-reference).

:func:`chat_completion` / :func:`text_completion` are the non-streaming answers; :class:`ChatStream`
and :class:`CompletionStream` turn engine events into ``chat.completion.chunk`` /
``text_completion`` chunks, the optional usage chunk and the final ``[DONE]``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ...engine.events import DeltaEvent, DoneEvent, EngineEvent
from . import DONE_SENTINEL, PING_COMMENT, Frame, IdFactory, new_id
from .calls import TOOL_DELTAS_PER_PING, final_message, unsent_text
from .llama_native import progress_timings, prompt_progress


def usage(u: dict[str, int]) -> dict[str, Any]:
    """OpenAI usage from the engine's ``{"prompt_tokens", "completion_tokens", "cached_tokens"}``."""
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def error_payload(data: dict[str, Any]) -> dict[str, Any]:
    """An error event's data as an OpenAI error object (sent inside a started stream)."""
    code = data.get("code", "engine_error")
    return {"error": {"message": f"{data.get('message') or 'engine error'} ({code})", "type": "server_error",
                      "code": data.get("code", "engine_error"), "param": None}}


def chat_logprobs(entries: Optional[list[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """A chat choice's ``logprobs`` object of the engine's entries (:mod:`...engine.logprobs`);
    None when the request did not ask for them."""
    return None if entries is None else {"content": entries, "refusal": None}


def legacy_logprobs(entries: Optional[list[dict[str, Any]]], offset: int = 0) -> Optional[dict[str, Any]]:
    """Legacy completions' ``logprobs`` object of the engine's entries: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (one ``{token: logprob}`` per token) and ``text_offset``
    (each token's character offset in the generated text, counted from ``offset``); None when
    the request did not ask for them."""
    if entries is None:
        return None
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def chat_message(done: dict[str, Any], ids: IdFactory = new_id) -> dict[str, Any]:
    """The assistant message of a chat completion (content, reasoning_content, tool_calls)."""
    m, _ = final_message(done)
    out: dict[str, Any] = {"role": "assistant", "content": m.get("content") or None}
    if m.get("reasoning_content"):
        out["reasoning_content"] = m["reasoning_content"]
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or tc
        calls.append({"id": tc.get("id") or ids("call_"), "type": "function",
                      "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments") or "{}"}})
    if calls:
        out["tool_calls"] = calls
    elif out["content"] is None:
        out["content"] = ""
    return out


def legacy_call(msg: dict[str, Any]) -> dict[str, Any]:
    """A message with ``tool_calls`` in the legacy ``functions`` shape: its first call as
    ``function_call`` ``{name, arguments}`` (a legacy request gets one call)."""
    out = {k: v for k, v in msg.items() if k != "tool_calls"}
    fn = msg["tool_calls"][0]["function"]
    out["function_call"] = {"name": fn["name"], "arguments": fn["arguments"]}
    return out


def chat_completion(rid: str, model: Optional[str], created: int, done: dict[str, Any],
                    u: dict[str, int], ids: IdFactory = new_id, legacy: bool = False) -> dict[str, Any]:
    """The non-streaming answer of ``POST /v1/chat/completions`` (``legacy``: the request gave
    ``functions``, so a call comes back as ``function_call``, finish reason "function_call")."""
    msg = chat_message(done, ids)
    _, finish = final_message(done)
    if msg.get("tool_calls"):
        finish = "tool_calls"
        if legacy:
            msg, finish = legacy_call(msg), "function_call"
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": "ostinato",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": chat_logprobs(done.get("logprobs"))}],
            "usage": usage(u)}


def text_completion(rid: str, model: Optional[str], created: int, done: dict[str, Any],
                    u: dict[str, int]) -> dict[str, Any]:
    """The non-streaming answer of ``POST /v1/completions``."""
    text = (done.get("message") or {}).get("content") or done.get("text") or ""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": done.get("finish_reason") or "stop",
                         "logprobs": legacy_logprobs(done.get("logprobs"))}], "usage": usage(u)}


class _Stream:
    """What the chat and the legacy completion streams share: ids, the usage chunk, pings, errors
    and the final ``[DONE]``. Subclasses give the object name, the first frames, the delta frames
    and the finish frame."""

    object = ""

    def __init__(self, rid: str, model: Optional[str], created: int, include_usage: bool):
        self.rid, self.model, self.created, self.include_usage = rid, model, created, include_usage
        self.lp_pending: Optional[list[dict[str, Any]]] = None  # logprob entries not yet sent
        self.lp_sent = 0
        # llama-server's extensions: ``timings`` (a function giving them) on the last chunk, and
        # with ``timings_per_token`` on every delta chunk; ``prompt_progress`` chunks while the
        # prompt is prefilled with ``return_progress``
        self.timings: Optional[Callable[[], dict[str, Any]]] = None
        self.timings_per_token = False
        self.return_progress = False

    def _empty_chunk(self) -> Frame:
        raise NotImplementedError

    def _take_logprobs(self) -> Optional[list[dict[str, Any]]]:
        """The logprob entries for the next chunk (all received and not yet sent; None: the
        request asked for none)."""
        out, self.lp_pending = self.lp_pending, ([] if self.lp_pending is not None else None)
        self.lp_sent += len(out or [])
        return out

    def start(self) -> list[Frame]:
        return []

    def _delta(self, d: dict[str, Any]) -> list[Frame]:
        raise NotImplementedError

    def _finish(self, done: dict[str, Any]) -> list[Frame]:
        raise NotImplementedError

    def feed(self, ev: EngineEvent, u: dict[str, int]) -> list[Frame]:
        """The frames of one engine event (``ping``, ``delta``, ``done`` or ``error``)."""
        if ev.type == "ping":
            return [PING_COMMENT]
        if ev.type == "progress":
            if not self.return_progress:
                return []
            f = self._empty_chunk()
            f.data["prompt_progress"] = prompt_progress(ev.data)
            if self.timings_per_token:
                f.data["timings"] = progress_timings(ev.data)
            return [f]
        if isinstance(ev, DeltaEvent):
            if ev.logprobs is not None:
                self.lp_pending = (self.lp_pending or []) + ev.logprobs
            out = self._delta(ev.data)
            if self.timings_per_token and self.timings is not None and out and isinstance(out[-1].data, dict):
                out[-1].data["timings"] = self.timings()
            return out
        if isinstance(ev, DoneEvent):
            if ev.logprobs is not None:  # the done event's list is whole: what no delta carried
                self.lp_pending = ev.logprobs[self.lp_sent:]
            out = self._finish(ev.data)
            if self.include_usage:
                out.append(Frame({"id": self.rid, "object": self.object, "created": self.created,
                                  "model": self.model, "choices": [], "usage": usage(u)}))
            if self.timings is not None and out and isinstance(out[-1].data, dict):
                out[-1].data["timings"] = self.timings()
            return out
        if ev.type == "error":
            return [Frame(error_payload(ev.data))]
        return []

    def end(self) -> list[Frame]:
        return [DONE_SENTINEL]


class ChatStream(_Stream):
    """The chunks of one streamed chat completion: :meth:`start`, :meth:`feed` per engine event,
    :meth:`end` (``[DONE]``)."""

    object = "chat.completion.chunk"

    def __init__(self, rid: str, model: Optional[str], created: int, include_usage: bool,
                 ids: IdFactory = new_id, legacy: bool = False):
        super().__init__(rid, model, created, include_usage)
        self.ids = ids
        self.legacy = legacy  # calls as the legacy function_call (the request gave functions)
        self.sent = ""  # content streamed so far
        self.held_tool_deltas = 0

    def _chunk(self, delta: dict[str, Any], finish: Optional[str] = None) -> Frame:
        c: dict[str, Any] = {"id": self.rid, "object": self.object, "created": self.created,
                             "model": self.model, "system_fingerprint": "ostinato",
                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                          "logprobs": chat_logprobs(self._take_logprobs() or None)}]}
        if self.include_usage:
            c["usage"] = None
        return Frame(c)

    def start(self) -> list[Frame]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _empty_chunk(self) -> Frame:
        return self._chunk({})

    def _delta(self, d: dict[str, Any]) -> list[Frame]:
        out = []
        if d.get("reasoning"):
            out.append(self._chunk({"reasoning_content": d["reasoning"]}))
        if d.get("content"):
            self.sent += d["content"]
            out.append(self._chunk({"content": d["content"]}))
        for _ in d.get("tool_calls") or []:  # held back: sent whole at the end (module encoders)
            self.held_tool_deltas += 1
            if self.held_tool_deltas % TOOL_DELTAS_PER_PING == 0:
                out.append(PING_COMMENT)
        return out

    def _finish(self, done: dict[str, Any]) -> list[Frame]:
        msg, finish = final_message(done)
        out = []
        rest = unsent_text(msg.get("content"), self.sent)
        if rest:
            out.append(self._chunk({"content": rest}))
        calls = [{"index": i, "id": tc.get("id") or self.ids("call_"), "type": "function",
                  "function": {"name": (tc.get("function") or tc).get("name") or "",
                               "arguments": (tc.get("function") or tc).get("arguments") or "{}"}}
                 for i, tc in enumerate(msg.get("tool_calls") or [])]
        if calls and self.legacy:
            out.append(self._chunk({"function_call": {"name": calls[0]["function"]["name"],
                                                      "arguments": calls[0]["function"]["arguments"]}}))
            out.append(self._chunk({}, "function_call"))
            return out
        if calls:
            out.append(self._chunk({"tool_calls": calls}))
        out.append(self._chunk({}, "tool_calls" if calls else finish))
        return out


class CompletionStream(_Stream):
    """The chunks of one streamed legacy completion (raw text)."""

    object = "text_completion"

    def __init__(self, rid: str, model: Optional[str], created: int, include_usage: bool):
        super().__init__(rid, model, created, include_usage)
        self.n_chars = 0  # characters of the tokens whose logprobs went out (text_offset)

    def _chunk(self, text: str, finish: Optional[str] = None) -> Frame:
        entries = self._take_logprobs() or None
        lp = legacy_logprobs(entries, self.n_chars)
        self.n_chars += sum(len(e["token"]) for e in entries or [])
        return Frame({"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                      "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}]})

    def _delta(self, d: dict[str, Any]) -> list[Frame]:
        return [self._chunk(d["content"])] if d.get("content") else []

    def _empty_chunk(self) -> Frame:
        return self._chunk("")

    def _finish(self, done: dict[str, Any]) -> list[Frame]:
        return [self._chunk("", done.get("finish_reason") or "stop")]
