"""Caching across agents: with one KV slot, two agents' sessions interleave and
each returning session finds its prefix again -- its KV state was kept in host memory while the
other agent used the slot (real daemon, real HTTP, openai client)."""

from __future__ import annotations

import openai


def test_interleaved_sessions_restore_from_host_memory(start_daemon, tiny_model):
    d = start_daemon("--model", str(tiny_model), "--n-ctx", "2048", "--n-slots", "1", "--n-threads", "2",
                     "--engine-mode", "subprocess", "--cache-ram-mb", "64")
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    sys_a = "You are agent A, a careful coding assistant. " * 40
    sys_b = "You are agent B, who writes release notes and titles. " * 40

    def turn(system: str, user: str):
        return c.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": user}])

    a1 = turn(sys_a, "Fix the bug.")
    b1 = turn(sys_b, "Title this.")  # takes the only slot
    assert b1.usage.prompt_tokens_details.cached_tokens < 50
    a2 = turn(sys_a, "Fix the bug.")  # back: restored from host memory, not re-prefilled
    assert a2.usage.prompt_tokens_details.cached_tokens >= a1.usage.prompt_tokens - 8, a2.usage
    b2 = turn(sys_b, "Title this.")
    assert b2.usage.prompt_tokens_details.cached_tokens >= b1.usage.prompt_tokens - 8, b2.usage
    d.stop()
