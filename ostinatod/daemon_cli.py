"""``ostinatod``: start/run/stop/status of the daemon (filled in by the daemon module)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .daemon import main as daemon_main
    return daemon_main(argv)


if __name__ == "__main__":
    sys.exit(main())
