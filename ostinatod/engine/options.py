"""The expert engine's options: one typed, immutable value resolved once per load.

:class:`EngineOptions` holds every tuning value of the native engine. Its first fields are the
user's, taken as they are from the ``[engine]`` settings table (:class:`..settings.EngineTuning`,
whose defaults are declared there once); the rest are resolved at the load from the settings, the
calibration and the hardware by :func:`resolve_options`. The native struct
``ostinato_engine_options`` (native/include/ostinato.h) mirrors it field by field, in this order:
:func:`c_struct` generates its ctypes Structure from the fields, so the field list exists once on
the Python side. ``native.load_model`` passes it with the load, ``native.reconfigure`` changes it
between passes (the native side decides what a change rebuilds).

Adding an option: a field here (or in :class:`..settings.EngineTuning` when the user sets it), the
same field in the C struct, and its use (docs/architecture.md, "Adding an engine option").
"""

from __future__ import annotations

import ctypes
import logging
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..settings import EngineTuning

log = logging.getLogger("ostinatod.experts")

FORCE_PATHS = ("auto", "split", "upload")
ROW_PAIRS = ("off", "avx2", "avx512")


class EngineOptions(EngineTuning):
    """The engine's tuning (the user's [engine] fields first, see :class:`..settings.EngineTuning`).
    Immutable: change it with :meth:`with_`, which validates. Defaults are the served ones; the
    native library's own defaults (what a load without options gets) are
    :func:`ostinatod.engine.native.library_options`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the setting's "auto" is resolved to a count (resolve_options, decode_prefetch_choice); same place
    decode_prefetch_experts: int = Field(2, ge=0, le=16, description="Decode prefetch: predicted cold "
                                         "experts a layer stages for the next one (0 off).")
    prefill_threshold: int = Field(512, ge=1, json_schema_extra={"c": "int64"},
                                   description="Np (tokens): forward passes of at least Np tokens take the "
                                   "upload path (docs/engine.md, \"Np\").")
    force_path: Literal["auto", "split", "upload"] = Field("auto", description="Prefill passes on one "
                                                            "path (measurements), or auto (by Np).")
    timing: bool = Field(False, description="Timing mode: GPU-branch times per pass at the cost of one "
                         "sync per MoE layer (calibration).")
    decode_overlap: bool = Field(True, description="Decode overlap: a layer's CPU branch runs while its "
                                 "GPU branch computes; false: first, one host round trip fewer.")
    decode_graph: Optional[bool] = Field(None, description="Decode graph: None on when a pool is on a "
                                         "GPU, True also on a CPU build (tests), False off.")
    decode_graph_max_tokens: int = Field(64, ge=1, le=4096, description="Largest pass (tokens) that "
                                         "takes the decode graph.")
    cpu_threads: int = Field(0, ge=0, description="Threads of the decode graph's CPU-branch pool (and "
                             "the hybrid pass's share); 0: the physical cores, estimated.")
    pool_views: bool = Field(True, description="Per-layer pool views for split and upload passes of "
                             "9 tokens or more (docs/engine.md, \"Pool views\"); off for measurements.")
    resident_path: bool = Field(True, description="All-resident layers compute as stock over their "
                                "pool slots (docs/engine.md); off for measurements.")
    hybrid_rows: int = Field(64, ge=1, le=4096, description="Most tokens the CPU branch of a hybrid "
                             "upload pass takes.")
    cpu_split_alpha_us: float = Field(0.0, ge=0, allow_inf_nan=False, description="The prefill's "
                                      "cost-model split: the CPU branch's fixed cost per layer (us).")
    cpu_split_cpu_gbps: float = Field(0.0, ge=0, allow_inf_nan=False, description="Its CPU-branch "
                                      "bandwidth (GB/s) at the prefill's threads; 0 with h2d: off.")
    cpu_split_h2d_gbps: float = Field(0.0, ge=0, allow_inf_nan=False, description="Its pinned "
                                      "host->GPU bandwidth (GB/s).")
    prefetch_depth: int = Field(0, ge=0, le=2, description="Prefill prefetch depth of the pool (0 off; "
                                "the pool gets depth + 1 staging regions; read at its build).")

    @model_validator(mode="after")
    def _split_both_or_none(self) -> "EngineOptions":
        if (self.cpu_split_cpu_gbps > 0) != (self.cpu_split_h2d_gbps > 0):
            raise ValueError("cpu_split_cpu_gbps and cpu_split_h2d_gbps: both > 0 (the split on) or both 0")
        return self

    def with_(self, **changes: Any) -> "EngineOptions":
        """A validated copy with ``changes`` (ValueError naming the field for a bad value)."""
        return type(self).model_validate({**self.model_dump(), **changes})

    @property
    def cpu_split(self) -> Optional[dict[str, float]]:
        """The cost-model split as {"alpha_us", "cpu_gbps", "h2d_gbps"}, or None when off."""
        if self.cpu_split_cpu_gbps > 0 and self.cpu_split_h2d_gbps > 0:
            return {"alpha_us": self.cpu_split_alpha_us, "cpu_gbps": self.cpu_split_cpu_gbps,
                    "h2d_gbps": self.cpu_split_h2d_gbps}
        return None


def split_fields(split: Optional[dict[str, float]]) -> dict[str, float]:
    """The cpu_split_* fields of a split dict (:func:`..residency.cost.cpu_split_params`; None: off)."""
    if not split:
        return {"cpu_split_alpha_us": 0.0, "cpu_split_cpu_gbps": 0.0, "cpu_split_h2d_gbps": 0.0}
    return {"cpu_split_alpha_us": float(split["alpha_us"]), "cpu_split_cpu_gbps": float(split["cpu_gbps"]),
            "cpu_split_h2d_gbps": float(split["h2d_gbps"])}


# --- the C mirror ------------------------------------------------------------------------------

def _codec(name: str, field: Any) -> tuple[Any, Any, Any]:
    """(ctypes type, to C, from C) of a field, from its annotation: bool -> int32 0/1, Optional[bool]
    -> int32 -1 (None)/0/1, Literal -> int32 index, int -> int32 (int64 where marked), float -> double."""
    ann = field.annotation
    if ann is bool:
        return ctypes.c_int32, lambda v: 1 if v else 0, lambda x: bool(x)
    if ann == Optional[bool]:
        return ctypes.c_int32, lambda v: -1 if v is None else int(bool(v)), lambda x: None if x < 0 else bool(x)
    if typing.get_origin(ann) is Literal:
        values = typing.get_args(ann)
        return ctypes.c_int32, values.index, lambda x: values[x]
    if ann is int:
        wide = (field.json_schema_extra or {}).get("c") == "int64"
        return (ctypes.c_int64 if wide else ctypes.c_int32), int, int
    if ann is float:
        return ctypes.c_double, float, float
    raise TypeError(f"EngineOptions.{name}: no C form for {ann!r}")


_CODECS = {name: _codec(name, f) for name, f in EngineOptions.model_fields.items()}


class EngineOptionsC(ctypes.Structure):
    """``struct ostinato_engine_options``, generated from :class:`EngineOptions`' fields."""

    _fields_ = [(name, c[0]) for name, c in _CODECS.items()]


