"""Agents get what they ask for: forced and single tool calls, no raw call markup, the
fields real clients send, the demo model's JSON and tool round trip, the refused requests that
leave a trace, the Anthropic routes without /v1. Live daemon on loopback, the official openai and
anthropic clients, the tiny random-weight model."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ROOM = 200  # output tokens: a forced call ends far below this (QUOTE closes random strings)
QUOTE = {"1": 10.0}  # '"' in the qwen2 vocabulary of the synthetic models
Q = [{"role": "user", "content": "Weather and time?"}]


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def _chat_calls(oai, model, stream: bool, **kw):
    """(content, [(name, arguments dict)], finish_reason) of one chat completion."""
    kw = dict(model=model, messages=Q, tools=TOOLS, max_tokens=ROOM, **{"logit_bias": QUOTE, **kw})
    if not stream:
        c = oai.chat.completions.create(**kw).choices[0]
        calls = [(tc.function.name, json.loads(tc.function.arguments)) for tc in c.message.tool_calls or []]
        return c.message.content or "", calls, c.finish_reason
    content, calls, finish = "", {}, None
    for ch in oai.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, ["", ""])
            e[0] += (tc.function.name or "") if tc.function else ""
            e[1] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, [(n, json.loads(a)) for n, a in calls.values()], finish


# --- 1. a forced tool choice is a call from the first token ---------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_chat(oai, model, stream):
    for seed in (1, 2):
        # one call: random weights never end a run of parallel calls, the last would be cut
        content, calls, finish = _chat_calls(oai, model, stream, tool_choice="required", seed=seed,
                                             temperature=1.0, parallel_tool_calls=False)
        assert content == "" and calls and finish == "tool_calls", (content, calls, finish)
        assert all(n in ("get_weather", "get_time") for n, _ in calls)
        content, calls, finish = _chat_calls(oai, model, stream, seed=seed, temperature=1.0, parallel_tool_calls=False,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert content == "" and finish == "tool_calls"
        assert [n for n, _ in calls] and {n for n, _ in calls} == {"get_time"}
        assert all(a["zone"] in ("UTC", "CET") for _, a in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_any_and_tool_choice_anthropic(ant, stream):
    for choice, names in (({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "get_time"}),
                          ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, {"get_weather"})):
        kw = dict(model="claude-x", max_tokens=ROOM, tools=A_TOOLS, tool_choice=choice, messages=Q,
                  extra_body={"seed": 3, "temperature": 1.0, "logit_bias": QUOTE})
        if stream:
            with ant.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = ant.messages.create(**kw)
        assert m.stop_reason == "tool_use", m
        assert [b.type for b in m.content][0] == "tool_use"  # nothing before the call
        assert {b.name for b in m.content if b.type == "tool_use"} <= names


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_choice_responses(oai, model, stream):
    kw = dict(model=model, input="Weather and time?", tools=R_TOOLS, max_output_tokens=ROOM,
              tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False, extra_body={"seed": 4, "temperature": 1.0, "logit_bias": QUOTE})
    if stream:
        with oai.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = oai.responses.create(**kw)
    assert r.status == "completed"
    assert [o.type for o in r.output][0] == "function_call"
    assert {o.name for o in r.output if o.type == "function_call"} == {"get_time"}


# --- 2. parallel_tool_calls false / disable_parallel_tool_use: at most one call --------------------

def test_parallel_tool_calls_false_gives_one_call(oai, model, ant, tool_call_bias):
    # the bias keeps opening <tool_call>: with parallel calls allowed the model makes several
    bias = {**tool_call_bias, **QUOTE}
    bias.pop("151645")  # no early end of turn
    for stream in (False, True):
        _, calls, finish = _chat_calls(oai, model, stream, tool_choice="required", parallel_tool_calls=False,
                                       temperature=1.0, seed=5, logit_bias=bias)
        assert len(calls) == 1 and finish == "tool_calls", calls
    r = oai.responses.create(model=model, input="Weather and time?", tools=R_TOOLS, max_output_tokens=ROOM,
                             tool_choice="required", parallel_tool_calls=False,
                             extra_body={"seed": 5, "temperature": 1.0, "logit_bias": bias})
    assert [o.type for o in r.output].count("function_call") == 1
    m = ant.messages.create(model="claude-x", max_tokens=ROOM, tools=A_TOOLS, messages=Q,
                            tool_choice={"type": "any", "disable_parallel_tool_use": True},
                            extra_body={"seed": 5, "temperature": 1.0, "logit_bias": bias})
    assert [b.type for b in m.content].count("tool_use") == 1 and m.stop_reason == "tool_use"


# --- 4. fields real clients send -----------------------------------------------------------------

def test_null_description_empty_arguments_null_n(oai, model, ant):
    tool = {"type": "function", "function": {**WEATHER["function"], "description": None}}
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = oai.chat.completions.create(model=model, messages=history, tools=[tool], n=None, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    m = ant.messages.create(model="claude-x", max_tokens=4, messages=Q,
                            tools=[{**A_TOOLS[0], "description": None}])
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_json_object_with_schema_is_enforced(oai, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for seed in (1, 2):
        r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "ok?"}], max_tokens=ROOM,
                                        response_format={"type": "json_object", "schema": schema}, seed=seed,
                                        temperature=1.0)
        data = json.loads(r.choices[0].message.content)
        assert set(data) == {"ok"} and isinstance(data["ok"], bool)


# --- 14. Anthropic clients posting to <base>/messages -----------------------------------------------

def _post(url: str, body: dict) -> tuple[int, dict]:
    from helpers import post
    return post(url, json.dumps(body).encode())


def test_messages_without_v1_is_served(live_daemon):
    body = {"model": "claude-x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    code, out = _post(live_daemon.url + "/messages", body)
    assert code == 200 and out["type"] == "message", out
    code, out = _post(live_daemon.url + "/messages/count_tokens", {k: body[k] for k in ("model", "messages")})
    assert code == 200 and out["input_tokens"] > 0
    code, out = _post(live_daemon.url + "/messages", {"model": "claude-x", "messages": []})
    assert code == 400 and out["type"] == "error"  # Anthropic's error shape


# --- 15. every refused request leaves a line and a count ----------------------------------------------

def _metric(url: str, code: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^ostinato_http_errors_total\{[^}]*code="' + re.escape(code) + r'"[^}]*\} (\S+)$', text, re.M))


def test_refused_requests_are_logged_and_counted(live_daemon):
    before = (_metric(live_daemon.url, "not_found"), _metric(live_daemon.url, "model_not_found"))
    code, out = _post(live_daemon.url + "/v2/chat/completions", {"model": "x", "messages": []})
    assert code == 404 and "/v1" in out["error"]["message"]
    code, _ = _post(live_daemon.url + "/v1/chat/completions",
                    {"model": "no-such-model-29", "messages": [{"role": "user", "content": "hi"}]})
    assert code == 404
    assert _metric(live_daemon.url, "not_found") == before[0] + 1
    assert _metric(live_daemon.url, "model_not_found") == before[1] + 1
    log = live_daemon.log()
    assert re.search(r"POST /v2/chat/completions -> 404 not_found", log)
    assert re.search(r"POST /v1/chat/completions -> 404 model_not_found: .*no-such-model-29", log)


# --- 5 and 9. the demo model: JSON stays JSON; a tool round trip ------------------------------------

@pytest.fixture(scope="module")
def demo_oai(demo_daemon):
    import openai
    return openai.OpenAI(base_url=demo_daemon.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_demo_json_mode_is_json(demo_oai):
    r = demo_oai.chat.completions.create(model="ostinato-demo-random-weights", max_tokens=ROOM,
                                         messages=[{"role": "user", "content": "JSON please"}],
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_demo_tool_round_trip_chat(demo_oai):
    m = "ostinato-demo-random-weights"
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = demo_oai.chat.completions.create(model=m, messages=msgs, tools=TOOLS, max_tokens=4096)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time") and set(args) <= {"city", "zone"} and args
    msgs += [{"role": "assistant", "content": c.message.content, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = demo_oai.chat.completions.create(model=m, messages=msgs, tools=TOOLS, max_tokens=4096)
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert r2.choices[0].message.content.startswith("[Ostinato demo model")
    # a call cut by the client's limit is "length", not a finished turn
    r3 = demo_oai.chat.completions.create(model=m, messages=msgs[:1], tools=TOOLS, max_tokens=3)
    assert r3.choices[0].finish_reason == "length"


def test_demo_tool_round_trip_anthropic(demo_daemon):
    import anthropic
    ant = anthropic.Anthropic(base_url=demo_daemon.url, api_key="none", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "What time is it?"}]
    with ant.messages.stream(model="claude-x", max_tokens=32000, tools=A_TOOLS, messages=msgs) as s:
        m = s.get_final_message()
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].input
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "noon"}]}]
    m2 = ant.messages.create(model="claude-x", max_tokens=32000, tools=A_TOOLS, messages=msgs)
    assert m2.stop_reason == "end_turn" and [b.type for b in m2.content] == ["text"]


# --- 6 and 8. launch: the URL the agent will use answers; mini-swe-agent and the OpenHands SDK -------

def _launch(daemon, tmp_path, agent: str, args: list[str], **env: str):
    """``ostinato launch AGENT -- ARGS`` with a stand-in executable per agent on PATH that prints the
    variables it was started with (the real CLIs run in test_agent_clis.py / test_claude_code.py)."""
    import os
    import subprocess
    import sys

    from conftest import child_pythonpath
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("claude", "mini"):
        exe = bin_dir / name
        exe.write_text("#!/bin/sh\nenv | grep -E '^(ANTHROPIC_BASE_URL|MSWEA_[A-Z_]+|OPENAI_API_BASE|CLAUDE_CODE_AUTO_COMPACT_WINDOW)=' | sort\n")
        exe.chmod(0o755)
    e = {k: v for k, v in daemon.env.items() if k != "ANTHROPIC_BASE_URL"}
    e.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp_path), PYTHONPATH=child_pythonpath(),
             **env)
    return subprocess.run([sys.executable, "-m", "ostinatod.cli", "launch", agent, "--", *args], env=e,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))


def test_launch_refuses_a_dead_base_url(live_daemon, tmp_path):
    r = _launch(live_daemon, tmp_path, "claude", [], ANTHROPIC_BASE_URL="http://127.0.0.1:9")
    assert r.returncode == 1 and "ANTHROPIC_BASE_URL=" not in r.stdout, (r.stdout, r.stderr)
    assert "nothing answers at http://127.0.0.1:9" in r.stderr and "unset ANTHROPIC_BASE_URL" in r.stderr
    assert "starting claude" not in r.stderr
    r = _launch(live_daemon, tmp_path, "claude", [])
    assert r.returncode == 0 and f"ANTHROPIC_BASE_URL={live_daemon.url}\n" in r.stdout, r.stderr
    assert f"starting claude on {live_daemon.url}" in r.stderr


def test_launch_mini_and_openhands_sdk(live_daemon, tmp_path):
    r = _launch(live_daemon, tmp_path, "mini", ["-t", "x"])
    assert r.returncode == 0, r.stderr
    assert "MSWEA_CONFIGURED=true\n" in r.stdout and "MSWEA_COST_TRACKING=ignore_errors\n" in r.stdout
    assert f"OPENAI_API_BASE={live_daemon.url}/v1\n" in r.stdout
    assert re.search(r"^MSWEA_MODEL_NAME=openai/\S+$", r.stdout, re.M)
    import sys
    r = _launch(live_daemon, tmp_path, "openhands-sdk",
                [sys.executable, "-c", "import os; print(os.environ['LLM_BASE_URL'], os.environ['LLM_MODEL'])"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{live_daemon.url}/v1 openai/")


# --- 10. shutdown with a control stream attached (the TUI's /events) ---------------------------------

def test_stop_with_an_events_stream_attached_exits_cleanly(start_daemon, tiny_model):
    import signal
    import socket
    import subprocess

    d = start_daemon("--model", str(tiny_model), "--n-ctx", "512", "--engine-mode", "inprocess",
                     "--n-threads", "1")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(d.control_socket))
    s.sendall(b"GET /events?interval=0.2 HTTP/1.1\r\nHost: ostinatod\r\n\r\n")
    assert b"200" in s.recv(4096)  # the stream is open
    d.proc.send_signal(signal.SIGTERM)
    try:
        rc = d.proc.wait(timeout=20)  # aiohttp's own shutdown timeout would hold it 60 s
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon did not exit within 20 s with an /events stream attached")
    finally:
        s.close()
    assert rc == 0, d.log()[-2000:]


# --- 13. /v1/models says the served context --------------------------------------------------------

def test_models_report_the_served_context(live_daemon):
    from conftest import LIVE_N_CTX
    with urllib.request.urlopen(live_daemon.url + "/v1/models", timeout=30) as r:
        entry = json.loads(r.read())["data"][0]
    assert entry["context_length"] == entry["max_model_len"] == LIVE_N_CTX


# --- 13 and 7. the default context is what agents assume; less only for memory, said plainly --------

def _context_length(daemon) -> int:
    with urllib.request.urlopen(daemon.url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["context_length"]


def test_default_context_is_what_agents_assume(start_daemon, tiny_model, tmp_path):
    d = start_daemon("--model", str(tiny_model), "--engine-mode", "inprocess", "--n-threads", "1")
    assert _context_length(d) == 131072  # the tiny model's training context; memory is plenty
    r = _launch(d, tmp_path, "claude", [])
    assert r.returncode == 0 and "CLAUDE_CODE_AUTO_COMPACT_WINDOW=131072\n" in r.stdout, r.stderr
    assert "WARNING" not in r.stderr


def test_context_lowered_for_memory_is_logged_and_launch_says_why(start_daemon, tiny_model, tmp_path):
    # a prefix-cache budget larger than the RAM leaves the KV cache no host memory: the floor is served
    from ostinatod.engine.context_fit import MIN_FIT_CONTEXT
    d = start_daemon("--model", str(tiny_model), "--engine-mode", "inprocess", "--n-threads", "1",
                     "--cache-ram-mb", str(1 << 30))
    assert _context_length(d) == MIN_FIT_CONTEXT
    assert re.search(rf"context: serving {MIN_FIT_CONTEXT} tokens per slot, not the 131072 asked: .*host memory",
                     d.log())
    r = _launch(d, tmp_path, "claude", [])
    assert r.returncode == 0, r.stderr
    assert f"serves {MIN_FIT_CONTEXT} tokens per slot because the KV cache" in r.stderr
    assert "Claude Code compacts its conversation only past 100000 tokens" in r.stderr
