"""The GPU timeline of ``ostinato bench timeline``, read from a torch.profiler (Kineto/CUPTI) chrome
trace. Pure: a list of chrome-trace events in, dicts out (tested on hand-made traces; no torch here).

Times are microseconds (us) as in the trace, unless a key says ``_ms``; bytes are bytes.

Phases are the harness's ``record_function`` ranges (``user_annotation`` events named
``timeline:<phase>``, e.g. ``timeline:prefill``, ``timeline:decode:3``); the harness synchronizes
the context at the end of each range, so the GPU work it launched ends inside it. A GPU event
(kernel, memcpy, memset) belongs to the phase whose range holds the CPU launch call that has the
same ``correlation`` id (CUDA graphs: the kernels of one ``cudaGraphLaunch`` share its id), else,
when the runtime call was not recorded, to the phase whose range holds the event's own start.

Per phase (:func:`phase_summary`): ``wall_us`` (the range), ``gpu_busy_us`` (the union of every
kernel, memcpy and memset interval, all streams), the **compute stream** (the stream with the most
kernel time) with its busy time, its first-kernel-to-last span, the idle gaps inside that span
(``idle_us``, ``gaps`` of at least :data:`GAP_MIN_US`, the largest with the kernels around them),
``lead_in_us`` (range start to its first kernel: host work before the first launch) and ``tail_us``
(its last kernel's end to the range's end); memcpy per direction (count, bytes, us); and per kernel
name (:func:`short_name`) count and total us.

**Per-layer time** (:func:`per_layer`), a heuristic: llama.cpp launches the same *marker* kernel at
fixed places of every layer (default: the kernel whose name contains ``rms_norm``: the norm before
attention, with the norm before the FFN and the output norm under the same name when CUDA fuses
the multiply into both). A kernel name qualifies when it occurs ``passes * (m * n_layer + r)``
times in the phase, ``m >= 1`` per layer, ``r`` in {0, 1} (the output norm); of those the smallest
``m``, then the earliest first launch. Layer i of a pass spans from its marker ``i * m`` to layer
i + 1's (the last layer to the output norm, or to the pass's last kernel); kernels are attributed by
their start time (all streams; a copy stream's uploads go to the layer whose span they start in);
``pre_us`` is what runs before the first pass's first marker (embeddings, inputs), ``post_us`` what
runs after a pass's output norm, up to the next pass's first marker (the next pass's inputs included).
It fails (``None`` with a note naming the marker counts) where no name fits: layers of different
kinds with a different number of such norms (qwen35moe's linear- and full-attention layers may),
a fusion that differs per layer, or a trace without kernel names. Check ``marker`` in the result.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable, Optional

#: idle intervals on the compute stream shorter than this (us) are not counted as gaps
GAP_MIN_US = 2.0
#: largest gaps listed per phase
TOP_GAPS = 5
PHASE_PREFIX = "timeline:"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CALL_CATS = ("cuda_runtime", "cuda_driver", "runtime", "driver")


def short_name(name: str, width: int = 72) -> str:
    """A demangled kernel name shortened: no return type, no parameter list, no ``(ggml_type)``
    casts or spaces in the template arguments, cut to ``width`` characters."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    s = s[:cut]
    s = re.sub(r"\((?:ggml_type|int|bool|unsigned int)\)", "", s)
    s = re.sub(r"\s+", "", s).replace("ggml_cuda::", "")
    return s if len(s) <= width else s[: width - 1] + "~"


def _events(trace: Any) -> list[dict[str, Any]]:
    if isinstance(trace, dict):
        trace = trace.get("traceEvents") or []
    return [e for e in trace if isinstance(e, dict) and e.get("ph") == "X"]


def _corr(e: dict[str, Any]) -> Optional[int]:
    a = e.get("args") or {}
    c = a.get("correlation", a.get("correlation id"))
    return int(c) if isinstance(c, (int, float)) else None


def _stream(e: dict[str, Any]) -> Any:
    a = e.get("args") or {}
    return a.get("stream", e.get("tid"))


