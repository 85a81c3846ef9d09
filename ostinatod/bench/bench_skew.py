"""``ostinato bench engines --skew-sweep``: the same run once per routing skew.

Each skew S gets its own synthetic file (same shape, layers, quant and seed; routers made for S by
:func:`ostinatod.synth.skew.strength_for_skew`) and a whole ``ostinato bench engines`` run on it
(dev traces, plan, the engines asked for), stored as ``<name>-skew<NN>.json``. The sweep's own
result ``<name>.json`` holds one row per skew: the skew asked for, the router strength, the hot-route
share the Ostinato engine measured per phase, and for decode, TTFT after tool outputs and session
time the Ostinato engine, the best peer (every engine but Ostinato's and the limit) and the limit
(``stock-all-gpu``); ``<name>.md`` the table and ``<name>.svg`` the plot
(:func:`ostinatod.bench.bench_plot.skew_svg`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path
from typing import Any, Callable, Optional

from ..synth.shapes import SHAPES
from ..synth.skew import SKEW_RANGE, strength_for_skew
from .bench_common import LIMIT, METRICS, BenchError, parse_list, say, skew_tag
from .bench_report import best_of, fmt, machine_info


def parse_skews(text: Optional[str]) -> list[float]:
    """``"0.6,0.84"`` -> [0.6, 0.84] (sorted, unique); BenchError outside :data:`SKEW_RANGE`."""
    lo, hi = SKEW_RANGE
    return parse_list(text, "--skew-sweep", "shares", lambda x: lo <= x <= hi, f"[{lo}, {hi}]")


def sub_argv(argv: list[str], skew: float, name: str) -> list[str]:
    """The command line of one skew's run: ``argv`` without ``--skew-sweep``, ``--skew`` and
    ``--name`` (either form, ``--opt V`` or ``--opt=V``), plus ``--skew S --name N``."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        opt = x.split("=", 1)[0]
        if opt in ("--skew-sweep", "--skew", "--name"):
            skip = "=" not in x
            continue
        out.append(x)
    return out + ["--skew", f"{skew:g}", "--name", name]


def sweep_row(skew: float, result: dict[str, Any]) -> dict[str, Any]:
    """One skew's row of the sweep from its ``bench engines`` result."""
    eng = result.get("engines") or {}
    o = eng.get("ostinato") or {}
    b = o.get("step_breakdown") or {}
    row: dict[str, Any] = {"skew": skew, "result": result.get("name"), "model_file": result["model"]["file"],
                           "n_layer": result["model"]["n_layer"],
                           "router_strength": result["model"].get("router_strength"),
                           "hot_route_share": o.get("hot_route_share"),
                           "hot_route_share_decode": (b.get("decode_step") or {}).get("hot_route_share"),
                           "hot_route_share_prefill": (b.get("prefill") or {}).get("hot_route_share"),
                           "warnings": list(result.get("warnings") or [])}
    for key, metric in METRICS:
        peer, pv = best_of(eng, metric)
        row[key] = {"ostinato": o.get(metric), "best_peer": pv, "best_peer_engine": peer,
                    "limit": (eng.get(LIMIT) or {}).get(metric)}
    return row


def run_skew_sweep(a: argparse.Namespace, argv: list[str], skews: list[float],
                   run_one: Callable[[argparse.Namespace], dict[str, Any]],
                   write_one: Callable[[dict[str, Any]], Path]) -> dict[str, Any]:
    """Run ``run_one`` (a whole bench run) once per skew on its own synthetic file, writing each
    result with ``write_one``; returns the sweep's result. Raises BenchError with ``--model``
    (the sweep writes its files), ``--budget-sweep`` or no skew, SynthError (before any run) for
    a skew the shape's routers cannot make."""
    if a.model:
        raise BenchError("--skew-sweep writes one synthetic file per skew: it cannot take --model")
    if a.budget_sweep:
        raise BenchError("--skew-sweep and --budget-sweep: one sweep per run")
    if not skews:
        raise BenchError("--skew-sweep: no skew given")
    shp = SHAPES[a.shape]
    for s in skews:  # a skew the routers cannot make stops the sweep before its first run
        strength_for_skew(s, shp.n_expert, shp.n_expert_used)
    name = a.name or (f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}-engines-{a.shape}"
                      + (f"-L{a.layers}" if a.layers else "") + "-skew-sweep")
    rows = []
    for s in skews:
        say(f"skew sweep: skew {s} ({len(rows) + 1} of {len(skews)})")
        sub = argparse.Namespace(**{**vars(a), "skew": s, "skew_sweep": None, "name": f"{name}-{skew_tag(s)}",
                                    "work_dir": Path(a.work_dir) / skew_tag(s) if a.work_dir else None})
        res = run_one(sub)
        write_one(res)
        rows.append(sweep_row(s, res))
    return {"name": name, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "command": "ostinato bench engines " + " ".join(argv),
            "skew_sweep": {"skews": skews, "shape": a.shape, "quant": a.quant,
                           "budget_frac": a.budget_frac, "rows": rows}}


def skew_markdown(sweep: dict[str, Any]) -> str:
    """The sweep's table (one row per skew)."""
    sw = sweep["skew_sweep"]
    lines = [f"# {sweep['name']}", "", f"Command: `{sweep['command']}`", "",
             f"Synthetic qwen3moe files of shape {sw['shape']} ({sw['rows'][0]['n_layer']} layers, {sw['quant']}), "
             f"one per skew; pool budget {sw['budget_frac']:.0%}. Skew: the held-out share of the development "
             "top-44% experts the routers are made for; hot share: what the Ostinato engine measured on its "
             "pool (decode steps / prefills). Times: Ostinato / the best peer (its name) / the limit "
             f"({LIMIT}).", "",
             "| skew | A | hot share decode / prefill | decode ms/token | TTFT after tool s | session s |",
             "|---:|---:|---|---|---|---|"]
    for r in sw["rows"]:
        cells = []
        for (key, _), nd in zip(METRICS, (2, 3, 2)):
            c = r[key]
            cells.append(f"{fmt(c['ostinato'], '', nd)} / {fmt(c['best_peer'], '', nd)}"
                         f"{' (' + c['best_peer_engine'] + ')' if c['best_peer_engine'] else ''} / "
                         f"{fmt(c['limit'], '', nd)}")
        lines.append(f"| {r['skew']:.2f} | {fmt(r['router_strength'], '', 3)} | "
                     f"{fmt(r['hot_route_share_decode'], '', 3)} / {fmt(r['hot_route_share_prefill'], '', 3)} | "
                     + " | ".join(cells) + " |")
    for r in sw["rows"]:
        lines += [f"- skew {r['skew']:.2f}: {w}" for w in r["warnings"]]
    lines += ["", "Per-skew runs: " + ", ".join(f"`{r['result']}.json`" for r in sw["rows"]) + "."]
    return "\n".join(lines) + "\n"
