"""The worker pipe: typed messages between the daemon (:class:`~.client.SubprocessEngine`) and the
engine worker process (:mod:`.worker_main`), one JSON object per line.

Parent -> worker: :class:`Init` (first line), then :class:`Generate`, :class:`Cancel`,
:class:`Call` (one class per call kind: :class:`CountTokens`, :class:`GetStats`,
:class:`FlushTraces`, :class:`SwitchResidency`, :class:`Tokenize`, :class:`Detokenize`,
:class:`ApplyTemplate`, :class:`Ping`; answered by a :class:`Reply` with the same ``rid``, whose
result the call types with :meth:`Call.result_of`; a switch is answered once the loop has swapped
the set, at the next request boundary) and :class:`Shutdown`.
Worker -> parent: :class:`StateMsg` (``ready`` with the model facts, :class:`~.stats.ModelFacts`,
or ``error``), :class:`Event` (one typed :class:`~.events.EngineEvent` of request ``id``) and
:class:`Reply`.

Both ends use :func:`encode` and :func:`decode`; the op names live only in :class:`Op`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Optional, Union

from ..settings import Settings
from .events import EngineEvent, ErrorEvent, event_from_data
from .stats import EngineStats, LoopProgress, ModelFacts
from .types import EngineError, GenRequest


class Op(str, Enum):
    """The ``op`` of a pipe message."""

    INIT = "init"
    GENERATE = "generate"
    CANCEL = "cancel"
    COUNT_TOKENS = "count_tokens"
    STATS = "stats"
    FLUSH_TRACES = "flush_traces"
    SWITCH_RESIDENCY = "switch_residency"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    APPLY_TEMPLATE = "apply_template"
    PING = "ping"  # liveness: answered by the worker's pipe reader at once, whatever the loop does
    SHUTDOWN = "shutdown"
    STATE = "state"
    EVENT = "event"
    REPLY = "reply"


def request_to_wire(req: GenRequest) -> dict[str, Any]:
    """``req`` as a JSON object."""
    return asdict(req)


def request_from_wire(d: dict[str, Any]) -> GenRequest:
    """The GenRequest of a JSON object (unknown keys are ignored)."""
    names = {f.name for f in fields(GenRequest)}
    return GenRequest(**{k: v for k, v in d.items() if k in names})


def error_to_wire(e: EngineError) -> dict[str, Any]:
    d = {"code": e.code, "message": e.message, "status": e.status}
    if e.extra:
        d["extra"] = e.extra
    return d


def error_from_wire(d: dict[str, Any], default_code: str = "internal_error",
                    default_status: int = 500, default_message: str = "") -> EngineError:
    return EngineError(d.get("code", default_code), d.get("message", default_message),
                       int(d.get("status", default_status)), d.get("extra"))


@dataclass
class Init:
    """The first line: the daemon's settings (the Settings model's JSON on the pipe, validated back
    into :class:`~ostinatod.settings.Settings` by the worker) and the model file."""

    settings: Settings
    model_path: str


@dataclass
class Generate:
    req: GenRequest


@dataclass
class Cancel:
    id: str


@dataclass
class Shutdown:
    pass


@dataclass
class Call:
    """Base of the calls answered by a :class:`Reply` with the same ``rid``; one subclass per call
    kind (its ``op``), whose :meth:`result_of` types the reply's result."""

    op: ClassVar[Op]
    rid: str

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Call":
        return cls(d.get("rid"))  # type: ignore[call-arg]

    def result_of(self, raw: Any) -> Any:
        """The typed result of this call from the reply's JSON ``result``."""
        return raw


@dataclass
class CountTokens(Call):
    """Tokens of the rendered prompt of ``req`` -> int."""

    op: ClassVar[Op] = Op.COUNT_TOKENS
    req: Optional[GenRequest] = None

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "req": request_to_wire(self.req)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "CountTokens":
        return cls(d.get("rid"), request_from_wire(d["req"]))

    def result_of(self, raw: Any) -> int:
        return int(raw)


@dataclass
class ApplyTemplate(CountTokens):
    """The prompt text the chat template makes of ``req`` -> str."""

    op: ClassVar[Op] = Op.APPLY_TEMPLATE

    def result_of(self, raw: Any) -> str:  # type: ignore[override]
        return str(raw)


@dataclass
class Tokenize(Call):
    """llama-server's /tokenize of ``content`` -> list of ids (or ``{"id", "piece"}`` entries)."""

    op: ClassVar[Op] = Op.TOKENIZE
    content: Any = ""
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "content": self.content, "add_special": self.add_special,
                "parse_special": self.parse_special, "with_pieces": self.with_pieces}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Tokenize":
        return cls(d.get("rid"), d.get("content", ""), bool(d.get("add_special")),
                   bool(d.get("parse_special", True)), bool(d.get("with_pieces")))

    def result_of(self, raw: Any) -> list[Any]:
        return list(raw)


@dataclass
class Detokenize(Call):
    """The text of ``tokens`` -> str."""

    op: ClassVar[Op] = Op.DETOKENIZE
    tokens: list[int] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "tokens": list(self.tokens)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Detokenize":
        return cls(d.get("rid"), list(d.get("tokens") or []))

    def result_of(self, raw: Any) -> str:
        return str(raw)


