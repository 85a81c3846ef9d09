"""Claude Code's real CLI (print mode) against the live daemon.

The CLI is installed with npm into ~/.cache/ostinato-test/claude-code on first use (reruns reuse
it; conftest.npm_cli).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from conftest import npm_cli, run_launch


@pytest.fixture(scope="session")
def claude_cli() -> tuple[Path, dict]:
    """(path of the claude executable, env with node on PATH)."""
    return npm_cli("@anthropic-ai/claude-code", "claude", "claude-code")


@pytest.fixture(scope="module")
def agent_daemon(start_daemon, tiny_model):
    """A daemon with an agent-sized context (Claude Code's system prompt and tools are ~20K tokens)."""
    return start_daemon("--model", str(tiny_model), "--n-ctx", "65536", "--n-slots", "2",
                        "--n-threads", "2", "--engine-mode", "subprocess")


def test_claude_print_mode_completes(claude_cli, agent_daemon):
    exe, env = claude_cli
    # the served id, as `ostinato launch claude` configures it (claude-* names would work too)
    model = json.loads(urllib.request.urlopen(agent_daemon.url + "/v1/models").read())["data"][0]["id"]
    cfg = Path(tempfile.mkdtemp(prefix="claude-cfg-"))
    env = dict(env, ANTHROPIC_BASE_URL=agent_daemon.url, ANTHROPIC_AUTH_TOKEN="ostinato-test",
               ANTHROPIC_MODEL=model, ANTHROPIC_DEFAULT_SONNET_MODEL=model,
               ANTHROPIC_DEFAULT_OPUS_MODEL=model, ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="32",
               MAX_THINKING_TOKENS="0", DISABLE_AUTOUPDATER="1", API_TIMEOUT_MS="600000",
               CLAUDE_CONFIG_DIR=str(cfg), HOME=str(cfg))
    # Random weights never emit <|im_end|> by themselves and Claude Code fails a turn that stops at
    # max_tokens; a header (ANTHROPIC_CUSTOM_HEADERS) biases the end-of-turn token so turns end.
    from ostinatod.synth.shapes import TOKEN_IM_END

    env["ANTHROPIC_CUSTOM_HEADERS"] = "x-ostinato-logit-bias: " + json.dumps({str(TOKEN_IM_END): 12.0})
    env.pop("ANTHROPIC_API_KEY", None)
    workdir = tempfile.mkdtemp(prefix="claude-work-")
    r = subprocess.run([str(exe), "-p", "say hi", "--max-turns", "1"], env=env, cwd=workdir,
                       capture_output=True, text=True, timeout=540)
    log = agent_daemon.log()
    lines = [ln for ln in log.splitlines() if " anthropic " in ln and "status=" in ln]
    assert r.returncode == 0, f"claude exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}\n" \
                              f"daemon log:\n{log[-3000:]}"
    assert lines, f"no /v1/messages requests seen:\n{log[-3000:]}"
    bad = [ln for ln in lines if "status=ok" not in ln]
    assert not bad, "protocol errors:\n" + "\n".join(bad)
    assert any("client=claude-code" in ln and "workload=coding" in ln for ln in lines)
    # the real system prompt and tool definitions were templated (not an empty prompt)
    prompts = [int(m.group(1)) for ln in lines if (m := re.search(r" prompt=(\d+)", ln))]
    assert max(prompts) > 1000
    shutil.rmtree(cfg, ignore_errors=True)


def test_launch_starts_claude_on_the_demo_model(claude_cli, demo_daemon):
    """`ostinato launch claude -- ARGS` starts the real Claude Code with the daemon's URL, model,
    key and context; the demo model ends its turns by itself (no logit-bias header) and says it is
    a demo in its first words. Its first turn is a call to one of Claude Code's tools, which print
    mode does not grant unless it is read-only, so the turn after the result
    ends the session: two turns. A real Anthropic key in the user's environment is not sent."""
    from ostinatod.engine.types import DEMO_NOTICE

    exe, env = claude_cli
    # room for the demo's schema-valid call to one of Claude Code's tools (at most
    # DEMO_CALL_MAX_TOKENS; with 64 a long call was cut and Claude Code stopped on "length")
    r = run_launch(demo_daemon, "claude", exe, env, ["-p", "say hi", "--max-turns", "3"],
                   DISABLE_AUTOUPDATER="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="512", MAX_THINKING_TOKENS="0",
                   ANTHROPIC_API_KEY="a-real-anthropic-key-not-for-ostinato")
    log = demo_daemon.log()
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}\nlog:\n{log[-3000:]}"
    assert "starting claude on " + demo_daemon.url in r.stderr
    assert "WARNING" not in r.stderr and "100k minimum" not in r.stderr  # the compact window is accepted
    assert r.stdout.startswith(DEMO_NOTICE.strip()), r.stdout
    lines = [ln for ln in log.splitlines() if " anthropic " in ln and "status=" in ln]
    assert lines and all("status=ok" in ln for ln in lines), "\n".join(lines)
    assert any("client=claude-code" in ln for ln in lines)


def test_demo_model_ends_its_turns_and_says_so(demo_daemon):
    import openai

    from ostinatod.engine.types import DEMO_NOTICE

    c = openai.OpenAI(base_url=demo_daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="ostinato-demo-random-weights", max_tokens=2000,
                                  messages=[{"role": "user", "content": "Write a long story."}])
    assert r.choices[0].finish_reason == "stop"  # a finished turn, not a cut one
    assert r.usage.completion_tokens <= 48  # demo_max_tokens
    assert r.choices[0].message.content.startswith(DEMO_NOTICE)
    chunks = list(c.chat.completions.create(model="ostinato-demo-random-weights", max_tokens=2000, stream=True,
                                            messages=[{"role": "user", "content": "Again."}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.startswith(DEMO_NOTICE)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
