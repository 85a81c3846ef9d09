"""Anthropic Messages API against the live daemon with the official ``anthropic`` client."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import pytest

TOOLS = [{"name": "read_file", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string", "enum": ["a.py", "main.py"]}},
                           "required": ["path"]}}]


@pytest.fixture(scope="module")
def client(live_daemon):
    return anthropic.Anthropic(base_url=live_daemon.url, api_key="none", max_retries=0, timeout=120)


def test_message_non_stream_any_claude_name(client):
    m = client.messages.create(model="claude-sonnet-4-5", max_tokens=5,
                               system="You are helpful.", messages=[{"role": "user", "content": "Hi"}])
    assert m.type == "message" and m.role == "assistant"
    assert m.model == "claude-sonnet-4-5"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.content and m.content[0].type == "text"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 5
    assert 1 <= m.usage.output_tokens <= 5


def test_stream_event_sequence(client):
    kinds = []
    with client.messages.stream(model="claude-haiku-4-5", max_tokens=6, extra_body={"ignore_eos": True},
                                messages=[{"role": "user", "content": "Write a poem"}]) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 6


def test_tool_use_forced_stream_and_non_stream(client, tool_call_bias):
    m = client.messages.create(model="claude-x", max_tokens=96, tools=TOOLS, tool_choice={"type": "any"},
                               extra_body={"logit_bias": tool_call_bias, "temperature": 1.0, "seed": 5},
                               messages=[{"role": "user", "content": "Open main.py"}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use"
    assert uses and uses[0].name == "read_file" and isinstance(uses[0].input, dict)

    deltas = []
    with client.messages.stream(model="claude-x", max_tokens=96, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "read_file"},
                                extra_body={"logit_bias": tool_call_bias, "temperature": 1.0, "seed": 5},
                                messages=[{"role": "user", "content": "Open a.py"}]) as s:
        for ev in s:
            if ev.type == "content_block_delta":
                deltas.append(ev.delta.type)
        final = s.get_final_message()
    assert "input_json_delta" in deltas
    assert final.stop_reason == "tool_use"
    tu = [b for b in final.content if b.type == "tool_use"]
    assert tu and tu[0].name == "read_file" and isinstance(tu[0].input, dict)


def test_history_with_tool_result_thinking_and_inner_system(client):
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Open main.py"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should read it.", "signature": "abc"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "main.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "print(1)"}]},
            {"type": "text", "text": "Explain it."}]},
        {"role": "system", "content": "Reminder: be brief."},  # Claude Code >= 2.1.154 sends these
    ]
    m = client.messages.create(model="claude-x", max_tokens=4, tools=TOOLS, messages=msgs,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_beta_path_and_headers(client):
    # the beta resource posts to /v1/messages?beta=true with anthropic-beta headers, like Claude Code
    m = client.beta.messages.create(model="claude-x", max_tokens=3, betas=["interleaved-thinking-2025-05-14"],
                                    messages=[{"role": "user", "content": "hi"}])
    assert m.content[0].type in ("text", "thinking")


def test_count_tokens_grows_with_input(client):
    a = client.messages.count_tokens(model="claude-x", messages=[{"role": "user", "content": "hi"}])
    b = client.messages.count_tokens(model="claude-x", messages=[{"role": "user", "content": "hi " * 50}],
                                     tools=TOOLS)
    assert 0 < a.input_tokens < b.input_tokens


def test_billing_header_is_neutralized_for_prefix_cache(client, live_daemon):
    """Two turns differing only in Claude Code's per-request cch= line share the cached prefix."""
    base = "You are Claude Code. " + "Follow the instructions carefully. " * 30

    def turn(cch: str):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.40.a1; "
                                           f"cc_entrypoint=cli; cch={cch};"},
                  {"type": "text", "text": base}]
        return client.messages.create(model="claude-x", max_tokens=2, system=system,
                                      messages=[{"role": "user", "content": "hello"}])
    turn("0a1b2")
    m = turn("ffee9")
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert m.usage.cache_read_input_tokens >= total - 8, m.usage


def test_claude_cli_user_agent_means_coding(live_daemon):
    body = json.dumps({"model": "claude-x", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "x"}]}).encode()
    req = urllib.request.Request(live_daemon.url + "/v1/messages?beta=true", data=body, headers={
        "content-type": "application/json", "User-Agent": "claude-cli/2.1.332 (external, cli)",
        "anthropic-version": "2023-06-01", "x-ostinato-workload": "review"})
    with urllib.request.urlopen(req) as r:
        assert r.status == 200
    log = live_daemon.log()
    assert "client=claude-code workload=review" in log  # header beats the client default
