"""Protocol translation (pure functions, no daemon): Anthropic and Responses payloads to the one
OpenAI-shaped message list, and the volatile-line neutralisation."""

from __future__ import annotations

import json

import pytest

from ostinatod.server.anthropic_api import MessagesBody, convert_messages, convert_tool_choice, convert_tools
from ostinatod.server.common import NEUTRAL_LINE, neutralize_messages, neutralize_text
from ostinatod.server.errors import ApiError
from ostinatod.server.responses_api import ResponsesBody, convert_input


def test_anthropic_blocks_to_messages():
    b = MessagesBody(model="claude-x", max_tokens=5, system=[{"type": "text", "text": "S"}], messages=[
        {"role": "user", "content": "open a"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a"}},
            {"type": "tool_use", "id": "t2", "name": "read", "input": {"p": "b"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "here"},
            {"type": "tool_result", "tool_use_id": "t1", "content": "A"},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "B"}],
             "is_error": True}]},
        {"role": "system", "content": "late system"}])
    m = convert_messages(b)
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "tool", "user", "system"]
    a = m[2]
    assert a["reasoning_content"] == "hmm" and a["content"] == "ok"
    assert [json.loads(c["function"]["arguments"]) for c in a["tool_calls"]] == [{"p": "a"}, {"p": "b"}]
    assert m[3] == {"role": "tool", "tool_call_id": "t1", "content": "A"}
    assert m[4]["content"] == "Error: B"
    assert m[5]["content"] == "here"  # user text follows the tool results of its turn


def test_anthropic_tools_and_choice():
    tools = convert_tools([{"name": "f", "input_schema": {"type": "object"}},
                           {"type": "web_search_20250305", "name": "web_search"}])
    assert tools == [{"type": "function", "function": {"name": "f", "description": "",
                                                       "parameters": {"type": "object"}}}]
    assert convert_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert convert_tool_choice({"type": "tool", "name": "f"})[0]["function"]["name"] == "f"
    with pytest.raises(ApiError):
        convert_tool_choice({"type": "sometimes"})


def test_responses_items_to_messages():
    b = ResponsesBody(instructions="I", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{\"cmd\":\"ls\"}"},
        {"type": "function_call", "call_id": "c2", "name": "sh", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "c2", "output": "b.py"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}])
    m = convert_input(b)
    assert [x["role"] for x in m] == ["system", "system", "user", "assistant", "tool", "tool", "assistant"]
    assert m[3]["reasoning_content"] == "think"
    assert [c["id"] for c in m[3]["tool_calls"]] == ["c1", "c2"]
    assert m[4]["tool_call_id"] == "c1" and m[6]["content"] == "done"
    with pytest.raises(ApiError, match="needs call_id"):
        convert_input(ResponsesBody(input=[{"type": "function_call_output", "output": "x"}]))


def test_responses_output_no_call_asked_for_is_that_tools_output():
    # Codex 0.171 after create_goal: the call's own output, then one it adds with a name, no call_id.
    m = convert_input(ResponsesBody(input=[
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "create_goal", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "{\"goal\": 1}"},
        {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
         "output": "ship it"},
        {"type": "function_call_output", "name": "plain", "output": [{"type": "input_text", "text": "p"}]}]))
    assert m[2] == {"role": "tool", "tool_call_id": "c1", "content": "{\"goal\": 1}"}
    assert m[3] == {"role": "tool", "name": "agent__goal_objective", "content": "ship it"}
    assert m[4] == {"role": "tool", "name": "plain", "content": "p"}


def test_neutralize_billing_line_only():
    a = "x-anthropic-billing-header: cc_version=2.1.40.a1; cc_entrypoint=cli; cch=0a1b2;\nYou are X."
    b = a.replace("0a1b2", "99999")
    assert neutralize_text(a) == neutralize_text(b) == NEUTRAL_LINE + "\nYou are X."
    msgs = [{"role": "system", "content": [{"type": "text", "text": a}]}, {"role": "user", "content": a}]
    neutralize_messages(msgs)
    assert msgs[0]["content"][0]["text"].startswith(NEUTRAL_LINE)
    assert msgs[1]["content"] == a  # user text is never rewritten
