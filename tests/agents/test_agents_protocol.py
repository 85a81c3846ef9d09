"""Protocol edge cases that agents hit (docs/api.md), each across the protocols, streaming
and not, against the live daemon with the official ``openai`` and ``anthropic`` clients (real HTTP on
loopback, real engine worker, tiny random-weight model)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import anthropic
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
A_WEATHER = {"name": "get_weather", "description": "Weather of a city",
             "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


# --- 1. a tool call cut by max_tokens goes back as nothing, with length / max_tokens -------------
# (no call, no markup, no half-written call in the text)

def _no_markup(text: str) -> None:
    assert "get_weather" not in text and "<tool_call>" not in text and "{" not in text, text

CUT = 28  # output tokens: with seed 11 the call has begun (grammar-forced JSON) but not ended


def test_cut_tool_call_is_dropped_with_length_chat(oai, model, tool_call_bias):
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
              tool_choice="required", max_tokens=CUT, temperature=1.0, seed=11, logit_bias=tool_call_bias)
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length", c
    assert not c.message.tool_calls
    _no_markup(c.message.content or "")
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    _no_markup(text)


def test_cut_tool_call_is_dropped_with_max_tokens_anthropic(ant, tool_call_bias):
    kw = dict(model="claude-x", max_tokens=CUT, tools=[A_WEATHER], tool_choice={"type": "any"},
              extra_body={"logit_bias": tool_call_bias, "temperature": 1.0, "seed": 11},
              messages=[{"role": "user", "content": "Weather?"}])
    m = ant.messages.create(**kw)
    assert m.stop_reason == "max_tokens" and all(b.type == "text" for b in m.content)
    _no_markup("".join(b.text for b in m.content))
    with ant.messages.stream(**kw) as s:
        kinds = [ev.content_block.type for ev in s if ev.type == "content_block_start"]
        final = s.get_final_message()
    assert "tool_use" not in kinds
    assert final.stop_reason == "max_tokens"
    _no_markup("".join(b.text for b in final.content))


def test_cut_tool_call_is_dropped_incomplete_responses(oai, model, tool_call_bias):
    kw = dict(model=model, input="Weather?", tools=[{"type": "function", **WEATHER["function"]}],
              tool_choice="required", max_output_tokens=CUT,
              extra_body={"logit_bias": tool_call_bias, "seed": 11, "temperature": 1.0})
    r = oai.responses.create(**kw)
    assert r.status == "incomplete" and all(o.type == "message" for o in r.output)
    _no_markup(r.output_text)
    with oai.responses.stream(**kw) as s:
        types = [ev.type for ev in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" not in types
    assert final.status == "incomplete"
    _no_markup(final.output_text)


# --- 3. a client's stop sequence is reported as such (Anthropic) --------------------------------

HELLO = 9707  # "Hello" in the qwen2 vocabulary of the synthetic models


def test_stop_sequence_reported_anthropic(ant):
    kw = dict(model="claude-x", max_tokens=12, stop_sequences=["loHel"],
              extra_body={"logit_bias": {str(HELLO): 100}, "temperature": 0},
              messages=[{"role": "user", "content": "Say hello"}])
    m = ant.messages.create(**kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "loHel")
    assert m.content[0].text == "Hel"
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "loHel")
    # the template's own end-of-turn strings are not the client's stop sequences
    m = ant.messages.create(model="claude-x", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert m.stop_sequence is None


def test_stop_sequence_openai_finish_stop(oai, model):
    r = oai.chat.completions.create(model=model, max_tokens=12, stop=["loHel"], temperature=0,
                                    logit_bias={str(HELLO): 100}, messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Hel"


# --- 4. a final assistant message is continued (prefill) -----------------------------------------

def test_final_assistant_message_is_continued(ant, oai, model):
    user = [{"role": "user", "content": "Count to five."}]
    n_user = ant.messages.count_tokens(model="claude-x", messages=user).input_tokens
    n_pre = ant.messages.count_tokens(model="claude-x",
                                      messages=user + [{"role": "assistant", "content": "1, 2,"}]).input_tokens
    # the open assistant turn plus "1, 2," (5 tokens), not that turn closed and a new one opened
    # (<|im_end|>, newline, <|im_start|>assistant, newline: 5 more)
    assert n_pre == n_user + 5, (n_user, n_pre)
    r = oai.chat.completions.create(model=model, max_tokens=2, messages=user + [
        {"role": "assistant", "content": "1, 2,"}])
    assert r.usage.prompt_tokens == n_pre


# --- 5. a prompt over the context: Anthropic's wording, OpenAI's code -----------------------------

def test_prompt_too_long_wording(ant, oai, model):
    big = "word " * 4000
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": big}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert re.match(r"prompt is too long: \d+ tokens > \d+ maximum", e.value.body["error"]["message"])
    with pytest.raises(openai.BadRequestError) as e2:
        oai.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": big}])
    assert e2.value.code == "context_length_exceeded"


# --- 6. a JSON schema that cannot be enforced is refused -----------------------------------------

def test_unenforceable_json_schema_pattern_is_400(oai, model):
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^hello there indeed\\!$"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}})
    assert "pattern ^hello there indeed\\!$ is not supported" in e.value.message
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=model, input="x", max_output_tokens=4,
                             text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    ok = dict(schema, properties={"a": {"type": "string", "pattern": "^[a-z]+$"}})
    r = oai.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ok}})
    assert r.choices[0].finish_reason in ("stop", "length")


# --- 7. tool_choice "none": tools stay in the prompt, a call made anyway is dropped ---------------

def test_tool_choice_none_call_made_anyway_is_dropped(worker):
    from ostinatod.engine.chat import openai_message
    from ostinatod.engine.text import settle_tool_calls
    from ostinatod.engine.types import GenRequest

    w = worker
    req = GenRequest(id="r", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                     tool_choice="none")
    prompt, rendered = w.render(req)
    auto = w.render(GenRequest(id="a", messages=req.messages, tools=[WEATHER]))[0]
    assert prompt == auto  # the decision: same prompt (and cached prefix) as "auto"
    p = w.chat_parser(req, rendered)
    try:
        res = p.feed('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                     final=True)
    finally:
        p.close()
    msg, finish = settle_tool_calls(openai_message(res.message), "stop", req.tool_choice)
    assert finish == "stop" and "tool_calls" not in msg
    assert msg["content"] == "Sure."


# --- 8. Anthropic tools with defer_loading stay out of the prompt until loaded --------------------

def test_deferred_tools_stay_out_until_loaded(ant):
    msgs = [{"role": "user", "content": "hi"}]
    deferred = {"name": "DeferredToolPlaceholder", "description": "A tool loaded on demand. " * 20,
                "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
                "defer_loading": True}
    base = ant.messages.count_tokens(model="claude-x", messages=msgs, tools=[A_WEATHER]).input_tokens
    with_deferred = ant.messages.count_tokens(model="claude-x", messages=msgs,
                                              tools=[A_WEATHER, deferred]).input_tokens
    assert with_deferred == base
    loaded = msgs + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "placeholder"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "DeferredToolPlaceholder"}]}]}]
    n_loaded = ant.messages.count_tokens(model="claude-x", messages=loaded, tools=[A_WEATHER, deferred])
    n_not = ant.messages.count_tokens(model="claude-x", messages=loaded, tools=[A_WEATHER])
    assert n_loaded.input_tokens > n_not.input_tokens + 50


# --- 9. Codex's namespace tools are flattened, web_search is named in the log and `ps` ------------

def test_codex_namespace_tools_and_web_search_warning(oai, model, live_daemon, tool_call_bias):
    tools = [{"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents",
              "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn an agent",
                         "parameters": {"type": "object", "properties": {"who": {"type": "string", "enum": ["a"]}},
                                        "required": ["who"]}}]},
             {"type": "web_search"}]
    r = oai.responses.create(model=model, input="Start a helper", tools=tools, tool_choice="required",
                             max_output_tokens=96, extra_body={"logit_bias": tool_call_bias, "seed": 11,
                                                               "temperature": 1.0})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "spawn_agent"
    assert calls[0].namespace == "multi_agent_v1"
    assert "tool web_search (web_search) left out" in live_daemon.log()
    ps = subprocess.run([sys.executable, "-m", "ostinatod.cli", "ps", "--json"], env=live_daemon.env,
                        capture_output=True, text=True, timeout=60)
    recs = json.loads(ps.stdout)
    rec = [x for x in recs.get("recent", []) if x["id"] == r.id]
    assert rec and any("web_search" in w for w in rec[0]["warnings"])


# --- 9b. an output Codex adds without a call (create_goal's goal_objective) is read, not refused --

def test_codex_output_without_a_call_is_read(oai, model):
    turn = [{"role": "user", "content": "Set a goal"},
            {"type": "function_call", "call_id": "call_1", "name": "create_goal",
             "arguments": "{\"objective\": \"x\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "{\"goal\": \"active\"}"}]
    added = {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
             "output": "Port the parser to Rust and keep every test green " * 4}
    base = oai.responses.create(model=model, input=turn, max_output_tokens=1)
    r = oai.responses.create(model=model, input=turn + [added], max_output_tokens=1)
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > base.usage.input_tokens + 30  # the added output is in the prompt


# --- 10. a base URL ending in /v1 (POST /v1/v1/messages) is served --------------------------------

def test_doubled_v1_anthropic_base_url_is_served(live_daemon):
    c = anthropic.Anthropic(base_url=live_daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
    m = c.messages.create(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert m.type == "message"
    assert c.messages.count_tokens(model="claude-x", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    assert "drop /v1 from ANTHROPIC_BASE_URL" in live_daemon.log()


# --- 2. whitespace variants of the tool-call marker are calls -------------------------------------

@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory):
    """An engine worker on the tiny model (not running its loop): its templates and parsers."""
    import os

    from ostinatod.engine.worker import Worker
    from ostinatod.settings import Settings

    os.environ.setdefault("OSTINATO_HOME", str(tmp_path_factory.mktemp("home")))
    w = Worker(Settings(n_ctx=512, n_slots=1, n_threads=1, experts="stock", log_level="WARNING"), tiny_model)
    w.load()
    yield w
    w.close()


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>  {"name":"get_weather","arguments":{"city":"Paris"}} </tool_call>',
    '<tool_call>\n\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'])
def test_tool_call_marker_whitespace_variants_are_calls(worker, text):
    from ostinatod.engine.types import GenRequest

    req = GenRequest(id="r", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    p = worker.chat_parser(req, worker.render(req)[1])
    try:
        streamed = []
        for i in range(1, len(text) + 1):  # as the worker streams it: the text so far, growing
            streamed += p.feed(text[:i]).diffs
        res = p.feed(text, final=True)
        streamed += res.diffs
    finally:
        p.close()
    assert [(c["name"], json.loads(c["arguments"])) for c in res.message["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    assert not res.message["content"]
    assert not any("<tool_call>" in (d.get("content") or "") for d in streamed)


# --- 13. LiteLLM-based agents (openai SDK user agent) are recognised by their system prompt --------

def test_litellm_agents_recognised_by_system_prompt(oai, model, live_daemon):
    system = ("You are a helpful assistant that can interact with a computer.\n"
              "Reply with one bash block:\n```mswea_bash_command\nls\n```")
    r = oai.chat.completions.create(
        model=model, max_tokens=1, messages=[{"role": "system", "content": system},
                                             {"role": "user", "content": "Solve the issue."}])
    assert any(r.id in ln and "client=mini-swe-agent workload=coding" in ln for ln in live_daemon.log().splitlines())
