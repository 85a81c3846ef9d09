"""pytest plugin that runs llama.cpp's own server tests (tools/server/tests/unit, from the pinned
llama-cpp-python sdist) against a running Ostinato daemon instead of a llama-server they start.

Loaded by tests/daemon/test_llama_server_suite.py in a pytest of its own (``-p llama_server_plugin``):
their ``ServerProcess.start`` points the test at the daemon named by ``OSTINATO_SUITE_URL`` (no
process is started, ``stop`` stops nothing), and the tests listed in docs/api.md ("Deliberate
differences") are deselected by id: ``file::test`` deselects every parametrization of that test,
``file::test[params]`` one of them, ``file`` the whole file, and a ``*`` in an entry stands for any
text (``file::test[Qwen-*]``: the parametrizations whose id starts so). An entry that matches
nothing is an error (the list must stay exact).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"
BEGIN, END = "<!-- llama-server-suite: deselected -->", "<!-- /llama-server-suite -->"


def deselected() -> dict[str, str]:
    """``{test id: reason}`` of the table between the markers in docs/api.md (first column: the
    test id in backquotes, second: the reason)."""
    text = DOCS.read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    out: dict[str, str] = {}
    for line in block.splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def pytest_configure(config: pytest.Config) -> None:
    import utils  # theirs: tools/server/tests/utils.py

    url = urlparse(os.environ["OSTINATO_SUITE_URL"])

    def start(self, timeout_seconds: int = 60) -> None:
        self.server_host, self.server_port = url.hostname, url.port
        self.ready = True

    def stop(self) -> None:
        utils.server_instances.discard(self)

    utils.ServerProcess.start = start
    utils.ServerProcess.stop = stop


def _matches(nodeid: str, entry: str) -> bool:
    if "*" in entry:
        return re.fullmatch(".*".join(map(re.escape, entry.split("*"))), nodeid, re.S) is not None
    base = nodeid.split("[", 1)[0]
    return nodeid == entry or base == entry or nodeid.split("::", 1)[0] == entry


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = deselected()
    used: set[str] = set()
    keep, drop = [], []
    for item in items:
        hit = [e for e in entries if _matches(item.nodeid, e)]
        used.update(hit)
        (drop if hit else keep).append(item)
    stale = sorted(set(entries) - used)
    if stale:
        raise pytest.UsageError("docs/api.md deselects tests that do not exist: " + ", ".join(stale))
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
