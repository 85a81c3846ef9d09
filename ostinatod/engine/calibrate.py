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
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ..paths import get_paths

log = logging.getLogger(__name__)

CALIBRATION_FORMAT = "ostinato-calibration/1"
DEFAULT_NP = 512  # the paper's threshold on PCIe 4.0 (Section 3.3), used when nothing is calibrated
SOURCE = "arXiv 2611.11533 Sec. 3.2-3.3, Prop. 3.2, App. B"


class CalibrationError(RuntimeError):
    """Calibration could not measure or fit (no engine, no model, too few samples)."""


# --------------------------------------------------------------------------------------------
# Pure math (unit-tested with synthetic measurements)
# --------------------------------------------------------------------------------------------

def fit_cpu_branch(rows: Iterable[Sequence[float]]) -> dict[str, Any]:
    """Least-squares fit of the per-layer CPU-branch cost C(r) from pass measurements.

    Each row is ``(n0, n1, R, cpu_ms)`` for one decode step: n0 layers with no cold route, n1
    layers with at least one, R cold routes over all layers, cpu_ms the summed CPU-branch time.
    Model (paper Sec. 3.2): ``cpu_ms = gamma0 n0 + alpha n1 + beta R``. A per-layer sample (r, ms)
    is the row (1, 0, 0, ms) for r = 0 and (0, 1, r, ms) otherwise.
    Returns {"gamma0_ms", "alpha_ms", "beta_ms", "rmse_ms", "samples"}; a term without data is None.
    Raises CalibrationError with fewer than 2 rows or no step with a cold route.
    """
    a = np.asarray(list(rows), dtype=float)
    if a.ndim != 2 or a.shape[0] < 2 or a.shape[1] != 4:
        raise CalibrationError("need at least 2 rows of (n0, n1, R, cpu_ms)")
    X, y = a[:, :3], a[:, 3]
    used = [j for j in range(3) if np.any(X[:, j] > 0)]
    if 1 not in used and 2 not in used:
        raise CalibrationError("no step with a cold route: alpha and beta cannot be fitted")
    coef = _lstsq_terms(X, y, used)
    # One robust pass: steps disturbed by other work on the machine (residual beyond 3 scaled
    # MADs) are dropped and the fit repeated.
    resid = y - X @ np.nan_to_num(coef)
    mad = 1.4826 * np.median(np.abs(resid - np.median(resid)))
    keep = np.abs(resid - np.median(resid)) <= 3 * mad if mad > 0 else np.ones(len(y), bool)
    if keep.sum() >= max(2, len(y) // 2) and not keep.all():
        X, y = X[keep], y[keep]
        coef = _lstsq_terms(X, y, [j for j in used if np.any(X[:, j] > 0)])
    resid = y - np.nan_to_num(X @ np.nan_to_num(coef))
    out = {"gamma0_ms": coef[0], "alpha_ms": coef[1], "beta_ms": coef[2],
           "rmse_ms": float(np.sqrt(np.mean(resid ** 2))), "samples": int(a.shape[0]),
           "outliers_dropped": int(a.shape[0] - len(y))}
    return {k: (None if isinstance(v, float) and np.isnan(v) else
                (float(v) if isinstance(v, (float, np.floating)) else v)) for k, v in out.items()}


def _lstsq_terms(X: np.ndarray, y: np.ndarray, used: list[int]) -> np.ndarray:
    """Least squares over the columns ``used`` of X (others NaN). When alpha and beta are
    confounded (every layer with cold routes had the same r), alpha is set to 0 and logged."""
    coef = np.full(3, np.nan)
    sol, *_ = np.linalg.lstsq(X[:, used], y, rcond=None)
    coef[used] = sol
    if 1 in used and 2 in used and np.linalg.matrix_rank(X[:, [1, 2]]) < 2:
        log.warning("cold routes per layer did not vary: alpha set to 0, beta = C(r)/r")
        rest = [j for j in used if j != 1]
        sol, *_ = np.linalg.lstsq(X[:, rest], y, rcond=None)
        coef[rest] = sol
        coef[1] = 0.0
    return coef


def cpu_branch_cost(r: int | np.ndarray, gamma0: float, alpha: float, beta: float) -> np.ndarray:
    """C(r) of the paper (Sec. 3.2): gamma0 for r = 0, alpha + beta r otherwise (ms)."""
    r = np.asarray(r, dtype=float)
    return np.where(r == 0, gamma0, alpha + beta * r)


def fit_linear(x: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[np.ndarray, float]:
    """Least squares y ~ [1, x...] @ coef; returns (coef with intercept first, rmse)."""
    X = np.column_stack([np.ones(len(y)), np.asarray(x, dtype=float)])
    y = np.asarray(y, dtype=float)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return coef, float(np.sqrt(np.mean((y - X @ coef) ** 2)))


@dataclass
class PrefillPoint:
    """One measured prefill forward pass: tokens n, path, wall time, distinct cold experts u."""

    n: int
    path: str  # "split" | "upload"
    total_ms: float
    distinct_cold: float = 0.0
    cold_routes: float = 0.0


def ubar_curve(points: Sequence[PrefillPoint]) -> tuple[np.ndarray, np.ndarray]:
    """Mean distinct cold experts per forward pass by token count: (ns, ū(ns)), with ū(0) = 0.

    Made non-decreasing (Lemma B.3) so that interpolation keeps the lemma's shape.
    """
    by_n: dict[int, list[float]] = {}
    for p in points:
        by_n.setdefault(int(p.n), []).append(float(p.distinct_cold))
    ns = np.array([0] + sorted(by_n), dtype=float)
    us = np.array([0.0] + [float(np.mean(by_n[int(n)])) for n in ns[1:]])
    return ns, np.maximum.accumulate(us)


def fit_prefill_paths(points: Sequence[PrefillPoint], *, expert_upload_ms: Optional[float] = None
                      ) -> dict[str, Any]:
    """Fit the two prefill paths and return Phi's coefficients (Prop. 3.2).

    split:  total_ms = a_s + c_s n;    upload: total_ms = a_u + c_u n + phi2 u.
    ``expert_upload_ms`` (bytes of one expert / pinned bandwidth) fixes phi2 when the upload points
    cannot separate it from n (too few sizes). Returns {"phi0_ms", "phi1_ms_per_token",
    "phi2_ms_per_expert", "split": {...}, "upload": {...}}. Raises CalibrationError when a path has
    fewer than 2 sizes.
    """
    sp = [p for p in points if p.path == "split"]
    up = [p for p in points if p.path == "upload"]
    if len({p.n for p in sp}) < 2 or len({p.n for p in up}) < 2:
        raise CalibrationError("need split and upload passes of at least 2 sizes each")
    (a_s, c_s), rm_s = fit_linear([[p.n] for p in sp], [p.total_ms for p in sp])
    phi2 = None
    if len({p.n for p in up}) >= 3:
        (a_u, c_u, phi2_fit), rm_u = fit_linear([[p.n, p.distinct_cold] for p in up],
                                                [p.total_ms for p in up])
        if phi2_fit > 0:
            phi2 = float(phi2_fit)
    if phi2 is None:
        phi2 = float(expert_upload_ms or 0.0)
        (a_u, c_u), rm_u = fit_linear([[p.n] for p in up],
                                      [p.total_ms - phi2 * p.distinct_cold for p in up])
    return {"phi0_ms": float(a_s - a_u), "phi1_ms_per_token": float(c_s - c_u),
            "phi2_ms_per_expert": phi2,
            "split": {"a_ms": float(a_s), "c_ms_per_token": float(c_s), "rmse_ms": rm_s,
                      "points": len(sp)},
            "upload": {"a_ms": float(a_u), "c_ms_per_token": float(c_u), "rmse_ms": rm_u,
                       "points": len(up)}}


def switch_point(phi0: float, phi1: float, phi2: float, ubar_n: Sequence[float],
                 ubar_u: Sequence[float], n_max: int = 1 << 16) -> Optional[int]:
    """Np = min{n >= 1 : Phi(n) >= 0} with Phi(n) = phi0 + phi1 n - phi2 ū(n) (Prop. 3.2).

    ū is interpolated linearly between the measured sizes and held at its last value beyond them
    (it is bounded by the number of cold experts, Lemma B.3). Returns None when the upload path is
    never cheaper up to ``n_max`` tokens (e.g. phi1 <= 0).
    """
    n = np.arange(1, n_max + 1, dtype=float)
    u = np.interp(n, np.asarray(ubar_n, float), np.asarray(ubar_u, float))
    phi = phi0 + phi1 * n - phi2 * u
    idx = np.nonzero(phi >= 0)[0]
    return int(n[idx[0]]) if len(idx) else None


def measured_crossing(points: Sequence[PrefillPoint]) -> Optional[int]:
    """Smallest measured n whose median upload time is <= its median split time (a check on Np)."""
    ns = sorted({p.n for p in points})
    for n in ns:
        s = [p.total_ms for p in points if p.n == n and p.path == "split"]
        u = [p.total_ms for p in points if p.n == n and p.path == "upload"]
        if s and u and np.median(u) <= np.median(s):
            return int(n)
    return None


def measured_switch_point(points: Sequence[PrefillPoint]) -> Optional[int]:
    """Np from the measured costs: the first token count where the upload path's median time drops to
    the split path's, linearly interpolated between the two bracketing measured sizes.

    ``points``: forced-path prefill passes (both paths at the same sizes). Returns the smallest
    measured size when the upload path already wins there, None when it never does.
    """
    ns = sorted({p.n for p in points if p.path == "split"} & {p.n for p in points if p.path == "upload"})
    prev = None
    for n in ns:
        d = (float(np.median([p.total_ms for p in points if p.n == n and p.path == "split"]))
             - float(np.median([p.total_ms for p in points if p.n == n and p.path == "upload"])))
        if d >= 0:
            if prev is None:
                return int(n)
            n0, d0 = prev  # d0 < 0 <= d: zero crossing of split - upload between n0 and n
            return int(np.ceil(n0 + (n - n0) * (-d0) / (d - d0)))
        prev = (n, d)
    return None


def solve_calibration(decode_rows: Sequence[Sequence[float]], gpu_ms_per_layer: Sequence[float],
                      prefill: Sequence[PrefillPoint], *, gpu: bool,
                      expert_bytes: Optional[int] = None, h2d_gbps: Optional[float] = None
                      ) -> dict[str, Any]:
    """Turn measurements into the stored calibration dict (no I/O).

    ``decode_rows``: see :func:`fit_cpu_branch`; ``gpu_ms_per_layer``: GPU-branch time per layer of
    decode steps; ``prefill``: forced-path prefill passes. With ``gpu=False`` the GPU terms are left
    out (None) and a note says why. Np is the measured switch point of the two paths
    (:func:`measured_switch_point`); the cost model's value (:func:`switch_point`, Prop. 3.2) is kept
    as ``np_model`` and used only when the measurements never cross.
    """
    notes: list[str] = []
    cal: dict[str, Any] = {"format": CALIBRATION_FORMAT, "source": SOURCE, "gpu_terms": gpu,
                           "cpu_branch": fit_cpu_branch(decode_rows)}
    cb = cal["cpu_branch"]
    if any((cb[k] or 0) < 0 for k in ("gamma0_ms", "alpha_ms", "beta_ms")):
        notes.append("a fitted CPU-branch term is negative: the measurements were too noisy "
                     "(other load on the machine?); re-run 'ostinato calibrate --full' when idle")
    cal["gpu_branch_ms"] = (float(np.median(gpu_ms_per_layer))
                            if gpu and len(gpu_ms_per_layer) else None)
    cal["h2d_pinned_gbps"] = h2d_gbps if gpu else None
    up_ms = (expert_bytes / (h2d_gbps * 1e9) * 1e3) if (expert_bytes and h2d_gbps) else None
    cal["expert_upload_ms"] = up_ms if gpu else None
    cal["np_tokens"] = None
    cal["prefill"] = None
    if not gpu:
        notes.append("no GPU: G, pinned H2D bandwidth and Np are not measured (the upload path "
                     f"equals the split path here); the engine uses settings.prefill_threshold or "
                     f"{DEFAULT_NP}")
    elif prefill:
        try:
            fit = fit_prefill_paths(prefill, expert_upload_ms=up_ms)
            ns, us = ubar_curve([p for p in prefill if p.path == "upload"] or prefill)
            fit["ubar"] = [[int(a), float(b)] for a, b in zip(ns, us)]
            cal["prefill"] = fit
            cal["np_model"] = switch_point(fit["phi0_ms"], fit["phi1_ms_per_token"],
                                           fit["phi2_ms_per_expert"], ns, us)
            cal["np_measured_crossing"] = measured_crossing(prefill)
            measured = measured_switch_point(prefill)
            cal["np_tokens"] = measured if measured is not None else cal["np_model"]
            if measured is not None and cal["np_model"] is not None and \
                    not (measured / 4 <= cal["np_model"] <= measured * 4):
                notes.append(f"the cost model's Np ({cal['np_model']}) is far from the measured "
                             f"switch point ({measured}): the linear path fits do not hold over "
                             "the measured sizes; Np is the measured one")
            if cal["np_tokens"] is None:
                notes.append("the upload path was never cheaper than the split path: Np unset")
        except CalibrationError as e:
            notes.append(f"prefill paths not fitted: {e}")
    if cb["gamma0_ms"] is not None and cal["gpu_branch_ms"] is not None and cb["alpha_ms"] is not None:
        g = max(cb["gamma0_ms"], cal["gpu_branch_ms"])
        cal["residual_alpha_minus_g_ms"] = cb["alpha_ms"] - g  # delta of Prop. B.1
    cal["notes"] = notes
    return cal


# --------------------------------------------------------------------------------------------
# Hardware profile I/O
# --------------------------------------------------------------------------------------------

def load_calibration(path: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """The ``calibration`` section of the hardware profile, or None (missing/unreadable)."""
    path = Path(path) if path else get_paths().hardware_profile
    try:
        return json.loads(path.read_text()).get("calibration")
    except (OSError, ValueError, AttributeError):
        return None


def prefill_threshold(settings: Any = None, path: Optional[Path] = None) -> int:
    """Np to use: ``settings.prefill_threshold`` if set, else the calibrated value (unless stale),
    else 512 (the paper's value, Sec. 3.3)."""
    if settings is not None and getattr(settings, "prefill_threshold", None):
        return int(settings.prefill_threshold)
    cal = load_calibration(path)
    if cal and not cal.get("stale") and cal.get("np_tokens"):
        return int(cal["np_tokens"])
    return DEFAULT_NP


def store_calibration(cal: dict[str, Any], path: Optional[Path] = None) -> Path:
    """Write ``cal`` under ``"calibration"`` in the hardware profile, keeping every other key.

    Atomic (temp file + rename). When the file is missing or has no hardware fingerprint, the quick
    hardware probe (:func:`ostinatod.profile.collect_profile` without bandwidth measurements) is
    stored with it: otherwise the daemon's start-up profile would see "changed hardware" and mark this
    fresh calibration stale.
    """
    path = Path(path) if path else get_paths().hardware_profile
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        prof = json.loads(path.read_text())
        if not isinstance(prof, dict):
            prof = {}
    except (OSError, ValueError):
        prof = {}
    if not prof.get("fingerprint"):
        try:
            from ..profile import collect_profile
            prof = {**collect_profile(measure=False), **prof}
        except Exception as e:  # noqa: BLE001 - the calibration is still worth storing
            log.warning("hardware probe for the profile failed: %s", e)
    prof["calibration"] = cal
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(prof, indent=1))
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------
# Measurement through the engine
# --------------------------------------------------------------------------------------------

def _h2d_from_profile(path: Optional[Path] = None) -> Optional[float]:
    try:
        prof = json.loads((Path(path) if path else get_paths().hardware_profile).read_text())
        vals = [e.get("gbps") for e in prof.get("bandwidth", {}).get("h2d_pinned", []) if e.get("gbps")]
        return float(max(vals)) if vals else None
    except (OSError, ValueError, AttributeError):
        return None


def _default_model() -> Optional[Path]:
    try:
        from ..settings import load_settings

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
    from .traces import Trace

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
    Returns {"decode_rows", "gpu_ms_per_layer", "prefill": [PrefillPoint], "gpu", "expert_bytes",
    "model"}. Raises CalibrationError when the engine or the model cannot be used.
    """
    import tempfile

    import llama_cpp

    from ..settings import load_settings
    from . import experts
    from .planner import read_model_shape
    from .residency import make_residency, write_residency
    from .worker import Worker

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
                      n_threads=n_threads, engine_mode="inprocess")
    w = Worker(s, model_path)
    w.load()
    try:
        if w.rt is None:
            raise CalibrationError("the expert engine is not active for this model (stock run)")
        info = w.rt.info() if hasattr(w.rt, "info") else {}
        gpu = bool(experts._has_gpu())
        n_moe = int(info.get("moe_layers") or block["n_layer"])
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(w.vocab))
        rng = np.random.default_rng(0)
        mem = llama_cpp.llama_get_memory(w.ctx)
        batch = llama_cpp.llama_batch_init(n_max, 0, 1)

        def decode(tokens: Sequence[int], pos0: int) -> float:
            batch.n_tokens = len(tokens)
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if i == len(tokens) - 1 else 0
            t0 = time.perf_counter()
            rc = llama_cpp.llama_decode(w.ctx, batch)
            llama_cpp.llama_synchronize(w.ctx)
            ms = (time.perf_counter() - t0) * 1e3
            if rc != 0:
                raise CalibrationError(f"llama_decode returned {rc}")
            return ms

        def toks(n: int) -> list[int]:
            return [int(x) for x in rng.integers(100, max(101, n_vocab - 300), size=n)]

        w.rt.set_timing(True)   # GPU-branch times (one sync per layer; off again when serving)
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
            w.rt.set_timing(False)   # serving conditions for the decode sweep
            sweep = decode_sweep(w, paths[len(paths) // 2], decode, toks, steps=max(8, decode_steps // 2))
            say(f"calibration: decode overlap x threads: {len(sweep)} settings")
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
            w.rt.set_timing(False)
            llama_cpp.llama_batch_free(batch)
        exp_bytes = info.get("expert_bytes")
        if isinstance(exp_bytes, list):
            exp_bytes = max(exp_bytes) if exp_bytes else None
        return {"decode_rows": rows, "gpu_ms_per_layer": gpu_ms, "prefill": prefill, "gpu": gpu,
                "decode_sweep": sweep,
                "expert_bytes": exp_bytes, "model": {k: block[k] for k in ("fingerprint", "name")}}
    finally:
        w.close()


def decode_sweep(w: Any, residency_path: Path, decode, toks, *, steps: int = 16) -> list[dict[str, Any]]:
    """Median one-token decode step (ms, llama_decode + sync) for decode overlap on/off x CPU thread
    counts (all physical cores, half, a quarter), with ``residency_path`` active and timing mode off.

    ``w``: the calibration's loaded Worker; ``decode(tokens, pos0) -> ms`` and ``toks(n)`` as in
    :func:`measure`. Restores overlap on and the context's thread counts. Returns
    [{"overlap", "threads", "median_ms"}].
    """
    import llama_cpp

    from .worker import _physical_cores

    p = int(w.settings.n_threads or _physical_cores())
    counts = sorted({max(1, p // 4), max(1, p // 2), p})
    w.rt.switch(residency_path)
    mem = llama_cpp.llama_get_memory(w.ctx)
    out: list[dict[str, Any]] = []
    try:
        for overlap in (True, False):
            w.rt.set_overlap(overlap)
            for n in counts:
                llama_cpp.llama_set_n_threads(w.ctx, n, p)
                llama_cpp.llama_memory_clear(mem, True)
                decode(toks(16), 0)
                ms = [decode(toks(1), 16 + i) for i in range(steps + 3)][3:]  # 3 warm-up steps
                out.append({"overlap": overlap, "threads": n, "median_ms": float(np.median(ms))})
    finally:
        w.rt.set_overlap(True)
        llama_cpp.llama_set_n_threads(w.ctx, p, p)
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
                                h2d_gbps=_h2d_from_profile(profile_path))
        best = best_decode(m.get("decode_sweep") or [])
        if best is not None:
            cal["decode_overlap"] = bool(best["overlap"])
            cal["decode_threads"] = int(best["threads"])
            cal["decode_step_ms"] = best["median_ms"]
            cal["decode_sweep"] = m["decode_sweep"]
        cal["measurements"] = {"decode_steps": len(m["decode_rows"]),
                               "prefill_passes": len(m["prefill"]),
                               "prefill": [vars(p) for p in m["prefill"]]}
        cal["model"] = m.get("model")
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
