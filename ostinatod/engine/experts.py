"""The engine worker's hook into the native expert engine (resident expert pool, split/upload paths).

Use (arXiv 2611.11533, Sections 2-3; DESIGN.md "The native engine")::

    rt = ExpertRuntime.prepare(model_path, settings)   # before llama_model_load_from_file
    if rt: rt.adjust_model_params(mparams)              # before the load
    model = llama_model_load_from_file(path, mparams)   # the patched loader builds the pool
    ctx = llama_init_from_model(model, cparams)
    if rt: rt.attach(model, ctx)
    ... rt.stats(), rt.take_request_stats(), rt.switch(path), rt.close()

``prepare`` returns None (one log line) when the model runs stock: ``settings.experts == "stock"``,
a dense model, or an architecture the engine does not support. Without a residency set the engine
still runs (all experts cold, computed from host memory) so that route counts for the planner's
traces are collected.

The native functions live in libllama (they are called by the patched llama.cpp) and are reached
through llama-cpp-python's handle of libllama (no dependency on libostinato).
"""

from __future__ import annotations

import ctypes
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

from ..paths import residency_file
from ..residency.calibration import DEFAULT_NP, decode_choices, prefill_threshold
from ..residency.sets import ResidencyError, ResidencySet, model_block, read_residency

log = logging.getLogger("ostinatod.experts")

# Architectures whose MoE layers the engine splits (separate up/gate/down expert tensors; expert
# biases, as in gpt-oss, get per-slot bias rows in the pool).
SUPPORTED_ARCHS = ("qwen3moe", "deepseek2", "gpt-oss")

_C = ctypes.c_char_p
_SIGS: dict[str, tuple[list[Any], Any]] = {
    "ostinato_experts_configure": ([_C], ctypes.c_int),
    "ostinato_experts_switch": ([_C], ctypes.c_int),
    "ostinato_experts_active": ([], ctypes.c_int),
    "ostinato_experts_last_error": ([], _C),
    "ostinato_experts_set_threshold": ([ctypes.c_int64], ctypes.c_int),
    "ostinato_experts_force_path": ([_C], ctypes.c_int),
    "ostinato_experts_set_timing": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_overlap": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_info": ([], _C),
    "ostinato_experts_stats": ([ctypes.c_int], _C),
    "ostinato_experts_take_request_stats": ([], _C),
    "ostinato_experts_reset_stats": ([], None),
}


class ExpertEngineError(RuntimeError):
    """The native expert engine is missing (stale build) or refused a configuration."""


_bound: dict[str, Any] = {}


def _fn(name: str):
    """The native function ``name``. The expert engine is part of libllama (the patched llama.cpp
    calls it), so it is reached through llama-cpp-python's own handle of that library."""
    f = _bound.get(name)
    if f is not None:
        return f
    try:
        from llama_cpp import llama_cpp as _ll
        f = getattr(_ll._lib, name)
    except ImportError as e:
        raise ExpertEngineError(f"llama_cpp is not importable ({e}); run 'ostinato build'") from e
    except AttributeError:
        raise ExpertEngineError(f"libllama lacks {name}: the native engine was built without "
                                "the expert engine; run 'ostinato build'") from None
    f.argtypes, f.restype = _SIGS[name]
    _bound[name] = f
    return f


def _err() -> str:
    return (_fn("ostinato_experts_last_error")() or b"").decode(errors="replace")


def _json(name: str, *args: Any) -> dict[str, Any]:
    return json.loads(_fn(name)(*args).decode())


def native_available() -> bool:
    """True if the installed native engine has the expert engine (``ostinato build`` done)."""
    try:
        _fn("ostinato_experts_configure")
        return True
    except ExpertEngineError:
        return False


