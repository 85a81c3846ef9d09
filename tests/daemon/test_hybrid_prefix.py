"""Prefix reuse for hybrid models: qwen35moe's linear-attention layers keep a
recurrent state that cannot be cut back to a shorter prefix, so an agent turn that appends to the
previous turn re-prefilled everything. The worker keeps the recurrent layers' state at the end of
each prompt (a message boundary; llama.cpp's partial state, in its device buffers) and the next turn
goes back to it, cutting only the attention layers' cells: real daemon, real HTTP, the openai
client, the synthetic qwen35moe file."""

from __future__ import annotations

import openai
import pytest

from ostinatod.control.client import call

SYSTEM = "You are a careful coding agent. Read the files, then fix the failing test. " * 30


def _session(d):
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=300)
    model = c.models.list().data[0].id

    def turn(messages):
        r = c.chat.completions.create(model=model, max_tokens=3, temperature=0, messages=messages)
        return r.choices[0].message.content, r.usage

    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]
    out1, u1 = turn(first)
    # the agent appends the assistant message (as it keeps it) and the tool output
    second = first + [{"role": "assistant", "content": "I ran them: one failure in test_add."},
                      {"role": "user", "content": "FAILED test_add - assert 3 == 4"}]
    out2, u2 = turn(second)
    return u1, out2, u2, turn, second


@pytest.fixture(scope="module")
def hybrid_model():
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    return synthetic_model(CACHE, arch="qwen35moe", shape="tiny")


def test_hybrid_turn_restores_the_checkpoint_instead_of_prefilling_again(start_daemon, hybrid_model):
    flags = ("--model", str(hybrid_model), "--n-ctx", "4096", "--n-slots", "1", "--n-threads", "2",
             "--engine-mode", "subprocess")
    on = start_daemon(*flags, "--cache-ram-mb", "256")
    u1, out_on, u2, turn, second = _session(on)
    engine = call("GET", "/metrics", socket=on.control_socket)["engine"]
    # another conversation takes the only slot; the first one comes back a turn later: the slot
    # went back to its checkpoint before it was given away, and that boundary's whole state was
    # kept in host memory
    turn([{"role": "system", "content": "You translate text. " * 60}, {"role": "user", "content": "Hi."}])
    _, u3 = turn(second + [{"role": "assistant", "content": "Fixed."}, {"role": "user", "content": "Thanks."}])
    later = call("GET", "/metrics", socket=on.control_socket)["engine"]
    on.stop()
    off = start_daemon(*flags, "--cache-ram-mb", "0")
    _, out_off, u2_off, _, _ = _session(off)
    off.stop()
    # without checkpoints the recurrent state cannot go back to the end of the first prompt
    assert (u2_off.prompt_tokens_details.cached_tokens or 0) == 0, u2_off
    # with them the second turn starts from the first turn's prompt (a message boundary)
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens - 1, (u1, u2)
    assert out_on == out_off   # the restored state computes what a full prefill computes
    # ... by going back to the slot's own checkpoint, not through a whole state in host memory
    assert engine["slot_checkpoints"] >= 2 and engine["checkpoint_rewinds"] == 1, engine
    assert engine["host_cache"]["hits"] == 0, engine
    assert later["host_cache"]["hits"] == 1, later
    assert u3.prompt_tokens_details.cached_tokens >= u2.prompt_tokens - 1, (u2, u3)
