"""The markdown page of ``ostinato bench timeline`` (ostinatod/bench/bench_timeline.py): the engines
side by side per phase (prefill pass, decode step), the kernels by total time, the per-layer time.
Pure. Times in the tables are ms for walls and us for GPU work, as the headers say."""

from __future__ import annotations

from typing import Any, Optional

from .bench_common import fmt

TOP_KERNELS = 25


def _get(d: Optional[dict[str, Any]], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def _paths(paths: Any) -> str:
    """The paths a call's passes took (``{"split": 1, ...}`` -> ``split``; several: ``split 1 + upload 1``)."""
    used = {k: v for k, v in (paths or {}).items() if v}
    return " + ".join(f"{k} {v}" for k, v in used.items()) if len(used) > 1 else (next(iter(used), "n/a"))


def _phase_rows(names: list[str], eng: dict[str, Any], phase: str) -> list[str]:
    def row(label: str, f) -> str:
        return f"| {label} | " + " | ".join(fmt(f(eng[n])) for n in names) + " |"

    tl = lambda e: _get(e, "timeline", phase)  # noqa: E731
    cs = lambda e: _get(tl(e), "compute_stream")  # noqa: E731

    def mb(e: dict[str, Any]) -> Optional[float]:
        b = _get(tl(e), "memcpy", "H2D", "bytes")
        return None if b is None else round(b / 1e6, 2)

    return [row("GPU busy us (union, all streams)", lambda e: _get(tl(e), "gpu_busy_us")),
            row("kernels / kernel us (sum)", lambda e: None if tl(e) is None else
                f"{tl(e)['kernels']} / {tl(e)['kernel_us']}"),
            row("compute stream: busy us", lambda e: _get(cs(e), "busy_us")),
            row("compute stream: first to last kernel us", lambda e: _get(cs(e), "span_us")),
            row("compute stream: idle us (gaps >= 2 us: count / us)", lambda e: None if cs(e) is None else
                f"{cs(e)['idle_us']} ({cs(e)['gaps']} / {cs(e)['gap_us']})"),
            row("lead-in us (range start to first kernel) / tail us", lambda e: None if cs(e) is None else
                f"{cs(e)['lead_in_us']} / {cs(e)['tail_us']}"),
            row("memcpy H2D: count / MB / us", lambda e: None if _get(tl(e), "memcpy", "H2D") is None else
                f"{tl(e)['memcpy']['H2D']['count']} / {mb(e)} / {tl(e)['memcpy']['H2D']['us']}"),
            row("memcpy D2H: count / us", lambda e: None if _get(tl(e), "memcpy", "D2H") is None else
                f"{tl(e)['memcpy']['D2H']['count']} / {tl(e)['memcpy']['D2H']['us']}")]


def _kernel_table(names: list[str], eng: dict[str, Any], phase: str, unit: str) -> list[str]:
    tabs = {n: _get(eng[n], "timeline", phase, "by_kernel") or {} for n in names}
    if not any(tabs.values()):
        return []
    every = {k for t in tabs.values() for k in t}
    top = sorted(every, key=lambda k: -max(t.get(k, {}).get("us", 0) for t in tabs.values()))[:TOP_KERNELS]
    head = "| kernel | " + " | ".join(f"{n} count | {n} us" for n in names) + " |"
    out = [f"Kernels of the {phase} ({unit}; the {TOP_KERNELS} largest, names shortened):", "", head,
           "|---|" + "---:|---:|" * len(names)]
    for k in top:
        cells = []
        for n in names:
            v = tabs[n].get(k)
            cells += [fmt(v["count"]) if v else "-", fmt(v["us"]) if v else "-"]
        out.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return out + [""]


def _layer_table(names: list[str], eng: dict[str, Any], phase: str) -> list[str]:
    lays = {n: _get(eng[n], "timeline", phase, "per_layer") or {} for n in names}
    ok = [n for n in names if lays[n].get("layers")]
    out = []
    for n in names:
        if n not in ok and _get(eng[n], "timeline", phase):
            out.append(f"- {n}: no per-layer time: {lays[n].get('note')}")
    if not ok:
        return out + ([""] if out else [])
    count = max(len(lays[n]["layers"]) for n in ok)
    out += ["", f"Per layer, {phase} (kernel us by start time, marker `"
            + "`, `".join(sorted({lays[n]['marker'] for n in ok})) + "`):", "",
            "| layer | " + " | ".join(f"{n} kernel us | {n} span us" for n in ok) + " |",
            "|---:|" + "---:|---:|" * len(ok)]
    for i in range(count):
        cells = []
        for n in ok:
            x = lays[n]["layers"][i] if i < len(lays[n]["layers"]) else None
            cells += [fmt(x["kernel_us"]) if x else "-", fmt(x["span_us"]) if x else "-"]
        out.append(f"| {i} | " + " | ".join(cells) + " |")
    return out + [""]


def markdown(result: dict[str, Any]) -> str:
    """The page of one ``bench timeline`` result."""
    eng = result["engines"]
    names = list(eng)
    ok = [n for n in names if "error" not in eng[n]]
    lines = [f"# bench timeline: {result['model']}", "",
             f"C = {result['context_tokens']} tokens in the KV cache, a prefill of N = {result['prompt_tokens']} "
             f"tokens, D = {result['decode_steps']} decode steps; residency `{result.get('residency')}`.", ""]
    for n in names:
        if "error" in eng[n]:
            lines.append(f"- {n}: FAILED: {eng[n]['error']}")
    if ok:
        def row(label: str, f) -> str:
            return f"| {label} | " + " | ".join(fmt(f(eng[n])) for n in ok) + " |"

        def dec(e: dict[str, Any]) -> Optional[float]:
            d = e["wall"]["decode_ms"]
            return round(sum(d[1:] or d) / len(d[1:] or d), 3)

        lines += ["| wall (ms, perf_counter, profiler on where noted) | " + " | ".join(ok) + " |",
                  "|---|" + "---:|" * len(ok),
                  row("load s", lambda e: e["wall"]["load_s"]),
                  row("ubatch (prefill passes)", lambda e: f"{e['ubatch']['ubatch']} ({e['prefill_passes']})"),
                  row("context prefill ms (untimed part)", lambda e: e["wall"]["context_ms"]),
                  row("prefill ms", lambda e: e["wall"]["prefill_ms"]),
                  row("decode ms/step (after the first)", dec),
                  row("first decode step ms", lambda e: e["wall"]["decode_ms"][0]),
                  row("native: prefill path / upload ms / total ms", lambda e: None if not _get(e, "native", "prefill")
                      else f"{_paths(e['native']['prefill'].get('paths'))} / {fmt(e['native']['prefill'].get('upload_ms'))}"
                      f" / {fmt(e['native']['prefill'].get('total_ms'))}"),
                  row("profiled", lambda e: "yes" if e.get("timeline") else "no"), ""]
        timed = [n for n in ok if eng[n].get("timeline")]
        for phase, title in (("prefill", "The prefill pass (us)"), ("decode", "A decode step (us, mean per step)")):
            if not any(_get(eng[n], "timeline", phase) for n in timed):
                continue
            lines += [f"## {title}", "", "| GPU | " + " | ".join(timed) + " |", "|---|" + "---:|" * len(timed),
                      *_phase_rows(timed, eng, phase), ""]
            gaps = [(n, g) for n in timed for g in (_get(eng[n], "timeline", phase, "compute_stream",
                                                         "largest_gaps") or [])[:3]]
            if gaps:
                lines += ["Largest idle gaps on the compute stream:", ""]
                lines += [f"- {n}: {g['us']} us at +{g['at_us']} us, after `{g['after']}`, before `{g['before']}`"
                          for n, g in gaps] + [""]
            lines += _kernel_table(timed, eng, phase, "us per step" if phase == "decode" else "us")
            lines += _layer_table(timed, eng, phase)
    notes = list(result.get("notes") or []) + [f"{n}: {x}" for n in names for x in eng[n].get("notes") or []]
    if notes:
        lines += ["Notes:", ""] + [f"- {x}" for x in notes] + [""]
    return "\n".join(lines)