def configure(hot: Optional[dict[int, list[int]]], *, device: int = -1, prefill_threshold: int = 512,
              force_path: str = "auto", layer_device: Optional[dict[int, int]] = None) -> None:
    """Set the process-global config read by the next model load.

    ``hot`` is {layer: hot expert ids}; None clears the config (next loads run stock).
    ``device``: GPU index of the pool (-1: a CPU pool, as on CPU-only builds).
    ``layer_device`` (several GPUs): {layer: GPU index}; one pool per GPU in use, layers not named
    go to ``device``. Empty/None: one pool on ``device`` (the one-GPU config, unchanged). On a GPU
    build the load then fails unless each layer's dense weights sit on its GPU (see
    :func:`tensor_split_for`); on a CPU build every pool is a CPU buffer. Raises ExpertEngineError.
    """
    if hot is None:
        _fn("ostinato_experts_configure")(None)
        return
    cfg = _config_json(hot, device, prefill_threshold, force_path, layer_device)
    if _fn("ostinato_experts_configure")(json.dumps(cfg).encode()) != 0:
        raise ExpertEngineError(_err())


def _config_json(hot: dict[int, list[int]], device: int, prefill_threshold: int, force_path: str,
                 layer_device: Optional[dict[int, int]]) -> dict[str, Any]:
    cfg: dict[str, Any] = {"hot": {str(k): list(map(int, v)) for k, v in hot.items()},
                           "device": int(device), "prefill_threshold": int(prefill_threshold),
                           "force_path": force_path}
    if layer_device:  # absent for a one-GPU config: the native engine then takes today's path
        cfg["layer_device"] = {str(k): int(v) for k, v in sorted(layer_device.items())}
    return cfg


def full_layer_devices(res: ResidencySet, n_layer: int) -> list[int]:
    """GPU index of each layer 0..n_layer-1 for a residency set (from its ``gpus`` entries).

    A layer named by no entry takes the GPU of the layer before it (the first named layer's GPU for
    leading ones). Raises ResidencyError unless the GPUs hold contiguous layer ranges in ascending
    GPU order: that is the only placement llama.cpp's layer split (split_mode LAYER) can give the
    dense weights, and each layer's pool must be on its dense weights' GPU.
    """
    named = res.layer_devices()
    if not named:
        d = res.devices[0] if res.devices else 0
        return [d] * n_layer
    cur = named[min(named)]
    out = []
    for il in range(n_layer):
        cur = named.get(il, cur)
        out.append(cur)
    for il in range(1, n_layer):
        if out[il] < out[il - 1]:
            raise ResidencyError(
                f"{res.path or 'residency set'}: layer {il} is on GPU {out[il]} after layer {il - 1} on "
                f"GPU {out[il - 1]}: each GPU must hold one contiguous layer range, in GPU order "
                "(llama.cpp's layer split); plan the set again with 'ostinato plan'")
    return out


def tensor_split_for(layer_dev: list[int], n_devices: int, n_gpu_layers: int = -1) -> list[float]:
    """llama.cpp ``tensor_split`` (``n_devices`` floats, sum 1) with which its layer split
    (split_mode LAYER) puts layer ``il`` on GPU ``layer_dev[il]`` (the output layer on the last
    GPU that has layers).

    Mirrors ``llama_model::load_tensors``: with ``n_gpu_layers`` g (-1 = all, i.e. n_layer + 1,
    the output counted), layers ``il >= start = max(n_layer + 1 - g, 0)`` go to GPU
    ``upper_bound(cumsum(split) / sum, (il - start) / act)`` with ``act = min(g, n_layer + 1)``;
    layers below ``start`` stay on the CPU (their entry is ignored). Each split point is put half a
    layer before the next GPU's first layer, so float rounding cannot move a boundary. Raises
    ValueError when the layers are not contiguous ranges in ascending GPU order or a GPU index is
    outside ``0..n_devices-1``. :func:`simulate_layer_split` is the check.
    """
    n = len(layer_dev)
    g = n + 1 if n_gpu_layers < 0 else int(n_gpu_layers)
    start, act = max(n + 1 - g, 0), min(g, n + 1)
    gl = list(layer_dev[start:])
    if any(not 0 <= d < n_devices for d in gl):
        raise ValueError(f"layer GPUs {sorted(set(gl))} outside 0..{n_devices - 1}")
    if any(b < a for a, b in zip(gl, gl[1:])):
        raise ValueError("each GPU must hold one contiguous layer range, in GPU order")
    if act <= 0 or not gl:
        return [0.0] * n_devices
    last = gl[-1]
    points = []
    for d in range(n_devices):
        if d >= last:
            points.append(1.0)
            continue
        b = next(i for i, x in enumerate(gl) if x > d)  # first GPU layer (offset) beyond GPU d
        points.append(max(0.0, (b - 0.5) / act))
    return [points[0]] + [points[i] - points[i - 1] for i in range(1, n_devices)]


