"""The project's size rule: no source file over :data:`MAX_LINES` lines (every .py under ostinatod/
and tests/, every .cpp/.h/.cu/.cuh under native/src and native/include). A file that grows past it
is split by topic into modules of its package."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600
SOURCES = [("ostinatod", (".py",)), ("tests", (".py",)),
           ("native/src", (".cpp", ".h", ".cu", ".cuh")), ("native/include", (".cpp", ".h", ".cu", ".cuh"))]


def _sources() -> list[Path]:
    out = []
    for top, exts in SOURCES:
        out += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in exts]
    return sorted(out)


def _lines(p: Path) -> int:
    with p.open("rb") as f:
        return sum(1 for _ in f)


def test_the_rule_sees_the_sources():
    found = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert "ostinatod/synth/tensors.py" in found and "tests/unit/test_source_size.py" in found
    assert any(f.startswith("native/src/") and f.endswith(".cpp") for f in found)
    assert any(f.startswith("native/include/") and f.endswith(".h") for f in found)


def test_no_source_file_over_the_limit():
    over = [f"{p.relative_to(ROOT).as_posix()} ({n} lines)" for p in _sources() if (n := _lines(p)) > MAX_LINES]
    assert over == [], f"over {MAX_LINES} lines (split them): " + ", ".join(over)
