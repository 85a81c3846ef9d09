"""Cost model of the paper (arXiv 2611.11533, Sections 2-3 and Appendix B): fits and the switch point.

Per MoE layer:

* CPU branch of a decode step with r cold routes: ``C(0) = gamma0``, ``C(r) = alpha + beta * r``
  for r >= 1 (Section 3.2; calibration in Appendix B, "Calibration").
* GPU branch ``G`` (fixed: zero slots keep it at k experts), pinned host->GPU bandwidth ``B``.
* Prefill: the split path costs ``a_s + c_s n`` and the upload path ``a_u + c_u n + phi2 u(n)`` for
  an n-token forward pass with u(n) distinct cold experts. Their difference
  ``Phi(n) = phi0 + phi1 n - phi2 u(n)`` (phi0 = a_s - a_u < 0, phi1 = c_s - c_u > 0, phi2 = w/B the
  time to upload one expert) is convex because u is concave (Lemma B.3), so the paths switch once
  (Proposition 3.2): ``Np = min{n : Phi(n) >= 0}``.
* Planner ranking: the expected time a resident expert saves over traced decode steps and prefill
  passes, priced per phase with these terms (:func:`expert_time_savings`, :class:`PhaseCosts`).

Pure numpy (unit-tested with synthetic measurements); the measurement through the engine is
:mod:`ostinatod.engine.calibrate`, the stored record :mod:`ostinatod.residency.calibration`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .calibration import CALIBRATION_FORMAT, DEFAULT_NP, SOURCE
from ..errors import MessageError

log = logging.getLogger("ostinatod.calibrate")

class CalibrationError(MessageError, RuntimeError):
    """Calibration could not measure or fit (no engine, no model, too few samples)."""

    code, status = "calibration_failed", 500


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


def fit_cpu_bandwidth(rows: Sequence[dict[str, Any]]) -> Optional[dict[str, float]]:
    """Least-squares ``ms = alpha + bytes / bw`` of the CPU branch's kernel over measurements of one
    (tokens, threads): paper Sec. 3.2, C(r) = alpha + beta r with beta = expert bytes / bw.

    ``rows``: dicts with ``bytes`` (expert bytes read), ``kernel_ms`` and ``kernel`` (false rows,
    left to ggml, are ignored), as ``ostinato_cpu_branch_bench`` gives them. Returns {"alpha_us",
    "bw_gbps" (1e9 bytes/s), "rmse_us", "points"}, or None with fewer than 2 distinct byte counts
    (alpha and bw confounded)."""
    pts = [(float(r["bytes"]), float(r["kernel_ms"])) for r in rows if r.get("kernel") and r.get("bytes")]
    if len({b for b, _ in pts}) < 2:
        return None
    coef, rmse = fit_linear([[b] for b, _ in pts], [t for _, t in pts])
    slope = float(coef[1])   # ms per byte
    return {"alpha_us": float(coef[0]) * 1e3, "bw_gbps": (1.0 / slope / 1e6) if slope > 0 else float("inf"),
            "rmse_us": rmse * 1e3, "points": len(pts)}


def cpu_split_params(bandwidth: Sequence[dict[str, Any]], threads: int,
                     h2d_gbps: Optional[float]) -> Optional[dict[str, float]]:
    """Parameters of the prefill's CPU/upload split (the engine options' ``cpu_split_*``, rule
    in native/src/paths/hybrid_split.h: per layer the CPU branch takes the cold experts with the fewest
    routes while alpha + routes x expert bytes / cpu_gbps stays under the uploads of the rest at
    expert bytes / h2d_gbps each; paper Sec. 3.2's C(r) = alpha + beta r).

    ``bandwidth``: the calibration's ``cpu_branch_bandwidth`` rows ({"threads", "alpha_us",
    "bw_gbps"}, :func:`fit_cpu_bandwidth` per thread count); ``threads``: the prefill's thread count
    (the context's), whose row is used, else the row of the most threads below it, else the fewest
    above; ``h2d_gbps``: pinned host->GPU bandwidth (GB/s). Returns {"alpha_us", "cpu_gbps",
    "h2d_gbps", "threads"} (``threads``: the row's), or None without a usable row or bandwidth."""
    if not h2d_gbps or not (float(h2d_gbps) > 0) or not math.isfinite(float(h2d_gbps)):
        return None
    rows = [r for r in bandwidth or () if isinstance(r, dict) and r.get("threads")
            and isinstance(r.get("bw_gbps"), (int, float)) and 0 < r["bw_gbps"] < float("inf")
            and isinstance(r.get("alpha_us"), (int, float))]
    if not rows:
        return None
    below = [r for r in rows if int(r["threads"]) <= threads]
    row = max(below, key=lambda r: int(r["threads"])) if below else min(rows, key=lambda r: int(r["threads"]))
    return {"alpha_us": max(0.0, float(row["alpha_us"])), "cpu_gbps": float(row["bw_gbps"]),
            "h2d_gbps": float(h2d_gbps), "threads": int(row["threads"])}


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
# What a resident expert saves, per phase (the planner's ranking)
# --------------------------------------------------------------------------------------------

#: CPU branch's bandwidth (GB/s) without a calibration: the paper's beta = 0.184 ms per cold route of
#: a 13.4 MB expert (DeepSeek-V4-Flash, Sec. 3.2), 13.4 MB / 0.184 ms
DEFAULT_CPU_BRANCH_GBPS = 72.8
#: pinned host->GPU bandwidth (GB/s) without a calibration or a measured profile: the paper's upload
#: of a 13.4 MB expert in 0.53 ms on an idle PCIe 4.0 bus (Sec. 3.2, Rule 2)
DEFAULT_H2D_GBPS = 25.3
#: the largest prefill pass (tokens) the planner assumes when the ubatch is automatic: the automatic
#: choice takes the largest of 512-4096 up to n_batch that fits (ostinatod/engine/prefill_plan.py)
MAX_AUTO_UBATCH = 4096


@dataclass(frozen=True)
class PhaseCosts:
    """The cost model's terms that price a cold expert in each phase (planner ranking).

    ``cpu_gbps``: the CPU branch's bandwidth, expert bytes read per second per cold route (1e9
    bytes/s; paper Sec. 3.2, beta = expert bytes / cpu_gbps); ``h2d_gbps``: pinned host->GPU
    bandwidth (1e9 bytes/s; one upload costs expert bytes / h2d_gbps); ``np_tokens``: the prefill
    threshold Np (passes of fewer tokens take the split path, Sec. 3.3); ``ubatch``: the largest
    prefill pass (tokens; a prefill of n tokens runs as ceil(n / ubatch) passes); ``source``: where
    each came from ({"cpu_gbps": "calibration" | "default", ...}), for the plan file.
    """

    cpu_gbps: float = DEFAULT_CPU_BRANCH_GBPS
    h2d_gbps: float = DEFAULT_H2D_GBPS
    np_tokens: int = DEFAULT_NP
    ubatch: int = 2048
    source: Optional[dict[str, str]] = None

    def to_json(self) -> dict[str, Any]:
        return {"cpu_gbps": self.cpu_gbps, "h2d_gbps": self.h2d_gbps, "np_tokens": self.np_tokens,
                "ubatch": self.ubatch, "source": dict(self.source or {})}


def prefill_passes(new_tokens: Iterable[int], ubatch: int) -> list[int]:
    """Token counts of the prefill passes of requests that prefilled ``new_tokens`` tokens each: a
    prefill of n tokens runs as floor(n / ubatch) passes of ``ubatch`` and one of the rest (none for
    n = 0). Raises ValueError for ubatch < 1."""
    if ubatch < 1:
        raise ValueError("ubatch must be >= 1")
    out: list[int] = []
    for n in new_tokens:
        n = int(n)
        full, rest = divmod(max(0, n), ubatch)
        out.extend([ubatch] * full + ([rest] if rest else []))
    return out


def upload_pass_cost(lam: np.ndarray, cpu_s: float, upload_s: float) -> np.ndarray:
    """Expected cost (time per byte of the expert, in the unit of ``cpu_s`` and ``upload_s``) of a cold
    expert in an upload-path pass whose routes to it are Poisson(``lam``): ``E[min(C cpu_s, 1{C > 0}
    upload_s)]``, C ~ Poisson(lam).

    ``cpu_s``: time per byte of one route on the CPU branch (1 / CPU bandwidth); ``upload_s``: time
    per byte of one upload (1 / link bandwidth); :func:`expert_time_savings` passes ms per byte. The min is the engine's per-expert choice
    between computing an expert's routes in the CPU share and uploading it once
    (native/src/paths/hybrid_split.h; paper Sec. 3.2 C(r) = alpha + beta r, alpha left out). Exact
    for up to 256 routes below the upload's price (beyond, the CPU terms are cut there). Same shape
    as ``lam``."""
    lam = np.asarray(lam, dtype=float)
    m = int(min(256, math.floor(upload_s / cpu_s))) if cpu_s > 0 else 0
    pmf = np.exp(-lam)
    p0 = pmf.copy()
    routes = np.zeros_like(lam)   # E[C 1{1 <= C <= m}]
    mass = np.zeros_like(lam)     # Pr[1 <= C <= m]
    for c in range(1, m + 1):
        pmf = pmf * lam / c
        routes += c * pmf
        mass += pmf
    return cpu_s * routes + upload_s * np.clip(1.0 - p0 - mass, 0.0, None)


def expert_time_savings(counts_prefill: np.ndarray, counts_decode: np.ndarray,
                        expert_bytes: Sequence[int], pass_tokens: Sequence[int],
                        costs: PhaseCosts) -> np.ndarray:
    """Expected time (ms) that keeping each expert resident saves over the traced workload; the
    planner fills the pool by this value per byte.

    ``counts_prefill``/``counts_decode``: (n_layer, n_expert) route counts of the development traces
    per phase; ``expert_bytes[l]``: bytes of one expert of layer l (0: dense layer, value 0);
    ``pass_tokens``: token counts of the traces' prefill passes (:func:`prefill_passes`); ``costs``:
    bandwidths, Np and ubatch (:class:`PhaseCosts`). Returns float64 (n_layer, n_expert), ms.

    Cost model of arXiv 2611.11533 (Sec. 3.2 C(r) = alpha + beta r with beta = w_l / B_cpu, the
    decode step's CPU branch, Rule 2; Sec. 3.3 the split path below Np and the upload path of one
    copy w_l / B_link per distinct cold expert per pass, Rule 3 / Prop. 3.2), alpha left out as in
    Prop. 3.1::

        S[l,e] = w_l * ( D[l,e] / B_cpu + sum_p phi_p(lam[p,l,e]) ),   lam[p,l,e] = n_p P[l,e] / sum_q n_q
        phi_p(lam) = lam / B_cpu                                   if n_p < Np  (split path: per route)
        phi_p(lam) = E[min(C / B_cpu, 1{C>0} / B_link)], C~Poisson(lam)   if n_p >= Np (upload path)

    D and P are the decode and prefill route counts, n_p the tokens of prefill pass p. A decode
    route costs its expert's bytes over the CPU branch, per route and step; an upload pass pays an
    expert once if any of its tokens touches it (or its routes on the CPU, when fewer are cheaper).
    Spreading P over the passes in proportion to their tokens treats tokens as independent draws
    (the stationary routes of Lemma B.3): it overstates how many passes touch an expert when routes
    cluster. The value per byte, S / w_l, does not depend on the expert's size: bytes cost the same
    time in every layer. With only split-path passes (or only decode) S / w_l is the route count /
    B_cpu: Rule 1's ranking by routes (Prop. 3.1). Raises ValueError on shape mismatches or
    bandwidths <= 0.
    """
    P = np.asarray(counts_prefill, dtype=float)
    D = np.asarray(counts_decode, dtype=float)
    w = np.asarray(expert_bytes, dtype=float)
    if P.shape != D.shape or P.ndim != 2 or w.shape != (P.shape[0],):
        raise ValueError(f"counts {P.shape} / {D.shape} and expert_bytes {w.shape} do not match")
    if not (costs.cpu_gbps > 0 and costs.h2d_gbps > 0):
        raise ValueError("bandwidths must be > 0")
    cpu_s, up_s = 1e3 / (costs.cpu_gbps * 1e9), 1e3 / (costs.h2d_gbps * 1e9)   # ms per byte
    per_byte = D * cpu_s
    total = float(sum(pass_tokens))
    if total > 0:
        split = sum(n for n in pass_tokens if n < costs.np_tokens)
        per_byte = per_byte + P * (split / total) * cpu_s
        sizes: dict[int, int] = {}   # passes of equal size cost the same: one term each
        for n in pass_tokens:
            if n >= costs.np_tokens:
                sizes[int(n)] = sizes.get(int(n), 0) + 1
        for n, times in sizes.items():
            per_byte = per_byte + times * upload_pass_cost(P * (n / total), cpu_s, up_s)
    return per_byte * w[:, None]


# --------------------------------------------------------------------------------------------
# Decode prefetch: how many predicted cold experts a layer's chain copies
# --------------------------------------------------------------------------------------------

#: a decode prefetch chain's fixed cost beside its copies (us): router product, top k and stage list
#: on the side stream. H100 host, Qwen3.5 (2026-12-06 runs, "decode prefetch chains"): 67 us per
#: chain of which 50 us copies (~1.08 experts of 2.1 MB at ~45 GB/s)
DECODE_PREFETCH_CHAIN_US = 17.0
#: the most experts a chain may stage (the setting's and the native check's limit)
DECODE_PREFETCH_MAX = 16


def decode_prefetch_count(expert_bytes: float, h2d_gbps: float, gpu_layer_ms: float, *,
                          chain_us: float = DECODE_PREFETCH_CHAIN_US, most: int = DECODE_PREFETCH_MAX
                          ) -> dict[str, float]:
    """The decode prefetch count per layer that the cost model fits in one layer's GPU time.

    Layer l's chain (forked before layer l's router) copies predicted cold experts of layer l+1 on a
    side stream, and the ops after route(l+1) wait for its copies: they are free while they end
    within about one layer's GPU time ``g`` (paper Sec. 3.2: the GPU branch G_l; App. B, Prop. B.1:
    an overlapped layer costs max{C, G_l}), and every expert more delays the step by its whole copy.
    One copy costs ``w / B`` (Sec. 3.2, Rule 2; phi2 = w/B of Prop. 3.2), so

        n = max{ n in 0..most : chain_us + n * w / B <= g }  =  floor((g - chain_us) / (w / B))

    with ``w`` = ``expert_bytes`` (the largest expert of the model's MoE layers, bytes), ``B`` =
    ``h2d_gbps`` (pinned host->GPU, 1e9 bytes/s) and ``chain_us`` the chain's fixed cost
    (:data:`DECODE_PREFETCH_CHAIN_US`). n is an upper bound: a chain stages only the experts its
    prediction finds cold, so the CPU side needs no cap of its own (a layer with fewer predicted cold
    routes copies fewer). Returns ``{"experts", "copy_us", "window_us", "chain_us"}``; ValueError for
    a non-positive or non-finite input."""
    vals = (expert_bytes, h2d_gbps, gpu_layer_ms)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in vals):
        raise ValueError(f"decode_prefetch_count: expert bytes, bandwidth and GPU time must be > 0, got {vals}")
    copy_us = float(expert_bytes) / (float(h2d_gbps) * 1e9) * 1e6
    window_us = float(gpu_layer_ms) * 1e3
    room = window_us - chain_us
    n = 0 if room <= 0 else int(math.floor(room / copy_us + 1e-9))
    return {"experts": max(0, min(int(most), n)), "copy_us": copy_us, "window_us": window_us,
            "chain_us": float(chain_us)}