def simulate_layer_split(tensor_split: list[float], n_layer: int, n_gpu_layers: int = -1) -> list[int]:
    """Device index per layer 0..n_layer (the last entry is the output layer; -1 = CPU) as
    llama.cpp's layer split computes it from ``tensor_split`` (float32, as in C++), for checking
    :func:`tensor_split_for` without GPUs."""
    import bisect

    import numpy as np

    nd = len(tensor_split)
    g = n_layer + 1 if n_gpu_layers < 0 else int(n_gpu_layers)
    start, act = max(n_layer + 1 - g, 0), min(g, n_layer + 1)
    splits = np.zeros(nd, dtype=np.float32)
    acc = np.float32(0)
    for i, x in enumerate(tensor_split):
        acc = np.float32(acc + np.float32(x))
        splits[i] = acc
    splits = [float(x) for x in (splits / acc).astype(np.float32)]
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= act:
            out.append(-1)
        else:
            x = np.float32(il - start) / np.float32(act)
            out.append(min(bisect.bisect_right(splits, float(x)), nd - 1))
    return out


def set_prefill_threshold(np_tokens: int) -> None:
    """Set Np: forward passes of >= Np tokens take the upload path. Raises ValueError if < 1."""
    if _fn("ostinato_experts_set_threshold")(int(np_tokens)) != 0:
        raise ValueError(f"prefill threshold must be >= 1, got {np_tokens}")


def force_path(path: str) -> None:
    """Force prefill passes onto one path: "split", "upload", or "auto" (by Np). Raises ValueError."""
    if _fn("ostinato_experts_force_path")(path.encode()) != 0:
        raise ValueError(f"path must be auto, split or upload, got {path!r}")


def set_timing(on: bool) -> None:
    """Timing mode: GPU-branch times per forward pass (``gpu_branch_ms``, ``gpu_timed``) at the cost
    of one GPU sync per MoE layer. Off while serving (the branches then overlap); on for calibration.
    CPU-branch and upload times are measured in both modes."""
    _fn("ostinato_experts_set_timing")(1 if on else 0)


def set_overlap(on: bool) -> None:
    """Decode overlap on/off (DESIGN.md item 5): with it the CPU branch of a layer runs while the GPU
    branch computes; without it the CPU branch runs first, saving one host round trip per layer.
    Which is faster depends on the machine; ``ostinato calibrate`` measures both."""
    _fn("ostinato_experts_set_overlap")(1 if on else 0)


def _default_np(settings: Any) -> int:
    try:
        return int(prefill_threshold(settings))
    except Exception:  # an unreadable profile: the paper's PCIe 4.0 value
        return DEFAULT_NP


