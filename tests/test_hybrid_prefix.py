"""Prefix reuse for hybrid models (issue 13 item 3): qwen35moe's linear-attention layers keep a
recurrent state that cannot be cut back to a shorter prefix, so an agent turn that appends to the
previous turn re-prefilled everything. The worker now keeps a whole-state checkpoint at the end of
each prompt (a message boundary, in the host prefix cache) and the next turn restores it: real
daemon, real HTTP, the openai client, the synthetic qwen35moe file."""

from __future__ import annotations

import openai
import pytest

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
    return u1, out2, u2


@pytest.fixture(scope="module")
def hybrid_model():
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    return synthetic_model(CACHE, arch="qwen35moe", shape="tiny")


def test_hybrid_turn_restores_the_checkpoint_instead_of_prefilling_again(start_daemon, hybrid_model):
    flags = ("--model", str(hybrid_model), "--n-ctx", "4096", "--n-slots", "1", "--n-threads", "2",
             "--engine-mode", "subprocess")
    on = start_daemon(*flags, "--cache-ram-mb", "256")
    u1, out_on, u2 = _session(on)
    on.stop()
    off = start_daemon(*flags, "--cache-ram-mb", "0")
    _, out_off, u2_off = _session(off)
    off.stop()
    # without checkpoints the recurrent state cannot go back to the end of the first prompt
    assert (u2_off.prompt_tokens_details.cached_tokens or 0) == 0, u2_off
    # with them the second turn starts from the first turn's prompt (a message boundary)
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens - 1, (u1, u2)
    assert out_on == out_off   # the restored state computes what a full prefill computes
