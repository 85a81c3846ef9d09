"""Session replay (``ostinato bench replay``) and the task-grouped session split.

The live tests replay a few turns of real recorded sessions through a real daemon serving the tiny
synthetic model, with the official openai and anthropic clients.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ostinatod.tools import replay, sessions

SESSIONS = Path(__file__).resolve().parents[2] / "shared" / "sessions"
if not SESSIONS.is_dir():  # checkout elsewhere: the shared tree's usual place
    SESSIONS = Path("/work/shared/sessions")
SWE, TAU2 = SESSIONS / "swe.jsonl", SESSIONS / "tau2.jsonl"
# short contexts (first turns fit in a few thousand tokens); the swe one uses tool calls
SWE_ID = "swe-mini-astropy__astropy-6938"
TAU2_ID = "tau2-retail-task18-gpt41-cee86852"


def test_split_keeps_tasks_together():
    dev, held = sessions.split_sessions(SWE, held_out_frac=1 / 3, seed=0)
    all_ids = [s["id"] for s in sessions.load_sessions(SWE)]
    assert sorted(s["id"] for s in dev + held) == sorted(all_ids)
    assert 0.2 < len(held) / len(all_ids) < 0.45
    for side in (dev, held):
        other = held if side is dev else dev
        keys = {sessions.task_key(s["id"]) for s in side}
        assert not keys & {sessions.task_key(s["id"]) for s in other}
    # the eight recordings of marshmallow-1867 are one task
    k = {sessions.task_key(i) for i in all_ids if "marshmallow-1867" in i}
    assert k == {"swe:marshmallow-1867"}
    assert sessions.split_sessions(SWE, seed=0) == (dev, held)
    assert sessions.task_key("tau2-retail-task12-gpt41-0c18a52c") == sessions.task_key("tau2-retail-task12-bfc6c6ec")


def test_sessions_file_errors(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "system", "content": ""}]}\nnot json\n')
    with pytest.raises(sessions.SessionError, match=":2:"):
        sessions.load_sessions(bad)
    assert replay.main(["--sessions", str(tmp_path / "missing.jsonl")]) == 2


def test_anthropic_conversion_alternates_and_pairs_tool_ids():
    s = next(x for x in sessions.load_sessions(SWE) if x["id"] == SWE_ID)
    turn = sessions.assistant_turns(s)[3]
    system, msgs = replay.to_anthropic(turn.context)
    assert system and msgs[0]["role"] == "user"
    assert all(a["role"] != b["role"] for a, b in zip(msgs, msgs[1:]))
    uses = [b["id"] for m in msgs for b in m["content"] if b["type"] == "tool_use"]
    results = [b["tool_use_id"] for m in msgs for b in m["content"] if b["type"] == "tool_result"]
    assert uses and uses == results
    assert all(isinstance(b["input"], dict) for m in msgs for b in m["content"] if b["type"] == "tool_use")


@pytest.fixture(scope="module")
def replay_daemon(start_daemon, tiny_model: Path):
    """A daemon with a context long enough for the first turns of the recorded sessions."""
    return start_daemon("--model", str(tiny_model), "--n-ctx", "12288", "--n-slots", "2",
                        "--n-threads", "2", "--engine-mode", "subprocess")


@pytest.mark.parametrize("client,file,sid", [("openai", TAU2, TAU2_ID), ("anthropic", SWE, SWE_ID)])
def test_replay_live(replay_daemon, client: str, file: Path, sid: str, tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    rc = replay.main(["--sessions", str(file), "--ids", sid, "--max-turns", "3", "--client", client,
                      "--base-url", replay_daemon.url, "--json", str(out)])
    data = json.loads(out.read_text())
    turns = data["sessions"][0]["turns"]
    assert rc == 0, [t["error"] for t in turns]
    assert len(turns) == 3 and data["summary"]["errors"] == 0
    assert data["token_count_method"] == "count_tokens"
    kinds = [t["after"] for t in turns]
    assert kinds[0] == "first" and set(kinds[1:]) <= {"tool", "user"}
    if client == "anthropic":
        assert "tool" in kinds  # a function-calling session: turns after tool results
    for t in turns:
        assert t["completion_tokens"] == t["max_tokens"]  # ignore_eos: exactly the recorded length
        assert t["ttft_s"] is not None and t["total_s"] >= t["ttft_s"]
        assert t["prompt_tokens"] > 0 and t["new_tokens"] is not None
    # the prefix of turn i is reused by turn i+1: later turns prefill only their new tokens
    assert turns[2]["cached_tokens"] > 0 and turns[2]["new_tokens"] < turns[2]["prompt_tokens"]
    assert sid in capsys.readouterr().out  # the table


def test_replay_records_errors(tmp_path: Path):
    """A server that is not there: every turn is recorded as an error and the exit code says so."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.json"
    rc = replay.main(["--sessions", str(TAU2), "--ids", TAU2_ID, "--max-turns", "2", "--base-url",
                      f"http://127.0.0.1:{port}", "--model", "m", "--json", str(out), "--timeout", "5"])
    assert rc == 1
    turns = json.loads(out.read_text())["sessions"][0]["turns"]
    assert len(turns) == 2 and all(t["error"] for t in turns)
