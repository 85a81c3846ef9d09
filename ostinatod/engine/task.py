"""A request inside the engine worker (:class:`Task`) and its ``done`` event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .slots import Slot
from .text import StopScanner, Utf8Text
from .events import DoneEvent, EngineEvent, Timings, Usage
from .types import GenRequest

Emit = Callable[[EngineEvent], None]


@dataclass
class Task:
    """A request in the worker: its prompt, sampler, parser and progress."""

    req: GenRequest
    emit: Emit
    t_arrival: float
    prompt: list[int] = field(default_factory=list)
    rendered: Any = None
    parser: Any = None
    sampler: Any = None  # common_sampler * (native shim)
    slot: Optional[Slot] = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: Optional[int] = None  # sampled, not yet in the KV cache
    n_cached: int = 0
    n_gen: int = 0
    stops: StopScanner = field(default_factory=lambda: StopScanner(()))
    text: Utf8Text = field(default_factory=Utf8Text)
    sent: int = 0  # characters of text streamed so far (requests without a chat parser)
    t_prefill_start: float = 0.0
    prefill_passes: int = 0  # forward passes that carried its prompt tokens
    t_first: float = 0.0
    t_last: float = 0.0
    cancelled: bool = False
    finished: bool = False
    special_ids: set = field(default_factory=set)
    stop_sequence: Optional[str] = None  # the client's stop string that ended the output, if any
    demo_cap: Optional[int] = None  # the demo model's output cap (ends the turn as "stop")
    notice_sent: bool = False  # the demo notice went out (first content)
    residency_switch: Optional[dict[str, Any]] = None  # set swapped in right before this request
    residency_skipped: Optional[str] = None  # why its workload's planned set was not swapped in
    t_render: float = 0.0  # when its preparation thread started on it (template_timeout_s)
    # (code, message, status, extra fields) if it cannot be served
    prep_error: Optional[tuple[str, str, int, dict[str, Any]]] = None
    logprobs: list = field(default_factory=list)  # entries of the generated tokens (req.logprobs)
    logprobs_sent: int = 0  # of them, how many went out with a delta

    def done_event(self, reason: Optional[str], message: dict[str, Any], now: float) -> DoneEvent:
        """The ``done`` event of this request: ``finish_reason``, ``message``, ``usage``,
        ``timings`` (s, from the monotonic clock; ``now`` is the end), ``text``, ``slot`` and, with
        ``logprobs``, every token's entry (the worker adds ``prefill``, ``stop_sequence`` and
        ``experts``)."""
        ttft = (self.t_first - self.t_arrival) if self.t_first else None
        tpot = ((self.t_last - self.t_first) / (self.n_gen - 1)) if self.n_gen > 1 else None
        return DoneEvent(
            finish_reason=reason, message=message,
            usage=Usage(prompt_tokens=len(self.prompt), completion_tokens=self.n_gen,
                        cached_tokens=self.n_cached, prefilled_tokens=len(self.prompt) - self.n_cached),
            timings=Timings(ttft_s=ttft, tpot_s=tpot,
                            prefill_s=(self.t_first - self.t_prefill_start) if self.t_first else None,
                            decode_s=(self.t_last - self.t_first) if self.t_first else None,
                            total_s=now - self.t_arrival, queue_s=self.t_prefill_start - self.t_arrival),
            text=self.text.text, slot=self.slot.id if self.slot else None,
            logprobs=self.logprobs if self.req.logprobs is not None else None)
