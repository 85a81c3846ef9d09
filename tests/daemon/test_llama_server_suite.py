"""Conformance: llama.cpp's own server tests (tools/server/tests/unit of the pinned llama-cpp-python
sdist that the build downloads; never copied here) run against a live Ostinato daemon.

Their ``ServerProcess`` is pointed at the daemon by tests/llama_server_plugin.py instead of
starting llama-server; the tests that exercise what Ostinato deliberately does otherwise are
deselected by id from the list in docs/api.md ("llama.cpp's server tests"), with the reason of
each; every other selected test must pass. The daemon is started with the flags of their
``tinyllama2`` preset that Ostinato has (context 256 over 2 slots, seed 42; 8 output tokens where
a test sets none, their preset's 64 cut to keep CI short) on the test model's file, with one
engine thread (``LIVE_N_THREADS``). About 15 s of tests on the 2-core CI machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import LIVE_N_THREADS, ROOT, launch_daemon

# the files of the suite that exercise the HTTP API Ostinato serves; the others test features it
# does not have (embeddings, rerank, LoRA, router mode, MCP and built-in tools, the CORS proxy,
# speculative decoding, vision, slot save/restore, sleeping, Vertex AI): docs/api.md
FILES = ["test_basic.py", "test_chat_completion.py", "test_compat_anthropic.py",
         "test_compat_oai_responses.py", "test_completion.py", "test_ctx_shift.py", "test_ignore_eos.py",
         "test_infill.py", "test_metrics.py", "test_security.py", "test_stream.py", "test_template.py",
         "test_tokenize.py", "test_tool_call.py"]


def suite_dir() -> Path:
    """tools/server/tests of the sdist the build uses (:func:`ostinatod.build.fetch_sdist`: the
    extracted copy, fetched if missing)."""
    from ostinatod.build import fetch_sdist

    return fetch_sdist() / "vendor" / "llama.cpp" / "tools" / "server" / "tests"


@pytest.fixture(scope="module")
def suite_daemon(tiny_model):
    home = Path(tempfile.mkdtemp(prefix="ostinato-llama-suite-"))
    d = launch_daemon(home, "--model", str(tiny_model), "--n-ctx", "256", "--n-slots", "2", "--seed", "42",
                      "--n-threads", str(LIVE_N_THREADS), "--max-tokens-default", "8",
                      "--model-alias", "tinyllama-2", "--any-model-name", "--engine-mode", "subprocess")
    yield d
    d.stop()


def test_llama_cpp_server_suite(suite_daemon, tmp_path):
    tests = suite_dir()
    env = dict(os.environ, OSTINATO_SUITE_URL=suite_daemon.url,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])))
    # their per-request timeout is 600 s; a hung request fails its test after 120 s instead
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "llama_server_plugin", "-p", "no:cacheprovider",
                        "-m", "not slow", "-q", "-rfEs", "--timeout", "120", "--basetemp", str(tmp_path / "t"),
                        *[f"unit/{f}" for f in FILES]],
                       cwd=tests, env=env, capture_output=True, text=True, timeout=900)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|deselected|skipped)", last)}
    print(f"llama.cpp server suite: {last}")
    assert r.returncode == 0, tail
    assert counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error") \
        and not counts.get("errors"), tail
