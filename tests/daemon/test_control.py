"""Control API on a real Unix socket, driven by the real client (ControlClient) and the CLI commands.

The server runs in its own thread and event loop around a real DaemonState, so the synchronous CLI
(`ostinato status` etc.) and async clients can both talk to it as they do to a running daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from ostinatod.control import commands as ctl
from ostinatod.control.server import start_control_server
from ostinatod.control.client import ControlAPIError, ControlClient, DaemonNotRunning, call

from helpers import ControlThread, recording_control_server, write_moe_gguf, write_tiny_gguf  # noqa: E402,F401 (used here and by other tests)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    # AF_UNIX paths are limited to ~107 bytes: keep the home short
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="ost-", dir="/tmp"))
    monkeypatch.setenv("OSTINATO_HOME", str(d))
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture()
def server(home):
    t = recording_control_server()
    yield t
    t.stop()


def test_socket_is_private_and_status_answers(server):
    mode = stat.S_IMODE(os.stat(server.socket).st_mode)
    assert mode == 0o600
    s = call("GET", "/status")
    assert s["pid"] == os.getpid()
    assert s["engine_state"] == "stopped"
    assert s["workload"] == "coding"
    assert s["paused"] is False


def test_cli_without_daemon_says_how_to_start(home, capsys):
    assert ctl.cmd_status([]) == 3
    err = capsys.readouterr().err
    assert "not running" in err and "ostinatod start" in err
    with pytest.raises(DaemonNotRunning):
        call("GET", "/status")


def test_cli_status_and_ps(server, capsys):
    rec = server.state.begin_request("req-1", "anthropic", "m", "claude-code", "coding")
    rec.update(ttft_s=0.25, tpot_s=0.02, prompt_tokens=1200, cached_tokens=1000, completion_tokens=7)

    async def finish():
        server.state.finish_request(rec)
    server.run(finish())
    server.state.begin_request("req-2", "openai_chat", "m", "opencode", "coding")
    assert ctl.cmd_status([]) == 0
    out = capsys.readouterr().out
    assert "engine stopped" in out and "workload   coding" in out
    assert ctl.cmd_ps(["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in d["active"]] == ["req-2"]
    assert d["recent"][0]["id"] == "req-1" and d["recent"][0]["ttft_s"] == 0.25
    assert ctl.cmd_ps([]) == 0
    table = capsys.readouterr().out
    assert "req-1" in table and "0.250" in table and "running" in table


def test_models_and_load_unload(server, home, capsys):
    models = home / "data" / "models"
    models.mkdir(parents=True)
    g = write_tiny_gguf(models / "tiny.gguf")
    d = call("GET", "/models")
    assert [m["path"] for m in d["available"]] == [str(g)]
    assert ctl.cmd_load([str(g)]) == 0
    assert server.loads == [g]
    assert ctl.cmd_unload([]) == 0
    assert server.loads == [g, None]


@pytest.mark.parametrize("body,status,code", [
    ({"path": "/nonexistent/x.gguf"}, 404, "model_not_found"),
    ({}, 400, "invalid_request"),
    ({"path": 3}, 400, "invalid_request"),
])
def test_load_bad_input_is_a_clear_error(server, body, status, code):
    with pytest.raises(ControlAPIError) as e:
        call("POST", "/models/load", body)
    assert (e.value.status, e.value.code) == (status, code)
    assert server.loads == []


def test_load_refuses_a_non_gguf_file(server, home, capsys):
    bad = home / "notes.gguf"
    bad.write_text("hello")
    assert ctl.cmd_load([str(bad)]) == 1
    assert "not a GGUF file" in capsys.readouterr().err
    assert server.loads == []


def test_malformed_json_and_unknown_route(server):
    async def raw():
        async with ControlClient() as c:
            s = c._session
            async with s.post("http://x/models/load", data=b"{nope",
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()
    status, body = asyncio.run(raw())
    assert status == 400 and body["error"]["code"] == "invalid_json"
    with pytest.raises(ControlAPIError) as e:
        call("GET", "/nope")
    assert e.value.status == 404


def test_pause_resume_round_trip(server, home):
    with pytest.raises(ControlAPIError) as e:  # nothing loaded yet
        call("POST", "/pause")
    assert e.value.code == "model_not_loaded"
    g = write_tiny_gguf(home / "m.gguf")
    call("POST", "/models/load", {"path": str(g)})

    class Loaded:  # an engine object is only needed for "is something loaded"; state comes from it
        state = "ready"
    server.state.engine = Loaded()
    assert ctl.cmd_pause([]) == 0
    assert call("GET", "/status")["paused"] is True
    assert call("POST", "/pause")["paused"] is True  # twice: still paused, nothing reloaded
    assert ctl.cmd_resume([]) == 0
    assert server.loads == [g, None, g]


def test_profile_route(server, capsys):
    with pytest.raises(ControlAPIError) as e:
        call("GET", "/profile")
    assert e.value.code == "no_profile"
    from ostinatod.profile import update_profile
    update_profile(measure=False, recalibrate=False)
    assert call("GET", "/profile")["format"] == "ostinato-hardware/1"


def test_metrics_snapshot_and_events_stream(server):
    m = call("GET", "/metrics")
    assert m["engine_state"] == "stopped"
    assert m["memory"]["host"]["total_bytes"] > 0
    assert set(m["experts"]["paths"]) == {"decode", "split", "upload", "stock"}

    async def stream():
        async with ControlClient() as c:
            return [e async for e in c.events(interval=0.05, count=3)]
    evs = asyncio.run(stream())
    assert len(evs) == 3 and evs[0]["time"] <= evs[-1]["time"]
    assert "engine" not in evs[0]  # raw counters stay on /metrics


def test_residency_routes_answer_clearly_without_a_model(server, capsys):
    d = call("GET", "/residency")
    assert d["workload"] == "coding" and d["sets"] == []
    with pytest.raises(ControlAPIError) as e:
        call("POST", "/residency/switch", {"workload": "../etc"})
    assert e.value.code == "invalid_workload"
    with pytest.raises(ControlAPIError) as e:
        call("POST", "/residency/switch", {"workload": "coding"})
    assert (e.value.status, e.value.code) == (409, "model_not_loaded")  # nothing to switch
    assert ctl.cmd_residency(["switch"]) == 1
    assert "needs a WORKLOAD" in capsys.readouterr().err


def test_logs_command(home, capsys):
    assert ctl.cmd_logs([]) == 1
    log = home / "state" / "ostinatod.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    assert ctl.cmd_logs(["-n", "3"]) == 0
    assert capsys.readouterr().out == "line 7\nline 8\nline 9\n"


def test_cli_processes_against_the_live_daemon(live_daemon):
    """The real `ostinato` console commands, as separate processes, against the live daemon."""
    import subprocess
    import sys
    run = lambda *a: subprocess.run([sys.executable, "-m", "ostinatod.cli", *a], env=live_daemon.env,
                                    capture_output=True, text=True, timeout=120)
    p = run("status", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["pid"] == live_daemon.pid and s["engine_state"] == "ready"
    assert s["http_url"] == live_daemon.url
    p = run("ps")
    assert p.returncode == 0 and p.stdout.startswith("id ")
    p = run("load", "/nonexistent/model.gguf")
    assert p.returncode == 1 and "no such file" in p.stderr
    m = call("GET", "/metrics", socket=live_daemon.control_socket)
    assert m["engine_state"] == "ready" and len(m["engine"]["slots"]) == 2
    assert m["memory"]["host"]["daemon_rss_bytes"] > 0


def test_background_replan_when_idle_and_traces_moved(home):
    """Replanner: plans a workload whose traces have no set, leaves it alone until the traces grow
    by replan_growth, and never plans while a request runs."""
    import numpy as np
    from ostinatod.residency.planner import read_model_shape
    from ostinatod.residency.traces import Trace, merge_into_file, trace_path
    from ostinatod.server.state import DaemonState
    from ostinatod.settings import load_settings
    from ostinatod.workload import Replanner

    model = write_moe_gguf(home / "m.gguf")
    shape = read_model_shape(model)
    tpath = trace_path(shape.fingerprint, "customer-service", home / "data")
    counts = np.random.default_rng(1).zipf(1.4, size=(shape.n_layer, shape.n_expert)).astype(np.int64)

    def add(c):
        t = Trace.empty(shape.model_block(), "customer-service")
        t.add_counts(c, np.zeros_like(c))
        t.max_request_tokens = 128
        merge_into_file(tpath, t)
    add(counts)
    st = DaemonState(settings=load_settings(replan_idle_s=60, expert_budget_frac=0.5))
    st.model_info = {"path": str(model)}
    rp = Replanner(st)

    async def go():
        t0 = rp.last_busy
        assert await rp.check_once(now=t0 + 10) == []  # not idle long enough
        st.begin_request("r", "openai_chat", "m", None, "coding")
        assert await rp.check_once(now=t0 + 100) == []  # busy: nothing, idle clock restarts
        st.active.clear()
        assert await rp.check_once(now=t0 + 120) == []
        first = await rp.check_once(now=t0 + 200)
        assert [d["workload"] for d in first] == ["customer-service"]
        assert first[0]["planned_routes"] is None and Path(first[0]["path"]).is_file()
        assert await rp.check_once(now=t0 + 300) == []  # traces unchanged: set is current
        add(counts // 10)  # +10%: below replan_growth
        assert await rp.check_once(now=t0 + 400) == []
        add(counts // 2)  # now +60% over what the set was planned from
        again = await rp.check_once(now=t0 + 500)
        assert [d["workload"] for d in again] == ["customer-service"]
        assert again[0]["planned_routes"] == int(counts.sum())
    asyncio.run(go())


def test_the_daemon_runs_the_replanner_and_records_the_profile_at_first_start(home):
    """The control server only serves routes; the daemon's upkeep runs the re-planner (named in
    /residency) and records the hardware profile, and its shutdown stops the re-planner before the
    control server goes (no task left pending, the socket removed)."""
    from ostinatod.daemon import Daemon
    from ostinatod.settings import load_settings

    async def go():
        d = Daemon(load_settings())
        st = d.state
        d._runners.append(await start_control_server(st, d.paths.control_socket))
        d._control_bound = True
        assert st.replanner is None  # the control server alone starts nothing
        d.start_upkeep()
        rp = st.replanner
        for _ in range(600):
            if st.paths.hardware_profile.exists():
                break
            await asyncio.sleep(0.05)
        async with ControlClient(d.paths.control_socket) as c:
            assert (await c.get("/residency"))["background_replan"]["planned"] == []
        await d._shutdown()
        assert rp._task.done() and not d.paths.control_socket.exists()
        return json.loads(st.paths.hardware_profile.read_text())
    p = asyncio.run(go())
    assert p["format"] == "ostinato-hardware/1" and p["bandwidth"]["host_read_gbps"] > 0
