"""The one internal request type and the events an engine streams back.

Protocol adapters (OpenAI chat/completions, Responses, Anthropic Messages) translate their payloads
into :class:`GenRequest` and the :class:`EngineEvent` stream back into their wire format. Everything
here is plain data because it crosses the pipe to the engine worker subprocess
(:mod:`.protocol`).

Messages use the OpenAI chat shape, which is also what llama.cpp's ``common/chat`` accepts:
``{"role": "system"|"user"|"assistant"|"tool", "content": str | [parts], "tool_calls": [...],
"tool_call_id": str, "reasoning_content": str}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Protocol

if TYPE_CHECKING:
    from .stats import EngineStats

from ..errors import OstinatoError


@dataclass
class GenRequest:
    """One generation request, protocol-neutral.

    Either ``messages`` (chat; rendered with the model's chat template) or ``prompt`` (raw text,
    /v1/completions) is set. ``max_tokens`` counts output tokens (0: the prompt is only
    prefilled into the KV cache). ``ignore_eos`` makes the engine generate exactly ``max_tokens``
    tokens (used by the replay benchmark).
    """

    id: str
    messages: Optional[list[dict[str, Any]]] = None
    prompt: Optional[str] = None
    # a raw prompt of token ids and texts in order (llama-server's /completion forms ``[12, 34]`` and
    # ``[12, "text", 34]``), instead of ``prompt``
    prompt_tokens: Optional[list[Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type":"function","function":{"name"}}
    parallel_tool_calls: bool = True
    max_tokens: int = 4096
    # sampling; None: the setting of the same name (Settings.temperature, ...: the one default)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    enable_thinking: Optional[bool] = None
    json_schema: Optional[dict[str, Any]] = None  # response_format json_schema, if any
    logit_bias: Optional[dict[int, float]] = None  # token id -> bias added to its logit (OpenAI logit_bias)
    # None: no log-probabilities; n >= 0: each output token's, with its n most likely alternatives
    # (OpenAI logprobs/top_logprobs; :mod:`.logprobs`)
    logprobs: Optional[int] = None
    # GBNF the output must match (llama-server's ``grammar``); checked by llama.cpp's grammar parser
    # before the request is served (:mod:`.grammar`), in force from the first output token
    grammar: Optional[str] = None
    # fill-in-the-middle (llama-server's /infill): {"input_prefix", "input_suffix", "input_extra":
    # [{"filename", "text"}], "prompt"}; the prompt is built from the vocabulary's FIM tokens
    # (:mod:`.infill`) instead of ``prompt`` or ``messages``
    infill: Optional[dict[str, Any]] = None
    # stream "progress" events while the prompt is prefilled (llama-server's ``return_progress``)
    return_progress: bool = False
    workload: Optional[str] = None
    client: Optional[str] = None  # e.g. "claude-code", "openai-python": for stats and workload
    model: Optional[str] = None  # the name the client asked for (echoed back)
    # what the adapter could not honour (a tool left out, ...): logged and shown by `ostinato ps`
    warnings: list[str] = field(default_factory=list)
    # served by the generated demo model: the engine ends the turn early (settings demo_max_tokens,
    # demo_end_bias) and the answer starts with DEMO_NOTICE
    demo: bool = False
    # the client forced a call (tool_choice "required" or named): nothing may precede it
    forced_by_client: bool = False

    def says_demo_notice(self) -> bool:
        """True when the answer starts with :data:`DEMO_NOTICE`: served by the demo model, not a
        JSON answer (``json_schema``), whose content must stay JSON, and not a call the client
        forced (no text precedes a forced call)."""
        return self.demo and self.json_schema is None and self.grammar is None and not self.forced_by_client


DEMO_NOTICE = "[Ostinato demo model: random weights, the words that follow mean nothing] "

# the events of a stream, typed (one class per event type): :mod:`.events`
from .events import (EVENT_CLASSES, TERMINAL, DeltaEvent, DoneEvent, EngineEvent,  # noqa: E402,F401
                     ErrorEvent, EventType, PingEvent, ProgressEvent, StartEvent, event_from_data)


class EngineError(OstinatoError):
    """A request the engine cannot serve. ``status`` is the HTTP status the front end should use;
    ``extra``: further fields of the error answer (``n_prompt_tokens``, ``n_ctx`` of a context
    overflow)."""

    def __init__(self, code: str, message: str, status: int = 400,
                 extra: Optional[dict[str, Any]] = None):
        super().__init__(code, message, status, extra)


class EngineClient(Protocol):
    """What the HTTP front end and control API need from an engine (in-process or subprocess).

    ``state`` is one of "stopped", "loading", "ready", "error", "restarting", "stalled" (a worker
    process not answering pings, about to be restarted).
    """

    state: str

    async def start(self) -> None:
        """Start the worker and load the model (returns once loading has begun)."""

    async def stop(self) -> None:
        """Stop the worker; in-flight requests end with an ``error`` event."""

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the model is loaded. Raises EngineError if loading failed."""

    def generate(self, req: GenRequest) -> AsyncIterator[EngineEvent]:
        """Stream events for ``req``; never raises for model output, errors arrive as events."""

    async def count_tokens(self, req: GenRequest) -> int:
        """Tokens of the rendered prompt of ``req`` (chat template applied)."""

    async def tokenize(self, content: Any, add_special: bool = False, parse_special: bool = True,
                       with_pieces: bool = False) -> list[Any]:
        """Token ids of ``content`` (a string, or strings and ids mixed; llama-server's /tokenize),
        or ``[{"id", "piece"}]`` with ``with_pieces``."""

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (llama-server's /detokenize)."""

    async def apply_template(self, req: GenRequest) -> str:
        """The prompt text the chat template makes of ``req`` (llama-server's /apply-template)."""

    async def info(self) -> dict[str, Any]:
        """Loaded model: {"name", "path", "arch", "n_ctx" (served per slot), "n_ctx_reason" (why it is
        below the setting), "n_ctx_train", "n_params", "is_demo", "n_expert", "n_expert_used",
        "n_layer", "experts_mode", "chat_template" (its source), "bos_token", "eos_token",
        "eog_tokens" (ids of the end-of-generation tokens), "infill" (the vocabulary has FIM
        tokens), "ftype" (llama.cpp's name of the file type), ...}."""

    async def stats(self) -> "EngineStats":
        """Engine counters: slots, requests, tokens, expert-path counts and hot-route share, parsed
        once from the worker's JSON (:class:`.stats.EngineStats`)."""

    async def switch_residency(self, path: Any, reason: str = "control") -> dict[str, Any]:
        """Swap the residency set to the file ``path`` at the next request boundary; returns the
        swap's facts (``seconds``, ``workload``, ``hot_experts``, ``pool_bytes``, ...). Raises
        EngineError (409 ``residency_unavailable``, 400 ``residency_refused``, ...)."""

    async def flush_traces(self) -> None:
        """Write the routing counts recorded so far to the trace files."""
