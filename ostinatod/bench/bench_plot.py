"""``ostinato bench plot``: time against pool size, from stored ``ostinato bench engines`` JSONs.

Two panels, decode ms/token and median TTFT after tool outputs, against the pool budget (fraction
of the expert bytes): the Ostinato engine as a line over the budgets found (the ``sweep`` block of
each JSON and its main run at ``plan.budget_frac``), the stock baselines and ``stock-all-gpu`` (the
limit) as horizontal lines. Written as a small hand-made SVG (no plotting library needed), so it
runs anywhere from the stored JSONs::

    ostinato bench plot docs/benchmarks/runs/2026-11-30-engines-h200-L48-sweep.json [more.json ...] [-o out.svg]

Several JSONs are merged: Ostinato points by budget (the first file that has a budget wins),
each horizontal line from the first file that has that engine.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from .bench_skew import skew_markdown

PANELS = (("decode_ms_per_token", "decode ms/token"), ("ttft_after_tool_median_s", "TTFT after tool (s)"))
COLORS = {"stock-all-gpu": "#2ca02c", "stock-layers": "#ff7f0e", "llama-server": "#d62728",
          "stock-cpu": "#9467bd"}
OSTINATO_COLOR = "#1f77b4"


def collect(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], str]:
    """(Ostinato points sorted by budget: {budget_frac, pool_bytes, <metric>...}, horizontal lines
    {engine: metrics}, title) from result dicts."""
    points: dict[float, dict[str, Any]] = {}
    lines: dict[str, dict[str, Any]] = {}
    for r in results:
        for run in (r.get("sweep") or {}).get("runs", []):
            if run.get("ostinato"):
                points.setdefault(round(run["budget_frac"], 4),
                                  {"budget_frac": run["budget_frac"], "pool_bytes": run.get("pool_bytes"),
                                   **run["ostinato"]})
        o = (r.get("engines") or {}).get("ostinato")
        plan = r.get("plan") or {}
        if o and plan.get("budget_frac") is not None:
            points.setdefault(round(plan["budget_frac"], 4),
                              {"budget_frac": plan["budget_frac"], "pool_bytes": plan.get("pool_bytes"), **o})
        for n, e in (r.get("engines") or {}).items():
            if n != "ostinato":
                lines.setdefault(n, e)
    first = results[0] if results else {}
    m = first.get("model") or {}
    title = (f"{first.get('name', 'bench')}: {m.get('n_layer', '?')} layers x {m.get('n_expert', '?')} "
             f"experts, {', '.join(g.get('name', '') for g in (first.get('machine') or {}).get('gpus', [])) or 'no GPU'}")
    return [points[k] for k in sorted(points)], lines, title


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0

    e = 10 ** math.floor(math.log10(v))
    for f in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if f * e >= v:
            return f * e
    return 10 * e


def _frame(out: list[str], x0: float, y0: float, PW: float, PH: float, ymax: float,
           xticks: list[tuple[float, str]], xlabel: str, ylabel: str) -> None:
    """A panel's box, y grid with ticks (0..ymax), x ticks at (position, text), axis labels."""
    out.append(f'<rect x="{x0}" y="{y0}" width="{PW}" height="{PH}" fill="none" stroke="#444"/>')
    for i in range(6):
        v = ymax * i / 5
        y = y0 + PH - v / ymax * PH
        out.append(f'<line x1="{x0}" x2="{x0 + PW}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    for x, text in xticks:
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0 + PH}" y2="{y0 + PH + 5}" stroke="#444"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + PH + 18}" text-anchor="middle">{html.escape(text)}</text>')
    out.append(f'<text x="{x0 + PW / 2}" y="{y0 + PH + 38}" text-anchor="middle">{html.escape(xlabel)}</text>')
    out.append(f'<text x="{x0 - 50}" y="{y0 + PH / 2}" text-anchor="middle" '
               f'transform="rotate(-90 {x0 - 50} {y0 + PH / 2})">{html.escape(ylabel)}</text>')


def _legend(out: list[str], items: list[tuple[str, str, str]], x: float, y: float, W: float) -> None:
    """Legend entries (text, colour, dash attribute) from (x, y), wrapped at width W."""
    x_start = x
    for text, c, dash in items:
        if x > x_start and x + 40 + 7 * len(text) > W:
            x, y = x_start, y + 20
        out.append(f'<line x1="{x}" x2="{x + 24}" y1="{y}" y2="{y}" stroke="{c}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{x + 30}" y="{y + 4}">{html.escape(text)}</text>')
        x += 40 + 7 * len(text)


