"""The prefill threshold Np measured at a model load (the "load probe"), and the timed forward passes
it shares with the calibration (:mod:`.calibrate`).

Without a setting, a calibration or an earlier probe of the model, a GPU engine would serve with the
paper's Np of 512 (PCIe 4.0, Sec. 3.3); where the host-to-GPU link is faster or the CPU branch slower
the paths cross far lower (16 tokens on the H200 host: docs/benchmarks), and every prefill below 512
tokens (most prefills after a tool output) would pay the CPU branch. The probe measures the two paths
on the served model and pool in about a second (Prop. 3.2: they cross once).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import numpy as np

from ..hardware import default_threads
from ..residency.calibration import DEFAULT_NP
from ..residency.cost import CalibrationError, PrefillPoint, fit_cpu_bandwidth, measured_switch_point
from . import native

log = logging.getLogger("ostinatod.engine")


class Passes:
    """Timed forward passes of random tokens on sequence 0 of a loaded Worker's context (the
    calibration's and the load probe's measurements). ``decode(tokens, pos0)`` returns the wall
    time of ``llama_decode`` + synchronize in ms and raises CalibrationError when it fails."""

    def __init__(self, w: Any, n_max: int, seed: int = 0):
        import llama_cpp  # lazy: the native engine, loaded only where it runs

        self._llama, self.w = llama_cpp, w
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(w.vocab))
        self.rng = np.random.default_rng(seed)
        self.mem = llama_cpp.llama_get_memory(w.ctx)
        self.batch = llama_cpp.llama_batch_init(n_max, 0, 1)

    def decode(self, tokens: Sequence[int], pos0: int) -> float:
        b, llama_cpp = self.batch, self._llama
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if i == len(tokens) - 1 else 0
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self.w.ctx, b)
        llama_cpp.llama_synchronize(self.w.ctx)
        ms = (time.perf_counter() - t0) * 1e3
        if rc != 0:
            raise CalibrationError(f"llama_decode returned {rc}")
        return ms

    def toks(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(100, max(101, self.n_vocab - 300), size=n)]

    def clear(self) -> None:
        self._llama.llama_memory_clear(self.mem, True)

    def free(self) -> None:
        if self.batch is not None:
            self._llama.llama_batch_free(self.batch)
            self.batch = None


PROBE_SIZES = (16, 64, 256)   # token counts of the load probe's passes (after-tool prefills: ~100-1000)


def probe_np(w: Any, sizes: Sequence[int] = PROBE_SIZES) -> dict[str, Any]:
    """Np measured on the served model at its load (no calibration for it yet): one forced
    split-path and one forced upload-path pass of each of ``sizes`` tokens (after a warm-up pass
    per path), Np = the measured switch point of the two
    (:func:`..residency.cost.measured_switch_point`; Prop. 3.2 says the paths cross once), or 512
    when the upload path is not cheaper at any size (the crossing lies beyond them).

    ``w``: a loaded :class:`.worker.Worker` whose expert runtime is active, before it serves (its
    context's memory is cleared afterwards, the native counters reset so that the probe's routes
    reach neither the traces nor the served statistics, the path back on auto). Takes ~1 s on the
    48-layer 30B shape. Returns ``{"np_tokens", "points": [PrefillPoint as dicts], "seconds"}``.
    Raises CalibrationError when a pass fails or the context's batch is smaller than a size.
    """
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    t0 = time.monotonic()
    # one pass per size: within the context's ubatch (a larger pass would be several forward passes)
    n_batch = min(int(llama_cpp.llama_n_batch(w.ctx)), int(llama_cpp.llama_n_ubatch(w.ctx)))
    sizes = sorted({int(n) for n in sizes if 0 < int(n) <= n_batch})
    if len(sizes) < 2:
        raise CalibrationError(f"the context's ubatch ({n_batch} tokens) is too small to probe Np")
    passes = Passes(w, max(sizes), seed=1)
    points: list[PrefillPoint] = []
    try:
        for path_name in ("split", "upload"):
            w.rt.force_path(path_name)
            passes.clear()
            passes.decode(passes.toks(sizes[0]), 0)   # warm-up: allocations, the staging buffers
            for n in sizes:
                passes.clear()
                w.rt.take_request_stats()
                ms = passes.decode(passes.toks(n), 0)
                st = w.rt.take_request_stats()
                points.append(PrefillPoint(n, path_name, ms, float(st.get("distinct_cold_experts", 0)),
                                           float(st.get("cold_routes", 0))))
    finally:
        w.rt.force_path("auto")
        passes.clear()
        passes.free()
        native.llama_fn("ostinato_experts_reset_stats")()   # the totals and the per-request counters
    measured = measured_switch_point(points)
    return {"np_tokens": int(measured) if measured is not None else DEFAULT_NP,
            "points": [vars(p) for p in points], "cpu_branch_bandwidth": _cpu_branch(w),
            "seconds": round(time.monotonic() - t0, 3)}


def _cpu_branch(w: Any) -> list[dict[str, Any]]:
    """The CPU branch's kernel at the prefill's thread count on this model's experts
    (:func:`cpu_branch_bandwidth`): what the prefill's CPU/upload split needs
    (:func:`..residency.calibration.cpu_split_inputs`). [] when it cannot be measured (logged)."""
    threads = w.rt.batch_threads or w.settings.n_threads or default_threads(getattr(w.settings, "cpu_set", None))
    try:
        return cpu_branch_bandwidth(w, counts=[int(threads)])
    except Exception as e:  # noqa: BLE001 - Np is still worth serving with
        log.warning("experts: CPU-branch bandwidth not measured at load: %s", e)
        return []


def cpu_branch_bandwidth(w: Any, counts: Optional[Sequence[int]] = None) -> list[dict[str, Any]]:
    """The CPU branch's own kernel alone on the served model's experts (its first MoE layer, as the
    engine holds them in host memory), decode-like: 1 token, 1-8 cold experts, per thread count (1, a
    quarter, half, all but one and all of the cores; or ``counts``). Per count: the fixed cost and bandwidth of
    ``ms = alpha + bytes / bw`` (:func:`ostinatod.residency.cost.fit_cpu_bandwidth`, paper Sec. 3.2)
    and the host's read bandwidth at that count, measured in the same call
    (``native.cpu_branch_bench``). Returns [{"threads", "alpha_us", "bw_gbps", "host_read_gbps"}];
    [] when the engine cannot run it (logged)."""
    p = int(w.settings.n_threads or default_threads(getattr(w.settings, "cpu_set", None)))
    counts = sorted({int(c) for c in counts} if counts else {1, max(1, p // 4), max(1, p // 2), max(1, p - 1), p})
    try:
        res = native.cpu_branch_bench(w.model, {"experts": [1, 2, 4, 8], "tokens": [1], "threads": counts,
                                                "reps": 8, "ggml": False, "read_bw_bytes": 512 << 20})
    except native.ExpertEngineError as e:
        log.warning("CPU-branch bandwidth not measured: %s", e)
        return []
    read = {int(b["threads"]): float(b["gbps"]) for b in res.get("read_bw", [])}
    out = []
    for t in counts:
        f = fit_cpu_bandwidth([r for r in res["rows"] if int(r["threads"]) == t])
        if f:
            out.append({"threads": t, "alpha_us": round(f["alpha_us"], 2), "bw_gbps": round(f["bw_gbps"], 2),
                        "host_read_gbps": round(read[t], 2) if t in read else None})
    return out
