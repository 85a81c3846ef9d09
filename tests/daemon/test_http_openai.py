"""OpenAI chat/completions/models and the Responses API against the live daemon, with the official
``openai`` client (real HTTP on loopback, real engine, tiny random-weight model)."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    # an enum keeps the grammar-forced arguments short on a random-weight model
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(live_daemon):
    return openai.OpenAI(base_url=live_daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_served_model(client, tiny_model):
    data = client.models.list().data
    assert len(data) == 1
    assert data[0].id == tiny_model.stem
    assert data[0].model_extra["random_weights"] is True  # synthetic model is flagged


def test_chat_non_stream_usage_and_prefix_cache(client, model):
    msgs = [{"role": "system", "content": "You are a terse assistant. " * 20},
            {"role": "user", "content": "Say hello."}]
    r1 = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    assert r1.object == "chat.completion"
    assert isinstance(r1.choices[0].message.content, str)
    assert r1.choices[0].finish_reason in ("stop", "length")
    assert r1.usage.prompt_tokens > 40
    assert 1 <= r1.usage.completion_tokens <= 4
    # same prefix again: the slot's KV prefix is reused, so most prompt tokens are cached
    r2 = client.chat.completions.create(model=model, messages=msgs + [
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}], max_tokens=2)
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 8


def test_chat_ignore_eos_generates_exactly_max_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "count"}],
                                       max_tokens=7, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"


def test_chat_stream_with_usage(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == 6
    assert isinstance(text, str)
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat_tool_choice_required_gives_structured_call(client, model, tool_call_bias):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=96, temperature=1.0, seed=7, logit_bias=tool_call_bias)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert call.id
    # the parsed call is not repeated as text (the biased random model may emit stray "<tool_call>"
    # tokens before the trigger, and a further call cut by max_tokens: text by docs/api.md's rules)
    assert f"get_weather({call.function.arguments})" not in (choice.message.content or "")


def test_chat_stream_named_tool_call_assembles(client, model, tool_call_bias):
    with client.chat.completions.stream(
            model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=96,
            temperature=1.0, seed=11, logit_bias=tool_call_bias) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    # the parsed call is not repeated as text (a further call cut by max_tokens is text: docs/api.md)
    assert f"get_weather({calls[0].function.arguments})" not in (final.choices[0].message.content or "")


def test_chat_tool_history_roundtrip(client, model):
    msgs = [{"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": "{\"city\": \"Rome\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_response_format(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give JSON."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "additionalProperties": False}}})
    if r.choices[0].finish_reason == "stop":  # grammar-complete output must parse
        assert isinstance(json.loads(r.choices[0].message.content)["a"], int)


def test_completions_endpoint(client, model):
    r = client.completions.create(model=model, prompt="def main():", max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 5
    pieces = list(client.completions.create(model=model, prompt="hello", max_tokens=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert pieces[-1].choices[0].finish_reason == "length"


def _check_entries(entries, n_top: int) -> None:
    """Each entry a token's natural-log probability with its ``n_top`` alternatives, most likely
    first; greedy output (temperature 0, no bias or grammar) is the first alternative."""
    import math
    for e in entries:
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == n_top and tops == sorted(tops, reverse=True)
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-9
        if n_top:
            assert e.top_logprobs[0].token == e.token and abs(tops[0] - e.logprob) < 1e-9


def test_chat_logprobs_with_top_alternatives(client, model):
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens > 0  # one per generated token (not the end token)
    _check_entries(entries, 3)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == r.choices[0].message.content
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0,
                                           logprobs=True)
    _check_entries(plain.choices[0].logprobs.content, 0)
    without = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    assert without.choices[0].logprobs is None


def test_chat_stream_logprobs_arrive_with_the_chunks(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    usage = [c.usage for c in chunks if c.usage][0]
    assert len(entries) == usage.completion_tokens > 0
    _check_entries(entries, 2)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text
    # a content chunk carries the entries of its own tokens (not all of them at the end)
    with_both = [c for c in chunks if c.choices and c.choices[0].delta.content and c.choices[0].logprobs]
    assert len(with_both) >= 2


def test_logprobs_bounds_are_400s(client, model):
    msgs = [{"role": "user", "content": "hi"}]
    for extra in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=1, **extra)
        assert "top_logprobs" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=1, logprobs=6)


def test_completions_logprobs_legacy_shape(client, model):
    r = client.completions.create(model=model, prompt="def main():", max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    pieces = list(client.completions.create(model=model, prompt="def main():", max_tokens=5,
                                            temperature=0, logprobs=1, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [t for p in pieces if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens]
    assert len(streamed) == 5


def test_model_workload_suffix_accepted(client, model, live_daemon):
    r = client.chat.completions.create(model=model + "@support", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1)
    assert r.model == model + "@support"
    assert "workload=support" in live_daemon.log()


def test_responses_plain_and_usage(client, model):
    r = client.responses.create(model=model, input="Hello there", instructions="Be brief.",
                                max_output_tokens=5, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 3
    assert isinstance(r.output_text, str)


def test_responses_stream_function_call_with_history(client, model, tool_call_bias):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": WEATHER["function"]["parameters"]}]
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": "{\"city\": \"Rome\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
               {"role": "user", "content": "And in Paris?"}]
    types = []
    with client.responses.stream(model=model, input=history, tools=tools, tool_choice="required",
                                 max_output_tokens=128, temperature=1.0,
                                 extra_body={"logit_bias": tool_call_bias, "seed": 13}) as s:
        for ev in s:
            types.append(ev.type)
        final = s.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments), dict)
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in types
    assert "response.output_item.done" in types


def test_metrics_exposes_requests_and_engine(live_daemon, client, model):
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "m"}], max_tokens=2)
    text = urllib.request.urlopen(live_daemon.url + "/metrics").read().decode()
    assert 'ostinato_requests_total{protocol="openai_chat",status="ok"}' in text
    assert "ostinato_ttft_seconds_bucket" in text
    assert "ostinato_prompt_tokens_total" in text
    assert "ostinato_engine_" in text  # engine stats flattened

