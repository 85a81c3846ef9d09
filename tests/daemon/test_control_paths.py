"""The control API and the daemon's own files under hostile input: paths that are
not regular files are named for what they are and never a 500, a render that times out under load
is a 503 with Retry-After, SIGTERM removes the control socket and answers queued requests with a
structured ``engine_stopped``, lock files are 0600 and log lines valid UTF-8."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ostinatod.control.client import ControlAPIError, call
from ostinatod.files import NotRegularFile, regular_file
from ostinatod.residency.traces import _locked


@pytest.fixture(scope="module")
def fifo(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("paths") / "model.gguf"
    os.mkfifo(p)
    return p


def test_regular_file_names_what_a_path_is(fifo, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert regular_file(str(f)) == f
    cases = {str(fifo): "FIFO", str(tmp_path): "directory", "/dev/zero": "character device",
             str(tmp_path / "none"): "missing", "/x" + "a" * 5000: "name too long",
             str(tmp_path / ("b" * 300)): "name too long", "a\0b": "invalid name"}
    for path, kind in cases.items():
        with pytest.raises(NotRegularFile) as e:
            regular_file(path)
        assert e.value.kind == kind, path
        assert len(str(e.value)) < 400  # a 5,000-character name is shortened in the message


def test_control_paths_are_4xx_naming_what_they_are(live_daemon, fifo, tmp_path):
    sock = live_daemon.control_socket
    cases = [("/models/load", {"path": "/m/" + "a" * 5000 + ".gguf"}, 400, "invalid_path", "too long"),
             ("/models/load", {"path": str(fifo)}, 400, "not_a_file", "a FIFO"),
             ("/models/load", {"path": str(tmp_path)}, 400, "not_a_file", "a directory"),
             ("/models/load", {"path": "/dev/zero"}, 400, "not_a_file", "a character device"),
             ("/models/load", {"path": "/m/a\0b.gguf"}, 400, "invalid_path", "not a valid file name"),
             ("/models/load", {"path": str(tmp_path / "none.gguf")}, 404, "model_not_found", "no such file"),
             ("/residency/switch", {"path": str(tmp_path / ("r" * 300 + ".json"))}, 400, "invalid_path",
              "too long"),
             ("/residency/switch", {"path": "/dev/zero"}, 400, "not_a_file", "a character device")]
    for route, body, status, code, words in cases:
        with pytest.raises(ControlAPIError) as e:
            call("POST", route, body, socket=sock)
        assert (e.value.status, e.value.code) == (status, code), (route, body, e.value.message)
        assert words in e.value.message
    assert call("GET", "/status", socket=sock)["engine_state"] == "ready"  # still serving


def test_trace_lock_files_are_private(tmp_path):
    trace = tmp_path / "traces" / "coding.json"
    (tmp_path / "traces").mkdir()
    old = trace.with_name(trace.name + ".lock")
    old.touch(mode=0o644)
    os.chmod(old, 0o644)  # one left by an earlier version
    with _locked(trace):
        pass
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    other = tmp_path / "traces" / "review.json"
    with _locked(other):
        pass
    assert stat.S_IMODE(other.with_name("review.json.lock").stat().st_mode) == 0o600


def test_log_lines_are_utf8_whatever_they_hold(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from ostinatod.daemon_cli import DETACHED_ENV, setup_logging
    from ostinatod.settings import Settings
    monkeypatch.setenv(DETACHED_ENV, "1")
    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        setup_logging(Settings(), SimpleNamespace(log_file=tmp_path / "ostinatod.log"))
        logging.getLogger("ostinatod.test").warning("path %s", "/m/caf\udce9.gguf")  # a lone surrogate
        for h in root.handlers:
            h.flush()
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved:
            root.addHandler(h)
    text = (tmp_path / "ostinatod.log").read_bytes().decode("utf-8")
    assert "path /m/caf\\udce9.gguf" in text


def _post(url: str, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_sigterm_removes_the_socket_answers_queued_requests_and_logs_utf8(start_daemon, tiny_model):
    d = start_daemon("--model", str(tiny_model), "--n-ctx", "8192", "--n-slots", "1", "--n-threads", "1",
                     "--engine-mode", "subprocess")
    assert d.control_socket.exists()
    out: dict = {}

    def ask(name: str, n: int) -> None:
        out[name] = _post(d.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": n, "ignore_eos": True})
    threads = [threading.Thread(target=ask, args=(name, n)) for name, n in (("running", 8000), ("queued", 4))]
    for th in threads:
        th.start()
        time.sleep(0.4)
    time.sleep(0.5)
    os.kill(d.proc.pid, signal.SIGTERM)
    for th in threads:
        th.join(60)
    assert d.proc.wait(30) == 0
    for name in ("running", "queued"):
        code, body, headers = out[name]
        assert code == 503 and body["error"]["code"] == "engine_stopped", (name, body)
        assert headers.get("Retry-After")
    assert not d.control_socket.exists()
    raw = d.log_file.read_bytes()
    raw.decode("utf-8")  # every line valid UTF-8
    assert b"Logging error" not in raw and b"Traceback" not in raw