@dataclass
class GetStats(Call):
    """The worker's counters -> :class:`~.stats.EngineStats` (parsed here, once)."""

    op: ClassVar[Op] = Op.STATS

    def result_of(self, raw: Any) -> EngineStats:
        return EngineStats.parse(raw)


@dataclass
class FlushTraces(Call):
    """Write the pending routing counts to the trace files -> None."""

    op: ClassVar[Op] = Op.FLUSH_TRACES

    def result_of(self, raw: Any) -> None:
        return None


@dataclass
class SwitchResidency(Call):
    """Swap the residency set to the file ``path`` at the next request boundary -> the swap's
    facts (:class:`~.stats.SwitchInfo`), answered once the loop has swapped the set."""

    op: ClassVar[Op] = Op.SWITCH_RESIDENCY
    path: str = ""
    reason: str = "control"

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "path": self.path, "reason": self.reason}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "SwitchResidency":
        return cls(d.get("rid"), str(d.get("path") or ""), str(d.get("reason") or "control"))

    def result_of(self, raw: Any) -> dict[str, Any]:
        return dict(raw)


@dataclass
class Ping(Call):
    """Liveness: answered by the worker's pipe reader at once -> :class:`~.stats.LoopProgress`."""

    op: ClassVar[Op] = Op.PING

    def result_of(self, raw: Any) -> LoopProgress:
        return LoopProgress.parse(raw)


CALLS: dict[Op, type[Call]] = {c.op: c for c in (CountTokens, ApplyTemplate, Tokenize, Detokenize,
                                                  GetStats, FlushTraces, SwitchResidency, Ping)}


@dataclass
class StateMsg:
    """``state`` "ready" (with the model ``info``) or "error" (with ``error``)."""

    state: str
    info: Optional[ModelFacts] = None
    error: Optional[EngineError] = None


@dataclass
class Event:
    id: str
    event: EngineEvent


@dataclass
class Reply:
    """The answer to a :class:`Call`: ``result`` (JSON; typed by the call's
    :meth:`Call.result_of` on the receiving end), or ``error`` when it failed."""

    rid: Optional[str]
    result: Any = None
    error: Optional[EngineError] = None


Message = Union[Init, Generate, Cancel, Shutdown, Call, StateMsg, Event, Reply]


def encode(msg: Message) -> str:
    """One line (with its newline) of JSON for ``msg``."""
    if isinstance(msg, Init):
        d: dict[str, Any] = {"op": Op.INIT.value, "settings": msg.settings.model_dump(mode="json"),
                             "model_path": msg.model_path}
    elif isinstance(msg, Generate):
        d = {"op": Op.GENERATE.value, "req": request_to_wire(msg.req)}
    elif isinstance(msg, Cancel):
        d = {"op": Op.CANCEL.value, "id": msg.id}
    elif isinstance(msg, Shutdown):
        d = {"op": Op.SHUTDOWN.value}
    elif isinstance(msg, Call):
        d = {"op": msg.op.value, **msg.to_wire()}
    elif isinstance(msg, StateMsg):
        d = {"op": Op.STATE.value, "state": msg.state}
        if msg.error is not None:
            d.update(error_to_wire(msg.error))
        else:
            d["info"] = msg.info.wire if msg.info is not None else {}
    elif isinstance(msg, Event):
        d = {"op": Op.EVENT.value, "id": msg.id, "type": msg.event.type.value,
             "data": msg.event.to_data()}
    elif isinstance(msg, Reply):
        d = {"op": Op.REPLY.value, "rid": msg.rid}
        if msg.error is not None:
            d["error"] = error_to_wire(msg.error)
        else:
            d["result"] = msg.result
    else:  # pragma: no cover - programming error
        raise TypeError(f"not a pipe message: {msg!r}")
    return json.dumps(d, default=str) + "\n"


def decode(line: str | bytes) -> Optional[Message]:
    """The message of one line, or None for a line that is not one (ignored by both ends)."""
    try:
        d = json.loads(line)
        op = Op(d.get("op"))
    except (ValueError, TypeError, AttributeError):
        return None
    if op is Op.INIT:
        return Init(Settings.model_validate(d["settings"]), d["model_path"])
    if op is Op.GENERATE:
        return Generate(request_from_wire(d["req"]))
    if op is Op.CANCEL:
        return Cancel(d.get("id"))
    if op is Op.SHUTDOWN:
        return Shutdown()
    if op in CALLS:
        return CALLS[op].from_wire(d)
    if op is Op.STATE:
        err = (error_from_wire(d, "model_not_loaded", 503, "load failed")
               if d.get("state") == "error" else None)
        return StateMsg(d.get("state"), ModelFacts.parse(d["info"]) if d.get("info") else None, err)
    if op is Op.EVENT:
        try:
            ev = event_from_data(d["type"], d.get("data"))
        except (KeyError, ValueError) as e:  # never a lost event: the request ends with the error
            ev = ErrorEvent("internal_error", f"the engine sent an event this daemon cannot read: {e}", 500)
        return Event(d.get("id"), ev)
    if op is Op.REPLY:
        return Reply(d.get("rid"), d.get("result"),
                     error_from_wire(d["error"]) if "error" in d else None)
    return None
