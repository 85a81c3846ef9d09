"""Calibration of the cost model and of the prefill threshold Np (``ostinato calibrate``).

Cost model of the paper (arXiv 2611.11533, Section 2-3 and Appendix B), per MoE layer:

* CPU branch of a decode step with r cold routes: ``C(0) = gamma0``, ``C(r) = alpha + beta * r``
  for r >= 1 (Section 3.2; calibration in Appendix B, "Calibration").
* GPU branch ``G`` (fixed: zero slots keep it at k experts), pinned host->GPU bandwidth ``B``.
* Prefill: the split path costs ``a_s + c_s n`` and the upload path ``a_u + c_u n + phi2 u(n)`` for
  an n-token forward pass with u(n) distinct cold experts. Their difference
  ``Phi(n) = phi0 + phi1 n - phi2 u(n)`` (phi0 = a_s - a_u < 0, phi1 = c_s - c_u > 0, phi2 = w/B the
  time to upload one expert) is convex because u is concave (Lemma B.3), so the paths switch once
  (Proposition 3.2): ``Np = min{n : Phi(n) >= 0}``.

Measurement runs forward passes through the real engine (our native expert paths) with forced
paths: decode steps under residency sets of several sizes (per-layer cold routes r_l are known
exactly from the per-step route counts and the hot set), and prefill passes of several sizes on the
split and on the upload path. Fits are ordinary least squares (numpy). The result is stored under
``"calibration"`` in the hardware profile (read-modify-write; other keys are kept).

On a machine without a GPU the calibration still runs: the CPU-branch terms are measured, the GPU
terms (G, B, Np) are absent and the result says so (the engine then uses Np from settings or 512).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..hardware import apply_cpu_placement, default_threads
from ..paths import get_paths
from ..residency.calibration import CALIBRATION_FORMAT, h2d_from_profile, store_calibration
from ..residency.cost import CalibrationError, PrefillPoint, solve_calibration
from . import native
from ..residency.planner import read_model_shape
from ..residency.sets import make_residency, write_residency
from ..residency.traces import Trace
from ..settings import load_settings
from .worker import Worker
from .np_probe import Passes, cpu_branch_bandwidth

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Measurement through the engine
# --------------------------------------------------------------------------------------------

def _default_model() -> Optional[Path]:
    try:
        m = load_settings().model
        if m and Path(m).is_file():
            return Path(m)
    except Exception:  # a broken settings file must not stop the profile code
        pass
    models = get_paths().models_dir
    cands = sorted(models.glob("*demo*.gguf")) + sorted(models.glob("*.gguf")) if models.is_dir() else []
    return cands[0] if cands else None


def _hot_sets(block: dict[str, Any], fracs: Sequence[float]) -> list[tuple[float, dict[int, list[int]]]]:
    """Hot sets keeping ``frac`` of each layer's experts: the most routed ones when a trace of this
    model exists (any workload), else the lowest ids. Returns [(frac, {layer: ids})]."""
    counts = None
    tdir = get_paths().traces_dir / block["fingerprint"]
    for p in sorted(tdir.glob("*.json")) if tdir.is_dir() else []:
        try:
            c = Trace.load(p).counts
            counts = c if counts is None else counts + c
        except Exception:  # noqa: BLE001 - a bad trace only loses the better ranking
            continue
    n_l, n_e = int(block["n_layer"]), int(block["n_expert"])
    out = []
    for f in fracs:
        k = max(1, min(n_e, int(round(f * n_e))))
        hot = {}
        for l in range(n_l):
            order = (np.argsort(-counts[l], kind="stable") if counts is not None else np.arange(n_e))
            hot[l] = sorted(int(e) for e in order[:k])
        out.append((float(f), hot))
    return out


def measure(model_path: Path, *, decode_steps: int = 24, prefill_sizes: Sequence[int] = (),
            hot_fracs: Sequence[float] = (0.25, 0.5, 0.75, 1.0), repeats: int = 2,
            n_threads: Optional[int] = None, progress=None) -> dict[str, Any]:
    """Run forced-path forward passes through the native expert engine; return raw measurements.

    The model is loaded once by the engine worker's loader (:class:`ostinatod.engine.worker.Worker`,
    so the expert runtime is set up exactly as when serving) and driven with ``llama_decode``:
    for each hot fraction, ``decode_steps`` one-token steps (per-layer cold routes from the step's
    route counts and the hot set), then prefill passes of each size on the split and on the upload
    path (``force_path``), ``repeats`` times, timed around ``llama_decode``.
    Returns {"decode_rows", "gpu_ms_per_layer", "prefill": [PrefillPoint], "gpu", "decode_sweep",
    "cpu_placement" (the CPUs it ran on: hardware.apply_cpu_placement), "expert_bytes",
    "model"}. Raises CalibrationError when the engine or the model cannot be used.
    """
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    say = progress or (lambda s: None)
    block = read_model_shape(model_path).model_block()
    if block["n_expert"] <= 0:
        raise CalibrationError(f"{model_path} is a dense model: nothing to calibrate")
    sets = _hot_sets(block, hot_fracs)
    tmp = Path(tempfile.mkdtemp(prefix="ostinato-calib-"))
    paths = []
    for f, hot in sets:
        paths.append(write_residency(make_residency(block, hot, workload="calibration"),
                                     tmp / f"hot-{f:.2f}.json"))
    n_max = max([32, *prefill_sizes])
    s = load_settings(model=model_path, experts="ostinato", residency=paths[0], n_slots=1,
                      n_ctx=max(512, n_max + decode_steps + 64), n_batch=n_max, n_ubatch=max(32, n_max),
                      n_threads=n_threads, engine_mode="inprocess",
                      cache_disk_mb=0)   # every measured prefill computes (no earlier run's disk cache)

    place = apply_cpu_placement(s.cpu_set)   # measured on the CPUs the engine worker will run on
    w = Worker(s, model_path)
    w.load(probe_np=False)
    try:
        if w.rt is None:
            raise CalibrationError("the expert engine is not active for this model (stock run)")
        info = w.rt.info() if hasattr(w.rt, "info") else {}
        gpu = native.has_gpu()
        n_moe = int(info.get("moe_layers") or block["n_layer"])
        passes = Passes(w, n_max)
        decode, toks, mem = passes.decode, passes.toks, passes.mem
        # timing mode: GPU-branch times (one sync per layer; off again when serving); the
        # all-resident path (every layer of the 100% set) has no route op and so no timing marks:
        # the rows time the route op's path, which is what partly hot layers take
        w.rt.configure(timing=True, resident_path=False)
        # timing mode runs one-token steps on the split path: their CPU branch on the context's
        # threads, as served without the graph (the loader gave them 1 where the graph serves)
        n_ctx_threads = int(w.rt.batch_threads or s.n_threads or default_threads(s.cpu_set))
        llama_cpp.llama_set_n_threads(w.ctx, w.rt.context_decode_threads(n_ctx_threads, -1, graph=False),
                                      n_ctx_threads)
        rows: list[tuple[int, int, int, float]] = []
        gpu_ms: list[float] = []
        prefill: list[PrefillPoint] = []
        try:
            for (f, hot), path in zip(sets, paths):
                if path != paths[0]:
                    w.rt.switch(path)
                cold_mask = np.ones((block["n_layer"], block["n_expert"]), bool)
                for l, ids in hot.items():
                    cold_mask[l, ids] = False
                llama_cpp.llama_memory_clear(mem, True)
                decode(toks(16), 0)
                for step in range(3):  # warm-up: first passes pay one-time costs
                    decode(toks(1), 16 + step)
                w.rt.take_request_stats()
                for step in range(3, decode_steps + 3):
                    decode(toks(1), 16 + step)
                    st = w.rt.take_request_stats()
                    # a one-token pass is a decode step; count both kinds in case the engine
                    # files it under prefill
                    cd = sum(np.asarray(st.get(k) or np.zeros_like(cold_mask), np.int64)
                             for k in ("counts_decode", "counts_prefill"))
                    r = (cd * cold_mask).sum(axis=1)
                    n1 = int((r > 0).sum())
                    rows.append((n_moe - n1, n1, int(r.sum()), float(st.get("cpu_branch_ms", 0.0))))
                    if gpu:
                        gpu_ms.append(float(st.get("gpu_branch_ms", 0.0)) / n_moe)
                say(f"calibration: decode with {f:.0%} hot experts: {decode_steps} steps")
            w.rt.configure(timing=False, resident_path=True)   # serving conditions for the decode sweep
            sweep = decode_sweep(w, paths[len(paths) // 2], decode, toks, steps=max(8, decode_steps // 2))
            say(f"calibration: decode overlap x threads: {len(sweep)} settings")
            cpu_bw = cpu_branch_bandwidth(w)
            say(f"calibration: CPU-branch bandwidth at {len(cpu_bw)} thread counts")
            if prefill_sizes:
                mid = paths[len(paths) // 2]
                w.rt.switch(mid)
                for path_name in ("split", "upload"):
                    w.rt.force_path(path_name)
                    llama_cpp.llama_memory_clear(mem, True)
                    decode(toks(min(prefill_sizes)), 0)  # warm-up (allocations, staging buffer)
                    for n in prefill_sizes:
                        for _ in range(repeats):
                            llama_cpp.llama_memory_clear(mem, True)
                            w.rt.take_request_stats()
                            ms = decode(toks(n), 0)
                            st = w.rt.take_request_stats()
                            prefill.append(PrefillPoint(int(n), path_name, ms,
                                                        float(st.get("distinct_cold_experts", 0)),
                                                        float(st.get("cold_routes", 0))))
                    say(f"calibration: prefill on the {path_name} path: sizes {list(prefill_sizes)}")
                w.rt.force_path("auto")
        finally:
            w.rt.configure(timing=False, resident_path=True)
            passes.free()
        exp_bytes = info.get("expert_bytes")
        if isinstance(exp_bytes, list):
            exp_bytes = max(exp_bytes) if exp_bytes else None
        return {"decode_rows": rows, "gpu_ms_per_layer": gpu_ms, "prefill": prefill, "gpu": gpu,
                "decode_sweep": sweep, "cpu_branch_bandwidth": cpu_bw,
                "cpu_placement": {k: place.get(k) for k in ("cpulist", "threads", "pin", "reason")},
                "expert_bytes": exp_bytes, "model": {k: block[k] for k in ("fingerprint", "name")}}
    finally:
        w.close()


def decode_sweep(w: Any, residency_path: Path, decode, toks, *, steps: int = 16) -> list[dict[str, Any]]:
    """Median one-token decode step (ms, llama_decode + sync) for each way to run a decode step, x CPU
    thread counts (all physical cores, half, a quarter), with ``residency_path`` active and timing
    mode off: on a GPU build the decode graph (its CPU-branch pool sized to the count), then the
    split path with decode overlap on and off (the context's threads set to the count).

    ``w``: the calibration's loaded Worker; ``decode(tokens, pos0) -> ms`` and ``toks(n)`` as in
    :func:`measure`. Restores the decode graph to auto, overlap on and the thread counts. Returns
    [{"graph", "overlap", "threads", "median_ms"}] ("overlap" is None for graph rows).
    """
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    p = int(w.settings.n_threads or default_threads(getattr(w.settings, "cpu_set", None)))
    # every core but one: the default of the CPU branch's own kernel (hardware.expert_engine_threads)
    counts = sorted({max(1, p // 4), max(1, p // 2), max(1, p - 1), p})
    w.rt.switch(residency_path)
    served_pool = w.rt.pool_threads
    mem = llama_cpp.llama_get_memory(w.ctx)
    out: list[dict[str, Any]] = []

    def step_ms() -> float:
        llama_cpp.llama_memory_clear(mem, True)
        decode(toks(16), 0)
        return float(np.median([decode(toks(1), 16 + i) for i in range(steps + 3)][3:]))  # 3 warm-ups

    settings = ([(True, None)] if native.has_gpu() else []) + [(False, True), (False, False)]
    try:
        for graph, overlap in settings:
            w.rt.configure(decode_graph=graph, **({} if overlap is None else {"decode_overlap": overlap}))
            for n in counts:
                if graph:
                    w.rt.configure(cpu_threads=n)   # the graph's CPU-branch pool is made anew with n threads
                    # the context as served with the graph (ExpertRuntime.context_decode_threads)
                    llama_cpp.llama_set_n_threads(w.ctx, w.rt.context_decode_threads(n, -1, graph=True), p)
                else:
                    llama_cpp.llama_set_n_threads(w.ctx, n, p)
                out.append({"graph": graph, "overlap": overlap, "threads": n, "median_ms": step_ms()})
    finally:
        # decode graph auto, overlap on, the served thread counts (hardware.expert_engine_threads,
        # the loader's context)
        w.rt.configure(decode_graph=None, cpu_threads=served_pool or max(1, p - 1), decode_overlap=True)
        llama_cpp.llama_set_n_threads(w.ctx, *(w.rt.context_threads or (p, p)))
    return out


def best_decode(sweep: Sequence[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The fastest entry of :func:`decode_sweep`'s result (None when empty)."""
    return min(sweep, key=lambda r: r["median_ms"]) if sweep else None


def run_calibration(model_path: Optional[Path] = None, *, profile_path: Optional[Path] = None,
                    quick: bool = True, progress=None) -> dict[str, Any]:
    """Measure, fit and store the calibration; never raises (the profile code calls it).

    ``model_path`` defaults to settings.model, else a GGUF in the models dir (the demo model).
    Returns the calibration dict as stored; on failure {"error": message, ...} (also stored, so
    the profile shows why) unless nothing could be attempted.
    """
    t0 = time.monotonic()
    model_path = Path(model_path) if model_path else _default_model()
    if model_path is None:
        msg = "no model to calibrate with (set a model or start the daemon once for the demo model)"
        log.warning("calibration skipped: %s", msg)
        return {"format": CALIBRATION_FORMAT, "error": msg}
    try:
        m = measure(model_path, decode_steps=12 if quick else 48,
                    prefill_sizes=(32, 128, 512) if quick else (16, 64, 128, 256, 512, 1024, 2048),
                    repeats=1 if quick else 3, progress=progress)
        cal = solve_calibration(m["decode_rows"], m["gpu_ms_per_layer"], m["prefill"],
                                gpu=m["gpu"], expert_bytes=m.get("expert_bytes"),
                                h2d_gbps=h2d_from_profile(profile_path))
        best = best_decode(m.get("decode_sweep") or [])
        if best is not None:
            cal["decode_graph"] = bool(best.get("graph")) if any(r.get("graph") for r in m["decode_sweep"]) else None
            cal["decode_overlap"] = True if best.get("overlap") is None else bool(best["overlap"])
            cal["decode_threads"] = int(best["threads"])
            cal["decode_step_ms"] = best["median_ms"]
            cal["decode_sweep"] = m["decode_sweep"]
        cal["measurements"] = {"decode_steps": len(m["decode_rows"]),
                               "prefill_passes": len(m["prefill"]),
                               "prefill": [vars(p) for p in m["prefill"]]}
        cal["model"] = m.get("model")
        cal["cpu_placement"] = m.get("cpu_placement")   # the decode threads are counts on these CPUs
        if m.get("cpu_branch_bandwidth"):
            cal["cpu_branch_bandwidth"] = m["cpu_branch_bandwidth"]
    except Exception as e:  # noqa: BLE001 - reported in the profile instead of crashing the caller
        log.warning("calibration failed: %s", e)
        cal = {"format": CALIBRATION_FORMAT, "error": f"{type(e).__name__}: {e}",
               "model": {"path": str(model_path)}}
    cal["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    cal["seconds"] = round(time.monotonic() - t0, 2)
    store_calibration(cal, profile_path)
    return cal


def format_calibration(cal: dict[str, Any]) -> str:
    """Human-readable summary of a calibration dict."""
    if cal.get("error"):
        return f"calibration failed: {cal['error']}"
    cb = cal["cpu_branch"]

    def f(v, unit="ms"):
        return "n/a" if v is None else f"{v:.4f} {unit}"

    lines = [f"CPU branch per layer: gamma0 {f(cb['gamma0_ms'])}, alpha {f(cb['alpha_ms'])}, "
             f"beta {f(cb['beta_ms'])} per cold route (rmse {cb['rmse_ms']:.4f} ms, "
             f"{cb['samples']} steps)",
             f"GPU branch per layer G: {f(cal.get('gpu_branch_ms'))}; pinned H2D: "
             f"{cal.get('h2d_pinned_gbps') or 'n/a'} GB/s",
             f"decode: overlap {cal.get('decode_overlap', 'n/a')}, threads "
             f"{cal.get('decode_threads', 'n/a')}, step {f(cal.get('decode_step_ms'))}",
             f"prefill threshold Np: {cal.get('np_tokens') or 'not calibrated'}"
             + (f" (measured crossing {cal['np_measured_crossing']})"
                if cal.get("np_measured_crossing") else "")]
    bw = cal.get("cpu_branch_bandwidth") or []
    if bw:
        lines.append("CPU-branch kernel: " + "; ".join(
            f"{r['threads']} threads {r['bw_gbps']:.1f} GB/s + {r['alpha_us']:.1f} us"
            + (f" (host reads {r['host_read_gbps']:.1f} GB/s)" if r.get("host_read_gbps") else "") for r in bw))
    lines += [f"note: {n}" for n in cal.get("notes", [])]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``ostinato calibrate [--model M.gguf] [--full] [--json]``."""
    ap = argparse.ArgumentParser(prog="ostinato calibrate",
                                 description="Calibrate the cost model (gamma0, alpha, beta, G, "
                                             "H2D) and the prefill threshold Np on this machine.")
    ap.add_argument("--model", type=Path, help="MoE GGUF to measure with (default: settings.model "
                    "or the demo model)")
    ap.add_argument("--full", action="store_true", help="more steps and prefill sizes (slower)")
    ap.add_argument("--json", action="store_true", help="print the stored calibration as JSON")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cal = run_calibration(a.model, quick=not a.full, progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(cal, indent=1) if a.json else format_calibration(cal))
    print(f"stored in {get_paths().hardware_profile}", file=sys.stderr if a.json else sys.stdout)
    return 1 if cal.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