def c_struct(options: EngineOptions) -> EngineOptionsC:
    """The C struct of ``options``."""
    return EngineOptionsC(**{name: c[1](getattr(options, name)) for name, c in _CODECS.items()})


def from_c(st: EngineOptionsC) -> EngineOptions:
    """The EngineOptions of a C struct (ValueError when it holds values outside the fields' ranges)."""
    return EngineOptions.model_validate({name: c[2](getattr(st, name)) for name, c in _CODECS.items()})


# --- resolution --------------------------------------------------------------------------------

class ResolvedOptions(BaseModel):
    """What :func:`resolve_options` gives: the options and where their resolved values came from."""

    model_config = ConfigDict(frozen=True)

    options: EngineOptions
    np_source: str = "default"          # "settings", "calibration", "probe" or "default"
    decode_threads: Optional[int] = None   # one-token steps' CPU threads (settings/calibration; None: n_threads)
    batch_threads: Optional[int] = None    # the context's threads for batches (None: the loader's)
    prefetch_requested: int = 0         # the settings' prefill prefetch depth (the pool gets what its set allows)
    cpu_split: Optional[dict[str, float]] = None   # residency.cost.cpu_split_params (with "threads"), or None
    cpu_split_source: str = "no GPU pool"
    # the decode prefetch count (options.decode_prefetch_experts) and why: decode_prefetch_choice
    decode_prefetch: dict[str, Any] = {}


