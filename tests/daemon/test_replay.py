"""Session replay (``ostinato bench replay``) and the task-grouped session split.

The live tests replay a few turns of real recorded sessions through a real daemon serving the tiny
synthetic model, with the official openai and anthropic clients.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ostinatod import sessions
from ostinatod.bench import replay

SESSIONS = Path(__file__).resolve().parents[3] / "shared" / "sessions"
if not SESSIONS.is_dir():  # checkout elsewhere: the shared tree's usual place
    SESSIONS = Path("/work/shared/sessions")
SWE, TAU2 = SESSIONS / "swe.jsonl", SESSIONS / "tau2.jsonl"
# short context (its first three turns fit in 2048 tokens), tool-calling
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


@pytest.mark.parametrize("client,turns", [("openai", 2), ("anthropic", 3)])
def test_replay_live(live_daemon, client: str, turns: int, tmp_path: Path, capsys):
    """The shared live daemon (n_ctx 2048): the first three turns of SWE_ID fit in it."""
    out = tmp_path / "r.json"
    rc = replay.main(["--sessions", str(SWE), "--ids", SWE_ID, "--max-turns", str(turns), "--client", client,
                      "--base-url", live_daemon.url, "--json", str(out), "--cap-tokens", "12"])
    data = json.loads(out.read_text())
    got = data["sessions"][0]["turns"]
    assert rc == 0, [t["error"] for t in got]
    assert len(got) == turns and data["summary"]["errors"] == 0
    assert data["token_count_method"] == "count_tokens"
    assert [t["after"] for t in got] == ["first"] + ["tool"] * (turns - 1)
    for t in got:
        assert t["completion_tokens"] == t["max_tokens"]  # ignore_eos: exactly as many as asked
        assert t["max_tokens"] == min(12, t["target_tokens"]) and t["target_tokens"] > 1
        assert t["ttft_s"] is not None and t["total_s"] >= t["ttft_s"]
        assert t["prompt_tokens"] > 0 and t["new_tokens"] is not None
    # turn i+1 reuses the prefix of turn i: it prefills only its new tokens
    last = got[-1]
    assert last["cached_tokens"] > 0 and last["new_tokens"] < last["prompt_tokens"]
    assert SWE_ID in capsys.readouterr().out  # the table


@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_first_token_callback_once_per_turn_inside_it(live_daemon, client: str):
    """``on_first_token`` (the bench's cue to start observing the server after the TTFT) runs once
    per turn, while that turn streams: after the turns before it were logged, before it is."""
    sess = [s for s in sessions.load_sessions(SWE) if s["id"] == SWE_ID]
    logged: list[str] = []
    cues: list[int] = []
    model = replay._default_model(live_daemon.url, "ostinato")
    data = replay.run_replay(sess, live_daemon.url, client=client, model=model, max_turns=2, cap_tokens=6,
                             log=logged.append, on_first_token=lambda: cues.append(len(logged)))
    turns = data["sessions"][0]["turns"]
    assert [t["error"] for t in turns] == [None, None]
    assert cues == [0, 1]


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


def test_sessions_map_to_daemon_workloads():
    from ostinatod.sessions import workload_of

    assert workload_of({"workload": "swe"}) == "coding"
    assert workload_of({"workload": "tau2"}) == "customer-service"
    assert workload_of({}) == "coding"


def test_replay_sends_the_session_workload(live_daemon, tmp_path: Path):
    """tau2 sessions are replayed as workload customer-service (x-ostinato-workload), which the daemon
    logs per request; the tau2 prompt exceeds the small live context, which is fine here: the request
    is still filed under its workload."""
    replay.main(["--sessions", str(TAU2), "--ids", TAU2_ID, "--max-turns", "1", "--base-url", live_daemon.url,
                 "--json", str(tmp_path / "r.json"), "--cap-tokens", "2"])
    assert "workload=customer-service" in live_daemon.log()


def test_replay_interleaved_agents_reports_cached_tokens(start_daemon, tiny_model, tmp_path: Path, capsys):
    """Two sessions taking turns (agents side by side) on a daemon with ONE slot: each session's
    returning turn is served from the host-memory prefix cache, which the summary reports."""
    d = start_daemon("--model", str(tiny_model), "--n-ctx", "2048", "--n-slots", "1", "--n-threads", "2",
                     "--engine-mode", "subprocess", "--cache-ram-mb", "64")
    other = "swe-mini-pvlib__pvlib-python-1707"
    out = tmp_path / "r.json"
    rc = replay.main(["--sessions", str(SWE), "--ids", SWE_ID, other, "--max-turns", "2", "--interleave",
                      "--base-url", d.url, "--json", str(out), "--cap-tokens", "2", "--quiet"])
    data = json.loads(out.read_text())
    assert rc == 0 and data["interleave"] is True
    order = [(s["id"], t["index"]) for s in data["sessions"] for t in s["turns"]]
    assert len(order) == 4
    for s in data["sessions"]:
        second = s["turns"][1]
        # the other session used the only slot in between; the first turn's prefix came back
        assert second["cached_tokens"] >= s["turns"][0]["prompt_tokens"] - 16, second
    assert data["summary"]["cached_share_after_first"] > 0.5
    assert "cached %" in capsys.readouterr().out
    d.stop()
