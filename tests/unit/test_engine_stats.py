"""The engine's stats and model facts, parsed once at the worker pipe (ostinatod/engine/stats.py).

The fixtures in tests/fixtures/engine_stats/ are what a CPU run of the tiny synthetic qwen3moe
model sent over the pipe (the worker's counters with the native expert engine's stats merged under
``experts``, and the model facts of its ``ready`` message). Regenerate them after an intended change
of the engine's JSON with ``python tests/unit/test_engine_stats.py`` and review the diff. A key the
engine stops producing or renames fails here, not silently in the TUI.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from ostinatod.control.snapshots import EXPERT_VIEW_KEYS, expert_view, pool_lines
from ostinatod.engine.stats import EngineStats, ExpertStats, LoopProgress, ModelFacts, StepTiming
from ostinatod.engine.step_timing import STEP_TIMING_KEYS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine_stats"


def _stats() -> dict:
    return json.loads((FIXTURES / "worker_stats.json").read_text())


def test_the_engines_stats_parse_into_typed_fields():
    raw = _stats()
    st = EngineStats.parse(raw)
    assert st.wire == raw and list(st.wire) == list(raw)   # what goes out unchanged keeps its order
    assert st.requests == st.requests_ok == 1 and st.generated_tokens > 0 and len(st.slots) == 2
    ex = st.experts
    assert isinstance(ex, ExpertStats) and ex.active and ex.routes == raw["experts"]["routes"]
    assert set(ex.paths) == {"decode", "split", "upload"} and ex.pools and ex.pools[0].device == "CPU"
    assert (ex.switches, ex.auto_switch) == (0, raw["experts"]["auto_switch"])
    # the steps' wall-clock parts (every engine, stock included): typed, in the worker's key order
    tm = st.step_timing
    assert tm is not None and list(raw["step_timing"]) == list(STEP_TIMING_KEYS) == list(StepTiming.model_fields)
    assert tm.decode_steps > 0 and tm.prefill_passes > 0
    assert 0 < tm.decode_call_ms + tm.decode_sample_ms + tm.decode_out_ms <= tm.decode_wall_ms
    back = st.with_state("ready", 0)
    assert (back.state, back.restarts, back.wire["state"]) == ("ready", 0, "ready")
    assert EngineStats.not_ready("loading", 2).wire == {"state": "loading", "restarts": 2}


@pytest.mark.parametrize("where,key", [("", "decode_calls"), ("", "slots"), ("experts", "routes"),
                                       ("experts", "paths"), ("experts", "switches"),
                                       ("experts", "auto_switch"), ("experts", "workload"),
                                       ("", "step_timing"), ("step_timing", "decode_call_ms"),
                                       ("step_timing", "decode_steps"), ("step_timing", "prefill_wall_ms")])
def test_a_missing_or_renamed_key_fails_the_parse(where, key):
    raw = copy.deepcopy(_stats())
    d = raw[where] if where else raw
    d[key + "_renamed"] = d.pop(key)
    with pytest.raises(ValidationError):
        EngineStats.parse(raw)


def test_every_key_the_uis_read_is_produced_by_the_engine():
    raw = _stats()
    produced = set(raw["experts"])
    # expert_view reads these ExpertStats fields: each is a key of the engine's JSON, not a default
    read = {"hot_route_share", "routes", "hot_routes", "cold_routes", "paths", "residency", "workload",
            "hot_experts", "pool_bytes", "pools", "switches", "auto_switch"}
    assert read <= produced, read - produced
    view = expert_view(EngineStats.parse(raw))
    assert set(view) == set(EXPERT_VIEW_KEYS)
    for k in ("hot_route_share", "routes", "hot_routes", "cold_routes", "hot_experts", "pool_bytes",
              "pools", "switches", "auto_switch"):
        assert view[k] is not None, k
    assert view["paths"]["decode"] == raw["experts"]["paths"]["decode"]
    # pool_lines (TUI) reads these keys of each pool
    assert {"gpu", "device", "bytes", "hot_experts", "routes", "hot_route_share"} <= set(raw["experts"]["pools"][0])
    two = [dict(raw["experts"]["pools"][0], gpu=i) for i in range(2)]
    assert pool_lines(two)[0].startswith("GPU 0 (CPU): 0.0 GiB, 0 hot experts")
    # the TUI's request and slot figures (snapshot "engine")
    assert {"id", "n_tokens", "busy", "last_used"} <= set(raw["slots"][0])
    # a stock engine (no experts) reads as no figures, not as an error
    stock = {k: v for k, v in raw.items() if k != "experts"}
    assert expert_view(EngineStats.parse(stock))["routes"] is None and expert_view(None)["pools"] is None


def test_model_facts_and_loop_progress():
    raw = json.loads((FIXTURES / "model_facts.json").read_text())
    m = ModelFacts.parse(raw)
    assert m.n_ctx > 0 and m.max_piece_bytes > 0 and m.experts_mode in ("ostinato", "stock")
    assert m.wire == raw
    for key in ("n_ctx", "experts_mode", "is_demo", "path", "eog_tokens", "n_vocab"):  # read by the daemon
        bad = {k: v for k, v in raw.items() if k != key}
        with pytest.raises(ValidationError):
            ModelFacts.parse(bad)
    p = LoopProgress.parse({"steps": 4, "busy": {"what": "sampling", "for_s": 0.5, "requests": ["r1"]}})
    assert p.busy is not None and p.busy.what == "sampling" and p.steps == 4


def _capture(model: Path) -> None:  # pragma: no cover - regenerates the fixtures
    from ostinatod.engine.client import SubprocessEngine
    from ostinatod.engine.types import GenRequest
    from ostinatod.settings import Settings

    async def go() -> None:
        eng = SubprocessEngine(Settings(model=str(model), n_ctx=1024, n_slots=2, n_threads=1,
                                        engine_mode="subprocess", log_level="WARNING"))
        await eng.start()
        await eng.wait_ready(120)
        try:
            evs = [ev async for ev in eng.generate(GenRequest(id="r1", prompt="def add(a, b):", max_tokens=4))]
            assert evs[-1].type == "done", evs[-1]
            st = await eng.stats()
            info = dict(await eng.info())
        finally:
            await eng.stop()
        raw = {k: v for k, v in st.wire.items() if k not in ("state", "restarts")}
        info = {k: v for k, v in info.items() if k not in ("state", "restarts")}
        FIXTURES.mkdir(parents=True, exist_ok=True)
        (FIXTURES / "worker_stats.json").write_text(json.dumps(raw, indent=1) + "\n")
        (FIXTURES / "model_facts.json").write_text(json.dumps(info, indent=1) + "\n")

    asyncio.run(go())


if __name__ == "__main__":  # pragma: no cover
    _capture(Path(sys.argv[1]) if len(sys.argv) > 1 else
             Path.home() / ".cache" / "ostinato-test" / "tiny-qwen3moe.gguf")