class ExpertRuntime:
    """One model's expert engine in the worker process (see module docstring)."""

    def __init__(self, model_path: Path, model: dict[str, Any], residency: Optional[ResidencySet],
                 prefill_threshold: int, device: int, layer_device: Optional[list[int]] = None):
        self.model_path = Path(model_path)
        self.model = model
        self.residency = residency
        self.prefill_threshold = prefill_threshold
        self.device = device
        # several GPUs: GPU index of every layer (None: one GPU, the pool on `device`)
        self.layer_device = layer_device
        self.tensor_split: Optional[list[float]] = None   # set by adjust_model_params (GPU build)
        self._ts_array: Any = None                         # keeps the ctypes array alive
        self.forced = "auto"
        self.attached = False
        # CPU threads for decode steps (settings or calibration; None: n_threads), set by prepare
        self.decode_threads: Optional[int] = None

    @classmethod
    def prepare(cls, model_path: Path, settings: Any, *, workload: Optional[str] = None
                ) -> Optional["ExpertRuntime"]:
        """Validate/load the residency set and configure the native loader, before the model load.

        Returns None (logging one line) when the model runs stock. Raises ResidencyError for a
        residency set that is malformed or belongs to another model, ExpertEngineError when the
        native engine lacks the expert engine while ``settings.experts == "ostinato"``.
        """
        mode = getattr(settings, "experts", "auto")
        if mode == "stock":
            log.info("experts: stock llama.cpp placement (settings.experts = 'stock')")
            return None
        model = model_block(Path(model_path))
        if model["n_expert"] <= 0:
            log.info("experts: %s is a dense model (no routed experts): running stock", model["arch"])
            return None
        if model["arch"] not in SUPPORTED_ARCHS:
            log.info("experts: architecture %s is not supported by the expert engine yet: running "
                     "stock", model["arch"])
            return None
        if not native_available():
            if mode == "ostinato":
                raise ExpertEngineError("the installed native engine has no expert engine; run "
                                        "'ostinato build'")
            log.warning("experts: native expert engine not built: running stock")
            return None
        res_path = getattr(settings, "residency", None)
        if res_path is None:
            wl = workload or getattr(settings, "workload_default", "coding")
            cand = residency_file(model["fingerprint"], wl)
            res_path = cand if cand.exists() else None
        residency = read_residency(Path(res_path), model) if res_path else None
        hot = residency.hot_all() if residency else {}
        device = min(residency.hot) if residency and residency.hot else 0
        # a CPU-only build has no GPU device: the pool then lives in a CPU buffer
        dev = device if _has_gpu() else -1
        # several GPUs: one pool per GPU, each layer's on its GPU (on a CPU build the pools are CPU
        # buffers, one per GPU of the set, so the multi-pool code runs in CI too)
        layer_dev = None
        if residency is not None and len(residency.devices) > 1:
            layer_dev = full_layer_devices(residency, int(model["n_layer"]))
        np_tokens = _default_np(settings)
        configure(hot, device=dev, prefill_threshold=np_tokens,
                  layer_device=dict(enumerate(layer_dev)) if layer_dev else None)
        overlap, decode_threads = decode_choices(settings)
        set_overlap(overlap)
        log.info("experts: %d hot experts from %s, Np = %d%s", sum(len(v) for v in hot.values()),
                 res_path or "no residency set (all experts cold)", np_tokens,
                 f", GPUs {residency.devices}" if layer_dev else "")
        rt = cls(Path(model_path), model, residency, np_tokens, dev, layer_dev)
        rt.decode_threads = decode_threads
        return rt

    def adjust_model_params(self, mparams: Any) -> None:
        """Set fields of ``llama_model_params`` (ctypes struct) before the load.

        Turns off the CPU's repacked weight buffers: the CPU branch skips hot routes in ggml-cpu's
        generic mul_mat_id, which repacked weights bypass. (Routed experts are kept in host memory
        by the patched loader itself while a config is set: no tensor overrides needed.)

        Several GPUs (a residency set with more than one ``gpus`` entry) on a GPU build: sets
        ``split_mode`` = LLAMA_SPLIT_MODE_LAYER and ``tensor_split`` (llama_max_devices() floats,
        see :func:`tensor_split_for`, computed with ``mparams.n_gpu_layers``) so that each layer's
        dense weights and KV cache land on the GPU of its pool; the native engine checks this at
        load. Raises ExpertEngineError when the set names a GPU index llama.cpp cannot address.
        A one-GPU set leaves the split untouched.
        """
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = False
        if self.layer_device and _has_gpu():
            import llama_cpp
            n_dev = int(llama_cpp.llama_max_devices())
            try:
                ts = tensor_split_for(self.layer_device, n_dev, int(mparams.n_gpu_layers))
            except ValueError as e:
                raise ExpertEngineError(f"cannot place the residency set's layers with llama.cpp's "
                                        f"layer split: {e}") from e
            self._ts_array = (ctypes.c_float * n_dev)(*ts)
            mparams.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
            mparams.tensor_split = ctypes.cast(self._ts_array, ctypes.POINTER(ctypes.c_float))
            self.tensor_split = ts
            log.info("experts: layer split over GPUs %s, tensor_split %s",
                     sorted(set(self.layer_device)), [round(x, 4) for x in ts if x])

    def attach(self, model: Any, ctx: Any) -> None:
        """Check, after the context exists, that the patched loader built the pool. Raises
        ExpertEngineError with the native error when it did not."""
        # the loader config is consumed: a later load in this process (another model, a
        # vocab-only load) must not pick it up; Np and the forced path live on
        active, err = _fn("ostinato_experts_active")(), _err()
        configure(None)
        if not active:
            raise ExpertEngineError(f"expert engine not active after load: {err or 'unknown'}")
        self.attached = True

    def info(self) -> dict[str, Any]:
        """Pool layout: device, bytes, hot experts, size classes, Np, forced path, and ``pools``:
        one entry per device's pool ``{gpu, device, bytes, hot_experts, size_classes, layers,
        upload_stream}`` (``pool_device``, ``pool_bytes`` and ``hot_experts`` are the first pool's
        device name and the totals over all pools)."""
        return _json("ostinato_experts_info")

    def stats(self, with_counts: bool = False) -> dict[str, Any]:
        """Cumulative counters: passes, tokens, routes, hot_routes, cold_routes, hot_route_share,
        ``pools`` (per device: {gpu, device, bytes, hot_experts}),
        paths {decode, split, upload}, branch times (ms), ``last_passes`` (per-pass dicts) and with
        ``with_counts`` the per (layer, expert) ``counts_prefill``/``counts_decode``."""
        d = _json("ostinato_experts_stats", 1 if with_counts else 0)
        d["prefill_threshold"] = self.prefill_threshold
        return d

    def take_request_stats(self) -> dict[str, Any]:
        """Counters since the previous call (per request, for traces), incl. per (layer, expert)
        ``counts_prefill`` and ``counts_decode`` as [n_layer][n_expert] lists."""
        return _json("ostinato_experts_take_request_stats")

    def set_prefill_threshold(self, np_tokens: int) -> None:
        """Change Np at run time (calibration / tests)."""
        set_prefill_threshold(np_tokens)
        self.prefill_threshold = int(np_tokens)

    def force_path(self, path: str) -> None:
        """Force "split" or "upload" for prefill passes, or "auto"."""
        force_path(path)
        self.forced = path

    def set_timing(self, on: bool) -> None:
        """See :func:`set_timing`."""
        set_timing(on)

    def set_overlap(self, on: bool) -> None:
        """See :func:`set_overlap`."""
        set_overlap(on)

    def switch(self, residency_path: Path) -> float:
        """Swap the residency set at a request boundary (no forward pass may be running: call it
        on the thread that runs the forward passes, between them).

        Reads and validates ``residency_path`` against this model (fingerprint, layer and expert
        ranges), rebuilds the expert pool with its hot experts (route counters are kept) and makes
        the context rebuild its graph. Returns the seconds it took (file read included).
        Raises ResidencyError (unreadable, malformed, or a set for another model) or
        ExpertEngineError (the native engine refused it, e.g. no active engine or no memory for the
        pool); on error the old set stays in use.
        """
        t0 = time.perf_counter()
        res = read_residency(Path(residency_path), self.model)
        hot = res.hot_all()
        layer_dev = None
        if self.layer_device or len(res.devices) > 1:
            # loaded across several GPUs, or a set across several: name every layer's GPU so that
            # the native engine checks it against where the dense weights were loaded
            layer_dev = full_layer_devices(res, int(self.model["n_layer"]))
        cfg = _config_json(hot, self.device, self.prefill_threshold, self.forced,
                           dict(enumerate(layer_dev)) if layer_dev else None)
        try:
            if _fn("ostinato_experts_switch")(json.dumps(cfg).encode()) != 0:
                raise ExpertEngineError(_err())
        finally:
            # the switch goes through the loader config: clear it, so that a later model load in
            # this process does not pick it up (as attach does after the load)
            configure(None)
        self.residency = res
        return time.perf_counter() - t0

    def close(self) -> None:
        """Clear the loader config (the pool itself is freed with the model)."""
        try:
            configure(None)
        except ExpertEngineError:
            pass


def _has_gpu() -> bool:
    try:
        import llama_cpp
        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:
        return False


__all__ = ["ExpertRuntime", "ExpertEngineError", "ResidencyError", "SUPPORTED_ARCHS", "configure",
           "force_path", "set_prefill_threshold", "native_available"]
