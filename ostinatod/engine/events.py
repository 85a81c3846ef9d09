"""The events of a generation stream, one typed class per event type.

The worker makes them (:mod:`.worker`, :mod:`.task`), the pipe carries them as ``{"type", "data"}``
(:mod:`.protocol`: :meth:`EngineEvent.to_data` and :func:`event_from_data`), and the daemon's
adapters (:mod:`ostinatod.server.common`, :mod:`ostinatod.server.encoders`) read their fields. The
``data`` dict of an event is exactly what it was before the events were typed: the wire encoders
take the ``done`` data (its ``message`` is the OpenAI-shaped assistant message, a wire shape).

In stream order: :class:`StartEvent` once, :class:`ProgressEvent` (only with ``return_progress``),
:class:`DeltaEvent` 0..n, then :class:`DoneEvent` or :class:`ErrorEvent`. :class:`PingEvent` is
never sent by an engine: the HTTP front end makes it while it waits (heartbeat).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Optional, TypedDict


class EventType(str, Enum):
    """The ``type`` of an event (see the module docstring and each event class).
    Members compare, hash and print as their string value ("done" == EventType.DONE)."""

    START = "start"
    DELTA = "delta"
    DONE = "done"
    ERROR = "error"
    PROGRESS = "progress"
    PING = "ping"

    __hash__ = str.__hash__
    __str__ = str.__str__
    __format__ = str.__format__


TERMINAL = (EventType.DONE, EventType.ERROR)


class Usage(TypedDict):
    """``done.usage``: tokens of the prompt, of the output, of the prompt found in the KV cache
    and of the prompt computed (prompt - cached)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefilled_tokens: int


class Timings(TypedDict):
    """``done.timings`` in seconds (monotonic clock): time to first token, per output token after
    the first, prefill (from the slot to the first token), decode, total and waiting for a slot.
    None where there is no such figure (no token generated)."""

    ttft_s: Optional[float]
    tpot_s: Optional[float]
    prefill_s: Optional[float]
    decode_s: Optional[float]
    total_s: float
    queue_s: float


class ToolCallDelta(TypedDict):
    """One ``delta.tool_calls`` entry: ``arguments`` is the new text of the JSON argument string
    (a diff, as in OpenAI streaming); ``id`` and ``name`` come with the call's first entry."""

    index: int
    id: Optional[str]
    name: Optional[str]
    arguments: str


