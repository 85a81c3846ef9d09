"""``ostinato tui`` driven headless by Textual's pilot.

1. Against a control server around a real DaemonState whose model is the tiny synthetic MoE GGUF,
   with a routing trace and a residency set planned by the real planner: request sparklines,
   the per-layer heat strip, the keys p (re-plan) and w (switch workload).
2. Against the live daemon of tests/conftest.py (real engine worker): it connects, shows the
   model, and a request made through the OpenAI API appears in the table.

Screenshots of the second session are written to docs/img/ when OSTINATO_TUI_SCREENSHOTS=1.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from ostinatod.ui.tui import OstinatoTUI, heat_color, heat_strip

ROOT = Path(__file__).resolve().parents[2]


async def _until(pilot, cond, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)


def test_heat_strip_colours_follow_share():
    assert heat_color(0.0) != heat_color(1.0)
    t = heat_strip([0.0, 0.5, 1.0])
    assert t.plain.startswith("per layer\n██████\n3 layers") and "mean 50%" in t.plain
    assert heat_strip([0.5] * 48, "engine").plain.startswith("per layer (engine)\n" + "█" * 48 + "\n")
    assert "no per-layer" in heat_strip(None).plain


@pytest.fixture()
def planned_server(monkeypatch):
    """Control server; the state's model is a metadata-only MoE GGUF (6 layers x 16 experts),
    with a coding trace and no residency set yet."""
    from helpers import ControlThread, write_moe_gguf
    from ostinatod.residency.planner import read_model_shape
    from ostinatod.residency.traces import Trace, trace_path
    from ostinatod.server.state import DaemonState
    from ostinatod.settings import load_settings

    home = Path(tempfile.mkdtemp(prefix="ost-", dir="/tmp"))
    monkeypatch.setenv("OSTINATO_HOME", str(home))
    tiny_model = write_moe_gguf(home / "moe-6x16.gguf")
    monkeypatch.setenv("OSTINATO_EXPERT_BUDGET_FRAC", "0.5")
    shape = read_model_shape(tiny_model)
    rng = np.random.default_rng(0)
    counts = rng.zipf(1.5, size=(shape.n_layer, shape.n_expert)).astype(np.int64)
    tr = Trace.empty(shape.model_block(), "coding")
    tr.add_counts(counts, counts // 3)
    tr.max_request_tokens = 256
    tr.save(trace_path(shape.fingerprint, "coding", home / "data"))

    def factory():
        st = DaemonState(settings=load_settings())
        st.model_info = {"path": str(tiny_model), "arch": shape.arch, "n_layer": shape.n_layer,
                         "n_expert": shape.n_expert, "n_expert_used": shape.n_expert_used}
        for i, (ttft, tpot) in enumerate([(0.5, 0.05), (0.2, 0.04), (0.9, 0.06)]):
            rec = st.begin_request(f"req-{i}", "anthropic", "m", "claude-code", "coding")
            rec.update(ttft_s=ttft, tpot_s=tpot, prompt_tokens=100 * (i + 1), completion_tokens=8)
            st.finish_request(rec)
        return st
    t = ControlThread(factory)
    t.shape = shape
    yield t
    t.stop()


def test_tui_shows_requests_and_plans_and_switches(planned_server):
    async def run():
        app = OstinatoTUI(socket=planned_server.socket, interval=0.1)
        async with app.run_test(size=(150, 44)) as pilot:
            await _until(pilot, lambda: app.snapshots_seen > 0)
            assert list(app.query_one("#ttft").data) == [0.5, 0.2, 0.9]
            assert app.query_one("#requests").row_count == 3
            status = str(app.query_one("#status").render())
            assert "moe-6x16" in status and "coding" in status
            assert "no per-layer" in str(app.query_one("#heat").render())

            await pilot.press("p")  # plan the coding set from its trace (real planner)
            await _until(pilot, lambda: app.last_action is not None)
            assert app.last_action.startswith("planned coding"), app.last_action
            # the heat strip now shows the set's share of the traced routes, layer by layer
            await _until(pilot, lambda: "layers" in str(app.query_one("#heat").render()))
            shares = app.snapshot["experts"]["per_layer_hot_share"]
            assert len(shares) == planned_server.shape.n_layer and all(0 < s <= 1 for s in shares)
            if os.environ.get("OSTINATO_TUI_SCREENSHOTS") == "1":
                await pilot.pause(0.3)
                app.save_screenshot("tui-planned.svg", str(ROOT / "docs" / "img"))

            app.last_action = None
            await pilot.press("w")
            inp = app.screen.query_one("#prompt-input")
            inp.value = "support"
            await pilot.press("enter")
            await _until(pilot, lambda: app.last_action is not None)
            # no set planned for that workload: a clear answer, nothing switched
            assert "no residency set" in app.last_action and "plan one first" in app.last_action
            await pilot.press("q")
    asyncio.run(run())


def test_tui_against_live_daemon(live_daemon):
    from openai import OpenAI

    shots = os.environ.get("OSTINATO_TUI_SCREENSHOTS") == "1"

    async def run():
        app = OstinatoTUI(socket=live_daemon.control_socket, interval=0.2)
        async with app.run_test(size=(150, 44)) as pilot:
            await _until(pilot, lambda: app.snapshot.get("engine_state") == "ready", 120)
            # the shared daemon may have served many requests already and the snapshot keeps the
            # last 60: wait for new ids, not for a longer list
            seen = {r["id"] for r in app.snapshot["requests"]["recent"]}
            client = OpenAI(base_url=live_daemon.url + "/v1", api_key="x")
            model = app.snapshot["model"]["id"]
            for text, workload in (("def add(a, b):", "coding"),
                                   ("I want to change my flight to Tuesday.", "customer-service")):
                await asyncio.to_thread(lambda: client.chat.completions.create(
                    model=model, max_tokens=8, messages=[{"role": "user", "content": text}],
                    extra_headers={"x-ostinato-workload": workload}))
            await _until(pilot, lambda: len([r for r in app.snapshot["requests"]["recent"]
                                             if r["id"] not in seen]) >= 2, 60)
            recent = app.snapshot["requests"]["recent"]
            assert [r["workload"] for r in recent[-2:]] == ["coding", "customer-service"]
            # the switch shows: current workload follows the latest request, counts per workload
            assert app.snapshot["workload"] == "customer-service"
            assert app.snapshot["workload_counts"]["customer-service"] >= 1
            await pilot.pause(0.5)
            status = str(app.query_one("#status").render())
            assert "customer-service" in status and "latest request" in status
            assert all(r["status"] == "ok" and r["ttft_s"] is not None for r in recent[-2:])
            assert app.query_one("#requests").row_count >= 2
            assert len(app.query_one("#ttft").data) >= 2
            assert "tiny" in str(app.query_one("#status").render())
            if shots:
                app.save_screenshot("tui-live.svg", str(ROOT / "docs" / "img"))
            await pilot.press("l")  # load prompt opens with the current path
            assert app.screen.query_one("#prompt-input").value.endswith(".gguf")
            await pilot.press("escape")
            await pilot.press("q")
    asyncio.run(run())


def test_status_panel_says_why_nothing_is_served():
    """A model that failed to load (or a crashing worker) is explained in the TUI."""
    from ostinatod.ui.tui import status_text

    snap = {"engine_state": "error", "model": {"id": "x"}, "engine_health": {
        "restarts": 0, "error": "/m/x.gguf: /m/x.gguf is truncated: tensor data needs 10 bytes"}}
    assert "is truncated" in status_text(snap).plain
    snap = {"engine_state": "ready", "model": {"id": "x"}, "engine_health": {"restarts": 3, "error": None}}
    assert "3 worker restart(s)" in status_text(snap).plain
