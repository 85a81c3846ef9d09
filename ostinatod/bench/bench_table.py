"""``ostinato bench table``: the results page's rows (docs/benchmarks/README.md) from stored
``ostinato bench engines`` JSONs, and a plot of them.

One row per JSON: the model family the file imitates, the pool, Ostinato's three figures (decode
ms per token / median time to first token after a tool output / whole session), the limit's
(``stock-all-gpu``: every expert on the GPU), the best peer's at equal GPU memory (any engine but
Ostinato's and the limit, named per metric), the two sets of ratios, the hot-route share per phase
(decode steps / prefills after a tool output, from the run's ``step_breakdown``) and the run's
name. The same figures the run's own markdown prints, so a row never needs retyping::

    ostinato bench table docs/benchmarks/runs/RUN.json [more.json ...] [--svg out.svg]

``--svg`` draws, per family, where Ostinato and the best peer lie against the limit (time ÷ the
limit's, log scale) for decode and for the wait after a tool output: the distance to 1 is what a
GPU that held every expert would still save, the peer's distance what Ostinato saves.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from ..synth.shapes import SHAPES
from .bench_common import LIMIT, METRICS
from .bench_report import best_of, is_peer, ratios, ratios_vs_limit

# synthetic shape name (ostinatod/synth/shapes.py) -> the real model family it imitates
FAMILIES = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "qwen3.5-35b-a3b": "Qwen3.5-35B-A3B",
            "glm-4.5-air": "GLM-4.5-Air", "minimax-m2": "MiniMax-M2",
            "deepseek-v4-flash": "DeepSeek-V4-Flash"}

HEADER = ("| model family (file: layers / the real model's, quant) | pool | Ostinato | limit (all on the GPU) "
          "| best peer | vs best peer | vs limit | hot share decode / after tool | run |\n"
          "|---|---:|---|---|---|---|---|---|---|")


def family(result: dict[str, Any]) -> dict[str, Any]:
    """``{"family", "arch", "layers", "real_layers", "quant"}`` of a run's model, parsed from the
    synthetic file's name (``ostinato-demo ARCH SHAPE NL QUANT (random weights)``); the family is
    the shape's name where it is not one of :data:`FAMILIES`, None where the name has no shape."""
    m = result.get("model") or {}
    words = (m.get("name") or "").split()
    shape = words[2] if len(words) > 4 and words[0] == "ostinato-demo" else None
    quant = words[4].upper() if shape else (m.get("quant") or "").upper() or None
    real = SHAPES[shape].n_layer if shape in SHAPES else None
    return {"family": FAMILIES.get(shape, shape), "arch": m.get("arch"), "layers": m.get("n_layer"),
            "real_layers": real, "quant": quant}


def gpu_name(result: dict[str, Any]) -> Optional[str]:
    """The run's first GPU in short ("NVIDIA H100 80GB HBM3" -> "H100"), None where the JSON does
    not record it (runs before the bench stored its GPUs)."""
    gpus = (result.get("machine") or {}).get("gpus") or []
    words = [w for w in (gpus[0].get("name") or "").split() if w != "NVIDIA"] if gpus else []
    short = []
    for w in words:
        if w[:1].isdigit() and w.upper().endswith("GB"):
            break
        short.append(w)
    return " ".join(short) or None


def row(result: dict[str, Any], name: Optional[str] = None) -> dict[str, Any]:
    """The figures of one results-page row from a ``bench engines`` result dict (its JSON).

    Returns ``{"family", "arch", "layers", "real_layers", "quant", "pool" (fraction), "run",
    "gpu" (:func:`gpu_name`), "ostinato", "limit", "best_peer"`` (each ``{metric: value}`` over decode ms/token, TTFT after
    tool s, session s; best_peer also ``{metric}_engine``), ``"vs_best_peer", "vs_limit"`` (as
    :func:`.bench_report.ratios` / :func:`.bench_report.ratios_vs_limit`; None without such an
    engine), ``"hot_share_decode", "hot_share_after_tool"}`` (None where the run has no
    step breakdown). Raises KeyError when the result has no ``ostinato`` engine."""
    engines = result.get("engines") or {}
    o = engines["ostinato"]
    b = o.get("step_breakdown") or {}
    peer: dict[str, Any] = {}
    for key, metric in METRICS:
        n, v = best_of(engines, metric, is_peer)
        peer[key], peer[key + "_engine"] = v, n
    has_peer = any(peer[k] for k, _ in METRICS)
    return {**family(result), "pool": (result.get("plan") or {}).get("budget_frac"),
            "run": name or result.get("name"), "gpu": gpu_name(result),
            "ostinato": {k: o.get(m) for k, m in METRICS},
            "limit": {k: (engines.get(LIMIT) or {}).get(m) for k, m in METRICS} if LIMIT in engines else None,
            "best_peer": peer if has_peer else None,
            "vs_best_peer": ratios(engines, peers=True) if has_peer else None,
            "vs_limit": ratios_vs_limit(engines) if LIMIT in engines else None,
            "hot_share_decode": (b.get("decode_step") or {}).get("hot_route_share"),
            "hot_share_after_tool": (b.get("prefill_after_tool") or {}).get("hot_route_share")}


def _three(d: Optional[dict[str, Any]], unit: str = "") -> str:
    """"a / b / c" over the three metrics: times as the run's markdown prints them, ratios (unit "×")
    with two decimals; "–" when none is there."""
    if not d or not any(d.get(k) for k, _ in METRICS):
        return "–"
    fm = {"decode": "{:.2f}", "ttft_after_tool": "{:.2f}" if unit else "{:.3f}", "session_total": "{:.2f}"}
    return " / ".join(fm[k].format(d[k]) + unit if d.get(k) is not None else "n/a" for k, _ in METRICS)


