"""A huge prompt cannot hold other slots still: while other slots generate, its
prefill proceeds in chunks sized by ``prefill_chunk_target_s`` from the measured cost of a
prompt token, between their decode steps; alone it keeps the cost model's ubatch per step. The
real engine in-process on the tiny model (a tiny target makes the chunking visible on a fast
model; no timing is asserted)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from ostinatod.engine.types import GenRequest
from ostinatod.settings import Settings

UBATCH = 256


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    from ostinatod.engine.client import InProcessEngine
    os.environ.setdefault("OSTINATO_HOME", str(tmp_path_factory.mktemp("home")))
    loop = asyncio.new_event_loop()
    eng = InProcessEngine(Settings(n_ctx=4096, n_slots=2, n_threads=1, n_batch=UBATCH, n_ubatch=UBATCH,
                                   engine_mode="inprocess", log_level="WARNING", experts="stock",
                                   prefill_chunk_target_s=0.0001), tiny_model)
    loop.run_until_complete(eng.start())
    loop.run_until_complete(eng.wait_ready(600))
    yield loop, eng
    loop.run_until_complete(eng.stop())
    loop.close()


def _big_prompt() -> str:
    return " ".join(f"word{i}" for i in range(600))  # about 1,500 tokens: 6 ubatches


def test_a_huge_prefill_is_chunked_between_a_bystanders_decode_steps(engine):
    loop, eng = engine

    async def go():
        gaps: list[float] = []

        async def bystander():
            last = None
            async for ev in eng.generate(GenRequest(id="by", prompt="hello", max_tokens=400, ignore_eos=True,
                                                    temperature=0.0)):
                if ev.type == "delta":
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        by = asyncio.ensure_future(bystander())
        await asyncio.sleep(0.3)  # the bystander is generating
        events = [ev async for ev in eng.generate(GenRequest(id="big", prompt=_big_prompt(), max_tokens=1,
                                                             temperature=0.0))]
        running = not by.done()
        await by
        return events, running, gaps

    events, running, gaps = loop.run_until_complete(go())
    done = events[-1].data
    n_prompt = done["usage"]["prompt_tokens"]
    assert running and n_prompt > 4 * UBATCH
    # more passes than whole ubatches: it was cut into chunks between the bystander's tokens
    assert done["prefill"]["passes"] > 2 * -(-n_prompt // UBATCH), done["prefill"]
    assert gaps


def test_alone_a_prefill_keeps_whole_ubatches(engine):
    loop, eng = engine

    async def go():
        return [ev async for ev in eng.generate(GenRequest(id="alone", prompt=_big_prompt() + " again",
                                                           max_tokens=1, temperature=0.0))]
    done = loop.run_until_complete(go())[-1].data
    prefilled = done["usage"]["prefilled_tokens"]
    assert done["prefill"]["passes"] == -(-prefilled // UBATCH)


def test_a_short_prompt_is_not_queued_behind_a_huge_one(engine):
    """Prompts are prefilled shortest first: a short request admitted while a huge prompt is being
    prefilled gets its answer before the huge one finishes."""
    loop, eng = engine
    huge = " ".join(("hello", "world", "again")[i % 3] for i in range(3400))  # about 14 ubatches

    async def go():
        order: list[str] = []
        started = asyncio.Event()

        async def one(rid: str, prompt: str) -> None:
            async for ev in eng.generate(GenRequest(id=rid, prompt=prompt, max_tokens=1, temperature=0.0)):
                if ev.type in ("start", "error"):
                    started.set()
                if ev.type in ("done", "error"):
                    order.append(rid if ev.type == "done" else f"{rid}: {ev.data}")
        big = asyncio.ensure_future(one("huge", huge))
        await asyncio.wait_for(started.wait(), 120)
        await one("short", "hello there")
        await big
        return order
    assert loop.run_until_complete(go()) == ["short", "huge"]
