"""The engine worker and clients on the real native engine with the tiny synthetic model.

In-process engine: generation, usage/timings, exact token counts under ignore_eos, prefix reuse
across turns and slots, context overflow, grammar-forced tool calls, concurrency, cancellation,
bad model files. Subprocess engine: the worker is killed mid-stream -> ``engine_crashed`` and the
supervisor brings it back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from ostinatod.engine.types import EngineError, GenRequest
from ostinatod.settings import Settings

N_CTX = 1024

TOOLS = [{"type": "function", "function": {
    "name": "set_unit", "description": "Choose the temperature unit",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["unit"]}}}]


def _settings(**kw) -> Settings:
    # experts="stock": these tests are about the worker; the expert engine has its own tests
    base = dict(n_ctx=N_CTX, n_slots=2, n_threads=1, n_batch=256, n_ubatch=256, engine_mode="inprocess",
                log_level="WARNING", experts="stock")
    base.update(kw)
    return Settings(**base)


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_model, tmp_path_factory):
    from ostinatod.engine.client import InProcessEngine
    os.environ.setdefault("OSTINATO_HOME", str(tmp_path_factory.mktemp("home")))
    eng = InProcessEngine(_settings(), tiny_model)
    loop.run_until_complete(eng.start())
    loop.run_until_complete(eng.wait_ready(600))
    yield eng
    loop.run_until_complete(eng.stop())


def run(loop, eng, req: GenRequest) -> list:
    async def go():
        return [ev async for ev in eng.generate(req)]
    return loop.run_until_complete(go())


_n = 0


def req(**kw) -> GenRequest:
    global _n
    _n += 1
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 8)
    return GenRequest(id=f"t{_n}", **kw)


def done_of(events) -> dict:
    assert events[-1].type == "done", events[-1]
    return events[-1].data


def test_generate_events_usage_timings(loop, engine):
    ev = run(loop, engine, req(messages=[{"role": "user", "content": "Say hello."}], max_tokens=6))
    assert ev[0].type == "start" and ev[0].data["prompt_tokens"] > 0
    d = done_of(ev)
    u, tm = d["usage"], d["timings"]
    assert 0 < u["completion_tokens"] <= 6 and d["finish_reason"] in ("stop", "length")
    assert u["prompt_tokens"] == ev[0].data["prompt_tokens"]
    assert u["prefilled_tokens"] == u["prompt_tokens"] - u["cached_tokens"]
    assert tm["ttft_s"] is not None and tm["ttft_s"] >= 0 and tm["total_s"] >= tm["ttft_s"]
    streamed = "".join(e.data.get("content", "") for e in ev if e.type == "delta")
    assert streamed == (d["message"]["content"] or "")


def test_ignore_eos_generates_exactly_max_tokens(loop, engine):
    d = done_of(run(loop, engine, req(messages=[{"role": "user", "content": "Count."}], max_tokens=40,
                                      ignore_eos=True, temperature=0.8, seed=3)))
    assert d["usage"]["completion_tokens"] == 40 and d["finish_reason"] == "length"


def test_raw_prompt_completion(loop, engine):
    d = done_of(run(loop, engine, req(prompt="def fibonacci(n):", max_tokens=5, ignore_eos=True)))
    assert d["usage"]["completion_tokens"] == 5 and isinstance(d["message"]["content"], str)


def test_prefix_reuse_across_turns_and_side_request(loop, engine):
    conv = [{"role": "system", "content": "You are a coding agent working on repository alpha. " * 8},
            {"role": "user", "content": "List the files."}]
    ev1 = run(loop, engine, req(messages=conv, max_tokens=8, ignore_eos=True))
    d1 = done_of(ev1)
    slot_main = ev1[0].data["slot"]
    p1 = d1["usage"]["prompt_tokens"]

    # a side request of another conversation must land in the other slot, keeping the main cache
    side = run(loop, engine, req(messages=[{"role": "user", "content": "Title for: weather chat"}],
                                 max_tokens=4, ignore_eos=True))
    assert side[0].data["slot"] != slot_main

    conv2 = conv + [{"role": "assistant", "content": d1["message"]["content"] or "ok"},
                    {"role": "user", "content": "Now open README.md."}]
    ev2 = run(loop, engine, req(messages=conv2, max_tokens=4, ignore_eos=True))
    d2 = done_of(ev2)
    assert ev2[0].data["slot"] == slot_main
    u = d2["usage"]
    assert u["cached_tokens"] >= p1  # the whole first prompt came from the cache
    assert u["prefilled_tokens"] == u["prompt_tokens"] - u["cached_tokens"] < u["prompt_tokens"] - p1 + 32


def test_context_overflow_is_structured_error(loop, engine):
    ev = run(loop, engine, req(messages=[{"role": "user", "content": "word " * (2 * N_CTX)}]))
    assert len(ev) == 1 and ev[0].type == "error"
    assert ev[0].data["code"] == "context_length_exceeded" and ev[0].data["status"] == 400
    assert str(N_CTX) in ev[0].data["message"]


def test_max_tokens_beyond_the_context_is_clamped(loop, engine):
    # a prompt that fits, with an output budget that does not: generate to the end of the context
    ev = run(loop, engine, req(messages=[{"role": "user", "content": "word " * (N_CTX - 40)}],
                               max_tokens=32000, ignore_eos=True))
    done = ev[-1]
    assert done.type == "done" and done.data["finish_reason"] == "length"
    u = done.data["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == N_CTX


def test_bad_request_is_structured_error(loop, engine):
    ev = run(loop, engine, req(messages=[{"role": "user", "content": {"x": 1}}]))
    assert ev[-1].type == "error" and ev[-1].data["code"] == "invalid_request"
    ev = run(loop, engine, req())
    assert ev[-1].type == "error" and ev[-1].data["code"] == "invalid_request"


def test_required_tool_choice_yields_real_tool_call(loop, engine):
    # common/chat's "required" grammar lets free text precede the first "<tool_call>\n" (llama.cpp's
    # design), which random weights never end. Logit biases make the call's opening tokens and the end
    # of turn likely; the grammar then forces a valid name and arguments and allows the end of turn
    # only after a complete call.
    w = engine._worker
    bias = {tok: b for s, b in (("<tool_call>", 30.0), ("\n", 30.0), ("<|im_end|>", 50.0)) for tok in w.tokenize(s, add_special=False)}
    ev = run(loop, engine, req(messages=[{"role": "user", "content": "Use Fahrenheit."}], tools=TOOLS,
                               tool_choice="required", parallel_tool_calls=False, max_tokens=96,
                               temperature=1.0, seed=7, logit_bias=bias))
    d = done_of(ev)
    assert d["finish_reason"] == "tool_calls", d
    calls = d["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "set_unit" and calls[0]["id"]
    assert json.loads(calls[0]["function"]["arguments"])["unit"] in ("c", "f")
    streamed = [tc for e in ev if e.type == "delta" for tc in e.data.get("tool_calls", [])]
    assert streamed and streamed[0]["name"] == "set_unit" and streamed[0]["id"] == calls[0]["id"]
    assert "".join(tc["arguments"] for tc in streamed if tc["index"] == 0) == calls[0]["function"]["arguments"]


def test_json_schema_grammar_constrains_output(loop, engine):
    schema = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
              "required": ["unit"], "additionalProperties": False}
    d = done_of(run(loop, engine, req(messages=[{"role": "user", "content": "Pick a unit."}],
                                      json_schema=schema, max_tokens=48)))
    assert json.loads(d["message"]["content"])["unit"] in ("c", "f")


def test_concurrent_requests_in_two_slots(loop, engine):
    # requests are prepared on prepare threads (off the loop), which may finish in another order than
    # they came: which two run first is not fixed, but both slots serve
    async def go():
        async def one(i):
            return [e async for e in engine.generate(req(messages=[{"role": "user", "content": f"Job {i}"}],
                                                          max_tokens=12, ignore_eos=True))]
        return await asyncio.gather(one(1), one(2), one(3))
    results = loop.run_until_complete(go())
    for ev in results:
        assert done_of(ev)["usage"]["completion_tokens"] == 12
    assert len({ev[0].data["slot"] for ev in results}) == 2


def test_cancel_stops_generation(loop, engine):
    async def go():
        before = (await engine.stats()).requests_cancelled
        gen = engine.generate(req(messages=[{"role": "user", "content": "Write a long story."}],
                                  max_tokens=500, ignore_eos=True))
        async for e in gen:
            if e.type == "delta":
                break
        await gen.aclose()
        for _ in range(100):
            st = await engine.stats()
            if st.requests_cancelled > before and st.active == 0:
                return st
            await asyncio.sleep(0.05)
        return await engine.stats()
    st = loop.run_until_complete(go())
    assert st.active == 0 and st.requests_cancelled >= 1
    assert done_of(run(loop, engine, req(messages=[{"role": "user", "content": "still there?"}])))


def test_count_tokens_matches_prompt(loop, engine):
    r = req(messages=[{"role": "user", "content": "count me"}], max_tokens=1)
    n = loop.run_until_complete(engine.count_tokens(r))
    ev = run(loop, engine, r)
    assert ev[0].data["prompt_tokens"] == n


def test_info_and_stats(loop, engine):
    info = loop.run_until_complete(engine.info())
    assert info["is_demo"] is True and info["arch"] == "qwen3moe" and info["n_expert"] == 8
    assert info["n_ctx"] == N_CTX
    st = loop.run_until_complete(engine.stats())
    assert len(st.slots) == 2 and st.generated_tokens > 0


@pytest.mark.parametrize("kind", ["truncated", "foreign", "missing"])
def test_bad_model_file_is_clear_error(loop, tiny_model, tmp_path, kind):
    from ostinatod.engine.client import InProcessEngine
    bad = tmp_path / "bad.gguf"
    if kind == "truncated":
        data = Path(tiny_model).read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif kind == "foreign":
        bad.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 100)
    eng = InProcessEngine(_settings(), bad)
    loop.run_until_complete(eng.start())
    with pytest.raises(EngineError) as e:
        loop.run_until_complete(eng.wait_ready(60))
    assert e.value.code == "model_not_loaded"
    assert {"truncated": "truncated", "foreign": "not a GGUF", "missing": "not found"}[kind] in e.value.message
    assert eng.state == "error"
    ev = run(loop, eng, req(messages=[{"role": "user", "content": "hi"}]))
    assert ev[0].type == "error" and ev[0].data["code"] == "model_not_loaded"


def test_subprocess_worker_killed_midstream_recovers(loop, tiny_model):
    from ostinatod.engine.client import SubprocessEngine
    eng = SubprocessEngine(_settings(engine_mode="subprocess"), tiny_model)

    async def go():
        await eng.start()
        await eng.wait_ready(600)
        pid = eng.pid
        events = []
        async for e in eng.generate(req(messages=[{"role": "user", "content": "Go on."}], max_tokens=900,
                                        ignore_eos=True)):
            events.append(e)
            if e.type == "delta" and len(events) == 3:
                os.kill(pid, signal.SIGKILL)
        assert events[-1].type == "error" and events[-1].data["code"] == "engine_crashed"
        assert eng.state in ("restarting", "ready")
        await eng.wait_ready(600)
        assert eng.state == "ready" and eng.restarts == 1 and eng.pid != pid
        after = [e async for e in eng.generate(req(messages=[{"role": "user", "content": "Back?"}],
                                                    max_tokens=3, ignore_eos=True))]
        assert after[-1].type == "done" and after[-1].data["usage"]["completion_tokens"] == 3
        assert (await eng.count_tokens(req(messages=[{"role": "user", "content": "Back?"}]))) > 0
        st = await eng.stats()
        assert st.restarts == 1 and len(st.slots) == 2
        # a consumer that goes away (client disconnect) stops the generation in the worker process
        gen = eng.generate(req(messages=[{"role": "user", "content": "Long."}], max_tokens=900, ignore_eos=True))
        async for e in gen:
            if e.type == "delta":
                break
        await gen.aclose()
        for _ in range(200):
            st = await eng.stats()
            if st.requests_cancelled and st.active == 0:
                break
            await asyncio.sleep(0.05)
        assert st.requests_cancelled == 1 and st.active == 0
        assert st.generated_tokens < 900 + 3
        await eng.stop()
        assert eng.state == "stopped"
    loop.run_until_complete(go())


def test_stop_string_helpers():
    from ostinatod.engine.text import find_stop as _find_stop
    from ostinatod.engine.text import partial_stop_len as _partial_stop_len
    assert _find_stop("abc</s>def<END>", ["<END>", "</s>"]) == 3
    assert _find_stop("nothing here", ["<END>"]) is None
    # a suffix that may still become a stop string is held back from the stream
    assert _partial_stop_len("hello <EN", ["<END>"]) == 3
    assert _partial_stop_len("hello <", ["<END>", "<x>"]) == 1
    assert _partial_stop_len("hello", ["<END>"]) == 0


def test_utf8_pieces_split_inside_a_character():
    from ostinatod.engine.text import Utf8Text
    t = Utf8Text()
    data = "héllo → 世界".encode()
    for i in range(len(data)):
        t.add(data[i:i + 1])
        assert "\ufffd" not in t.text  # never a half character in the streamed text
    assert t.flush() == "héllo → 世界"


def test_prefill_stops_between_ubatches_when_cancelled(loop, tiny_model):
    """A prompt is prefilled one ubatch per step, so a cancel (client gone) takes
    effect between ubatches instead of after the whole n_batch chunk."""
    from ostinatod.engine.client import InProcessEngine

    eng = InProcessEngine(_settings(n_batch=1024, n_ubatch=64, n_slots=1), tiny_model)
    loop.run_until_complete(eng.start())
    loop.run_until_complete(eng.wait_ready(600))
    try:
        async def go():
            s0 = await eng.stats()
            evs = [e async for e in eng.generate(req(prompt="word " * 900, max_tokens=1))]
            s1 = await eng.stats()
            n_prompt = evs[0].data["prompt_tokens"]
            assert s1.decode_calls - s0.decode_calls >= -(-n_prompt // 64)  # one step per ubatch
            gen = eng.generate(req(prompt="other " * 900, max_tokens=1))
            async for e in gen:
                if e.type == "start":  # admitted: prefill running; the client goes away
                    break
            await gen.aclose()
            for _ in range(200):
                s2 = await eng.stats()
                if s2.requests_cancelled > s1.requests_cancelled and s2.active == 0:
                    return n_prompt, s2.prefilled_tokens - s1.prefilled_tokens
                await asyncio.sleep(0.01)
            raise AssertionError("not cancelled")
        n_prompt, prefilled = loop.run_until_complete(go())
        assert prefilled < n_prompt, (prefilled, n_prompt)
    finally:
        loop.run_until_complete(eng.stop())


def test_deterministic_chunks_do_not_depend_on_the_cache():
    """With ``deterministic`` the prompt chunks are the same whatever was cached."""
    from ostinatod.engine.determinism import aligned_keep, chunk_len, extends_valid

    def chunks(n_prompt: int, n_keep: int, step: int) -> list[tuple[int, int]]:
        pos, out = n_keep, []
        while pos < n_prompt:
            k = chunk_len(pos, n_prompt - pos, step)
            out.append((pos, pos + k))
            pos += k
        return out

    step, n = 32, 150
    cold = chunks(n, 0, step)
    assert cold[-1] == (n - 1, n) and all(b - a == step for a, b in cold[:-2])  # last token alone
    valid = 0
    for a, b in cold:
        valid = extends_valid(valid, a, b - a, step)
    assert valid == 128  # whole aligned chunks only
    for cached in (0, 5, 40, 100, 149):
        keep = aligned_keep(cached, valid, step)
        assert chunks(n, keep, step) == [c for c in cold if c[0] >= keep]


def test_deterministic_setting_one_sequence_per_pass_and_same_outputs(loop, tiny_model):
    """``deterministic`` runs one sequence per forward pass (no cross-slot
    batching), and greedy outputs are the same sequentially, again from the cache, and under
    concurrency."""
    from ostinatod.engine.client import InProcessEngine

    eng = InProcessEngine(_settings(deterministic=True, n_ubatch=32, n_batch=256), tiny_model)
    loop.run_until_complete(eng.start())
    loop.run_until_complete(eng.wait_ready(600))
    prompts = [f"Sort list number {i} in Python. " * (1 + i % 3) for i in range(4)]

    def text(evs) -> str:
        return "".join(e.data.get("text") or "" for e in evs if e.type == "delta")

    try:
        async def go():
            async def one(p):
                return [e async for e in eng.generate(req(messages=[{"role": "user", "content": p}],
                                                          max_tokens=12, ignore_eos=True))]
            first = [text(await one(p)) for p in prompts]
            again = [text(await one(p)) for p in prompts]
            s0 = await eng.stats()
            conc = await asyncio.gather(*[one(p) for p in prompts])
            s1 = await eng.stats()
            return first, again, [text(c) for c in conc], s1.decode_calls - s0.decode_calls
        first, again, conc, calls = loop.run_until_complete(go())
        assert first == again == conc
        assert calls >= 4 * 12  # every generated token in a pass of its own: nothing batched across slots
    finally:
        loop.run_until_complete(eng.stop())


def test_done_says_the_prefills_passes_and_ubatch(loop, tiny_model):
    """The prefill's stats: a prompt is prefilled in ceil(n / ubatch) forward
    passes, the done event and the worker's stats say how many and at what ubatch."""
    from ostinatod.engine.client import InProcessEngine

    eng = InProcessEngine(_settings(n_batch=1024, n_ubatch=64, n_slots=1), tiny_model)
    loop.run_until_complete(eng.start())
    loop.run_until_complete(eng.wait_ready(600))
    try:
        d = done_of(run(loop, eng, req(prompt="word " * 150, max_tokens=1)))
        n = d["usage"]["prefilled_tokens"]
        assert d["prefill"] == {"passes": -(-n // 64), "ubatch": 64} and n > 128
        st = loop.run_until_complete(eng.stats())
        assert st.ubatch == {"tokens": 64, "reason": "set"}
    finally:
        loop.run_until_complete(eng.stop())
