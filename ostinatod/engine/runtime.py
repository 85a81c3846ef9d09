"""The engine worker's hook into the native expert engine (resident expert pool, split/upload paths).

Use (arXiv 2611.11533, Sections 2-3; docs/design.md "The native engine")::

    rt = ExpertRuntime.prepare(model_path, settings)   # reads the residency set, checks the config
    model = rt.load(path, mparams) if rt else ...      # the patched loader builds the pool
    ctx = llama_init_from_model(model, cparams)
    ... rt.stats(), rt.take_request_stats(), rt.switch(path), rt.close()

``prepare`` returns None (one log line) when the model runs stock: ``settings.experts == "stock"``,
a dense model, or an architecture the engine does not support. Without a residency set the engine
still runs (all experts cold, computed from host memory) so that route counts for the planner's
traces are collected.

The native functions are reached through :mod:`.native` (the one ctypes loader); the placement
(hot experts, pool devices, layer split) is computed by :mod:`.placement` and passed with the
load (:func:`.native.load_model`), never left in the native engine's global config.
"""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path
from typing import Any, Optional

from . import native
from .native import ExpertEngineError
from .options import EngineOptions, cpu_split_choice, prefetch_for, resolve_options, split_fields
from .placement import check_devices, experts_config, full_layer_devices, tensor_split_for

from ..paths import residency_file
from ..residency.sets import ResidencySet, model_block, read_residency

log = logging.getLogger("ostinatod.experts")

# Architectures whose MoE layers the engine splits (up/gate/down or merged gate_up expert tensors;
# expert biases, as in gpt-oss, get per-slot bias rows in the pool). Each is exact against stock on
# the CPU and on the H200 (tests/engine/test_exactness.py, docs/benchmarks/runs/2026-11-30-exactness-h200.txt).
SUPPORTED_ARCHS = ("qwen3moe", "deepseek2", "gpt-oss", "glm4moe", "minimax-m2", "qwen35moe", "deepseek4")


def largest_expert_bytes(model_path: Path) -> Optional[int]:
    """Bytes of the largest expert of the model's MoE layers (``ModelInfo.expert_bytes``; the
    description is cached), or None where the file cannot be described."""
    from ..residency.model import describe_model

    try:
        return max(describe_model(model_path).expert_bytes or [0]) or None
    except Exception:  # noqa: BLE001 - "auto" then keeps the default count
        return None


