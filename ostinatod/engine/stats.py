"""Typed engine stats, loop progress and model facts, parsed once where they cross the worker pipe.

The worker builds its stats from its own counters and the native expert engine's JSON
(``ostinato_experts_stats``, merged under ``experts`` with the active residency set); the daemon
parses them here (:meth:`EngineStats.parse`, in :class:`.protocol.GetStats`) and its readers
(``control/snapshots.py``, ``server/metrics.py``, ``/slots``, the control API's status and
residency) use the fields. A key that the engine stops producing or renames fails the parse (and
``tests/unit/test_engine_stats.py``, which feeds a stored CPU run's JSON through it), not a reader.

Each model keeps the JSON object it was parsed from (:attr:`StatsModel.wire`): what goes out
unchanged (the control API's ``engine`` figures, /metrics' flattened counters) is that object, so
its keys and their order are the engine's.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator


class StatsModel(BaseModel):
    """A model parsed from a JSON object that keeps that object (``wire``). Keys it does not
    name are kept as extras (the engine's detail figures: timelines, per-pass lists, ...)."""

    model_config = ConfigDict(extra="allow")
    _wire: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def parse(cls, raw: Any):
        """The model of ``raw`` (a JSON object). Raises pydantic.ValidationError for a missing
        required key or a value of the wrong type."""
        m = cls.model_validate(raw)
        m._wire = dict(raw)
        return m

    @property
    def wire(self) -> dict[str, Any]:
        """The JSON object this was parsed from (its keys in the engine's order)."""
        return self._wire


class PoolStats(StatsModel):
    """One expert pool (a GPU): its bytes and hot experts; the routes it served (native stats
    only; the residency set's pool list has no route figures)."""

    gpu: int
    device: str
    bytes: int
    hot_experts: int
    routes: Optional[int] = None
    hot_routes: Optional[int] = None
    hot_route_share: Optional[float] = None


# keys the native engine's stats always has while the expert engine is active
_NATIVE_KEYS = ("passes", "tokens", "routes", "hot_routes", "cold_routes", "hot_route_share", "paths",
                "decode_graph")


class ExpertStats(StatsModel):
    """The expert runtime's figures as the worker embeds them under ``experts``: the native
    counters (``active`` true; ``ExpertRuntime.stats``) and the active residency set
    (:meth:`.switcher.ResidencySwitcher.state`: ``workload``, ``residency`` (its path),
    ``hot_experts``, ``pool_bytes``, ``pools``, ``switches``, ``last_switch``, ``auto_switch``,
    ``prefill``); ``error`` when the native stats call failed."""

    active: bool = False
    error: Optional[str] = None
    passes: Optional[int] = None
    tokens: Optional[int] = None
    routes: Optional[int] = None
    hot_routes: Optional[int] = None
    cold_routes: Optional[int] = None
    hot_route_share: Optional[float] = None
    paths: dict[str, int] = {}
    decode_graph: Optional[dict[str, Any]] = None
    pools: Optional[list[PoolStats]] = None
    # the residency set (switcher.state())
    workload: Optional[str]
    residency: Optional[str]
    hot_experts: Optional[int]
    pool_bytes: Optional[int]
    switches: int
    last_switch: Optional[dict[str, Any]]
    auto_switch: bool
    prefill: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _native_keys(self) -> "ExpertStats":
        if self.active:
            missing = [k for k in _NATIVE_KEYS if k not in self.model_fields_set]
            if missing:
                raise ValueError(f"the native engine's stats lack {missing}")
        return self


class SlotStats(StatsModel):
    """One KV slot: tokens in its cache, whether a request holds it, when it was last used
    (monotonic seconds of the worker)."""

    id: int
    n_tokens: int
    busy: bool
    last_used: float


class StepTiming(StatsModel):
    """The wall-clock parts of the worker loop's steps, cumulative since load
    (:meth:`.step_timing.StepClock.snapshot`; every engine, stock llama.cpp included): counts, and
    sums in ms over the decode steps (``decode_*``) and the prefill passes (``prefill_*``) of the
    forward pass's wall (``*_wall_ms``: a step's start to the next's), the ``llama_decode`` call with
    the wait for its logits (``*_call_ms``, of it ``*_wait_ms``), sampling (``*_sample_ms``) and the
    tokens' way out (``*_out_ms``, of it ``*_pipe_ms``: writing the delta events)."""

    decode_steps: int
    decode_tokens: int
    decode_wall_ms: float
    decode_call_ms: float
    decode_wait_ms: float
    decode_sample_ms: float
    decode_out_ms: float
    decode_pipe_ms: float
    prefill_passes: int
    prefill_tokens: int
    prefill_sampled: int
    prefill_wall_ms: float
    prefill_call_ms: float
    prefill_wait_ms: float
    prefill_sample_ms: float
    prefill_out_ms: float
    prefill_pipe_ms: float
    steps_before_idle: int


class EngineStats(StatsModel):
    """``EngineClient.stats()``: the worker's counters (cumulative since load), its slots, the host
    and disk prefix caches, requests waiting and active, the prefill step (``ubatch``: ``{"tokens",
    "reason"}``), the steps' wall-clock parts (``step_timing``, :class:`StepTiming`), the expert
    figures (None: stock llama.cpp) and, added by the client, the engine
    ``state`` and worker ``restarts``. An engine that is not ready has only those two
    (:meth:`not_ready`; its counters read 0)."""

    requests: int = 0
    requests_ok: int = 0
    requests_error: int = 0
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    decode_calls: int = 0
    busy_slot_steps: int = 0
    slot_checkpoints: int = 0
    checkpoint_rewinds: int = 0
    slots: list[SlotStats] = []
    host_cache: Optional[dict[str, Any]] = None
    disk_cache: Optional[dict[str, Any]] = None
    waiting: int = 0
    active: int = 0
    ubatch: Optional[dict[str, Any]] = None
    step_timing: Optional[StepTiming] = None
    experts: Optional[ExpertStats] = None
    state: Optional[str] = None
    restarts: Optional[int] = None

    @model_validator(mode="before")
    @classmethod
    def _worker_keys(cls, d: Any) -> Any:
        # a worker's stats (not the short form of an engine that is not ready) has every counter
        if isinstance(d, dict) and set(d) - {"state", "restarts"}:
            missing = [k for k in WORKER_KEYS if k not in d]
            if missing:
                raise ValueError(f"the worker's stats lack {missing}")
        return d

    @classmethod
    def not_ready(cls, state: str, restarts: Optional[int] = None) -> "EngineStats":
        """The stats of an engine that is not serving: ``{"state"[, "restarts"]}``."""
        raw: dict[str, Any] = {"state": state}
        if restarts is not None:
            raw["restarts"] = restarts
        return cls.parse(raw)

    def with_state(self, state: str, restarts: Optional[int] = None) -> "EngineStats":
        """These stats with the client's ``state`` (and ``restarts``) added."""
        raw = dict(self.wire, state=state)
        if restarts is not None:
            raw["restarts"] = restarts
        return EngineStats.parse(raw)


WORKER_KEYS = ("requests", "requests_ok", "requests_error", "requests_cancelled", "prompt_tokens",
               "cached_tokens", "prefilled_tokens", "generated_tokens", "decode_calls",
               "busy_slot_steps", "slot_checkpoints", "checkpoint_rewinds", "slots", "waiting",
               "active", "ubatch", "step_timing")


class LoopBusy(StatsModel):
    """The native call the worker's loop is inside: ``what`` ("forward pass" | "sampling"),
    seconds in it so far, the ids of the requests in it."""

    what: str
    for_s: float
    requests: list[str]


class LoopProgress(StatsModel):
    """The answer to a liveness ping (:meth:`.worker.Worker.progress`): forward passes so far and
    the native call running now (None between calls)."""

    steps: int
    busy: Optional[LoopBusy]


class ModelFacts(StatsModel):
    """The loaded model's facts (:func:`.loading.model_facts`; ``EngineClient.info``): name, path,
    architecture, the context per slot served (``n_ctx``) and why it is below the setting,
    parameters, vocabulary, expert shape, ``experts_mode`` ("ostinato" | "stock"), slots, the
    chat template's source and capabilities, special tokens, FIM support, file type."""

    name: str
    path: str
    arch: Optional[str]
    n_ctx: int
    n_ctx_reason: Optional[str]
    n_ctx_train: Optional[int]
    n_params: Optional[int]
    n_vocab: Optional[int]
    size_bytes: Optional[int]
    is_demo: bool
    n_expert: int
    n_expert_used: int
    n_layer: int
    experts_mode: str
    n_slots: int
    supports_thinking: bool
    max_piece_bytes: int
    chat_template_caps: dict[str, Any]
    chat_template: str
    bos_token: str
    eos_token: str
    eog_tokens: list[int]
    infill: bool
    ftype: str
