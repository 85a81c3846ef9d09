"""Residency planner (``ostinato plan``): which experts stay resident on each GPU.

Method of the paper (arXiv 2611.11533, Section 3.1 steps 1-3 and Appendix B):

1. Rank the experts of every layer by what keeping them resident saves on the development traces,
   per phase (cost model of Sec. 3.2-3.3, :func:`.cost.expert_time_savings`): a decode route of a
   cold expert costs its bytes over the CPU branch's bandwidth, per route and step; a prefill pass
   below Np computes its cold routes on the CPU the same way; a pass at or above Np uploads each
   distinct cold expert it touches once, over the link (or computes its few routes on the CPU, when
   cheaper). Decode and prefill counts stay separate and are weighted by the traces' own mix of
   decode steps and prefill passes, so a layer that prefill passes barely reach (llama.cpp computes
   a standard transformer's last layer only for the rows that give logits) still gets the experts
   its decode routes pay for. Traces without request sizes (no prefill passes to price) are ranked
   by their route counts (prefill + decode), Rule 1 as the paper states it.
2. Capacity test: per GPU, the longest development request (with the workload's tool definitions,
   which are part of its prompt tokens) must run with a margin free at peak. Its need is estimated
   as dense weights of the GPU's layers + KV cache at that length + compute buffers + the upload
   staging buffer + the k zero slots; what is left of free memory (pynvml) is the pool's capacity.
   An explicit budget (``--budget-frac`` of the expert bytes, or ``--budget-mb`` per GPU) caps it;
   without a GPU the budget alone sets it (emulation, CI).
3. Fill each GPU's slots with the highest-ranked experts of its layers *across* layers (one pool per
   GPU, no per-layer quota), by expected time saved per byte of pool, greedily (the knapsack rule;
   Appendix B, "Slots of two sizes"). Rule 1 / Proposition 3.1: where every route costs the same
   (decode and split-path prefill only, equal sizes), this keeps the most frequently routed experts,
   which minimises the expected number of cold routes. Since a route costs its expert's bytes over a
   bandwidth, time per byte does not depend on the expert's size; the count ranking of traces
   without request sizes fills by routes per byte instead (as before).

Layers are assigned to GPUs as contiguous ranges proportional to each GPU's free memory (unequal
GPUs get unequal ranges). The result is written as an ``ostinato-residency/1`` file under
``<data>/residency/<fingerprint>/<workload>.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..hardware import GpuSpec, detect_gpus
from ..paths import residency_file
from ..settings import load_settings
from .calibration import load_calibration, prefill_threshold_choice, h2d_from_profile
from .cost import (DEFAULT_CPU_BRANCH_GBPS, DEFAULT_H2D_GBPS, MAX_AUTO_UBATCH, PhaseCosts,
                   expert_time_savings, prefill_passes)
from .model import ModelInfo, describe_model, require_arch
from .sets import RESIDENCY_FORMAT, write_residency
from .traces import Trace, TraceError, load_traces, trace_path
from ..errors import MessageError

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_MARGIN_MB = 1024  # kept free at peak on every GPU (capacity test)


class PlanError(MessageError, ValueError):
    """The plan cannot be made (no traces, capacity test failed, bad arguments)."""

    code, status = "plan_failed", 400


def read_model_shape(path: Path) -> ModelInfo:
    """The model description the planner works with (:func:`describe_model`; cached). Raises
    ValueError for a file that is missing or not a GGUF, or has no architecture key."""
    return require_arch(describe_model(path))


def resolve_gpus(gpus: str | int) -> list[GpuSpec]:
    """``"auto"``: the detected GPUs (one emulated device if none); N: N devices (detected ones
    first, emulated ones with unknown free memory beyond). Raises PlanError for N < 1."""
    found = detect_gpus()
    if str(gpus) == "auto":
        return found or [GpuSpec(0)]
    try:
        n = int(gpus)
    except ValueError:
        raise PlanError(f"--gpus must be 'auto' or a number, not {gpus!r}") from None
    if n < 1:
        raise PlanError("--gpus must be at least 1")
    if len(found) >= n:
        return found[:n]
    if found:
        log.warning("%d GPUs requested but %d found: emulating the rest", n, len(found))
    # Mixed known/unknown free memory would skew the layer split: emulate all equally.
    return [GpuSpec(i) for i in range(n)]


def split_layers(n_layer: int, weights: Sequence[float]) -> list[list[int]]:
    """Contiguous layer ranges per GPU, sizes proportional to ``weights`` (e.g. free memory).

    Largest-remainder rounding; every GPU gets at least one layer when n_layer >= len(weights).
    Returns one list of layer indices per GPU, in order.
    """
    w = np.asarray(weights, dtype=float)
    if len(w) == 0 or (w <= 0).any():
        raise PlanError("GPU weights must be positive")
    quota = w / w.sum() * n_layer
    n = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - n), kind="stable")[: n_layer - n.sum()]:
        n[i] += 1
    if n_layer >= len(w):  # no empty GPU: take one layer from the largest share
        for i in np.where(n == 0)[0]:
            j = int(np.argmax(n))
            n[j] -= 1
            n[i] += 1
    out, start = [], 0
    for c in n:
        out.append(list(range(start, start + int(c))))
        start += int(c)
    return out


# --------------------------------------------------------------------------------------------
# Capacity test and fill
# --------------------------------------------------------------------------------------------

def staging_regions_for(settings: Any = None) -> int:
    """Staging regions of a pool for the upload path: 1 + the prefill prefetch's depth (settings
    ``prefill_prefetch``, default on, and ``prefill_prefetch_depth``, default 2; docs/engine.md
    "Prefetch"), 1 with the prefetch off. ``settings`` defaults to the loaded settings."""
    if settings is None:
        settings = load_settings()
    return 1 + prefetch_depth_setting(settings)


def prefetch_depth_setting(settings: Any) -> int:
    """The prefill prefetch depth the settings ask for: 0 (``prefill_prefetch`` off), else
    ``prefill_prefetch_depth`` (1 or 2)."""
    eng = getattr(settings, "engine", settings)   # Settings: its [engine] table
    if not getattr(eng, "prefill_prefetch", True):
        return 0
    return int(getattr(eng, "prefill_prefetch_depth", 2))


def prefetch_room(plan: dict[str, Any], depth: int) -> int:
    """The deepest prefill prefetch, at most ``depth``, whose staging regions (1 + depth) a residency
    set's ``plan`` leaves GPU memory for: ``depth`` when planned with that many regions; else, on
    every GPU whose capacity test ran, the regions that fit in the capacity minus the pool besides the
    planned ones (a region is ``need_bytes.staging`` / ``staging_regions``). A plan without those
    figures (hand-made or emulated) gives ``depth``: nothing shows it was cut to the memory."""
    planned = max(1, int(plan.get("staging_regions") or 1))
    if depth <= planned - 1:
        return max(0, depth)
    spare: Optional[int] = None
    for c in plan.get("capacity") or []:
        cap, pool = c.get("capacity_bytes"), c.get("pool_bytes")
        staging = (c.get("need_bytes") or {}).get("staging")
        if cap is None or pool is None or not staging:
            continue
        fit = max(0, int(cap) - int(pool)) // max(1, int(staging) // planned)
        spare = fit if spare is None else min(spare, fit)
    if spare is None:
        return depth
    return max(0, min(depth, planned - 1 + spare))


def estimate_gpu_need(shape: ModelInfo, layers: Sequence[int], max_tokens: int, *,
                      n_ubatch: int = 512, last: bool = False, staging_regions: int = 1) -> dict[str, int]:
    """Bytes a GPU needs besides its expert pool to run a ``max_tokens`` request (estimates).

    dense: non-expert weights of ``layers`` (+ output head on the ``last`` GPU); kv: f16 KV cache
    of those layers at ``max_tokens``; compute: llama.cpp-style compute buffers of one ubatch
    (logits + activations + expert intermediates, f32; + the router's sorted ids of every MoE layer,
    i32 [n_expert, n_ubatch] each, which the count op of all-resident layers keeps until the end of
    the graph, docs/engine.md "All-resident layers"); staging: the upload path's staging buffer
    (every expert of the largest layer: the most distinct cold experts one layer can have; times
    ``staging_regions``, 1 + the prefill prefetch's depth, docs/engine.md "Prefetch");
    zero_slots: k all-zero slots per size class. Returns a dict of these and ``total``.
    """
    layers = list(layers)
    frac = len(layers) / max(1, shape.n_layer)
    dense = sum(shape.dense_layer_bytes[l] for l in layers) + (shape.other_bytes if last else 0)
    kv = int(shape.kv_bytes_per_token * frac * max_tokens)
    ff = shape.n_ff_exp or 4 * shape.n_embd
    moe = [l for l in layers if shape.expert_bytes[l] > 0]
    compute = 4 * n_ubatch * ((shape.n_vocab if last else 0) + 16 * shape.n_embd
                              + 3 * max(1, shape.n_expert_used) * ff + len(moe) * shape.n_expert)
    staging = staging_regions * max((shape.expert_bytes[l] * shape.n_expert for l in moe), default=0)
    zero = sum(shape.n_expert_used * shape.expert_bytes[l]
               for l in {shape.size_class[l]: l for l in moe}.values())
    need = {"dense": dense, "kv": kv, "compute": compute, "staging": staging, "zero_slots": zero}
    need["total"] = sum(need.values())
    return need


def fill_pool(counts: np.ndarray, expert_bytes: Sequence[int], layers: Sequence[int],
              budget_bytes: int) -> tuple[dict[int, list[int]], int]:
    """Choose the hot experts of one GPU: highest value per byte first, across its layers.

    ``counts``: (n_layer, n_expert) values, >= 0: route counts (Rule 1) or the expected time an
    expert saves (:func:`.cost.expert_time_savings`, ms; floats); ``expert_bytes[l]``: bytes of one
    expert of layer l (0 = dense layer, skipped). Greedy in order of value/bytes (ties: higher
    value, lower layer, lower expert id), skipping experts that no longer fit so smaller ones fill
    leftover space. With route counts and equal sizes this is exactly Rule 1 (paper Prop. 3.1).
    Zero-value experts fill what is left (adding a slot never adds cold routes). Returns
    ({layer: sorted expert ids}, bytes used).
    """
    cand = []
    for l in layers:
        b = int(expert_bytes[l])
        if b <= 0:
            continue
        for e in range(counts.shape[1]):
            c = float(counts[l, e])
            cand.append((-c / b, -c, l, e, b))
    cand.sort()
    used, hot = 0, {}
    for _, _, l, e, b in cand:
        if used + b <= budget_bytes:
            used += b
            hot.setdefault(l, []).append(e)
    return {l: sorted(v) for l, v in sorted(hot.items())}, used


def hot_route_share(counts: np.ndarray, hot: dict[int, Sequence[int]] | list[dict]) -> float:
    """Share of the routes in ``counts`` (n_layer, n_expert) that go to hot experts, in [0, 1].

    ``hot`` is {layer: expert ids} or the residency file's ``gpus`` list. NaN if no routes.
    """
    if isinstance(hot, list):
        merged: dict[int, list[int]] = {}
        for g in hot:
            for l, es in g["hot"].items():
                merged.setdefault(int(l), []).extend(es)
        hot = merged
    total = counts.sum()
    if total <= 0:
        return float("nan")
    h = sum(int(counts[int(l), list(es)].sum()) for l, es in hot.items() if len(es))
    return float(h / total)


def phase_costs_for(settings: Any = None, path: Optional[Path] = None,
                    model_fingerprint: Optional[str] = None, *, np_tokens: Optional[int] = None,
                    ubatch: Optional[int] = None) -> PhaseCosts:
    """The cost terms the planner prices each phase with (:class:`.cost.PhaseCosts`), from what this
    machine has measured, else documented defaults; ``source`` says which.

    ``cpu_gbps``: the fastest row of the calibration's (full or load probe, not stale; of this model
    when both its and ``model_fingerprint`` are known)
    ``cpu_branch_bandwidth`` (decode runs at the calibration's fastest threads), else
    :data:`.cost.DEFAULT_CPU_BRANCH_GBPS` (the paper's beta); ``h2d_gbps``: the calibration's
    ``h2d_pinned_gbps``, else the profile's measured pinned bandwidth, else
    :data:`.cost.DEFAULT_H2D_GBPS`; ``np_tokens``: the argument, else
    :func:`.calibration.prefill_threshold_choice` (settings, calibration, probe of this model, 512);
    ``ubatch``: the argument if > 0, else the ``n_ubatch`` setting if > 0, else the largest the
    automatic choice may take (``n_batch``, at most :data:`.cost.MAX_AUTO_UBATCH`). ``settings``
    defaults to the loaded settings, ``path`` to the hardware profile. Never raises on a missing or
    unreadable calibration (defaults then)."""
    if settings is None:
        settings = load_settings()
    src: dict[str, str] = {}
    cal = load_calibration(path)
    if not isinstance(cal, dict) or cal.get("stale") or cal.get("error"):
        cal = {}
    # the CPU branch's bandwidth is measured on the calibrated model's experts (their types): another
    # model's does not price this one's (the link's bandwidth is the machine's and stays)
    fp = (cal.get("model") or {}).get("fingerprint")
    same_model = model_fingerprint is None or fp is None or fp == model_fingerprint
    rows = [r for r in (cal.get("cpu_branch_bandwidth") or [] if same_model else []) if isinstance(r, dict)
            and isinstance(r.get("bw_gbps"), (int, float)) and 0 < r["bw_gbps"] < float("inf")]
    cpu = max((float(r["bw_gbps"]) for r in rows), default=None)
    src["cpu_gbps"] = ("calibration" if cpu else "default (paper: 13.4 MB per 0.184 ms route)"
                       + ("" if same_model else "; the calibration is of another model"))
    h2d = cal.get("h2d_pinned_gbps")
    if isinstance(h2d, (int, float)) and h2d > 0:
        src["h2d_gbps"] = "calibration"
    else:
        h2d = h2d_from_profile(path)
        src["h2d_gbps"] = "profile" if h2d else "default (paper: 13.4 MB per 0.53 ms upload)"
    if np_tokens:
        src["np_tokens"] = "argument"
    else:
        np_tokens, src["np_tokens"] = prefill_threshold_choice(settings, path, model_fingerprint)
    eng = getattr(settings, "engine", settings)
    if ubatch and ubatch > 0:
        src["ubatch"] = "argument"
    elif int(getattr(eng, "n_ubatch", 0) or getattr(settings, "n_ubatch", 0) or 0) > 0:
        ubatch = int(getattr(eng, "n_ubatch", 0) or getattr(settings, "n_ubatch", 0))
        src["ubatch"] = "settings"
    else:
        n_batch = int(getattr(eng, "n_batch", 0) or getattr(settings, "n_batch", 0) or 2048)
        ubatch = min(n_batch, MAX_AUTO_UBATCH)
        src["ubatch"] = "automatic (n_batch, at most 4096)"
    return PhaseCosts(cpu_gbps=float(cpu or DEFAULT_CPU_BRANCH_GBPS),
                      h2d_gbps=float(h2d or DEFAULT_H2D_GBPS), np_tokens=int(np_tokens),
                      ubatch=int(ubatch), source=src)


def plan_values(shape: ModelInfo, dev: Trace, costs: Optional[PhaseCosts] = None
                ) -> tuple[np.ndarray, dict[str, Any]]:
    """What the planner ranks the experts by: ``(values, info)``, values of shape
    (n_layer, n_expert) for :func:`fill_pool`.

    Phase-aware (``info["ranking"] == "time"``): the expected ms each expert saves over the dev
    traces, :func:`.cost.expert_time_savings` with ``costs`` (default :class:`.cost.PhaseCosts`(),
    the documented defaults) and the prefill passes of the traces' request sizes (``new_tokens``
    split by ``costs.ubatch``). Route counts, prefill + decode (``"routes"``, Rule 1 as before), when
    the traces hold prefill routes but no request with prefilled tokens (hand-made or old files:
    no passes to price them with). ``info`` adds the counts it used: ``decode_routes``,
    ``prefill_routes``, ``prefill_passes``, ``upload_passes`` and the costs."""
    counts = dev.counts
    info: dict[str, Any] = {"prefill_routes": int(dev.counts_prefill.sum()),
                            "decode_routes": int(dev.counts_decode.sum())}
    costs = costs or PhaseCosts()
    passes = prefill_passes((r.get("new_tokens", 0) for r in dev.requests), costs.ubatch)
    if info["prefill_routes"] > 0 and not passes:
        info["ranking"] = "routes"
        info["why"] = "the traces hold no request sizes: prefill passes cannot be priced"
        return counts, info
    info.update(ranking="time", costs=costs.to_json(), prefill_passes=len(passes),
                upload_passes=sum(1 for n in passes if n >= costs.np_tokens))
    return expert_time_savings(dev.counts_prefill, dev.counts_decode, shape.expert_bytes, passes, costs), info


def plan_residency(shape: ModelInfo, dev: Trace, *, workload: str,
                   gpus: Sequence[GpuSpec], budget_frac: Optional[float] = None,
                   budget_mb: Optional[int] = None, margin_mb: int = DEFAULT_MARGIN_MB,
                   n_ubatch: int = 512, heldout: Optional[Trace] = None,
                   source_traces: Sequence[str] = (), staging_regions: int = 1,
                   costs: Optional[PhaseCosts] = None) -> dict[str, Any]:
    """Plan a residency set; returns the ``ostinato-residency/1`` dict (not yet written).

    Experts are ranked by :func:`plan_values` (expected time saved per phase, priced with ``costs``:
    :func:`phase_costs_for` gives this machine's; None: the documented defaults of
    :class:`.cost.PhaseCosts`).

    Budget per GPU j: ``budget_frac`` x the expert bytes of its layers, or ``budget_mb`` MiB, capped
    by the capacity test when the GPU's free memory is known (free - need(longest request) - margin;
    ``staging_regions`` staging buffers in the need: 1 + the prefill prefetch's depth).
    Without either budget, free memory alone decides (needs real GPUs). Raises PlanError when the
    traces do not fit the model, no budget can be derived, or the capacity test leaves no room.
    """
    if dev.counts.shape != (shape.n_layer, shape.n_expert):
        raise PlanError(f"trace counts {dev.counts.shape} do not match the model "
                        f"({shape.n_layer}, {shape.n_expert})")
    fp = dev.model.get("fingerprint")
    if fp and fp != shape.fingerprint:
        raise PlanError(f"traces are for model {fp[:12]}, the model is {shape.fingerprint[:12]}")
    if not shape.moe_layers:
        raise PlanError(f"{shape.name}: no expert tensors (dense model): nothing to plan")
    if budget_frac is not None and not 0 < budget_frac <= 1:
        raise PlanError("budget fraction must be in (0, 1]")
    counts = dev.counts
    if counts.sum() == 0:
        log.warning("development traces hold no routes: the plan is arbitrary")
    values, ranking = plan_values(shape, dev, costs)
    known = [g.free_bytes is not None for g in gpus]
    weights = [g.free_bytes for g in gpus] if all(known) else [1.0] * len(gpus)
    ranges = split_layers(shape.n_layer, weights)
    max_tokens = max(int(dev.max_request_tokens), 1)
    out_gpus, capacity = [], []
    for j, (g, layers) in enumerate(zip(gpus, ranges)):
        exp_bytes = sum(shape.expert_bytes[l] * shape.n_expert for l in layers)
        need = estimate_gpu_need(shape, layers, max_tokens, n_ubatch=n_ubatch,
                                 last=(j == len(gpus) - 1), staging_regions=staging_regions)
        budget: Optional[int] = None
        if budget_mb is not None:
            budget = int(budget_mb) * MiB
        elif budget_frac is not None:
            budget = int(budget_frac * exp_bytes)
        cap = None
        if g.free_bytes is not None:
            cap = int(g.free_bytes) - need["total"] - margin_mb * MiB
            if cap < 0:
                raise PlanError(
                    f"capacity test failed on GPU {g.device}: the longest development request "
                    f"({max_tokens} tokens) needs {need['total'] / MiB:.0f} MiB + {margin_mb} MiB "
                    f"margin without any expert pool, {g.free_bytes / MiB:.0f} MiB are free")
            budget = cap if budget is None else min(budget, cap)
        if budget is None:
            raise PlanError("no GPU memory information: give the pool a budget (ostinato plan: "
                            "--budget-frac or --budget-mb; the daemon and 'ostinato residency plan': "
                            "the settings expert_budget_frac or expert_budget_mb, e.g. "
                            "OSTINATO_EXPERT_BUDGET_FRAC=0.45)")
        hot, used = fill_pool(values, shape.expert_bytes, layers, max(0, budget))
        out_gpus.append({"device": g.device, "layers": list(layers), "budget_bytes": int(budget),
                         "hot": {str(l): es for l, es in hot.items()}})
        capacity.append({"device": g.device, "name": g.name, "free_bytes": g.free_bytes,
                         "need_bytes": need, "margin_bytes": margin_mb * MiB,
                         "capacity_bytes": cap, "expert_bytes_of_layers": exp_bytes,
                         "pool_bytes": used,
                         "n_hot": sum(len(v) for v in hot.values()),
                         "test": "passed" if cap is not None else "emulated (free memory unknown)"})
    dev_share = hot_route_share(counts, out_gpus)
    held_share = hot_route_share(heldout.counts, out_gpus) if heldout is not None else None

    def per_phase(t: Optional[Trace]) -> Optional[dict[str, Optional[float]]]:
        if t is None:
            return None
        out = {}
        for name, c in (("prefill", t.counts_prefill), ("decode", t.counts_decode)):
            v = hot_route_share(c, out_gpus)
            out[name] = None if v != v else v   # NaN (no routes of that phase): null in JSON
        return out
    plan = {
        "source_traces": list(source_traces),
        "expected_hot_route_share": held_share if held_share is not None else dev_share,
        "dev_hot_route_share": dev_share,
        "heldout_hot_route_share": held_share,
        "dev_hot_route_share_per_phase": per_phase(dev),
        "heldout_hot_route_share_per_phase": per_phase(heldout),
        "ranking": ranking,
        "dev_routes": int(counts.sum()),
        "heldout_routes": int(heldout.counts.sum()) if heldout is not None else None,
        "budget_frac": budget_frac, "budget_mb": budget_mb,
        "expert_bytes_total": shape.total_expert_bytes,
        "pool_bytes_total": sum(c["pool_bytes"] for c in capacity),
        "max_request_tokens": max_tokens,
        "staging_regions": staging_regions,
        "capacity": capacity,
        "method": ("rank by the expected time each expert saves, decode routes over the CPU branch and "
                   "prefill passes by path (split: per route, upload: per distinct expert), fill each "
                   "GPU by time per byte across its layers (arXiv 2611.11533 Sec. 3.1-3.3, Rule 1-3, "
                   "App. B)" if ranking["ranking"] == "time" else
                   "rank by dev route counts (prefill+decode), fill each GPU by routes per byte "
                   "across its layers (arXiv 2611.11533 Sec. 3.1, Rule 1 / Prop. 3.1, App. B)"),
    }
    return {"format": RESIDENCY_FORMAT, "model": shape.model_block(), "workload": workload,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "gpus": out_gpus, "plan": plan}


def residency_path(fingerprint: str, workload: str, data_dir: Optional[Path] = None) -> Path:
    """Default residency-set path (:func:`ostinatod.paths.residency_file`)."""
    return residency_file(fingerprint, workload, data_dir)


def plan_for_model(model_path: Path, workload: str, *, traces: Sequence[Path] = (),
                   heldout_traces: Sequence[Path] = (), budget_frac: Optional[float] = None,
                   budget_mb: Optional[int] = None, gpus: str | int = "auto",
                   margin_mb: int = DEFAULT_MARGIN_MB, out: Optional[Path] = None,
                   data_dir: Optional[Path] = None) -> tuple[dict[str, Any], Path]:
    """Plan and write a residency set for a GGUF file (the Python form of ``ostinato plan``).

    ``traces`` default to the model's trace file for ``workload`` in the data dir. Returns
    (residency dict, written path). Raises PlanError/TraceError/ValueError with a clear message.
    """
    shape = read_model_shape(model_path)
    tpaths = [Path(p) for p in traces] or [trace_path(shape.fingerprint, workload, data_dir)]
    missing = [str(p) for p in tpaths if not p.exists()]
    if missing:
        raise PlanError(f"no routing traces: {', '.join(missing)} missing (replay development "
                        f"sessions through the daemon with this model and workload first)")
    dev = load_traces(tpaths, shape.fingerprint)
    held = load_traces([Path(p) for p in heldout_traces], shape.fingerprint) if heldout_traces else None

    s = load_settings()
    if budget_frac is None and budget_mb is None:
        budget_frac, budget_mb = s.expert_budget_frac, s.expert_budget_mb
    res = plan_residency(shape, dev, workload=workload, gpus=resolve_gpus(gpus),
                         budget_frac=budget_frac, budget_mb=budget_mb, margin_mb=margin_mb,
                         heldout=held, source_traces=[str(p) for p in tpaths],
                         staging_regions=staging_regions_for(s),
                         costs=phase_costs_for(s, model_fingerprint=shape.fingerprint))
    path = Path(out) if out else residency_path(shape.fingerprint, workload, data_dir)
    return res, write_residency(res, path)


def summary(res: dict[str, Any]) -> str:
    """Human-readable lines about a plan."""
    p = res["plan"]
    lines = [f"residency set for {res['model']['name']} ({res['model']['fingerprint'][:12]}), "
             f"workload {res['workload']}"]
    for c, g in zip(p["capacity"], res["gpus"]):
        lines.append(f"  GPU {g['device']}: layers {g['layers'][0]}-{g['layers'][-1]}, "
                     f"{c['n_hot']} hot experts, pool {c['pool_bytes'] / MiB:.1f} MiB of "
                     f"{c['expert_bytes_of_layers'] / MiB:.1f} MiB expert bytes; capacity test: "
                     f"{c['test']}" if g["layers"] else f"  GPU {g['device']}: no layers")
    lines.append(f"  pool {p['pool_bytes_total'] / MiB:.1f} MiB = "
                 f"{p['pool_bytes_total'] / max(1, p['expert_bytes_total']):.1%} of expert bytes; "
                 f"longest dev request {p['max_request_tokens']} tokens")
    lines.append(f"  hot-route share: dev {p['dev_hot_route_share']:.1%}" +
                 (f", held-out {p['heldout_hot_route_share']:.1%}"
                  if p["heldout_hot_route_share"] is not None else " (no held-out traces given)"))

    def phases(d: Optional[dict]) -> str:
        return ", ".join(f"{k} {v:.1%}" if v is not None else f"{k} n/a" for k, v in (d or {}).items())

    for label, key in (("dev", "dev_hot_route_share_per_phase"),
                       ("held-out", "heldout_hot_route_share_per_phase")):
        if p.get(key):
            lines.append(f"  {label} per phase: {phases(p[key])}")
    r = p.get("ranking") or {}
    if r.get("ranking") == "time":
        c = r["costs"]
        lines.append(f"  ranked by time saved: CPU branch {c['cpu_gbps']:.1f} GB/s, link "
                     f"{c['h2d_gbps']:.1f} GB/s, Np {c['np_tokens']}, ubatch {c['ubatch']}; "
                     f"{r['prefill_passes']} prefill passes ({r['upload_passes']} upload), "
                     f"{r['decode_routes']} decode routes")
    elif r.get("ranking") == "routes":
        lines.append(f"  ranked by route counts: {r.get('why')}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``ostinato plan``: plan a residency set from routing traces and write it."""
    ap = argparse.ArgumentParser(prog="ostinato plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="GGUF file")
    ap.add_argument("--workload", default="coding", help="workload name (default coding)")
    ap.add_argument("--traces", nargs="*", type=Path, default=[],
                    help="development trace files (default: the data dir's trace of this model "
                         "and workload)")
    ap.add_argument("--heldout-traces", nargs="*", type=Path, default=[],
                    help="held-out trace files: report the expected hot-route share on them")
    b = ap.add_mutually_exclusive_group()
    b.add_argument("--budget-frac", type=float, help="pool budget as a fraction of the expert bytes")
    b.add_argument("--budget-mb", type=int, help="pool budget in MiB per GPU")
    ap.add_argument("--gpus", default="auto", help="'auto' or a number of GPUs")
    ap.add_argument("--margin-mb", type=int, default=DEFAULT_MARGIN_MB,
                    help="memory kept free at peak on each GPU (capacity test)")
    ap.add_argument("-o", "--out", type=Path, help="output file (default: the data dir's "
                    "residency/<fingerprint>/<workload>.json)")
    ap.add_argument("--json", action="store_true", help="print the residency set as JSON")
    a = ap.parse_args(argv)
    try:
        res, path = plan_for_model(a.model, a.workload, traces=a.traces,
                                   heldout_traces=a.heldout_traces, budget_frac=a.budget_frac,
                                   budget_mb=a.budget_mb, gpus=a.gpus, margin_mb=a.margin_mb,
                                   out=a.out)
    except (PlanError, TraceError, ValueError, OSError) as e:
        print(f"ostinato plan: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if a.json else summary(res))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