class ExpertRuntime:
    """One model's expert engine in the worker process (see module docstring)."""

    def __init__(self, model_path: Path, model: dict[str, Any], residency: Optional[ResidencySet],
                 options: EngineOptions, device: int, layer_device: Optional[list[int]] = None):
        self.model_path = Path(model_path)
        self.model = model
        self.residency = residency
        # the engine's options (resolved once by options.resolve_options; changed by reconfigure)
        self.options = options
        # where Np came from: "settings", "calibration", "probe" (measured at a load) or "default"
        self.prefill_threshold_source = "default"
        self.device = device
        # several GPUs: GPU index of every layer (None: one GPU, the pool on `device`)
        self.layer_device = layer_device
        self.tensor_split: Optional[list[float]] = None   # set by adjust_model_params (GPU build)
        self._ts_array: Any = None                         # keeps the ctypes array alive
        self.attached = False
        # CPU threads for decode steps (settings or calibration; None: n_threads), set by prepare
        self.decode_threads: Optional[int] = None
        # the context's threads for batches (prefill): hardware.expert_engine_threads
        self.batch_threads: Optional[int] = None
        # the prefill prefetch depth the settings ask for (each set's pool gets what its plan leaves
        # room for: options.prefetch_depth), set by prepare
        self.prefetch = 0
        # the prefill's CPU/upload split (residency.cost.cpu_split_params, with its threads) and where it came from
        self.cpu_split: Optional[dict[str, float]] = None
        self.cpu_split_source = "no GPU pool"
        # the decode prefetch count and why (options.decode_prefetch_choice), set by prepare
        self.decode_prefetch: dict[str, Any] = {}
        # (one-token, batch) threads of the context, set by the loader; follows_graph: the loader
        # gave one-token steps 1 thread for the decode graph (follow_decode_graph keeps it true)
        self.context_threads: Optional[tuple[int, int]] = None
        self.follows_graph = False
        # the placement passed with the model load (native.load_model), set by prepare
        self.load_config: Optional[dict[str, Any]] = None

    # the options' values under the names the worker and the loader read
    prefill_threshold = property(lambda self: self.options.prefill_threshold, doc="Np (tokens).")
    forced = property(lambda self: self.options.force_path, doc="The forced prefill path, or auto.")
    decode_graph = property(lambda self: self.options.decode_graph,
                            doc="The decode graph served with (None: auto, on where the pool is on a GPU).")
    pool_threads = property(lambda self: self.options.cpu_threads, doc="The decode graph's CPU-branch pool.")
    prefetch_applied = property(lambda self: self.options.prefetch_depth,
                                doc="The prefill prefetch depth of the current set's pool.")

    def reconfigure(self, options: EngineOptions) -> None:
        """Make ``options`` the engine's (:func:`.native.reconfigure` once the model is loaded; before
        that they go with the load). Call between passes. Raises ExpertEngineError when refused."""
        if self.attached:
            native.reconfigure(options)
        self.options = options

    def configure(self, **changes: Any) -> EngineOptions:
        """:meth:`reconfigure` with the options changed by ``changes``; returns the previous options."""
        was = self.options
        self.reconfigure(was.with_(**changes))
        return was

    @classmethod
    def prepare(cls, model_path: Path, settings: Any, *, workload: Optional[str] = None
                ) -> Optional["ExpertRuntime"]:
        """Validate/load the residency set and make the placement config of the model load.

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
        if not native.experts_available():
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
        if residency is not None:
            check_devices(residency.devices, native.gpu_count(), f"{res_path}: ")
        hot = residency.hot_all() if residency else {}
        device = min(residency.hot) if residency and residency.hot else 0
        # a CPU-only build has no GPU device: the pool then lives in a CPU buffer
        dev = device if native.has_gpu() else -1
        # several GPUs: one pool per GPU, each layer's on its GPU (on a CPU build the pools are CPU
        # buffers, one per GPU of the set, so the multi-pool code runs in CI too)
        layer_dev = None
        if residency is not None and len(residency.devices) > 1:
            layer_dev = full_layer_devices(residency, int(model["n_layer"]))
        gpu_pool = dev >= 0 and native.has_gpu()
        res = resolve_options(settings, model, residency, gpu_pool=gpu_pool,
                              expert_bytes=largest_expert_bytes(Path(model_path)))
        opts = res.options
        config = experts_config(hot, device=dev, prefill_threshold=opts.prefill_threshold,
                                layer_device=dict(enumerate(layer_dev)) if layer_dev else None)
        native.check_experts_config(config)
        log.info("experts: %d hot experts from %s, Np = %d (%s)%s", sum(len(v) for v in hot.values()),
                 res_path or "no residency set (all experts cold)", opts.prefill_threshold, res.np_source,
                 f", GPUs {residency.devices}" if layer_dev else "")
        rt = cls(Path(model_path), model, residency, opts, dev, layer_dev)
        rt.prefill_threshold_source = res.np_source
        rt.decode_threads = res.decode_threads
        rt.batch_threads = res.batch_threads
        rt.prefetch = res.prefetch_requested
        rt.cpu_split, rt.cpu_split_source = res.cpu_split, res.cpu_split_source
        rt.decode_prefetch = dict(res.decode_prefetch)
        log.info("experts: decode prefetch %d experts per layer (%s, setting %s: %s)", opts.decode_prefetch_experts,
                 res.decode_prefetch.get("source"), res.decode_prefetch.get("setting"), res.decode_prefetch.get("why"))
        rt._log_split()
        rt.load_config = config
        return rt

    def apply_cpu_split(self, settings: Any) -> None:
        """Set the prefill's CPU/upload split (:func:`.options.cpu_split_choice` at the context's
        prefill thread count) in the engine's options and in :attr:`cpu_split`; on a GPU pool only.
        A non-zero ``upload_cpu_share`` replaces it. Called at the load and after the load probe
        measured the CPU branch."""
        split, source = cpu_split_choice(settings, self.model.get("fingerprint"),
                                         self.device >= 0 and native.has_gpu(), self.batch_threads)
        self.configure(**split_fields(split))
        self.cpu_split, self.cpu_split_source = split, source
        self._log_split()

    def _log_split(self) -> None:
        split = self.cpu_split
        if split:
            log.info("experts: prefill CPU share by the cost model (%s): %.1f us + routes x bytes / %.1f GB/s "
                     "(%d threads) against uploads at %.1f GB/s", self.cpu_split_source, split["alpha_us"],
                     split["cpu_gbps"], split["threads"], split["h2d_gbps"])

    def context_decode_threads(self, threads: int, n_gpu_layers: int, graph: Optional[bool] = None) -> int:
        """Threads of the llama context for one-token steps (``cparams.n_threads``; prefill keeps
        ``threads``).

        1 where the decode graph serves those steps (a GPU build, the pool on a GPU, the graph not
        switched off, every layer offloaded: ``n_gpu_layers`` < 0 or > n_layer): the MoE layers' CPU
        branch then runs on the graph's own pool and the context's CPU work in a step is the token's
        embedding row. A larger count there runs an OpenMP region (llama.cpp builds with
        GGML_OPENMP) per step, whose team, with the pool's, holds more threads than the host has
        CPUs: libgomp then sleeps and wakes them at every barrier (docs/engine.md, "Decode graph",
        threads). Else ``decode_threads`` capped by ``threads``, else ``threads``. ``graph``
        overrides the served setting (calibration's sweep forces it)."""
        n_layer = int(self.model.get("n_layer", 0))
        graph = self.decode_graph if graph is None else graph
        if (graph is not False and self.device >= 0 and native.has_gpu()
                and (n_gpu_layers < 0 or n_gpu_layers > n_layer)):
            return 1
        return min(self.decode_threads, threads) if self.decode_threads else threads

    def follow_decode_graph(self, ctx: Any, request_stats: dict[str, Any]) -> bool:
        """After a request, from its stats (:meth:`take_request_stats`): where the loader gave the
        context's one-token steps 1 thread for the decode graph (:meth:`context_decode_threads`,
        ``context_threads``), keep that count following what ran. One-token steps that ran without
        the graph (its creation failed, a lost wait turned it off, the pool fell back to the CPU)
        get the served count back (``decode_threads`` capped by the batch count, else the batch
        count), so that the split path's CPU branch is not left on one thread; steps in the graph
        again (after a residency switch, which clears a failure) get 1 again. A request without
        one-token steps changes nothing. Returns whether it changed the context; never raises."""
        if not self.context_threads or not self.follows_graph:
            return False
        one, batch = self.context_threads
        paths = request_stats.get("paths") or {}
        steps = int(paths.get("decode") or 0)
        if steps <= 0:
            return False
        in_graph = int(request_stats.get("decode_graph_steps") or 0) > 0
        want = 1 if in_graph else (min(self.decode_threads, batch) if self.decode_threads else batch)
        if want == one:
            return False
        import llama_cpp

        llama_cpp.llama_set_n_threads(ctx, want, batch)
        self.context_threads = (want, batch)
        if in_graph:
            log.info("experts: one-token steps run in the decode graph again: the context's threads "
                     "for them back to 1")
        else:
            log.warning("experts: %d one-token steps ran without the decode graph: they get %d threads "
                        "(see the engine's notes)", steps, want)
        return True

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
        if self.layer_device and native.has_gpu():
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

    def load(self, path: Path, mparams: Any) -> Any:
        """Load the model with this runtime's placement: :meth:`adjust_model_params`, then
        :func:`.native.load_model` with the config :meth:`prepare` made (set for this load only).
        Returns the model pointer (NULL when llama.cpp could not load the file). Raises
        ExpertEngineError with the native error when the loader did not build the pool (the model
        is freed)."""
        self.adjust_model_params(mparams)
        model, active, err = native.load_model(path, mparams, self.load_config, self.options)
        if model and not active:
            import llama_cpp
            llama_cpp.llama_model_free(model)
            raise ExpertEngineError(f"expert engine not active after load: {err or 'unknown'}")
        self.attached = bool(model)
        return model

    def info(self) -> dict[str, Any]:
        """Pool layout: device, bytes, hot experts, size classes, Np, forced path, and ``pools``:
        one entry per device's pool ``{gpu, device, bytes, hot_experts, size_classes, layers,
        upload_stream}`` (``pool_device``, ``pool_bytes`` and ``hot_experts`` are the first pool's
        device name and the totals over all pools)."""
        return native.experts_json("ostinato_experts_info")

    def stats(self, with_counts: bool = False) -> dict[str, Any]:
        """Cumulative counters: passes, tokens, routes, hot_routes, cold_routes, hot_route_share,
        ``pools`` (per device: {gpu, device, bytes, hot_experts}),
        paths {decode, split, upload}, branch times (ms), ``last_passes`` (per-pass dicts) and with
        ``with_counts`` the per (layer, expert) ``counts_prefill``/``counts_decode``."""
        d = native.experts_json("ostinato_experts_stats", 1 if with_counts else 0)
        d["prefill_threshold"] = self.prefill_threshold
        d["prefill_threshold_source"] = self.prefill_threshold_source
        d["prefill_cpu_split"] = {"params": self.cpu_split, "source": self.cpu_split_source}
        d["decode_prefetch_choice"] = {**self.decode_prefetch, "experts": self.options.decode_prefetch_experts}
        return d

    def take_request_stats(self) -> dict[str, Any]:
        """Counters since the previous call (per request, for traces), incl. per (layer, expert)
        ``counts_prefill`` and ``counts_decode`` as [n_layer][n_expert] lists."""
        return native.experts_json("ostinato_experts_take_request_stats")

    def set_prefill_threshold(self, np_tokens: int, source: Optional[str] = None) -> None:
        """Change Np at run time (calibration, the load probe, tests); ``source`` as in
        :attr:`prefill_threshold_source` (kept when None)."""
        self.configure(prefill_threshold=int(np_tokens))
        if source is not None:
            self.prefill_threshold_source = source

    def wants_np_probe(self) -> bool:
        """Whether the worker should measure Np at this load (:func:`.np_probe.probe_np`): nothing
        gave one (no setting, no calibration, no probe of this model) and the pool is on a GPU,
        where the split and upload paths differ (on a CPU build they are the same computation)."""
        return self.prefill_threshold_source == "default" and self.device >= 0 and native.has_gpu()

    def force_path(self, path: str) -> None:
        """Force "split" or "upload" for prefill passes, or "auto"."""
        self.configure(force_path=path)

    def set_timing(self, on: bool) -> None:
        """Timing mode (:attr:`.options.EngineOptions.timing`): GPU-branch times per pass
        (``gpu_branch_ms``) at one GPU sync per MoE layer; for calibration."""
        self.configure(timing=bool(on))

    def set_overlap(self, on: bool) -> None:
        """Decode overlap on or off (:attr:`.options.EngineOptions.decode_overlap`)."""
        self.configure(decode_overlap=bool(on))

    def switch(self, residency_path: Path, res: Optional[ResidencySet] = None) -> float:
        """Swap the residency set at a request boundary (no forward pass may be running: call it
        on the thread that runs the forward passes, between them).

        Reads and validates ``residency_path`` against this model (fingerprint, layer and expert
        ranges; ``res``: the set already read and validated from it, so the file is read once),
        rebuilds the expert pool with its hot experts (route counters are kept) and makes
        the context rebuild its graph. Returns the seconds it took (the file read included when
        ``res`` is not given).
        Raises ResidencyError (unreadable, malformed, or a set for another model) or
        ExpertEngineError (the native engine refused it, e.g. no active engine or no memory for the
        pool); on error the old set stays in use.
        """
        t0 = time.perf_counter()
        if res is None:
            res = read_residency(Path(residency_path), self.model)
        check_devices(res.devices, native.gpu_count(), f"{residency_path}: ")
        hot = res.hot_all()
        layer_dev = None
        if self.layer_device or len(res.devices) > 1:
            # loaded across several GPUs, or a set across several: name every layer's GPU so that
            # the native engine checks it against where the dense weights were loaded
            layer_dev = full_layer_devices(res, int(self.model["n_layer"]))
        options = self.options.with_(prefetch_depth=prefetch_for(self.prefetch, res))   # the pool's layout
        native.experts_switch(experts_config(hot, device=self.device, prefill_threshold=self.prefill_threshold,
                                             force_path=self.forced,
                                             layer_device=dict(enumerate(layer_dev)) if layer_dev else None),
                              options)
        self.residency = res
        self.options = options
        return time.perf_counter() - t0

    def close(self) -> None:
        """Nothing to free: the pool is freed with the model, the loader config is never left set."""
