"""The native chat shim (llama.cpp common/chat through libostinato): rendering and output parsing.

Uses the tiny synthetic model's chat template (ostinatod/synth/chat_template.jinja, ChatML/Hermes
with <tool_call> JSON calls and <think> reasoning). If common/chat stops recognising it (format_name
"Content-only" / no tool-call grammar), the template must keep: '<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>' for calls, tools listed as JSON inside <tools></tools>, '<think>'/'</think>' around
reasoning, and '<|im_start|>assistant\\n' as the generation prompt.
"""

from __future__ import annotations

import json

import pytest

from ostinatod.engine.types import EngineError

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def templates(tiny_model):
    import llama_cpp

    from ostinatod.engine.chat import ChatTemplates

    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(tiny_model).encode(), mp)
    assert model
    t = ChatTemplates(int(model))
    yield t, int(model)
    t.close()
    llama_cpp.llama_model_free(model)


def test_render_conversation_with_tools(templates):
    t, _ = templates
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = t.render(msgs, tools=TOOLS)
    assert r.prompt.startswith("<|im_start|>system\nYou are terse.")
    assert '"name": "get_weather"' in r.prompt and "<tool_response>\nsunny\n</tool_response>" in r.prompt
    assert r.prompt.endswith("<|im_start|>assistant\n")
    assert "get_weather" in r.grammar  # a tool-call grammar was derived from the template
    assert r.grammar_lazy  # tool_choice auto: free text until a <tool_call> trigger
    assert r.format_name.lower() != "content-only"


def test_render_required_and_named_tool_choice(templates):
    t, _ = templates
    msgs = [{"role": "user", "content": "hi"}]
    r = t.render(msgs, tools=TOOLS, tool_choice="required")
    assert r.grammar and not r.grammar_lazy
    r2 = t.render(msgs, tools=TOOLS + [{"type": "function", "function": {"name": "other", "parameters": {}}}],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "get_weather" in r2.grammar and "other" not in r2.grammar
    # the prompt shows every tool whatever the choice (the cached prefix stays)
    auto = t.render(msgs, tools=TOOLS + [{"type": "function", "function": {"name": "other", "parameters": {}}}])
    assert r2.prompt == auto.prompt and '"name": "other"' in r2.prompt
    assert r.prompt == t.render(msgs, tools=TOOLS).prompt


def test_render_bad_input_is_structured_error(templates):
    t, _ = templates
    with pytest.raises(EngineError) as e:
        t.render([{"role": "user", "content": 5}])
    assert e.value.code == "invalid_request"
    with pytest.raises(EngineError) as e:
        t.render([{"role": "user", "content": "x"}], tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.code == "invalid_request"
    with pytest.raises(EngineError):
        t.render([])


def _parser(templates, **kw):
    from ostinatod.engine.chat import ChatParser
    t, _ = templates
    return ChatParser(t.render([{"role": "user", "content": "Weather?"}], tools=TOOLS, **kw))


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parse_complete_tool_call(templates):
    p = _parser(templates)
    res = p.feed(CALL, final=True)
    calls = res.message["tool_calls"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"]
    assert not res.message["content"]


def test_parse_partial_tool_call_streams_diffs(templates):
    p = _parser(templates)
    deltas = []
    for i in range(1, len(CALL) + 1):
        deltas += p.feed(CALL[:i]).diffs
    deltas += p.feed(CALL, final=True).diffs
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls, deltas
    # id and name arrive once, first; then argument text diffs that add up to the full arguments
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert all(c["name"] is None for c in calls[1:])
    assert json.loads("".join(c["arguments"] for c in calls)) == {"city": "Paris"}
    assert not any(d.get("content") for d in deltas)  # the markup never leaks as text


def test_parse_reasoning_and_content(templates):
    p = _parser(templates)
    res = p.feed("<think>\nlet me see\n</think>\n\nIt is sunny.", final=True)
    assert res.message["reasoning_content"].strip() == "let me see"
    assert res.message["content"].strip() == "It is sunny."


def test_malformed_tool_call_degrades_to_text(templates):
    p = _parser(templates)
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    for i in range(1, len(bad) + 1):
        p.feed(bad[:i])
    res = p.feed(bad, final=True)  # must not raise
    msg = res.message
    # either the text is kept as content, or no broken call is reported as complete JSON
    if res.parse_error:
        assert msg["content"] == bad and not msg["tool_calls"]
    else:
        for c in msg["tool_calls"]:
            with pytest.raises(ValueError):
                json.loads(c["arguments"])


def test_plain_text_without_tools(templates):
    from ostinatod.engine.chat import ChatParser
    t, _ = templates
    p = ChatParser(t.render([{"role": "user", "content": "hi"}]), parse_tool_calls=False)
    res = p.feed("Hello there", final=True)
    assert res.message["content"] == "Hello there" and not res.message["tool_calls"]


def test_grammar_sampler_compiles(templates):
    """The request sampler (the one the worker samples with) compiles a forced call's grammar; a
    prompt without tools has none."""
    from ostinatod.engine.sampling import free_sampler, make_sampler
    from ostinatod.engine.types import GenRequest
    from ostinatod.settings import Settings
    t, model = templates
    msgs = [{"role": "user", "content": "hi"}]
    r = t.render(msgs, tools=TOOLS, tool_choice="required")
    assert r.grammar
    s = make_sampler(model, GenRequest(id="g", messages=msgs, tools=TOOLS, tool_choice="required"), r, Settings())
    assert s
    free_sampler(s)
    assert not t.render(msgs).grammar


@pytest.mark.parametrize("broken", [
    '\n<tool_call>\n{"name":\n\n"get_weather", "arguments": {"city": "Par',  # a second call begun
    '\n<tool_call>\n{"name": "get_weather" oops }\n</tool_call>',  # markup that never parses
])
def test_unparsable_output_keeps_its_calls_and_drops_markers(templates, broken):
    """The calls that parse stay calls, the rest is text without the format's
    markers (fed token by token, as the worker does)."""
    from ostinatod.engine.text import settle_tool_calls
    from ostinatod.engine.chat import openai_message
    p = _parser(templates)
    text = CALL + broken
    for i in range(1, len(text)):
        p.feed(text[:i])
    res = p.feed(text, final=True)
    msg, finish = settle_tool_calls(openai_message(res.message), "stop")
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert "<tool_call>" not in (msg.get("content") or "") and "</tool_call>" not in (msg.get("content") or "")


@pytest.mark.parametrize("text", [
    'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by the length limit
    'Sure.<tool_call>\n{"name": "get_weather" oops } more\n</tool_call>',  # never parses
])
def test_broken_call_markup_never_reaches_text(templates, text):
    """Neither the streamed content nor the final message holds any of a broken
    call (markup, name or arguments), and no call is returned."""
    from ostinatod.engine.chat import openai_message
    from ostinatod.engine.text import settle_tool_calls
    p = _parser(templates)
    streamed = ""
    for i in range(1, len(text)):
        streamed += "".join(d.get("content", "") for d in p.feed(text[:i]).diffs)
    res = p.feed(text, final=True)
    streamed += "".join(d.get("content", "") for d in res.diffs)
    msg, finish = settle_tool_calls(openai_message(res.message), "length")
    assert finish == "length" and "tool_calls" not in msg
    for out in (streamed, msg["content"]):
        assert out.strip() == "Sure.", (streamed, msg)