def phases(trace: Any) -> dict[str, tuple[float, float]]:
    """``{phase: (start_us, end_us)}`` of the harness's ranges (``timeline:<phase>`` annotations)."""
    out: dict[str, tuple[float, float]] = {}
    for e in _events(trace):
        n = str(e.get("name", ""))
        if n.startswith(PHASE_PREFIX) and e.get("cat") in ("user_annotation", "cpu_op", None):
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            out[n[len(PHASE_PREFIX):]] = (ts, ts + dur)
    return out


def split_by_phase(trace: Any) -> tuple[dict[str, tuple[float, float]], dict[str, list[dict[str, Any]]], int]:
    """(phase ranges, GPU events per phase, GPU events in no phase): see the module docstring."""
    evs = _events(trace)
    ranges = phases(evs)
    calls = {}
    for e in evs:
        if e.get("cat") in CPU_CALL_CATS and _corr(e) is not None:
            calls[_corr(e)] = float(e["ts"])
    order = sorted(ranges.items(), key=lambda kv: kv[1][0])

    def which(t: float) -> Optional[str]:
        for name, (a, b) in order:
            if a <= t <= b:
                return name
        return None

    per: dict[str, list[dict[str, Any]]] = {n: [] for n in ranges}
    outside = 0
    for e in evs:
        if e.get("cat") not in GPU_CATS:
            continue
        c = _corr(e)
        ph = which(calls[c]) if c in calls else None
        if ph is None:
            ph = which(float(e["ts"]))
        if ph is None:
            outside += 1
        else:
            per[ph].append(e)
    return ranges, per, outside