def engine_settings(settings: Any) -> Any:
    """The [engine] part of ``settings`` (``settings.engine``), or ``settings`` itself for an object
    without one (tests pass namespaces with the engine fields)."""
    return getattr(settings, "engine", settings)


def np_choice(settings: Any, fingerprint: Optional[str]) -> tuple[int, str]:
    """Np and its source (:func:`..residency.calibration.prefill_threshold_choice`); an unreadable
    profile gives the paper's PCIe 4.0 value, ``"default"``."""
    from ..residency.calibration import DEFAULT_NP, prefill_threshold_choice

    try:
        return prefill_threshold_choice(settings, model_fingerprint=fingerprint)
    except Exception:  # noqa: BLE001 - an unreadable profile
        return DEFAULT_NP, "default"


def prefetch_for(depth: int, residency: Any) -> int:
    """The prefill prefetch depth for a pool of ``residency``: ``depth`` (the settings'; 0 = off),
    less where the set was planned to the GPU's memory without room for its staging regions
    (:func:`..residency.planner.prefetch_room`; logged: re-plan to get it)."""
    from ..residency.planner import prefetch_room

    if depth <= 0 or residency is None:
        return max(0, depth)
    room = prefetch_room(residency.raw.get("plan") or {}, depth)
    if room < depth:
        log.info("experts: prefill prefetch depth %d instead of %d for the residency set %s: it was "
                 "planned to the GPU memory with %s staging region(s) (re-plan with `ostinato plan` "
                 "for %d)", room, depth, residency.path or "(unnamed)",
                 (residency.raw.get("plan") or {}).get("staging_regions", 1), depth + 1)
    return room


def thread_counts(settings: Any, decode_threads: Optional[int], graph: Optional[bool], gpu_pool: bool
                  ) -> tuple[Optional[int], int]:
    """(the context's batch threads or None, the decode graph's CPU-branch pool threads): together no
    more than the cores unless set (:func:`..hardware.expert_engine_threads`) where the graph can run
    (a pool on a GPU, ``gpu_pool``, the graph not off); else the context keeps every core and the
    pool takes ``decode_threads``, else n_threads, else all cores but one."""
    from ..hardware import default_threads, expert_engine_threads

    n_threads, cpu_set = getattr(settings, "n_threads", None), getattr(settings, "cpu_set", None)
    if graph is not False and gpu_pool:
        return expert_engine_threads(n_threads, decode_threads, cpu_set,
                                     kernel=engine_settings(settings).cpu_branch_kernel)
    return None, decode_threads or n_threads or max(1, default_threads(cpu_set) - 1)


def cpu_split_choice(settings: Any, fingerprint: Optional[str], gpu_pool: bool, threads: Optional[int]
                     ) -> tuple[Optional[dict[str, float]], str]:
    """The prefill's CPU/upload split and its source: :func:`..residency.cost.cpu_split_params` of
    :func:`..residency.calibration.cpu_split_inputs` at ``threads`` (the context's prefill threads;
    None: n_threads, else the cores), on a GPU pool only (on a CPU pool an "upload" is a memcpy). A
    non-zero ``upload_cpu_share`` replaces it (source "upload_cpu_share")."""
    from ..hardware import default_threads
    from ..residency.calibration import cpu_split_inputs
    from ..residency.cost import cpu_split_params

    eng = engine_settings(settings)
    if getattr(eng, "upload_cpu_share", 0.0):
        return None, "upload_cpu_share"
    if not gpu_pool:
        return None, "no GPU pool"
    threads = threads or getattr(settings, "n_threads", None) or default_threads(getattr(settings, "cpu_set", None))
    rows, h2d, source = cpu_split_inputs(eng, model_fingerprint=fingerprint)
    split = cpu_split_params(rows, int(threads), h2d) if rows else None
    if split is None and source in ("calibration", "probe"):
        source = "not calibrated"
    return split, source


DECODE_PREFETCH_DEFAULT = 2   # the measured default, kept where "auto" has no calibration


