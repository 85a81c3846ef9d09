"""Engine supervision: crashes restart with backoff and say so in /health
and status; a stopped worker is noticed by a liveness ping; /metrics never blocks on the engine; a
bad model file never replaces the served one. One real daemon with a subprocess worker."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from ostinatod.control import client as ctl


def get(url: str, timeout: float = 10) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def chat(url: str) -> int:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status


def wait_new_worker(d, old: set[int], timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = set(d.worker_pids()) - old
        if pids:
            return pids.pop()
        time.sleep(0.05)
    pytest.fail(f"no new worker:\n{d.log()[-3000:]}")


@pytest.fixture(scope="module")
def sup_daemon(start_daemon, tiny_model):
    return start_daemon("--model", str(tiny_model), "--n-ctx", "512", "--n-slots", "1", "--n-threads", "1",
                        "--engine-mode", "subprocess", "--worker-ping-timeout-s", "2",
                        "--max-tokens-default", "4")


def test_load_of_a_bad_file_keeps_the_served_model(sup_daemon, tiny_model, tmp_path):
    bad = tmp_path / "truncated.gguf"
    data = tiny_model.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ctl.ControlAPIError) as e:
        ctl.call("POST", "/models/load", {"path": str(bad)}, socket=sup_daemon.control_socket)
    assert "truncated" in str(e.value)
    code, body = get(sup_daemon.url + "/health")
    assert code == 200 and body["model"] == "tiny-qwen3moe", body
    assert chat(sup_daemon.url) == 200


def test_stopped_worker_is_noticed_and_metrics_never_block(sup_daemon):
    sup_daemon.wait_healthy()
    (pid,) = sup_daemon.worker_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        # a /metrics that waited on the stopped engine would hang past the request's timeout
        code, _ = get(sup_daemon.url + "/metrics", timeout=10)
        assert code == 200
        new = wait_new_worker(sup_daemon, {pid}, timeout=60)  # killed by the liveness ping, restarted
        assert new != pid
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    sup_daemon.wait_healthy(120)
    assert "did not answer a liveness ping" in sup_daemon.log()
    st = ctl.call("GET", "/status", socket=sup_daemon.control_socket)
    assert st["engine"]["restarts"] >= 1 and "ping" in st["engine"]["last_exit"]["reason"]


def test_repeated_crashes_restart_with_backoff(sup_daemon):
    sup_daemon.wait_healthy()
    seen: set[int] = set()
    saw_restarting = None
    for i in range(7):  # more than the 5 quick restarts of the window
        pid = wait_new_worker(sup_daemon, seen)
        seen.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if i >= 5:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and saw_restarting is None:
                code, body = get(sup_daemon.url + "/health")
                if code == 503 and body.get("status") == "restarting":
                    saw_restarting = body
                time.sleep(0.05)
    assert saw_restarting is not None, "health never said restarting"
    assert saw_restarting["restarts"] >= 6 and "restarting in" in saw_restarting["error"], saw_restarting
    sup_daemon.wait_healthy(180)  # it never gives up
    assert chat(sup_daemon.url) == 200
    assert "restarting in 2.0 s" in sup_daemon.log()
