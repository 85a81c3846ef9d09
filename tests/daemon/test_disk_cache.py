"""The prefix cache kept on disk. After the daemon restarts, the first turn of a
returning session reuses its prefix from disk; a damaged state file is ignored with a log line."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from conftest import launch_daemon

FLAGS = ("--n-ctx", "2048", "--n-slots", "1", "--n-threads", "2", "--engine-mode", "inprocess")


def _turn(d, text: str) -> dict:
    body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "go"}], "max_tokens": 2}
    r = urllib.request.Request(d.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=120) as resp:
        return json.loads(resp.read())["usage"]


def _restart(home: Path, model: Path):
    (home / "run" / "ostinatod.json").unlink(missing_ok=True)
    return launch_daemon(home, "--model", str(model), *FLAGS)


def test_session_comes_back_warm_after_a_restart(tiny_model, tmp_path):
    system = "You are a careful coding agent. " * 60  # ~400 tokens: above the cache's minimum
    home = tmp_path / "home"
    d = _restart(home, tiny_model)
    try:
        first = _turn(d, system)
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        d.stop()  # the idle slot's state is on disk by now (written when idle and at shutdown)
    files = list((home / "state" / "prefix-cache").glob("*.state"))
    assert files
    d = _restart(home, tiny_model)
    try:
        again = _turn(d, system)
        assert again["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 2, again
        assert "prefix cache on disk:" in d.log() and "restored into slot" in d.log()
    finally:
        d.stop()
    for f in (home / "state" / "prefix-cache").glob("*.state"):  # cut short: never served
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    d = _restart(home, tiny_model)
    try:
        cold = _turn(d, system)
        assert cold["prompt_tokens_details"]["cached_tokens"] == 0
        assert "ignored" in d.log()
    finally:
        d.stop()