def decode_prefetch_choice(setting: Any, fingerprint: Optional[str], gpu_pool: bool,
                           expert_bytes: Optional[int], path: Any = None) -> dict[str, Any]:
    """The decode prefetch count per layer for the setting ``decode_prefetch_experts``: a number as
    it is (source "settings"); "auto": :func:`..residency.cost.decode_prefetch_count` (the most
    experts whose copies, w / B each plus the chain's fixed cost, fit in G, the GPU time of a layer)
    of ``expert_bytes`` (the largest expert of the model's MoE layers) and the calibration's G and
    pinned bandwidth (:func:`..residency.calibration.decode_prefetch_inputs`, source "calibration"),
    else :data:`DECODE_PREFETCH_DEFAULT` with the reason as source. Returns ``{"experts", "setting",
    "source", "why"}`` plus, when computed, ``{"expert_bytes", "h2d_gbps", "gpu_layer_ms",
    "copy_us", "chain_us"}`` (the engine's log and stats()["decode_prefetch_choice"])."""
    from ..residency.calibration import decode_prefetch_inputs
    from ..residency.cost import decode_prefetch_count

    if setting != "auto":
        return {"experts": int(setting), "setting": setting, "source": "settings", "why": "set"}
    base = {"experts": DECODE_PREFETCH_DEFAULT, "setting": "auto"}
    if not gpu_pool:
        return {**base, "source": "no GPU pool", "why": "auto needs a GPU pool: the default count"}
    if not expert_bytes:
        return {**base, "source": "no expert size", "why": "the model's expert size is unknown: the default count"}
    g_ms, h2d, source = decode_prefetch_inputs(path, model_fingerprint=fingerprint)
    if g_ms is None or h2d is None:
        return {**base, "source": source, "why": f"{source}: the default count ('ostinato calibrate' measures G)"}
    r = decode_prefetch_count(int(expert_bytes), h2d, g_ms)
    why = (f"{r['chain_us']:.0f} us + n x {r['copy_us']:.0f} us ({int(expert_bytes) / 1e6:.1f} MB / "
           f"{h2d:.1f} GB/s) <= G {r['window_us']:.0f} us")
    return {**base, "experts": r["experts"], "source": source, "why": why, "expert_bytes": int(expert_bytes),
            "h2d_gbps": h2d, "gpu_layer_ms": g_ms, "copy_us": r["copy_us"], "chain_us": r["chain_us"]}


def resolve_options(settings: Any, model: dict[str, Any], residency: Any = None, *, gpu_pool: bool,
                    expert_bytes: Optional[int] = None) -> ResolvedOptions:
    """The engine's options for a load of ``model`` (its GGUF block: fingerprint) with ``residency``
    (a :class:`..residency.sets.ResidencySet` or None), once: the [engine] settings as they are, Np
    (settings, calibration, probe, default), decode overlap, threads and graph (settings, else the
    calibration), the thread counts of the context and of the decode graph's pool, the prefill
    prefetch depth the set's plan leaves room for, the prefill's CPU split and the decode prefetch
    count (:func:`decode_prefetch_choice`; ``expert_bytes``: the largest expert of the model's MoE
    layers, for "auto"). ``gpu_pool``: the pool is on a GPU (a GPU build, not a CPU pool). Reads the stored calibration; raises nothing for
    a missing or unreadable one."""
    from ..residency.calibration import decode_choices, decode_graph_choice
    from ..residency.planner import prefetch_depth_setting

    eng = engine_settings(settings)
    fp = model.get("fingerprint")
    np_tokens, np_source = np_choice(settings, fp)
    overlap, decode_threads = decode_choices(eng)
    graph = decode_graph_choice(eng)
    batch_threads, pool_threads = thread_counts(settings, decode_threads, graph, gpu_pool)
    requested = prefetch_depth_setting(eng)
    split, split_source = cpu_split_choice(settings, fp, gpu_pool, batch_threads)
    dpf = decode_prefetch_choice(eng.decode_prefetch_experts, fp, gpu_pool, expert_bytes)
    tuning = {name: getattr(eng, name) for name in EngineTuning.model_fields}
    tuning["decode_prefetch_experts"] = dpf["experts"]
    opts = EngineOptions(**tuning, prefill_threshold=np_tokens, decode_overlap=overlap, decode_graph=graph,
                         cpu_threads=pool_threads, prefetch_depth=prefetch_for(requested, residency),
                         **split_fields(split))
    return ResolvedOptions(options=opts, np_source=np_source, decode_threads=decode_threads,
                           batch_threads=batch_threads, prefetch_requested=requested, cpu_split=split,
                           cpu_split_source=split_source, decode_prefetch=dpf)
