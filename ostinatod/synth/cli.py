"""``ostinato synth``: write a synthetic MoE GGUF (:mod:`ostinatod.synth`), or report the routing
skew of one on recorded sessions."""

from __future__ import annotations

import argparse
import json
import sys
import time


from .shapes import QUANTS, SHAPES, Routing, SynthError
from .skew import DEFAULT_SKEW
from .archs import PLANS as _PLANS
from .writer import write_synthetic_moe
from .routing import routing_report

# --------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    """``ostinato synth``: write a synthetic MoE GGUF (see module docstring)."""
    ap = argparse.ArgumentParser(prog="ostinato synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3moe", choices=sorted(_PLANS))
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="number of layers (default: the shape's); a "
                    "real model's shape cut to fewer layers keeps its mix of layer kinds in proportion "
                    "(docs/synthetic-models.md, 'Representative cuts')")
    ap.add_argument("--narrow", action="store_true", help="a real shape's layers, layer kinds and expert "
                    "counts at small widths (hidden 256): routing checks on a small machine")
    ap.add_argument("--quant", default="q8_0", choices=list(QUANTS), help="quant recipe: f16, q8_0, q4_0, "
                    "mxfp4 set the experts' type; q4_k_m, q5_k_m, q6_k, iq4_xs, ud-q4_k_xl mix types per "
                    "tensor and layer like the published files (docs/synthetic-models.md)")
    ap.add_argument("--merged-gate-up", action="store_true", help="write ffn_gate_up_exps (one merged "
                    "tensor) instead of ffn_gate_exps + ffn_up_exps (deepseek2, qwen35moe)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skew", type=float, metavar="S", help="routing skew: the held-out share of the "
                    "development top-44%% experts, as the engine counts it (0.5-0.99, at least what "
                    f"token identity alone gives: 0.77 at 128 experts, 0.85 at 256; default {DEFAULT_SKEW} "
                    "on the real expert counts); mapped to a router strength by a calibrated table "
                    "(docs/synthetic-models.md, 'Skew as a knob')")
    ap.add_argument("-o", "--output", help="output .gguf path")
    ap.add_argument("--report", metavar="MODEL.gguf", help="instead of writing: print the routing "
                    "skew of an existing synthetic model on --sessions files (JSON)")
    ap.add_argument("--sessions", nargs="+", default=[], help="session JSONL files for --report")
    ap.add_argument("--engine", action="store_true", help="--report: count routes with the real "
                    "engine (native expert counters) instead of a numpy forward of the routers")
    ap.add_argument("--max-chars", type=int, default=2_000_000, help="--report: text per side")
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="--report --engine: generate N "
                    "greedy tokens after each 2048-token window and report the held-out share per phase "
                    "(prefill, decode)")
    args = ap.parse_args(argv)
    if args.report:
        if not args.sessions:
            ap.error("--report needs --sessions FILE.jsonl [FILE.jsonl]")
        if args.decode and not args.engine:
            ap.error("--decode needs --engine")
        try:
            rep = routing_report(args.report, args.sessions, max_chars=args.max_chars, engine=args.engine,
                                 decode=args.decode)
        except SynthError as e:
            print(f"ostinato synth: {e}", file=sys.stderr)
            return 2
        print(json.dumps(rep, indent=1))
        return 0
    if not args.output:
        ap.error("-o/--output is required")
    t0 = time.time()
    try:
        p = write_synthetic_moe(args.output, arch=args.arch, shape=args.shape, n_layer=args.layers,
                                quant=args.quant, seed=args.seed, progress=True,
                                merged_gate_up=args.merged_gate_up, narrow=args.narrow,
                                routing=Routing(skew=args.skew) if args.skew is not None else None)
    except SynthError as e:
        print(f"ostinato synth: {e}", file=sys.stderr)
        return 2
    print(f"wrote {p} ({p.stat().st_size / 2**20:.1f} MiB) in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
