"""On the shared live daemon (tiny model): the OpenAI surface's routes and fields the
official SDKs use, legacy function calling, token-id prompts, errors that name their parameter,
a forced call that keeps the conversation's cache, and model output kept out of the log."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
OTHER = {"type": "function", "function": {"name": "other", "description": "Something else",
                                          "parameters": {"type": "object", "properties": {}}}}


def _req(daemon, method: str, path: str, body=None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(daemon.url + path, data=data, method=method,
                               headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_models_retrieve_with_both_sdks(oai, ant, model, live_daemon):
    m = oai.models.retrieve(model)
    assert m.id == model and m.object == "model" and m.model_extra["context_length"] == 2048
    assert oai.models.retrieve(f"{model}@coding").id == f"{model}@coding"  # a name requests may use
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    a = ant.models.retrieve("claude-sonnet-4-5")  # the names Anthropic clients may use
    assert a.type == "model" and a.id == "claude-sonnet-4-5" and a.display_name == model
    assert a.created_at.year >= 2024
    listed = ant.models.list().data
    assert [x.type for x in listed] == ["model"] and listed[0].id == model


def test_not_found_hint_only_off_v1(live_daemon):
    code, body = _req(live_daemon, "GET", "/v1/nothing")
    assert code == 404 and "the API is under /v1" not in body["error"]["message"]
    code, body = _req(live_daemon, "GET", "/nothing")
    assert code == 404 and "the API is under /v1" in body["error"]["message"]
    assert _req(live_daemon, "GET", "/models")[0] == 200  # llama-server's routes without /v1 stay


def test_legacy_functions_become_tools(oai, model):
    """Functions + function_call are tools + tool_choice (the prompt shows them),
    role function messages are tool results of the call before them."""
    msgs = [{"role": "user", "content": "Weather?"}]
    plain = oai.chat.completions.create(model=model, messages=msgs, max_tokens=1)
    tools = oai.chat.completions.create(model=model, messages=msgs, max_tokens=1, tools=[WEATHER])
    legacy = oai.chat.completions.create(model=model, messages=msgs, max_tokens=1,
                                         functions=[WEATHER["function"]], function_call="auto")
    assert legacy.usage.prompt_tokens == tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    with pytest.raises(openai.BadRequestError) as e:  # function_call naming no function: refused as tool_choice is
        oai.chat.completions.create(model=model, messages=msgs, max_tokens=1, functions=[WEATHER["function"]],
                                    function_call={"name": "nope"})
    assert e.value.body["param"] == "tool_choice"
    turn = msgs + [{"role": "assistant", "content": None,
                    "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                   {"role": "function", "name": "get_weather", "content": "sunny and 21 C"}]
    as_tools = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny and 21 C"}]
    a = oai.chat.completions.create(model=model, messages=turn, max_tokens=1, functions=[WEATHER["function"]])
    b = oai.chat.completions.create(model=model, messages=as_tools, max_tokens=1, tools=[WEATHER])
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > legacy.usage.prompt_tokens + 10


def test_legacy_call_comes_back_as_function_call():
    from ostinatod.server.encoders import openai_chat as enc
    done = {"finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}
    u = {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    r = enc.chat_completion("id", "m", 0, done, u, legacy=True)
    c = r["choices"][0]
    assert c["finish_reason"] == "function_call" and "tool_calls" not in c["message"]
    assert c["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    s = enc.ChatStream("id", "m", 0, False, legacy=True)
    from ostinatod.engine.events import event_from_data
    frames = [f.data for f in s.feed(event_from_data("done", done), u)]
    deltas = [ch["choices"][0] for ch in frames if isinstance(ch, dict) and ch.get("choices")]
    assert any(d["delta"].get("function_call", {}).get("name") == "get_weather" for d in deltas)
    assert deltas[-1]["finish_reason"] == "function_call"


def test_token_id_prompts(oai, model):
    a = oai.completions.create(model=model, prompt=[9707, 1879], max_tokens=2, temperature=0)
    b = oai.completions.create(model=model, prompt=[[9707, 1879]], max_tokens=2, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == 2 and a.choices[0].text == b.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=[9707, 10 ** 9], max_tokens=2)
    assert str(10 ** 9) in e.value.body["message"] and e.value.body["param"] == "prompt"


def test_errors_name_tool_pointer_and_param(oai, model, live_daemon):
    bad = {"type": "function", "function": {"name": "mcp_broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/X"}},
        "$defs": {"X": {"type": "object", "properties": {"b": {"$ref": "#/$defs/Missing"}}}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                    tools=[WEATHER, OTHER, bad])
    msg = e.value.body["message"]
    assert "tools[2]" in msg and "mcp_broken" in msg and "#/$defs/X/properties/b" in msg, msg
    assert e.value.body["param"] == "tools.2"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input=[], max_output_tokens=1)
    assert e.value.body["param"] == "input"


def test_forced_call_keeps_the_conversation_cache(oai, model):
    """A turn forcing one tool renders every tool, so the next ordinary request
    of the conversation reuses the whole prompt."""
    msgs = [{"role": "system", "content": "You help with the weather. " * 20},
            {"role": "user", "content": "Weather in Paris?"}]
    forced = oai.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, OTHER], max_tokens=1,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    auto = oai.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, OTHER], max_tokens=1)
    assert forced.usage.prompt_tokens == auto.usage.prompt_tokens
    assert auto.usage.prompt_tokens_details.cached_tokens >= auto.usage.prompt_tokens - 1


def test_model_output_stays_out_of_the_log(oai, model, live_daemon, tool_call_bias):
    """Output that does not match the call format (tool_choice none, a model
    biased to open calls) is not written to the daemon's log at the default level."""
    for seed in (3, 5):
        r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather?"}],
                                        tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=1.0,
                                        seed=seed, logit_bias=tool_call_bias)
        assert "<tool_call>" not in (r.choices[0].message.content or "")
    log = live_daemon.log()
    assert "common_chat_peg_parse" not in log and "unparsed" not in log


def test_load_lines_state_the_served_context(demo_daemon):
    """llama.cpp's n_ctx_seq lines count the KV cache the slots share; the log
    states the context per slot instead of 'n_ctx_seq (262144) > n_ctx_train (131072)'."""
    from ostinatod.engine.loading import restate_context_line
    logs = "".join(p.read_text(errors="replace") for p in (demo_daemon.home / "state").glob("*.log"))
    assert "> n_ctx_train" not in logs
    assert restate_context_line(b"llama_context: n_ctx_seq (262144) > n_ctx_train (131072) -- x\n", (131072, 2)) is None
    said = restate_context_line(b"llama_context: n_ctx_seq             = 262144\n", (131072, 2))
    assert b"131072 tokens per slot" in said
    assert restate_context_line(b"other\n", (131072, 2)) == b"other\n"