def svg(results: list[dict[str, Any]]) -> str:
    """The plot as an SVG document (two panels side by side, legend below)."""
    points, lines, title = collect(results)
    W, H, PW, PH, ML, MT = 1000, 450, 380, 300, 70, 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{html.escape(title)}</text>']
    for pi, (key, label) in enumerate(PANELS):
        x0, y0 = ML + pi * (PW + 110), MT
        vals = [p.get(key) for p in points] + [e.get(key) for e in lines.values()]
        vals = [v for v in vals if isinstance(v, (int, float))]
        ymax = _nice_max(max(vals) * 1.08 if vals else 1.0)

        def X(f: float) -> float:
            return x0 + f * PW

        def Y(v: float) -> float:
            return y0 + PH - v / ymax * PH

        _frame(out, x0, y0, PW, PH, ymax, [(X(f), f"{f:.0%}") for f in (0, 0.25, 0.5, 0.75, 1.0)],
               "pool budget (fraction of expert bytes; pool size at the points)", label)
        for n, e in lines.items():  # horizontal lines: baselines and the limit
            v = e.get(key)
            if not isinstance(v, (int, float)):
                continue
            c = COLORS.get(n, "#7f7f7f")
            dash = "" if n == "stock-all-gpu" else ' stroke-dasharray="6 4"'
            out.append(f'<line x1="{x0}" x2="{x0 + PW}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="{c}" '
                       f'stroke-width="1.5"{dash}/>')
            out.append(f'<text x="{x0 + PW + 4}" y="{Y(v) + 4:.1f}" fill="{c}">{v:.3g}</text>')
        pts = [(p["budget_frac"], p.get(key), p.get("pool_bytes")) for p in points
               if isinstance(p.get(key), (int, float))]
        if len(pts) > 1:
            out.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
                OSTINATO_COLOR, " ".join(f"{X(f):.1f},{Y(v):.1f}" for f, v, _ in pts)))
        for f, v, pb in pts:
            out.append(f'<circle cx="{X(f):.1f}" cy="{Y(v):.1f}" r="4" fill="{OSTINATO_COLOR}"/>')
            out.append(f'<text x="{X(f):.1f}" y="{Y(v) - 8:.1f}" text-anchor="middle" '
                       f'fill="{OSTINATO_COLOR}">{v:.3g}</text>')
            if pb:
                size = f"{pb / 2**30:.1f} GiB" if pb >= 2**30 else f"{pb / 2**20:.1f} MiB"
                out.append(f'<text x="{X(f):.1f}" y="{y0 + PH - 6}" text-anchor="middle" fill="#666" '
                           f'font-size="10">{size}</text>')
    ly = MT + PH + 62  # legend
    items = [("ostinato (per pool budget)", OSTINATO_COLOR, "")] + [
        (n + (" (limit: every expert on the GPU)" if n == "stock-all-gpu" else " (once)"),
         COLORS.get(n, "#7f7f7f"), "" if n == "stock-all-gpu" else ' stroke-dasharray="6 4"')
        for n in lines]
    _legend(out, items, ML, ly, W)
    if not points:
        out.append(f'<text x="{W / 2}" y="{MT + PH / 2}" text-anchor="middle">no Ostinato run in '
                   'these results</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


SKEW_SERIES = (("ostinato", "ostinato", OSTINATO_COLOR, ""),
               ("best_peer", "best peer", COLORS["llama-server"], ' stroke-dasharray="6 4"'),
               ("limit", "stock-all-gpu (limit: every expert on the GPU)", COLORS["stock-all-gpu"], ""))


def skew_svg(sweep: dict[str, Any]) -> str:
    """Time against routing skew from an ``--skew-sweep`` result (:mod:`.bench_skew`): the panels of
    :data:`PANELS`, one line each for Ostinato, the best peer and the limit over the skews."""
    rows = sorted(sweep["skew_sweep"]["rows"], key=lambda r: r["skew"])
    W, H, PW, PH, ML, MT = 1000, 450, 380, 300, 70, 50
    xs = [r["skew"] for r in rows]
    lo, hi = (min(xs) - 0.02, max(xs) + 0.02) if xs else (0.5, 1.0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{html.escape(sweep["name"])}: time '
           'against routing skew</text>']
    keys = {m: k for k, m in (("decode", "decode_ms_per_token"), ("ttft_after_tool", "ttft_after_tool_median_s"))}
    for pi, (metric, label) in enumerate(PANELS):
        x0, y0 = ML + pi * (PW + 110), MT
        cells = [r[keys[metric]] for r in rows]
        vals = [c[s] for c in cells for s, *_ in SKEW_SERIES if isinstance(c.get(s), (int, float))]
        ymax = _nice_max(max(vals) * 1.08 if vals else 1.0)

        def X(v: float) -> float:
            return x0 + (v - lo) / (hi - lo) * PW

        def Y(v: float) -> float:
            return y0 + PH - v / ymax * PH

        _frame(out, x0, y0, PW, PH, ymax, [(X(v), f"{v:.2f}") for v in xs],
               "skew (held-out share of the dev top-44% experts)", label)
        for s, _, c, dash in SKEW_SERIES:
            pts = [(r["skew"], cell[s]) for r, cell in zip(rows, cells) if isinstance(cell.get(s), (int, float))]
            if len(pts) > 1:
                out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="'
                           + " ".join(f"{X(x):.1f},{Y(v):.1f}" for x, v in pts) + '"/>')
            for x, v in pts:
                out.append(f'<circle cx="{X(x):.1f}" cy="{Y(v):.1f}" r="3.5" fill="{c}"/>')
                out.append(f'<text x="{X(x):.1f}" y="{Y(v) - 7:.1f}" text-anchor="middle" fill="{c}" '
                           f'font-size="10">{v:.3g}</text>')
    peers = sorted({r["decode"].get("best_peer_engine") for r in rows} - {None})
    _legend(out, [(n + (f" ({', '.join(peers)})" if s == "best_peer" and peers else ""), c, dash)
                  for s, n, c, dash in SKEW_SERIES], ML, MT + PH + 62, W)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_skew_plot(sweep: dict[str, Any], path: Path) -> Path:
    """Write :func:`skew_svg` of ``sweep`` to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(skew_svg(sweep))
    return path


def write_plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Write :func:`svg` of ``results`` to ``path`` (an .svg file); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg(results))
    return path


def _skew_sweep(paths: list[Path]) -> Optional[dict[str, Any]]:
    """The ``--skew-sweep`` result when ``paths`` is one JSON that holds one (a ``skew_sweep`` block
    with rows), else None (the caller then reads them as pool-size results)."""
    if len(paths) != 1:
        return None
    try:
        r = json.loads(paths[0].read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(r, dict) and isinstance(r.get("skew_sweep"), dict) and r["skew_sweep"].get("rows")
    return r if ok else None


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``ostinato bench plot`` (dispatched from ostinatod/bench/cli.py)."""
    ap = argparse.ArgumentParser(prog="ostinato bench plot", description="Plot decode ms/token and "
                                 "TTFT after tool outputs against the pool budget from stored "
                                 "'ostinato bench engines' JSONs, or against routing skew from one "
                                 "'--skew-sweep' JSON (SVG; a sweep's table too, as .md beside it).")
    ap.add_argument("json", nargs="+", type=Path, help="result JSON(s) of ostinato bench engines")
    ap.add_argument("-o", "--out", type=Path, help="output .svg (default: the first JSON's name "
                    "with .svg)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    sweep = _skew_sweep(a.json)
    if sweep is not None:
        out = write_skew_plot(sweep, a.out or a.json[0].with_suffix(".svg"))
        md = out.with_suffix(".md")
        md.write_text(skew_markdown(sweep))
        print(f"written {out} and {md} ({len(sweep['skew_sweep']['rows'])} skews)")
        return 0
    results = []
    for p in a.json:
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            print(f"ostinato bench plot: {p}: not a readable JSON ({e})", file=sys.stderr)
            return 1
        if not isinstance(r, dict) or not isinstance(r.get("engines"), dict):
            print(f"ostinato bench plot: {p}: not an 'ostinato bench engines' result (no 'engines' block)",
                  file=sys.stderr)
            return 1
        results.append(r)
    out = write_plot(results, a.out or a.json[0].with_suffix(".svg"))
    pts, lines, _ = collect(results)
    print(f"written {out} ({len(pts)} Ostinato point(s), lines: {', '.join(lines) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
