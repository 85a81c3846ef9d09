"""``ostinato bench SUBCOMMAND``: benchmarks.

Subcommands (each a module with ``main(argv) -> int``):
  replay   replay recorded agent sessions through the HTTP API (ostinatod.bench.replay)
  engines  Ostinato against stock llama.cpp on the same model and sessions
           (ostinatod.bench.bench_engines)
  plot     time against pool size (or routing skew) from stored engines JSONs (ostinatod.bench.bench_plot)
  table    the results page's rows (and their plot) from stored engines JSONs (ostinatod.bench.bench_table)
  reliability  fuzzing, crashes, slow connections (ostinatod.bench.bench_reliability)
  cpu-branch   the CPU branch alone on a model's expert tensors (ostinatod.bench.bench_cpu)
  timeline     per-kernel GPU timeline of one prefill and a few decode steps, ours beside
               stock-all-gpu (ostinatod.bench.bench_timeline)
"""

from __future__ import annotations

import sys

from ..cli import dispatch

# name -> (module, function, one-line help); add a subcommand here
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "replay": ("ostinatod.bench.replay", "main",
               "replay recorded agent sessions through the HTTP API, time each turn"),
    "engines": ("ostinatod.bench.bench_engines", "main",
                "Ostinato vs stock llama.cpp baselines on one model and sessions"),
    "plot": ("ostinatod.bench.bench_plot", "main",
             "plot time against pool size, or routing skew, from stored 'bench engines' JSONs (SVG)"),
    "table": ("ostinatod.bench.bench_table", "main",
              "the results page's rows from stored 'bench engines' JSONs: family, limit, best peer (--svg: plot)"),
    "reliability": ("ostinatod.bench.bench_reliability", "main",
                    "fuzz every route, crash and stop the worker, slow connections: 5xx, hangs, RSS"),
    "cpu-branch": ("ostinatod.bench.bench_cpu", "main",
                   "the CPU branch's kernel vs llama.cpp's mul_mat_id on a model's experts, vs read bandwidth"),
    "timeline": ("ostinatod.bench.bench_timeline", "main",
                 "per-kernel GPU timeline (torch.profiler/CUPTI) of one prefill and decode steps, vs stock-all-gpu"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``ostinato bench <subcommand> ...``; 2 for an unknown subcommand."""
    return dispatch("ostinato bench", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
