"""``ostinato bench engines``: the per-step breakdown of the Ostinato engine from the native per-pass
stats (control-API snapshots before and after each turn): route counts per phase, hot-route shares
against the paper's targets, the decode path's warnings, per-turn and per-run breakdowns and their
markdown. The other figures and the report are in :mod:`.bench_report`."""

from __future__ import annotations

from typing import Any, Optional

from .bench_common import fmt


# --------------------------------------------------------------------------------------------
# per-step breakdown of the Ostinato engine (native per-pass stats)
# --------------------------------------------------------------------------------------------

def _ms_keys(d: dict[str, Any]) -> dict[str, float]:
    """The ``*_ms`` figures of a stats dict (any such key: the native side adds new ones)."""
    return {k: float(v) for k, v in d.items()
            if k.endswith("_ms") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _indexed(snap: Optional[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``last_passes`` of a stats snapshot keyed by pass number (0 = the first since load): the ring
    holds the last passes up to the cumulative ``passes`` count, both updated under one lock."""
    if not snap:
        return {}
    n, ring = int(snap.get("passes") or 0), list(snap.get("last_passes") or [])
    return {n - len(ring) + i: p for i, p in enumerate(ring)}


# per-pass counts of the native stats summed per prefill (bytes copied to the staging slots, the
# prefetch's experts: predicted and used, needed and not predicted, predicted and not used)
PASS_COUNT_KEYS = ("upload_bytes", "upload_copies", "distinct_cold_experts", "prefetch_hits", "prefetch_misses",
                   "prefetch_wasted")


# per-pass counts of the decode steps averaged per step seen: the CPU branch's expert bytes read and
# its layer computes (of which by its own kernel), docs/engine.md "CPU branch kernel"; the decode
# prefetch's staged experts, the cold routes they served on the GPU and the bytes they copied
# ("Decode prefetch")
DECODE_MEAN_KEYS = ("cpu_branch_bytes", "cpu_branch_layers", "cpu_kernel_layers", "decode_prefetch_staged",
                    "decode_prefetch_routes", "decode_prefetch_bytes")


ROUTE_KEYS = ("routes", "hot_routes", "cold_routes")


def route_sums(passes: list[dict[str, Any]]) -> dict[str, int]:
    """:data:`ROUTE_KEYS` summed over per-pass dicts (routes: one per token, MoE layer and used
    expert; hot: computed from a pool-resident expert)."""
    return {k: int(sum(p.get(k) or 0 for p in passes)) for k in ROUTE_KEYS}


def phase_routes(rs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Hot share of one phase over turn rows (``key``: "decode_routes" or "prefill_routes" of
    :func:`turn_breakdown`). Returns ``{"hot_route_share" (None where no route was counted),
    "routes", "cold_routes"}`` (sums)."""
    sums = [r[key] for r in rs if r.get(key)]
    n = sum(x["routes"] for x in sums)
    return {"hot_route_share": round(sum(x["hot_routes"] for x in sums) / n, 4) if n else None,
            "routes": n, "cold_routes": sum(x["cold_routes"] for x in sums)}


# decode more than this much hotter or colder than prefill: the model's generated tokens route unlike text
PHASE_SKEW_WARN = 0.05


# the Ostinato paper's real model (arXiv 2611.11533 Sec. 2): at a 44% pool 84% of held-out routes
# are hot; a run at a pool in HOT_SHARE_POOL warns when a phase's share is further than
# HOT_SHARE_TOL from it
HOT_SHARE_TARGET = 0.84


HOT_SHARE_TOL = 0.03


HOT_SHARE_POOL = (0.42, 0.47)


def phase_skew_warning(b: Optional[dict[str, Any]], who: str = "ostinato") -> Optional[str]:
    """A warning when the decode steps' hot-route share in a ``step_breakdown``
    (:func:`summarize_breakdown`) departs by more than :data:`PHASE_SKEW_WARN` from the prefills'
    (the prefills after tool outputs when there are any): hotter, the decode figures measure a model
    whose generated tokens route almost only to hot experts (docs/design.md "Testing and
    measuring"); colder, they exercise the CPU branch more than the real model would. None when it
    does not, or when a share is missing."""
    if not b:
        return None
    d = (b.get("decode_step") or {}).get("hot_route_share")
    pre = b.get("prefill_after_tool") or {}
    which = "prefill after tool"
    if pre.get("hot_route_share") is None:
        pre, which = b.get("prefill") or {}, "prefill"
    p = pre.get("hot_route_share")
    if d is None or p is None or abs(d - p) <= PHASE_SKEW_WARN:
        return None
    if d > p:
        return (f"{who}: decode hot-route share {d:.3f} is {100 * (d - p):.1f} points above the {which} "
                f"share {p:.3f} (more than {100 * PHASE_SKEW_WARN:.0f}): this model's generated tokens "
                "route unlike its prompts, so the decode figures undercount cold routes")
    return (f"{who}: decode hot-route share {d:.3f} is {100 * (p - d):.1f} points below the {which} "
            f"share {p:.3f} (more than {100 * PHASE_SKEW_WARN:.0f}): this model's generated tokens "
            "route unlike its prompts, so the decode figures overcount cold routes")


def hot_shares(b: Optional[dict[str, Any]], pool_frac: Optional[float], who: str = "ostinato") -> dict[str, Any]:
    """The per-phase hot-route shares of an Ostinato engine's run and their check against the
    paper's real model, from its ``step_breakdown`` ``b`` (:func:`summarize_breakdown`; the
    hot-shares-only mode builds the same keys from route counts) and the pool's share of the expert
    bytes ``pool_frac``. Returns ``{"pool_frac", "prefill", "prefill_after_tool", "decode",
    "decode_minus_prefill", "target": [lo, hi], "checked" (the pool is in :data:`HOT_SHARE_POOL`),
    "warnings": [str]}``: a warning when, at such a pool, a phase's share (prefill, decode) is
    outside ``HOT_SHARE_TARGET +- HOT_SHARE_TOL``, and at any pool :func:`phase_skew_warning`."""
    b = b or {}
    sh = {k: (b.get(src) or {}).get("hot_route_share")
          for k, src in (("prefill", "prefill"), ("prefill_after_tool", "prefill_after_tool"), ("decode", "decode_step"))}
    lo, hi = HOT_SHARE_TARGET - HOT_SHARE_TOL, HOT_SHARE_TARGET + HOT_SHARE_TOL
    checked = pool_frac is not None and HOT_SHARE_POOL[0] <= pool_frac <= HOT_SHARE_POOL[1]
    warnings = []
    if checked:
        for phase in ("prefill", "decode"):
            v = sh[phase]
            if v is not None and not lo - 1e-9 <= v <= hi + 1e-9:
                warnings.append(f"{who}: {phase} hot-route share {v:.3f} at a {pool_frac:.1%} pool is outside "
                                f"{HOT_SHARE_TARGET:.2f} +- {HOT_SHARE_TOL:.2f} (the paper's real model at a "
                                "44% pool): this file routes unlike the real model")
    gap = phase_skew_warning(b, who)
    if gap:
        warnings.append(gap)
    d, p = sh["decode"], sh["prefill"]
    return {"pool_frac": None if pool_frac is None else round(pool_frac, 4), **sh,
            "decode_minus_prefill": None if d is None or p is None else round(d - p, 4),
            "target": [round(lo, 4), round(hi, 4)], "checked": checked, "warnings": warnings}


def decode_path_warning(ex: Optional[dict[str, Any]], who: str = "ostinato") -> Optional[str]:
    """A warning when an Ostinato engine's decode steps did not all take the path its figures are
    read as (the decode graph with the CPU branch's own kernel), from its :func:`.bench_launch.expert_stats`
    ``ex``: the graph broken by a lost wait or failed at creation, one-token passes
    (``paths["decode"]``) outside it (``decode_graph_steps``), or a layer's CPU-branch graph that the
    kernel does not match (computed by ggml's graph compute although the kernel is on). None when all is as expected, when the run has no
    decode graph (a CPU build: ``decode_graph`` never active and no step in it) or no stats."""
    if not ex or not isinstance(ex.get("decode_graph"), dict):
        return None
    dg, problems = ex["decode_graph"], []
    steps = int((ex.get("paths") or {}).get("decode") or 0)
    in_graph = int(ex.get("decode_graph_steps") or 0)
    if not dg.get("active") and not in_graph and not dg.get("broken") and not dg.get("failed"):
        return None
    if dg.get("broken"):
        problems.append("a lost wait turned the decode graph off")
    if dg.get("failed"):
        problems.append("the decode graph could not be created")
    if steps and in_graph < steps:
        problems.append(f"{steps - in_graph} of {steps} decode steps ran outside the decode graph")
    k = dg.get("cpu_kernel") or {}
    if k.get("on") and k.get("unmatched"):
        # a layer's CPU-branch graph the kernel does not take (ggml computes it in every step); not
        # the experts with >= 8 routes of a tiled type in a multi-token pass, which ggml takes by design
        problems.append(f"a CPU-branch graph the kernel does not match ({k['unmatched']})")
    return f"{who}: " + "; ".join(problems) + ": its decode figures are not the kernel's" if problems else None


def turn_breakdown(prev: dict[str, Any], cur: dict[str, Any],
                   mid: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Per-turn split of the native engine's pass times between the turn's prefill passes (path
    split/upload) and its decode steps, from snapshots of ``ExpertRuntime.stats()`` (cumulative
    totals, ``paths`` counts, ``last_passes``: the last 32 passes) taken before the turn (``prev``),
    after it (``cur``) and, optionally, just after its first decode steps (``mid``: it holds the
    prefill passes however long the turn is).

    When every prefill pass of the turn was seen (in ``mid`` or ``cur``) the split is exact: decode
    = the turn's cumulative delta minus the prefill passes. Otherwise (no ``mid`` and more than 32
    passes) the decode steps are estimated as ``steps x the mean of the steps seen`` and the
    prefill as the delta minus that (``exact`` False). Keys only in the per-pass dicts (not in the
    totals) are summed over the passes seen. Returns ``{"passes", "seen", "exact",
    "decode_steps", "decode_seen", "decode_ms" (sums over the turn's steps), "decode_cold_routes"
    (mean per step seen), "decode_means" (:data:`DECODE_MEAN_KEYS` per step seen), "decode_routes"
    (:func:`route_sums` over the steps seen), "prefill_routes" (over the prefill passes, when all were
    seen, else None), "prefill_passes", "prefill_paths", "prefill_tokens", "prefill_ms" (sums
    over the turn's prefill passes), "prefill_sums" (:data:`PASS_COUNT_KEYS` summed over them, when
    all were seen, else empty), "gpu_timed" (share of the seen passes with GPU timing)}``."""
    p0 = int(prev.get("passes") or 0)
    dn = int(cur.get("passes") or 0) - p0
    known = {**_indexed(mid), **_indexed(cur)}
    seen = [known[i] for i in range(p0, p0 + dn) if i in known]
    pp, cp = prev.get("paths") or {}, cur.get("paths") or {}
    dpath = {k: int(cp.get(k, 0) or 0) - int(pp.get(k, 0) or 0) for k in set(pp) | set(cp)}
    n_dec = max(0, dpath.get("decode", 0))
    pre_paths = {k: v for k, v in dpath.items() if k != "decode" and v > 0}
    n_pre = sum(pre_paths.values())
    dec_seen = [p for p in seen if p.get("path") == "decode"]
    pre_seen = [p for p in seen if p.get("path") != "decode"]
    tot_prev, tot_cur = _ms_keys(prev), _ms_keys(cur)
    keys = sorted(set(tot_cur).union(*[_ms_keys(p) for p in seen]))

    def ssum(ps: list[dict], k: str) -> float:
        return sum(_ms_keys(p).get(k, 0.0) for p in ps)

    exact = len(seen) == dn
    all_pre = len(pre_seen) >= n_pre
    dec_ms: dict[str, Optional[float]] = {}
    pre_ms: dict[str, Optional[float]] = {}
    for k in keys:
        delta = tot_cur[k] - tot_prev[k] if k in tot_cur and k in tot_prev else None
        mean_dec = ssum(dec_seen, k) / len(dec_seen) if dec_seen else None
        if all_pre:
            pre_ms[k] = ssum(pre_seen, k)
            if len(dec_seen) >= n_dec:
                dec_ms[k] = ssum(dec_seen, k)
            elif delta is not None:
                dec_ms[k] = delta - pre_ms[k]
            else:
                dec_ms[k] = n_dec * mean_dec if mean_dec is not None else None
        else:
            dec_ms[k] = n_dec * mean_dec if mean_dec is not None else (0.0 if n_dec == 0 else None)
            pre_ms[k] = delta - dec_ms[k] if delta is not None and dec_ms[k] is not None else None
    if all_pre:
        pre_tokens: Optional[int] = int(sum(p.get("tokens") or 0 for p in pre_seen))
    else:
        pre_tokens = int(cur.get("tokens") or 0) - int(prev.get("tokens") or 0) - n_dec
    cold = [p.get("cold_routes") for p in dec_seen if p.get("cold_routes") is not None]
    means = {k: sum(p.get(k) or 0 for p in dec_seen) / len(dec_seen) for k in DECODE_MEAN_KEYS
             if dec_seen and any(k in p for p in dec_seen)}
    return {"passes": dn, "seen": len(seen), "exact": exact or all_pre,
            "decode_steps": n_dec, "decode_seen": len(dec_seen), "decode_ms": dec_ms,
            "decode_cold_routes": sum(cold) / len(cold) if cold else None,
            "decode_means": means,
            "decode_routes": route_sums(dec_seen), "prefill_routes": route_sums(pre_seen) if all_pre else None,
            "prefill_passes": n_pre, "prefill_paths": pre_paths, "prefill_tokens": pre_tokens,
            "prefill_ms": pre_ms,
            "prefill_sums": ({k: int(sum(p.get(k) or 0 for p in pre_seen)) for k in PASS_COUNT_KEYS}
                             if all_pre else {}),
            "gpu_timed": (sum(1 for p in seen if p.get("gpu_timed")) / len(seen)) if seen else None}


def summarize_breakdown(rows: list[Optional[dict[str, Any]]], turns: list[dict[str, Any]]
                        ) -> dict[str, Any]:
    """Means per decode step and per prefill over the turns (``rows`` from :func:`turn_breakdown`,
    aligned with ``turns`` from :func:`replay_turns`; None rows: no snapshot). Returns
    ``{"decode_step": {"steps", "sampled_steps", "cold_routes_mean" (per step), "hot_route_share",
    "routes", "cold_routes" (over the steps seen), "mean_ms": {key: ms}, "means": {DECODE_MEAN_KEYS
    per step, "cpu_branch_gbps": bytes / cpu_branch_ms}}, "prefill": {"prefills",
    "passes", "paths", "tokens_mean", "exact_share", "hot_route_share", "routes", "cold_routes",
    "cold_routes_per_prefill", "cold_routes_per_token" (over the prefills whose passes were all
    seen), "mean_ms", "mean_counts" (:data:`PASS_COUNT_KEYS` per
    prefill, over the same prefills)},
    "prefill_after_tool": (the same over turns after tool outputs), "gpu_timed_share", "source"}``.
    """
    def dec(rs: list[dict]) -> dict[str, Any]:
        steps = sum(r["decode_steps"] for r in rs)
        keys = sorted({k for r in rs for k in r["decode_ms"]})
        mean = {}
        for k in keys:
            have = [r for r in rs if r["decode_ms"].get(k) is not None and r["decode_steps"]]
            n = sum(r["decode_steps"] for r in have)
            mean[k] = round(sum(r["decode_ms"][k] for r in have) / n, 4) if n else None
        cold = [(r["decode_cold_routes"], r["decode_seen"]) for r in rs if r["decode_cold_routes"] is not None]
        w = sum(c[1] for c in cold)
        means = {}
        for k in DECODE_MEAN_KEYS:
            have = [(r["decode_means"][k], r["decode_seen"]) for r in rs if k in (r.get("decode_means") or {})]
            n = sum(c for _, c in have)
            if n:
                means[k] = round(sum(v * c for v, c in have) / n, 1)
        # the CPU branch's effective bandwidth over the steps seen (bytes read / its time)
        if means.get("cpu_branch_bytes") and mean.get("cpu_branch_ms"):
            means["cpu_branch_gbps"] = round(means["cpu_branch_bytes"] / mean["cpu_branch_ms"] / 1e6, 2)
        return {"steps": steps, "sampled_steps": sum(r["decode_seen"] for r in rs),
                "cold_routes_mean": round(sum(c * n for c, n in cold) / w, 3) if w else None,
                **phase_routes(rs, "decode_routes"), "mean_ms": mean, "means": means}

    def _per_prefill(rs: list[dict]) -> dict[str, Any]:
        counted = [r for r in rs if r.get("prefill_routes")]
        ph = phase_routes(counted, "prefill_routes")
        toks = sum(r["prefill_tokens"] or 0 for r in counted)
        return {**ph, "cold_routes_per_prefill": round(ph["cold_routes"] / len(counted), 2) if counted else None,
                "cold_routes_per_token": round(ph["cold_routes"] / toks, 3) if toks else None}

    def pre(rs: list[dict]) -> dict[str, Any]:
        rs = [r for r in rs if r["prefill_passes"] > 0]
        paths: dict[str, int] = {}
        for r in rs:
            for k, v in r["prefill_paths"].items():
                paths[k] = paths.get(k, 0) + v
        keys = sorted({k for r in rs for k in r["prefill_ms"]})
        mean = {}
        for k in keys:
            xs = [r["prefill_ms"][k] for r in rs if r["prefill_ms"].get(k) is not None]
            mean[k] = round(sum(xs) / len(xs), 4) if xs else None
        toks = [r["prefill_tokens"] for r in rs if r["prefill_tokens"] is not None]
        summed = [r["prefill_sums"] for r in rs if r.get("prefill_sums")]
        counts = {k: round(sum(c[k] for c in summed) / len(summed), 1) for k in PASS_COUNT_KEYS} if summed else {}
        return {"prefills": len(rs), "passes": sum(r["prefill_passes"] for r in rs), "paths": paths,
                "tokens_mean": round(sum(toks) / len(toks), 1) if toks else None,
                "exact_share": round(sum(1 for r in rs if r["exact"]) / len(rs), 3) if rs else None,
                **_per_prefill(rs), "mean_ms": mean, "mean_counts": counts}

    ok = [r for r in rows if r]
    after = [r for r, t in zip(rows, turns) if r and t.get("after") == "tool"]
    timed = [r["gpu_timed"] for r in ok if r["gpu_timed"] is not None]
    return {"decode_step": dec(ok), "prefill": pre(ok), "prefill_after_tool": pre(after),
            "gpu_timed_share": round(sum(timed) / len(timed), 3) if timed else None,
            "turns": len(rows), "turns_with_stats": len(ok),
            "source": "native per-pass stats (control API /metrics, engine.experts) before and after "
                      "every turn and after its first decode step; gpu_branch_ms is measured only in "
                      "timing mode (gpu_timed_share)"}


def breakdown_md(b: Optional[dict[str, Any]], who: str) -> list[str]:
    """Markdown lines for a ``step_breakdown`` (means in ms per decode step and per prefill)."""
    if not b:
        return []
    cols = [("decode step", b.get("decode_step") or {}), ("prefill", b.get("prefill") or {}),
            ("prefill after tool", b.get("prefill_after_tool") or {})]
    keys = sorted({k for _, c in cols for k in (c.get("mean_ms") or {})},
                  key=lambda k: (k != "total_ms", k))
    if not keys:
        return []
    d, p = cols[0][1], cols[1][1]
    out = ["", f"{who} per-step breakdown (native pass times, mean ms; {d.get('steps')} decode steps, "
           f"{d.get('sampled_steps')} seen pass by pass; {p.get('prefills')} prefills, paths "
           f"{p.get('paths')}, {fmt(p.get('exact_share'), '', 2)} of them exact; GPU-branch timing "
           f"on in {fmt(b.get('gpu_timed_share'), '', 2)} of the passes):", "",
           "| ms | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    for k in keys:
        out.append(f"| {k} | " + " | ".join(fmt((c.get("mean_ms") or {}).get(k), "", 3) for _, c in cols)
                   + " |")
    out.append("| cold routes / tokens | " + " | ".join(
        [fmt(d.get("cold_routes_mean"), "", 2)] + [fmt(c.get("tokens_mean"), "", 0) for _, c in cols[1:]])
        + " |")
    out.append("| hot-route share | " + " | ".join(fmt(c.get("hot_route_share"), "", 3) for _, c in cols) + " |")
    out.append("| cold routes per step / per prefill | " + " | ".join(
        [fmt(d.get("cold_routes_mean"), "", 2)] + [fmt(c.get("cold_routes_per_prefill"), "", 1) for _, c in cols[1:]])
        + " |")
    dm = d.get("means") or {}
    if dm.get("cpu_branch_bytes"):
        out.append(f"| CPU branch MB read / GB/s (decode) | {fmt(dm['cpu_branch_bytes'] / 1e6, '', 2)} / "
                   f"{fmt(dm.get('cpu_branch_gbps'), '', 1)} | | |")
    if dm.get("decode_prefetch_staged"):
        out.append(f"| decode prefetch: experts staged / cold routes on the GPU / MB copied (decode) | "
                   f"{fmt(dm['decode_prefetch_staged'], '', 1)} / {fmt(dm.get('decode_prefetch_routes'), '', 1)} / "
                   f"{fmt((dm.get('decode_prefetch_bytes') or 0) / 1e6, '', 1)} | | |")
    tl = b.get("decode_timeline")
    if tl:
        out.append(f"| decode timeline ({tl['passes']} steps): route to route ms / GPU work ms / layers with CPU "
                   f"routes: us each (of it wait) / other layers: us each | {fmt(tl['span_ms'], '', 2)} / "
                   f"{fmt(tl['gpu_work_ms'], '', 2)} / {fmt(tl['cpu_layers'], '', 1)}: {fmt(tl['cpu_layer_us'], '', 0)} "
                   f"({fmt(tl['cpu_wait_us'], '', 0)}) / {fmt(tl['gpu_layer_us'], '', 0)} | | |")
        if tl.get("chain_layers"):
            out.append(f"| decode prefetch chains: per step / us each (of it copies) / main stream's wait for "
                       f"the copies ms per step / share ending after the route | {fmt(tl['chain_layers'], '', 1)} / "
                       f"{fmt(tl['chain_us'], '', 0)} ({fmt(tl['chain_copy_us'], '', 0)}) / "
                       f"{fmt(tl['chain_wait_ms'], '', 3)} / {fmt(tl['chain_late_share'], '', 2)} | | |")
    return out