def _union(iv: Iterable[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total length of the union of intervals and the merged intervals, sorted."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(iv):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return sum(b - a for a, b in merged), merged


def _copy_kind(name: str) -> str:
    n = name.replace(" ", "").lower()
    for k in ("htod", "dtoh", "dtod", "htoh", "ptop"):
        if k in n:
            return {"htod": "H2D", "dtoh": "D2H", "dtod": "D2D", "htoh": "H2H", "ptop": "P2P"}[k]
    return "other"


def phase_summary(rng: tuple[float, float], evs: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's figures (module docstring) from its range and GPU events."""
    start, end = rng
    kern = [e for e in evs if e.get("cat") == "kernel"]
    iv = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in evs]
    busy, _ = _union(iv)
    by_stream: dict[Any, float] = defaultdict(float)
    for e in kern:
        by_stream[_stream(e)] += float(e.get("dur", 0))
    out: dict[str, Any] = {"wall_us": round(end - start, 1), "gpu_busy_us": round(busy, 1),
                           "kernels": len(kern), "kernel_us": round(sum(float(e.get("dur", 0)) for e in kern), 1),
                           "streams": {str(k): round(v, 1) for k, v in sorted(by_stream.items(), key=lambda kv: -kv[1])}}
    if kern:
        cs = max(by_stream, key=by_stream.get)
        ks = sorted((e for e in kern if _stream(e) == cs), key=lambda e: float(e["ts"]))
        cbusy, merged = _union((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in ks)
        first, last = merged[0][0], merged[-1][1]
        gaps = []
        for (a0, b0), (a1, _) in zip(merged, merged[1:]):
            if a1 - b0 >= GAP_MIN_US:
                gaps.append((a1 - b0, b0, a1))
        names = [(float(e["ts"]) + float(e.get("dur", 0)), float(e["ts"]), short_name(str(e.get("name", "")))) for e in ks]

        def around(t0: float, t1: float) -> tuple[str, str]:
            before = max((n for n in names if n[0] <= t0 + 1e-6), default=(0, 0, "?"))[2]
            after = min(((n[1], n[2]) for n in names if n[1] >= t1 - 1e-6), default=(0, "?"))[1]
            return before, after

        top = sorted(gaps, reverse=True)[:TOP_GAPS]
        out["compute_stream"] = {
            "stream": str(cs), "busy_us": round(cbusy, 1), "span_us": round(last - first, 1),
            "idle_us": round(last - first - cbusy, 1), "gaps": len(gaps),
            "gap_us": round(sum(g[0] for g in gaps), 1),
            "largest_gaps": [{"us": round(g, 1), "at_us": round(a - start, 1), "after": around(a, b)[0],
                              "before": around(a, b)[1]} for g, a, b in top],
            "lead_in_us": round(first - start, 1), "tail_us": round(end - last, 1)}
    copies: dict[str, dict[str, float]] = {}
    for e in evs:
        if e.get("cat") != "gpu_memcpy":
            continue
        c = copies.setdefault(_copy_kind(str(e.get("name", ""))), {"count": 0, "bytes": 0, "us": 0.0})
        c["count"] += 1
        c["bytes"] += int((e.get("args") or {}).get("bytes", 0) or 0)
        c["us"] = round(c["us"] + float(e.get("dur", 0)), 1)
    out["memcpy"] = copies
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kern:
        row = table[short_name(str(e.get("name", "")))]
        row[0] += 1
        row[1] += float(e.get("dur", 0))
    out["by_kernel"] = {k: {"count": int(v[0]), "us": round(v[1], 1)}
                        for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])}
    return out


def per_layer(evs: list[dict[str, Any]], n_layer: int, passes: int = 1,
              marker: str = "rms_norm") -> dict[str, Any]:
    """Per-layer GPU time of one phase by the marker heuristic (module docstring): ``{"marker",
    "per_layer_marker_count", "layers": [{"layer", "kernel_us", "span_us", "kernels"}], "pre_us",
    "post_us"}`` summed over the phase's ``passes``, or ``{"layers": None, "note": why}``."""
    kern = sorted((e for e in evs if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    if not kern or n_layer <= 0 or passes <= 0:
        return {"layers": None, "note": "no kernels in the phase"}
    counts: dict[str, int] = defaultdict(int)
    first: dict[str, float] = {}
    for e in kern:
        n = short_name(str(e.get("name", "")))
        if marker in n:
            counts[n] += 1
            first.setdefault(n, float(e["ts"]))
    fits = []
    for n, c in counts.items():
        if c % passes:
            continue
        per = c // passes
        for r in (0, 1):
            if per - r >= n_layer and (per - r) % n_layer == 0:
                fits.append(((per - r) // n_layer, first[n], n, r))
    if not fits:
        return {"layers": None, "note": f"no kernel named like {marker!r} occurs passes x (m x {n_layer} "
                f"[+1]) times ({passes} passes): counts {dict(counts)}"}
    m, _, name, r = min(fits)
    marks = [float(e["ts"]) for e in kern if short_name(str(e.get("name", ""))) == name]
    per_pass = m * n_layer + r
    layers = [{"layer": i, "kernel_us": 0.0, "span_us": 0.0, "kernels": 0} for i in range(n_layer)]
    pre = post = 0.0
    bounds: list[tuple[float, float, int]] = []   # (start, end, layer; -2: after the output norm)
    for p in range(passes):
        ms = marks[p * per_pass:(p + 1) * per_pass]
        p_end = marks[(p + 1) * per_pass] if p + 1 < passes else float("inf")
        starts = [ms[i * m] for i in range(n_layer)]
        ends = starts[1:] + [ms[n_layer * m] if r else p_end]
        for i in range(n_layer):
            bounds.append((starts[i], ends[i], i))
        if r:
            bounds.append((ends[-1], p_end, -2))
    for e in kern:
        t, d = float(e["ts"]), float(e.get("dur", 0))
        for a, b, i in bounds:
            if a <= t < b:
                if i >= 0:
                    layers[i]["kernel_us"] += d
                    layers[i]["kernels"] += 1
                else:
                    post += d
                break
        else:
            pre += d   # before a pass's first marker (embeddings, inputs)
    last_end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kern)
    for a, b, i in bounds:
        if i >= 0:
            layers[i]["span_us"] += min(b, last_end) - a
    for x in layers:
        x["kernel_us"], x["span_us"] = round(x["kernel_us"], 1), round(x["span_us"], 1)
    return {"marker": name, "per_layer_marker_count": m, "output_norm": bool(r), "layers": layers,
            "pre_us": round(pre, 1), "post_us": round(post, 1)}


def _mean_of(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step mean of several decode steps' summaries (scalars, memcpy, kernel table, layers)."""
    n = len(summaries)
    out: dict[str, Any] = {"steps": n}
    for k in ("wall_us", "gpu_busy_us", "kernels", "kernel_us"):
        out[k] = round(sum(s[k] for s in summaries) / n, 1)
    cs = [s["compute_stream"] for s in summaries if "compute_stream" in s]
    if cs:
        out["compute_stream"] = {k: round(sum(c[k] for c in cs) / len(cs), 1)
                                 for k in ("busy_us", "span_us", "idle_us", "gaps", "gap_us", "lead_in_us", "tail_us")}
        out["compute_stream"]["largest_gaps"] = sorted((g for c in cs for g in c["largest_gaps"]),
                                                       key=lambda g: -g["us"])[:TOP_GAPS]
    copies: dict[str, dict[str, float]] = {}
    for s in summaries:
        for k, c in s["memcpy"].items():
            d = copies.setdefault(k, {"count": 0, "bytes": 0, "us": 0.0})
            for f in d:
                d[f] += c[f] / n
    out["memcpy"] = {k: {f: round(v, 1) for f, v in d.items()} for k, d in copies.items()}
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in summaries:
        for k, v in s["by_kernel"].items():
            table[k][0] += v["count"] / n
            table[k][1] += v["us"] / n
    out["by_kernel"] = {k: {"count": round(v[0], 2), "us": round(v[1], 1)}
                        for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])}
    lay = [s.get("per_layer") or {} for s in summaries]
    if lay and all(x.get("layers") for x in lay) and len({len(x["layers"]) for x in lay}) == 1:
        out["per_layer"] = {"marker": lay[0]["marker"], "layers": [
            {"layer": i, "kernel_us": round(sum(x["layers"][i]["kernel_us"] for x in lay) / n, 1),
             "span_us": round(sum(x["layers"][i]["span_us"] for x in lay) / n, 1)}
            for i in range(len(lay[0]["layers"]))]}
    else:
        out["per_layer"] = {"layers": None, "note": next((x.get("note") for x in lay if x.get("note")),
                                                          "layers not found in every step")}
    return out


def summarize_trace(trace: Any, n_layer: int, prefill_passes: int, marker: str = "rms_norm",
                    skip_decode: int = 1) -> dict[str, Any]:
    """The timeline of one engine's trace: ``{"prefill": summary, "decode": per-step mean over the
    decode steps after the first ``skip_decode`` (all of them when there are no more), "decode_steps":
    [each step's wall/busy/kernels], "notes": [...]}``; the context prefill (``timeline:context``) is
    summarized too, when present, as ``context``."""
    ranges, per, outside = split_by_phase(trace)
    notes = []
    out: dict[str, Any] = {"outside_phases": outside}
    if "prefill" in ranges:
        s = phase_summary(ranges["prefill"], per["prefill"])
        s["per_layer"] = per_layer(per["prefill"], n_layer, prefill_passes, marker)
        out["prefill"] = s
        if not s["kernels"]:
            notes.append("the prefill range holds no GPU kernels: CUPTI recorded none of llama.cpp's launches")
    else:
        notes.append("no timeline:prefill range in the trace")
    if "context" in ranges:
        out["context"] = {k: v for k, v in phase_summary(ranges["context"], per["context"]).items()
                          if k != "by_kernel"}
    steps = sorted((n for n in ranges if n.startswith("decode:")), key=lambda n: int(n.split(":")[1]))
    sums = []
    for n in steps:
        s = phase_summary(ranges[n], per[n])
        s["per_layer"] = per_layer(per[n], n_layer, 1, marker)
        sums.append(s)
    out["decode_steps"] = [{"step": i, "wall_us": s["wall_us"], "gpu_busy_us": s["gpu_busy_us"],
                            "kernels": s["kernels"], "kernel_us": s["kernel_us"]} for i, s in enumerate(sums)]
    if sums:
        use = sums[skip_decode:] if len(sums) > skip_decode else sums
        out["decode"] = _mean_of(use)
        out["decode"]["first_step_skipped"] = len(use) < len(sums)
        if not any(s["kernels"] for s in sums):
            notes.append("the decode steps hold no GPU kernels: kernels of CUDA graphs instantiated before "
                         "the profiler started may be missing (rerun with --trace-from load)")
    out["notes"] = notes
    return out