@dataclass
class EngineEvent:
    """Base of the event classes; ``type`` names the subclass. ``data``: the event as the JSON
    object the pipe carries (fields that are None and optional are left out)."""

    type: ClassVar[EventType]
    _optional: ClassVar[tuple[str, ...]] = ()  # fields left out of ``data`` while None

    def to_data(self) -> dict[str, Any]:
        """The event's fields as a JSON object (optional fields only when set)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in self._optional:
                continue
            out[f.name] = v
        return out

    @property
    def data(self) -> dict[str, Any]:
        return self.to_data()

    @classmethod
    def from_data(cls, d: dict[str, Any]) -> "EngineEvent":
        """The event of a JSON object. Raises ValueError for a key the class does not have or a
        missing required one (a renamed key fails here, not in a reader)."""
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{cls.type.value} event: unknown field(s) {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"{cls.type.value} event: {e}") from None


@dataclass
class StartEvent(EngineEvent):
    """Once, when the request has its slot: prompt tokens, of them found in the KV cache, the slot,
    tokens put back from the host or disk cache, the residency swap made right before it
    (``residency_switch``: see :meth:`.worker.Worker.switch_residency`) or why its workload's
    planned set was not swapped in."""

    type: ClassVar[EventType] = EventType.START
    _optional: ClassVar[tuple[str, ...]] = ("slot", "host_cache_tokens", "residency_switch",
                                            "residency_switch_skipped")
    prompt_tokens: int
    cached_tokens: int
    slot: Optional[int] = None
    host_cache_tokens: Optional[int] = None
    residency_switch: Optional[dict[str, Any]] = None
    residency_switch_skipped: Optional[str] = None


@dataclass
class DeltaEvent(EngineEvent):
    """New output: text, reasoning text, tool-call diffs (any subset) and, when the request asked
    for ``logprobs``, the entries of the tokens generated since the previous delta
    (:mod:`.logprobs`)."""

    type: ClassVar[EventType] = EventType.DELTA
    _optional: ClassVar[tuple[str, ...]] = ("content", "reasoning", "tool_calls", "logprobs")
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None
    logprobs: Optional[list[dict[str, Any]]] = None


@dataclass
class DoneEvent(EngineEvent):
    """The end of a generation. ``finish_reason``: "stop", "length" or "tool_calls"; ``message``:
    the final assistant message in OpenAI shape (``content``, ``reasoning_content``, ``tool_calls``
    with whole arguments, each a valid call: :func:`.text.settle_tool_calls`), so adapters send
    the calls of ``message``, not the streamed diffs; ``text``: the raw output text; ``slot``;
    ``logprobs``: every generated token's entry (with ``logprobs``); ``prefill``: ``{"passes",
    "ubatch"}``; ``stop_sequence``: the client's stop string that ended the output; ``experts``:
    the expert runtime's counters of this request (``ExpertRuntime.take_request_stats``)."""

    type: ClassVar[EventType] = EventType.DONE
    _optional: ClassVar[tuple[str, ...]] = ("logprobs", "prefill", "stop_sequence", "experts")
    finish_reason: Optional[str] = None
    message: dict[str, Any] = field(default_factory=dict)
    usage: Usage = field(default_factory=dict)  # type: ignore[assignment]
    timings: Timings = field(default_factory=dict)  # type: ignore[assignment]
    text: str = ""
    slot: Optional[int] = None
    logprobs: Optional[list[dict[str, Any]]] = None
    prefill: Optional[dict[str, int]] = None
    stop_sequence: Optional[str] = None
    experts: Optional[dict[str, Any]] = None


@dataclass
class ErrorEvent(EngineEvent):
    """Instead of ``done`` on failure: a stable ``code`` ("context_length_exceeded",
    "invalid_request", "engine_crashed", "model_not_loaded", "cancelled", ...), the message, the HTTP
    status, and ``extra`` fields of the answer (``n_prompt_tokens`` and ``n_ctx`` of a context
    overflow: llama-server's). On the pipe the extra fields sit beside the others."""

    type: ClassVar[EventType] = EventType.ERROR
    code: str = "engine_error"
    message: str = "engine error"
    status: int = 500
    extra: dict[str, Any] = field(default_factory=dict)

    def to_data(self) -> dict[str, Any]:
        return {**self.extra, "code": self.code, "message": self.message, "status": self.status}

    @classmethod
    def from_data(cls, d: dict[str, Any]) -> "ErrorEvent":
        extra = {k: v for k, v in d.items() if k not in ("code", "message", "status")}
        return cls(d.get("code") or "engine_error", d.get("message") or "engine error",
                   int(d.get("status") or 500), extra)


@dataclass
class ProgressEvent(EngineEvent):
    """Prefill progress (only when the request asked ``return_progress``), once when its slot is
    given and after each prefill step: prompt tokens, of them cached, cached + prefilled so far, ms
    since the prefill began."""

    type: ClassVar[EventType] = EventType.PROGRESS
    total: int
    cache: int
    processed: int
    time_ms: float


@dataclass
class PingEvent(EngineEvent):
    """A heartbeat of the HTTP front end while the engine is silent (never from an engine)."""

    type: ClassVar[EventType] = EventType.PING


EVENT_CLASSES: dict[EventType, type[EngineEvent]] = {
    c.type: c for c in (StartEvent, DeltaEvent, DoneEvent, ErrorEvent, ProgressEvent, PingEvent)}


def event_from_data(type_: str | EventType, data: Optional[dict[str, Any]] = None) -> EngineEvent:
    """The typed event of a ``type`` and its ``data`` (as the pipe carries them). Raises ValueError
    for an unknown type or a field its class does not have."""
    return EVENT_CLASSES[EventType(type_)].from_data(dict(data or {}))
