"""``ostinatod`` commands: start/status/stop with the demo model, settings flags, bad model files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT


def ostinatod(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OSTINATO_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "ostinatod.daemon_cli", *args], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


def test_run_help_lists_every_setting():
    from ostinatod.settings import Settings

    out = subprocess.run([sys.executable, "-m", "ostinatod.daemon_cli", "run", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in out
    assert "Context length per slot" in out  # descriptions come from the settings model


def test_start_status_stop_demo_model():
    home = Path(tempfile.mkdtemp(prefix="ostinato-demo-"))
    r = ostinatod(home, "start", "--port", "0", "--demo-shape", "tiny", "--n-ctx", "512",
                  "--n-threads", "2")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "RANDOM WEIGHTS" in r.stdout
        assert (home / "data" / "models" / "ostinato-demo-tiny.gguf").is_file()
        st = ostinatod(home, "status", "--json")
        s = json.loads(st.stdout)
        assert st.returncode == 0 and s["running"] and s["random_weights"] is True
        assert s["model"] == "ostinato-demo-random-weights"
        models = json.loads(urllib.request.urlopen(s["http_url"] + "/v1/models").read())["data"]
        assert models[0]["id"] == "ostinato-demo-random-weights" and models[0]["random_weights"] is True
        assert "RANDOM WEIGHTS" in (home / "state" / "ostinatod.log").read_text()
        again = ostinatod(home, "start", "--port", "0")
        assert again.returncode == 0 and "already running" in again.stdout
    finally:
        stop = ostinatod(home, "stop")
    assert stop.returncode == 0 and "stopped" in stop.stdout
    st = ostinatod(home, "status")
    assert st.returncode == 3 and "not running" in st.stdout


def test_truncated_gguf_gives_clear_error(tiny_model):
    home = Path(tempfile.mkdtemp(prefix="ostinato-trunc-"))
    bad = home / "truncated.gguf"
    data = tiny_model.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    r = ostinatod(home, "start", "--port", "0", "--model", str(bad), "--wait", "120")
    assert r.returncode == 1
    assert "failed to load" in r.stderr and "truncated" in r.stderr
    assert "truncated.gguf" in r.stderr  # names the file and the reason
    # the daemon keeps running without a model and says why
    st = ostinatod(home, "status", "--json")
    assert st.returncode == 0, st
    url = json.loads(st.stdout)["http_url"]
    try:
        urllib.request.urlopen(url + "/health", timeout=5)
        raise AssertionError("health must be 503 without a model")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        assert e.code == 503 and body["status"] == "error" and "truncated" in body["error"], body
    assert ostinatod(home, "stop").returncode == 0


def test_missing_model_file():
    home = Path(tempfile.mkdtemp(prefix="ostinato-missing-"))
    r = ostinatod(home, "run", "--port", "0", "--model", str(home / "nope.gguf"))
    assert r.returncode == 1
    assert "model file not found" in r.stderr


def test_invalid_setting_value():
    home = Path(tempfile.mkdtemp(prefix="ostinato-bad-"))
    r = ostinatod(home, "run", "--n-slots", "99")
    assert r.returncode == 2 and "n_slots" in r.stderr


# --- hardening: settings and bind errors as one line; secrets never in argv ----------
def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode in (1, 2), r
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    hits = [ln for ln in lines if all(w in ln for w in words)]
    assert hits, r.stderr


def test_settings_file_errors_are_one_line():
    home = Path(tempfile.mkdtemp(prefix="ostinato-toml-"))
    (home / "config").mkdir(parents=True)
    toml = home / "config" / "settings.toml"
    toml.write_text('apikey = "x"\n')  # a typo must not start an open daemon
    _one_line_error(ostinatod(home, "run", "--port", "0"), "unknown setting", "apikey", "api_key")
    toml.write_text('port = \n')
    _one_line_error(ostinatod(home, "run", "--port", "0"), "not valid TOML", "settings.toml")


def test_bind_errors_are_one_line(tiny_model):
    import socket

    home = Path(tempfile.mkdtemp(prefix="ostinato-bind-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_line_error(ostinatod(home, "run", "--port", str(port), "--model", str(tiny_model), timeout=60),
                        "cannot listen", str(port))
    # (a non-loopback host needs a key or allow_open_bind before the bind is even tried)
    _one_line_error(ostinatod(home, "run", "--host", "no-such-host.invalid", "--port", "0", "--allow-open-bind",
                              "--model", str(tiny_model), timeout=60), "cannot listen", "no-such-host.invalid")


def test_api_key_never_on_the_command_line(tmp_path):
    home = Path(tempfile.mkdtemp(prefix="ostinato-key-"))
    r = ostinatod(home, "run", "--api-key", "sekret")
    _one_line_error(r, "--api-key", "OSTINATO_API_KEY")
    key = tmp_path / "key"
    key.write_text("sekret\n")
    key.chmod(0o644)
    _one_line_error(ostinatod(home, "run", "--api-key-file", str(key)), "api_key_file", "chmod 600")


def test_log_file_is_private():
    home = Path(tempfile.mkdtemp(prefix="ostinato-log-"))
    ostinatod(home, "run", "--port", "0", "--model", str(home / "nope.gguf"))
    log = home / "state" / "ostinatod.log"
    assert log.exists() and (log.stat().st_mode & 0o077) == 0
