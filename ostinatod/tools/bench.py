"""``ostinato bench SUBCOMMAND``: benchmarks.

Subcommands (each a module with ``main(argv) -> int``):
  replay   replay recorded agent sessions through the HTTP API (ostinatod.tools.replay)
  engines  Ostinato against stock llama.cpp on the same model and sessions
           (ostinatod.tools.bench_engines)
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help); add a subcommand here
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "replay": ("ostinatod.tools.replay", "replay recorded agent sessions through the HTTP API, time each turn"),
    "engines": ("ostinatod.tools.bench_engines", "Ostinato vs stock llama.cpp baselines on one model and sessions"),
}


def _usage() -> str:
    return "usage: ostinato bench SUBCOMMAND [ARGS...]\n\nsubcommands:\n" + "\n".join(
        f"  {n:<8} {h}" for n, (_, h) in SUBCOMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``ostinato bench <subcommand> ...``; 2 for an unknown subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"ostinato bench: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(SUBCOMMANDS[name][0])
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
