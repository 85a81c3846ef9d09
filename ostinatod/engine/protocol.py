"""The worker pipe: typed messages between the daemon (:class:`~.client.SubprocessEngine`) and the
engine worker process (:mod:`.worker_main`), one JSON object per line.

Parent -> worker: :class:`Init` (first line), then :class:`Generate`, :class:`Cancel`,
:class:`Call` (``count_tokens``, ``stats``, ``flush_traces``, ``switch_residency``, ``tokenize``,
``detokenize``, ``apply_template``; answered by a
:class:`Reply` with the same ``rid``; a switch is answered once the loop has swapped the set, at
the next request boundary) and :class:`Shutdown`.
Worker -> parent: :class:`StateMsg` (``ready`` with the model info, or ``error``), :class:`Event`
(one :class:`~.types.EngineEvent` of request ``id``) and :class:`Reply`.

Both ends use :func:`encode` and :func:`decode`; the op names live only in :class:`Op`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Optional, Union

from .types import EngineError, EngineEvent, EventType, GenRequest


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


CALL_OPS = (Op.COUNT_TOKENS, Op.STATS, Op.FLUSH_TRACES, Op.SWITCH_RESIDENCY, Op.PING, Op.TOKENIZE,
            Op.DETOKENIZE, Op.APPLY_TEMPLATE)


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
    settings: dict[str, Any]
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
    """A call answered by a :class:`Reply`: ``req`` for count_tokens and apply_template,
    ``path``/``reason`` for switch_residency, ``args`` for tokenize and detokenize."""

    op: Op
    rid: str
    req: Optional[GenRequest] = None
    path: Optional[str] = None
    reason: Optional[str] = None
    args: Optional[dict[str, Any]] = None


@dataclass
class StateMsg:
    """``state`` "ready" (with ``info``) or "error" (with ``error``)."""

    state: str
    info: dict[str, Any] = field(default_factory=dict)
    error: Optional[EngineError] = None


@dataclass
class Event:
    id: str
    event: EngineEvent


@dataclass
class Reply:
    """The answer to a :class:`Call`: ``result``, or ``error`` when it failed."""

    rid: Optional[str]
    result: Any = None
    error: Optional[EngineError] = None


Message = Union[Init, Generate, Cancel, Shutdown, Call, StateMsg, Event, Reply]


def encode(msg: Message) -> str:
    """One line (with its newline) of JSON for ``msg``."""
    if isinstance(msg, Init):
        d: dict[str, Any] = {"op": Op.INIT.value, "settings": msg.settings, "model_path": msg.model_path}
    elif isinstance(msg, Generate):
        d = {"op": Op.GENERATE.value, "req": request_to_wire(msg.req)}
    elif isinstance(msg, Cancel):
        d = {"op": Op.CANCEL.value, "id": msg.id}
    elif isinstance(msg, Shutdown):
        d = {"op": Op.SHUTDOWN.value}
    elif isinstance(msg, Call):
        d = {"op": Op(msg.op).value, "rid": msg.rid}
        if msg.req is not None:
            d["req"] = request_to_wire(msg.req)
        if msg.path is not None:
            d["path"], d["reason"] = msg.path, msg.reason
        if msg.args is not None:
            d["args"] = msg.args
    elif isinstance(msg, StateMsg):
        d = {"op": Op.STATE.value, "state": msg.state}
        if msg.error is not None:
            d.update(error_to_wire(msg.error))
        else:
            d["info"] = msg.info
    elif isinstance(msg, Event):
        d = {"op": Op.EVENT.value, "id": msg.id, "type": EventType(msg.event.type).value,
             "data": msg.event.data}
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
        return Init(d["settings"], d["model_path"])
    if op is Op.GENERATE:
        return Generate(request_from_wire(d["req"]))
    if op is Op.CANCEL:
        return Cancel(d.get("id"))
    if op is Op.SHUTDOWN:
        return Shutdown()
    if op in CALL_OPS:
        return Call(op, d.get("rid"), request_from_wire(d["req"]) if d.get("req") else None,
                    d.get("path"), d.get("reason"), d.get("args"))
    if op is Op.STATE:
        err = (error_from_wire(d, "model_not_loaded", 503, "load failed")
               if d.get("state") == "error" else None)
        return StateMsg(d.get("state"), d.get("info") or {}, err)
    if op is Op.EVENT:
        return Event(d.get("id"), EngineEvent(EventType(d["type"]), d.get("data") or {}))
    if op is Op.REPLY:
        return Reply(d.get("rid"), d.get("result"),
                     error_from_wire(d["error"]) if "error" in d else None)
    return None
