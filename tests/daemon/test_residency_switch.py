"""Residency sets swapped at request boundaries (docs/design.md "Planning"), on the real native engine.

A live daemon (subprocess engine worker, tiny synthetic qwen3moe: 2 layers x 8 experts, k = 2)
serves on loopback; its coding and customer-service sets are planned by the real planner from the
routing traces of real requests (POST /residency/plan flushes the worker's pending counts first).
Checked through the real control socket, /metrics and the TUI (Textual pilot):

- POST /residency/switch changes the engine's hot set (an all-hot set leaves no cold route);
- a set of another model is refused with a structured error, the old set stays, serving goes on;
- requests of workload A then B swap A's then B's planned set in before they run (automatic swap),
  reported in the log, /metrics, status and the TUI; the swap can be turned off;
- replaying a swe session then a tau2 session (ostinatod/bench/replay.py) shows the switch in the
  TUI and in /metrics, and the TUI key w switches back;
- the background re-planner plans and swaps in an idle daemon whose traces moved;
- a model served without the expert engine answers 409 with the reason;
- (in-process engine) a queued switch waits for the running generation, and requests arriving
  meanwhile wait for the switch.

No test asserts timings (only that a swap time is reported).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import launch_daemon
from ostinatod.control.client import ControlAPIError, call
from ostinatod.residency.sets import make_residency, model_block, read_residency, write_residency

ROOT = Path(__file__).resolve().parents[2]
CODE = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)"
PROSE = "Hello, I would like to change the delivery address of my order to my new apartment, please."

# the daemon flags every test daemon here shares: small, quick, planner budget half the experts
FLAGS = ("--n-ctx", "8192", "--n-slots", "2", "--n-threads", "2", "--engine-mode", "subprocess",
         "--max-tokens-default", "4", "--expert-budget-frac", "0.5")


def chat(d, text: str, workload: str, max_tokens: int = 4) -> dict:
    """One chat completion over HTTP with the workload header; returns the JSON answer."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(d.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "x-ostinato-workload": workload})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def prom(d) -> dict[str, float]:
    """/metrics (Prometheus text) as {'name{labels}': value}, parsed with prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(d.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def ctl(d, method: str, path: str, body=None) -> dict:
    return call(method, path, body, socket=d.control_socket)


def residency(d) -> dict:
    """The active residency set as control ``status`` reports it."""
    return ctl(d, "GET", "/status")["residency"]


def all_hot_set(model: Path, out: Path, workload: str = "all-hot") -> Path:
    m = model_block(model)
    return write_residency(make_residency(m, {l: list(range(m["n_expert"])) for l in range(m["n_layer"])},
                                          workload=workload), out)


@pytest.fixture(scope="module")
def sw(tiny_model):
    """Live daemon with planned coding and customer-service sets (none active at load)."""
    home = Path(tempfile.mkdtemp(prefix="ost-sw-", dir="/tmp"))  # short: AF_UNIX path limit
    d = launch_daemon(home, "--model", str(tiny_model), *FLAGS, "--replan-idle-s", "0")
    try:
        assert residency(d)["workload"] is None and residency(d)["switches"] == 0
        for text, wl in ((CODE, "coding"), (PROSE, "customer-service")):
            chat(d, text, wl)
        d.sets = {}
        for wl in ("coding", "customer-service"):
            p = ctl(d, "POST", "/residency/plan", {"workload": wl})
            d.sets[wl] = read_residency(Path(p["path"]))
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_control_switch_changes_the_hot_set(sw, tiny_model):
    m = model_block(tiny_model)
    n0 = residency(sw)["switches"]
    p = all_hot_set(tiny_model, sw.home / "all-hot.json")
    d = ctl(sw, "POST", "/residency/switch", {"path": str(p)})
    assert d["ok"] and d["workload"] == "all-hot" and d["reason"] == "control"
    assert d["hot_experts"] == m["n_layer"] * m["n_expert"] and isinstance(d["seconds"], float) and d["pool_bytes"] > 0
    r = residency(sw)
    assert (r["workload"], r["residency"], r["switches"]) == ("all-hot", str(p), n0 + 1)
    assert ctl(sw, "GET", "/status")["last_residency_switch"]["path"] == str(p)
    # the engine computes with it: a new request leaves no route cold (every layer all-resident:
    # its routes are counted on the pool's device and reach the totals at the stats call)
    ex0 = ctl(sw, "GET", "/metrics")["engine"]["experts"]
    chat(sw, PROSE, "all-hot")  # no planned set of that name: no automatic swap
    ex = ctl(sw, "GET", "/metrics")["engine"]["experts"]
    assert ex["cold_routes"] == ex0["cold_routes"] and ex["hot_routes"] > ex0["hot_routes"]
    assert all(ps["cold_routes"] == 0 for ps in ex["last_passes"][-3:])
    # by workload: the planned coding set, fewer hot experts; cold routes come back
    d = ctl(sw, "POST", "/residency/switch", {"workload": "coding"})
    assert d["workload"] == "coding" and d["previous_workload"] == "all-hot"
    assert d["hot_experts"] == sw.sets["coding"].n_hot < m["n_layer"] * m["n_expert"]
    cold0 = ctl(sw, "GET", "/metrics")["engine"]["experts"]["cold_routes"]
    chat(sw, PROSE, "all-hot")
    assert ctl(sw, "GET", "/metrics")["engine"]["experts"]["cold_routes"] > cold0
    mt = prom(sw)
    assert mt['ostinato_residency_active{workload="coding"}'] == 1
    assert mt['ostinato_residency_switches_total{reason="control"}'] >= 2
    assert mt["ostinato_engine_experts_hot_experts"] == sw.sets["coding"].n_hot


def test_foreign_model_set_is_refused_and_serving_goes_on(sw, tiny_model, tmp_path):
    from helpers import write_moe_gguf
    other = model_block(write_moe_gguf(tmp_path / "other.gguf"))
    foreign = make_residency(other, {0: [1, 2]}, workload="foreign")
    before = residency(sw)
    with pytest.raises(ControlAPIError) as e:
        ctl(sw, "POST", "/residency/switch", {"path": str(write_residency(foreign, tmp_path / "f.json"))})
    assert (e.value.status, e.value.code) == (400, "residency_refused")
    assert "fingerprint" in e.value.message and "previous set stays active" in e.value.message
    keys = ("workload", "residency", "hot_experts", "switches")
    assert {k: residency(sw)[k] for k in keys} == {k: before[k] for k in keys}
    # a foreign file where a workload's planned set belongs: the automatic swap skips it, the request runs
    fp = model_block(tiny_model)["fingerprint"]
    write_residency(foreign, sw.home / "data" / "residency" / fp / "foreign.json")
    out = chat(sw, PROSE, "foreign")
    assert out["usage"]["completion_tokens"] >= 1
    assert {k: residency(sw)[k] for k in keys} == {k: before[k] for k in keys}
    assert "automatic swap to the foreign set skipped" in sw.log()


def test_automatic_swap_per_workload(sw):
    auto0 = prom(sw).get('ostinato_residency_switches_total{reason="auto"}', 0)
    chat(sw, CODE, "coding")
    assert residency(sw)["workload"] == "coding"
    chat(sw, PROSE, "customer-service")
    s = ctl(sw, "GET", "/status")
    assert s["residency"]["workload"] == "customer-service"
    assert s["residency"]["hot_experts"] == sw.sets["customer-service"].n_hot
    last = s["last_residency_switch"]
    assert (last["reason"], last["previous_workload"], last["workload"]) == ("auto", "coding", "customer-service")
    assert last["request_id"].startswith("chatcmpl-") and isinstance(last["seconds"], float)
    from ostinatod.control.commands import format_status  # what `ostinato status` prints
    text = format_status(s)
    assert "residency  customer-service, " in text and "auto-switch on" in text
    assert "last swap  coding -> customer-service in " in text and "(auto)" in text
    n = residency(sw)["switches"]
    chat(sw, PROSE + " Thanks!", "customer-service")  # same workload: nothing to swap
    assert residency(sw)["switches"] == n
    mt = prom(sw)
    assert mt['ostinato_residency_switches_total{reason="auto"}'] >= auto0 + 1
    assert mt["ostinato_residency_last_switch_seconds"] == pytest.approx(last["seconds"])
    assert mt['ostinato_residency_active{workload="customer-service"}'] == 1
    log = sw.log()
    assert "residency set switched (auto, before request " + last["request_id"] in log
    assert f"{last['request_id']} openai_chat" in log and "switch=" in log
    # the request record says a swap preceded it
    recent = ctl(sw, "GET", "/requests?limit=5")["recent"]
    rec = next(r for r in recent if r["id"] == last["request_id"])
    assert rec["residency_switch_s"] == pytest.approx(last["seconds"])


def test_replay_swe_then_tau2_shows_the_switch_in_tui_and_metrics(sw, tiny_model, tmp_path):
    from test_replay import SWE, SWE_ID, TAU2, TAU2_ID
    from test_tui import _until
    from ostinatod.bench import replay
    from ostinatod.ui.tui import OstinatoTUI

    # start from a set of neither workload, so each session swaps its own set in
    ctl(sw, "POST", "/residency/switch", {"path": str(all_hot_set(tiny_model, sw.home / "all-hot.json"))})
    auto0 = prom(sw).get('ostinato_residency_switches_total{reason="auto"}', 0)

    def run_replay(sessions, sid, name):
        return replay.main(["--sessions", str(sessions), "--ids", sid, "--max-turns", "2", "--base-url", sw.url,
                            "--cap-tokens", "2", "--quiet", "--json", str(tmp_path / f"{name}.json")])

    def last_switch(app):
        return app.snapshot.get("last_residency_switch") or {}

    async def run():
        app = OstinatoTUI(socket=sw.control_socket, interval=0.1)
        async with app.run_test(size=(150, 44)) as pilot:
            await _until(pilot, lambda: app.snapshot.get("engine_state") == "ready", 60)
            assert await asyncio.to_thread(run_replay, SWE, SWE_ID, "swe") == 0
            await _until(pilot, lambda: last_switch(app).get("workload") == "coding")
            assert app.snapshot["workload"] == "coding" and app.snapshot["workload_source"] == "engine"
            assert await asyncio.to_thread(run_replay, TAU2, TAU2_ID, "tau2") == 0
            await _until(pilot, lambda: last_switch(app).get("workload") == "customer-service")
            await pilot.pause(0.3)
            status = str(app.query_one("#status").render())
            assert "customer-service  (residency set)" in status
            assert "customer-service set" in status and "auto" in status
            assert "swapped coding -> customer-service in" in status and "(auto)" in status
            table = app.query_one("#requests")
            workloads = [str(table.get_row_at(i)[1]) for i in range(table.row_count)]
            assert "customer-service *" in workloads and "coding *" in workloads
            if os.environ.get("OSTINATO_TUI_SCREENSHOTS") == "1":
                app.save_screenshot("tui-switch.svg", str(ROOT / "docs" / "img"))
            # key w: switch back to coding by hand
            app.last_action = None
            await pilot.press("w")
            app.screen.query_one("#prompt-input").value = "coding"
            await pilot.press("enter")
            await _until(pilot, lambda: app.last_action is not None)
            assert app.last_action.startswith("workload coding: residency set switched in"), app.last_action
            await _until(pilot, lambda: last_switch(app).get("reason") == "control")
            await pilot.press("q")
    asyncio.run(run())
    mt = prom(sw)
    assert mt['ostinato_residency_switches_total{reason="auto"}'] == auto0 + 2  # one per session
    assert mt['ostinato_residency_active{workload="coding"}'] == 1
    turns = [json.loads((tmp_path / f"{n}.json").read_text())["sessions"][0]["turns"] for n in ("swe", "tau2")]
    assert all(t["error"] is None for ts in turns for t in ts)


def test_background_replan_swaps_when_idle_and_traces_moved(tiny_model):
    """replan_idle_s 1: the coding set is planned once the daemon idles (no set yet) and swapped in;
    after the coding traces grew by >= replan_growth it is re-planned and swapped again."""
    home = Path(tempfile.mkdtemp(prefix="ost-rp-", dir="/tmp"))
    d = launch_daemon(home, "--model", str(tiny_model), *FLAGS, "--replan-idle-s", "1",
                      "--replan-growth", "0.25")
    try:
        chat(d, CODE, "coding")

        def wait_switches(n, timeout=30):
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                r = residency(d)
                if r["switches"] >= n:
                    return r
                time.sleep(0.2)
            pytest.fail(f"no background swap #{n}:\n{d.log()[-3000:]}")
        r = wait_switches(1)
        assert r["workload"] == "coding"
        s = ctl(d, "GET", "/status")["last_residency_switch"]
        assert s["reason"] == "replan" and s["previous_workload"] is None
        first = read_residency(Path(r["residency"]))
        for i in range(3):  # grow the coding traces well past 25%
            chat(d, CODE + f"\n# more {i}", "coding", max_tokens=8)
        r = wait_switches(2)
        again = read_residency(Path(r["residency"]))
        assert again.raw["plan"]["dev_routes"] >= 1.25 * first.raw["plan"]["dev_routes"]
        planned = ctl(d, "GET", "/residency")["background_replan"]["planned"]
        assert [p["workload"] for p in planned] == ["coding", "coding"]
        assert prom(d)['ostinato_residency_switches_total{reason="replan"}'] == 2
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_switch_without_the_expert_engine_is_409(tiny_model, tmp_path):
    """experts = "stock": the pool can only be built at load, so a switch is refused with the reason."""
    home = Path(tempfile.mkdtemp(prefix="ost-st-", dir="/tmp"))
    d = launch_daemon(home, "--model", str(tiny_model), *FLAGS, "--experts", "stock", "--replan-idle-s", "0")
    try:
        p = all_hot_set(tiny_model, tmp_path / "all-hot.json")
        with pytest.raises(ControlAPIError) as e:
            ctl(d, "POST", "/residency/switch", {"path": str(p)})
        assert (e.value.status, e.value.code) == (409, "residency_unavailable")
        assert "experts = 'stock'" in e.value.message and "load the model again" in e.value.message
        assert ctl(d, "GET", "/status")["residency"] is None
        assert chat(d, PROSE, "coding")["usage"]["completion_tokens"] >= 1
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_automatic_swap_can_be_turned_off(tiny_model, tmp_path, monkeypatch):
    """residency_auto_switch = false (in-process engine, real worker): a request of a workload with a
    planned set runs with the current set; an explicit switch still works."""
    from ostinatod.engine.client import InProcessEngine
    from ostinatod.engine.types import GenRequest
    from ostinatod.settings import Settings

    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    m = model_block(tiny_model)
    planned = write_residency(make_residency(m, {0: [0, 1], 1: [2, 3]}, workload="coding"),
                              tmp_path / "home" / "data" / "residency" / m["fingerprint"] / "coding.json")

    async def go():
        eng = InProcessEngine(Settings(n_ctx=512, n_slots=1, n_threads=1, n_batch=64, n_ubatch=64,
                                       engine_mode="inprocess", log_level="WARNING",
                                       residency_auto_switch=False, workload_default="other"), tiny_model)
        await eng.start()
        await eng.wait_ready(120)
        try:
            req = GenRequest(id="r1", prompt="def add(a, b):", max_tokens=2, workload="coding")
            evs = [ev async for ev in eng.generate(req)]
            assert evs[-1].type == "done" and "residency_switch" not in evs[0].data
            st = (await eng.stats()).experts
            assert (st.workload, st.switches, st.auto_switch) == (None, 0, False)
            info = await eng.switch_residency(planned)
            assert info["workload"] == "coding" and info["hot_experts"] == 4 and info["reason"] == "control"
            assert (await eng.stats()).experts.workload == "coding"
        finally:
            await eng.stop()
    asyncio.run(go())


async def _started_engine(tiny_model, n_ctx: int):
    """A started in-process engine (real worker) with 2 slots and workload_default "other"."""
    from ostinatod.engine.client import InProcessEngine
    from ostinatod.settings import Settings
    eng = InProcessEngine(Settings(n_ctx=n_ctx, n_slots=2, n_threads=1, n_batch=64, n_ubatch=64,
                                   engine_mode="inprocess", log_level="WARNING",
                                   workload_default="other"), tiny_model)
    await eng.start()
    await eng.wait_ready(120)
    return eng


async def _gen_logged(eng, order: list, rid: str, n: int) -> None:
    """Generate ``n`` tokens (ignore_eos) as request ``rid``; append "start:rid"/"done:rid"/"error:rid"."""
    from ostinatod.engine.types import GenRequest
    req = GenRequest(id=rid, prompt="def add(a, b):", max_tokens=n, ignore_eos=True, workload="x")
    async for ev in eng.generate(req):
        if ev.type in ("start", "done", "error"):
            order.append(f"{ev.type}:{rid}")


def test_explicit_switch_waits_for_the_running_generation(tiny_model, tmp_path, monkeypatch):
    """A switch queued while a request generates runs after that request's last token, and a
    request that arrives meanwhile starts after the switch (in-process engine, real worker)."""
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    target = all_hot_set(tiny_model, tmp_path / "all-hot.json")

    async def go():
        eng = await _started_engine(tiny_model, 512)
        order: list[str] = []

        def gen(rid: str, n: int):
            return _gen_logged(eng, order, rid, n)

        async def switch() -> None:
            info = await eng.switch_residency(target)
            order.append(f"switch:{info['workload']}")
        try:
            ta = asyncio.create_task(gen("A", 400))
            while "start:A" not in order:
                await asyncio.sleep(0.005)
            ts = asyncio.create_task(switch())
            tb = asyncio.create_task(gen("B", 2))
            await asyncio.gather(ta, ts, tb)
            assert order == ["start:A", "done:A", "switch:all-hot", "start:B", "done:B"]
        finally:
            await eng.stop()
    asyncio.run(go())


def test_switch_behind_an_endless_generation_is_refused_and_serving_resumes(tiny_model, tmp_path,
                                                                              monkeypatch):
    """A queued switch waits at most SWITCH_WAIT_S for the running request (here 0.3 s), then gets
    409 residency_busy and the request that queued behind it runs; a garbage file is refused at once
    even while a request generates (in-process engine, real worker)."""
    from ostinatod.engine import switcher as switcher_mod
    from ostinatod.engine.types import EngineError

    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(switcher_mod, "SWITCH_WAIT_S", 0.3)
    target = all_hot_set(tiny_model, tmp_path / "all-hot.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json at all")

    async def go():
        eng = await _started_engine(tiny_model, 4096)
        order: list[str] = []

        def gen(rid: str, n: int):
            return _gen_logged(eng, order, rid, n)

        async def switch(path, tag) -> None:
            try:
                await eng.switch_residency(path)
                order.append(f"switch:{tag}")
            except EngineError as e:
                order.append(f"{e.code}:{tag}")
        try:
            ta = asyncio.create_task(gen("A", 3000))
            while "start:A" not in order:
                await asyncio.sleep(0.005)
            await switch(garbage, "garbage")           # answered while A generates
            assert order == ["start:A", "residency_refused:garbage"]
            ts = asyncio.create_task(switch(target, "target"))
            tb = asyncio.create_task(gen("B", 2))
            await asyncio.gather(ts, tb)
            assert order[2:] == ["residency_busy:target", "start:B", "done:B"]
            assert "done:A" not in order               # A was still generating throughout
            ta.cancel()  # closing the stream cancels A in the engine
        finally:
            await eng.stop()
    asyncio.run(go())


def test_daemon_serves_through_the_decode_graph(tiny_model, tmp_path):
    """The live daemon with `decode_graph = true` on a CPU build (the GPU's default, forced here so
    the worker's slots, batching and swaps run through the route/join ops and the CPU-branch pool):
    two clients at once get answers, every decode pass of the engine took the decode graph, and a
    swap to another set keeps serving through it."""
    import concurrent.futures as cf
    home = Path(tempfile.mkdtemp(prefix="ost-dg-", dir="/tmp"))
    d = launch_daemon(home, "--model", str(tiny_model), *FLAGS, "--replan-idle-s", "0",
                      "--decode-graph")
    try:
        chat(d, CODE, "coding")
        ctl(d, "POST", "/residency/plan", {"workload": "coding"})
        ctl(d, "POST", "/residency/switch", {"workload": "coding"})
        with cf.ThreadPoolExecutor(2) as ex:
            outs = list(ex.map(lambda t: chat(d, t, "coding", max_tokens=8), (CODE, PROSE)))
        assert all(o["choices"][0]["message"] is not None for o in outs)
        snap = ctl(d, "GET", "/metrics")   # the control API's snapshot, raw engine stats included
        ex_stats = (snap.get("engine") or {}).get("experts") or {}
        passes = ex_stats.get("last_passes") or []
        decode = [p for p in passes if p.get("path") == "decode"]
        assert decode and all(p.get("decode_graph") for p in decode), passes
        assert residency(d)["workload"] == "coding"
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