def markdown_row(r: dict[str, Any]) -> str:
    """One markdown table row (columns of :data:`HEADER`) from :func:`row`'s dict."""
    layers = f"{r['layers']} / {r['real_layers']}" if r.get("real_layers") else f"{r['layers']}"
    fam = f"{r['family']} ({r['arch']}: {layers}, {r['quant']})"
    peer = r.get("best_peer")
    if peer:
        names = [peer.get(k + "_engine") for k, _ in METRICS]
        who = names[0] if len(set(names)) == 1 else " / ".join(n or "n/a" for n in names)
        peer_s = f"{_three(peer)} ({who})"
    else:
        peer_s = "no peer in the run"
    hs = [r.get("hot_share_decode"), r.get("hot_share_after_tool")]
    hot = " / ".join(f"{x:.2f}" if x is not None else "n/a" for x in hs)
    pool = f"{r['pool'] * 100:.0f}%" if r.get("pool") is not None else "n/a"
    return (f"| {fam} | {pool} | {_three(r['ostinato'])} | {_three(r.get('limit'))} | {peer_s} | "
            f"{_three(r.get('vs_best_peer'), '×')} | {_three(r.get('vs_limit'), '×')} | {hot} | "
            f"{r['gpu'] + ': ' if r.get('gpu') else ''}"
            f"[{r['run']}](runs/{r['run']}.md) ([command](runs/{r['run']}.cmd.txt)) |")


def svg(rows: list[dict[str, Any]]) -> str:
    """Two panels (decode, TTFT after a tool output): per row a line at its family's height with
    Ostinato's and the best peer's time ÷ the limit's on a log axis (1 = the limit). Rows without a
    limit are left out."""
    rows = [r for r in rows if r.get("vs_limit")]
    W, PH, top, left, right = 760, 34 * max(1, len(rows)), 46, 250, 24
    PW = (W - left - right - 30) / 2
    H = top + PH + 60
    xmax = 32.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>']

    def x_of(v: float, x0: float) -> float:
        return x0 + PW * math.log(max(1.0, min(v, xmax))) / math.log(xmax)
    for p, (key, title) in enumerate((("decode", "decode time per token"),
                                      ("ttft_after_tool", "wait after a tool output"))):
        x0 = left + p * (PW + 30)
        out.append(f'<text x="{x0 + PW / 2}" y="18" text-anchor="middle" font-weight="bold">'
                   f'{title}: × the limit (log)</text>')
        for t in (1, 2, 4, 8, 16, 32):
            x = x_of(t, x0)
            out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{top + PH}" stroke="#ddd"/>'
                       f'<text x="{x:.1f}" y="{top + PH + 16}" text-anchor="middle">{t}×</text>')
        for i, r in enumerate(rows):
            y = top + 17 + 34 * i
            lim = (r.get("limit") or {}).get(key)
            o = (r.get("vs_limit") or {}).get(key)
            pv = (r.get("best_peer") or {}).get(key)
            pr = pv / lim if pv and lim else None
            if o and pr:
                out.append(f'<line x1="{x_of(o, x0):.1f}" y1="{y}" x2="{x_of(pr, x0):.1f}" y2="{y}" '
                           f'stroke="#999" stroke-width="2"/>')
            if pr:
                out.append(f'<circle cx="{x_of(pr, x0):.1f}" cy="{y}" r="5" fill="#d62728"/>'
                           f'<text x="{x_of(pr, x0) + 8:.1f}" y="{y + 4}" font-size="10">{pr:.1f}×</text>')
            if o:
                out.append(f'<circle cx="{x_of(o, x0):.1f}" cy="{y}" r="5" fill="#1f77b4"/>'
                           f'<text x="{x_of(o, x0):.1f}" y="{y - 8}" font-size="10" '
                           f'text-anchor="middle">{o:.2f}×</text>')
    for i, r in enumerate(rows):
        y = top + 21 + 34 * i
        label = f"{r['family']} ({r['pool'] * 100:.0f}% pool)" if r.get("pool") is not None else r["family"]
        out.append(f'<text x="{left - 10}" y="{y}" text-anchor="end">{html.escape(str(label))}</text>')
    ly = H - 18
    out.append(f'<circle cx="{left}" cy="{ly - 4}" r="5" fill="#1f77b4"/><text x="{left + 10}" y="{ly}">'
               f'Ostinato</text><circle cx="{left + 90}" cy="{ly - 4}" r="5" fill="#d62728"/>'
               f'<text x="{left + 100}" y="{ly}">best peer at equal GPU memory</text>'
               f'<text x="{left + 300}" y="{ly}">1× = every expert on the GPU</text></svg>')
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """CLI: print the markdown rows of the given run JSONs; ``--svg PATH`` also writes the plot.
    Returns 0, or 2 when a file is missing or holds no ``ostinato`` engine."""
    ap = argparse.ArgumentParser(prog="ostinato bench table", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench engines JSONs (docs/benchmarks/runs/*.json)")
    ap.add_argument("--svg", type=Path, help="also write the plot of these rows here")
    ap.add_argument("--no-header", action="store_true", help="rows only")
    a = ap.parse_args(argv)
    rows = []
    for p in a.runs:
        try:
            rows.append(row(json.loads(p.read_text()), p.name.removesuffix(".json")))
        except (OSError, ValueError, KeyError) as e:
            print(f"ostinato bench table: {p}: {e!r}", file=sys.stderr)
            return 2
    if not a.no_header:
        print(HEADER)
    for r in rows:
        print(markdown_row(r))
    if a.svg:
        a.svg.write_text(svg(rows))
        print(f"wrote {a.svg}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
