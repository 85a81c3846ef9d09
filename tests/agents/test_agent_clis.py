"""The real OpenCode and Codex CLIs, started by ``ostinato launch`` on a daemon serving the demo
model, as a new user would: each completes a turn.

Installed with npm into the test cache on first use, the same way as Claude Code
(conftest.npm_cli), at the versions the issue was tried with; each is about 8 s of install and
350-450 MB on disk.
"""

from __future__ import annotations

import pytest

from conftest import npm_cli, run_launch

OPENCODE = "opencode-ai@1.18.33"
CODEX = "@openai/codex@0.171.0"


@pytest.fixture(scope="session")
def opencode_cli():
    return npm_cli(OPENCODE, "opencode", "opencode")


@pytest.fixture(scope="session")
def codex_cli():
    return npm_cli(CODEX, "codex", "codex")


def _requests(daemon, protocol: str) -> list[str]:
    return [ln for ln in daemon.log().splitlines() if f" {protocol} " in ln and "status=" in ln]


def test_launch_codex_exec_completes(codex_cli, demo_daemon):
    from ostinatod.engine.types import DEMO_NOTICE

    exe, env = codex_cli
    before = len(_requests(demo_daemon, "responses"))
    r = run_launch(demo_daemon, "codex", exe, env, ["exec", "--skip-git-repo-check", "say hi"])
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    assert DEMO_NOTICE.strip() in r.stdout
    lines = _requests(demo_daemon, "responses")[before:]
    assert lines and all("status=ok" in ln and "client=codex workload=coding" in ln for ln in lines), lines


def test_launch_opencode_run_completes(opencode_cli, demo_daemon):
    from ostinatod.engine.types import DEMO_NOTICE

    exe, env = opencode_cli
    before = len(_requests(demo_daemon, "openai_chat"))
    r = run_launch(demo_daemon, "opencode", exe, env, ["run", "say hi"])
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    assert DEMO_NOTICE.strip() in r.stdout
    lines = _requests(demo_daemon, "openai_chat")[before:]
    assert lines and all("status=ok" in ln and "client=opencode" in ln for ln in lines), lines
    assert max(int(ln.split(" prompt=")[1].split()[0]) for ln in lines) > 1000  # its real system prompt
