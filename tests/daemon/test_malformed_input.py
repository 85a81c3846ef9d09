"""Hardening against malformed input: settings mistakes and impossible residency sets are one-line
errors, malformed HTTP, bad header bytes and bodies in a bogus encoding are JSON 400s logged in one
line, every documented content encoding is decoded, and a set naming a missing GPU is refused. Real
HTTP on loopback against live daemons where a daemon is needed."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from hardening_helpers import chat, post


# ---- item 9: smaller ones -----------------------------------------------------------------------

def test_settings_mistakes_are_one_line_errors(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from ostinatod.settings import Settings, SettingsError, load_settings

    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    cfg = tmp_path / "config"
    cfg.mkdir()
    f = cfg / "settings.toml"
    for content, said in ((b"port = 9000\nmodel = \"\xff\xfe\"\n", "not UTF-8"),
                          (b"a = " + b"[" * 100000 + b"]" * 100000 + b"\n", "nests too deeply")):
        f.write_bytes(content)
        with pytest.raises(SettingsError, match=said):
            load_settings()
    f.unlink()
    f.symlink_to("/dev/zero")
    with pytest.raises(SettingsError, match="not a regular file"):
        load_settings()
    f.unlink()
    for bad in ({"port": True}, {"api_key": ""}, {"n_batch": 10**9}, {"n_ubatch": 10**9}):
        with pytest.raises(ValidationError):
            Settings(**bad)


def test_residency_sets_with_impossible_values_are_refused():
    from ostinatod.residency.sets import ResidencyError, validate_residency

    model = {"fingerprint": "f" * 64, "name": "m", "n_layer": 2, "n_expert": 8}

    def doc(**gpu):
        g = {"device": 0, "hot": {"0": [1, 2]}, **gpu}
        return {"format": "ostinato-residency/1", "model": model, "workload": "coding", "gpus": [g]}
    validate_residency(doc(), model)
    for bad in (doc(device=-1), doc(device=True), doc(hot={"0": [True]}), doc(budget_bytes=-5),
                doc(hot={"0": [1] * 100000})):
        with pytest.raises(ResidencyError):
            validate_residency(bad, model)


def _raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(data)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    s.close()
    return out


def test_malformed_http_gets_a_json_error_and_no_traceback(live_daemon):
    before = len(live_daemon.log())   # the shared daemon's log holds earlier tests' requests too
    out = _raw(live_daemon.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nBad Header\r\n\r\n")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
    assert b"application/json" in head and json.loads(body)["error"]["code"] == "invalid_http"
    time.sleep(0.2)   # the log line is written after the answer
    mine = live_daemon.log()[before:]
    assert "malformed HTTP request -> 400" in mine and "Error handling request" not in mine


def _unix_raw(path: Path, data: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(path))
    s.sendall(data)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def _json_400(answer: bytes) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0] and b"application/json" in head, answer[:300]
    return json.loads(body)


def test_bad_header_bytes_and_bad_gzip_bodies_are_json_400s_logged_in_one_line(live_daemon):
    import gzip

    body = json.dumps(chat(1)).encode()

    def post(path: bytes, extra: bytes, data: bytes) -> bytes:
        return (b"POST " + path + b" HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" + extra
                + b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    before = len(live_daemon.log())
    gz = gzip.compress(body)
    for extra, data, code in ((b"X-Trace: a\x01b\r\n", body, "invalid_http"),
                              (b"Content-Encoding: gzip\r\n", body, "invalid_encoding"),   # not gzip
                              (b"Content-Encoding: gzip\r\n", gz + b"junk", "invalid_encoding"),
                              (b"Content-Encoding: deflate\r\n", b"\x00" * 64, "invalid_encoding")):
        err = _json_400(_raw(live_daemon.url, post(b"/v1/chat/completions", extra, data)))
        assert err["error"]["code"] == code and "\n" not in err["error"]["message"], err
    # the control socket: its own JSON error shape, not aiohttp's text/plain
    sock = live_daemon.control_socket
    err = _json_400(_unix_raw(sock, b"GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"))
    assert err["error"]["code"] == "invalid_http"
    err = _json_400(_unix_raw(sock, post(b"/residency/switch", b"Content-Encoding: gzip\r\n", b'{"workload": "x"}')))
    assert err["error"]["code"] == "invalid_encoding"
    time.sleep(0.3)   # the log lines are written after the answers
    mine = live_daemon.log()[before:]
    for noise in ("Traceback", "Error handling request", "Unhandled exception"):
        assert noise not in mine, mine
    assert mine.count("-> 400") >= 5, mine  # one line each (the control API logs no body errors)


def test_non_utf8_user_agent_and_bogus_encoding(live_daemon):
    body = json.dumps(chat(1)).encode()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"User-Agent: agent\xff\xfe/1.0\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode()
           + b"\r\n\r\n" + body)
    assert b" 200 " in _raw(live_daemon.url, req).split(b"\r\n")[0]
    assert "Logging error" not in live_daemon.log()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Encoding: x-bogus\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode()
           + b"\r\n\r\n" + body)
    head, _, answer = _raw(live_daemon.url, req).partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0] and json.loads(answer)["error"]["code"] == "invalid_encoding"


def test_every_documented_content_encoding_is_decoded(live_daemon):
    # docs/api.md lists gzip, deflate, br, zstd and identity as decoded request bodies
    import gzip
    import zlib

    import brotli
    try:
        from compression import zstd
    except ImportError:
        from backports import zstd
    body = json.dumps(chat(1)).encode()
    for enc, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)), ("br", brotli.compress(body)),
                      ("zstd", zstd.compress(body)), ("identity", body)):
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Encoding: " + enc.encode() + b"\r\nConnection: close\r\nContent-Length: "
               + str(len(data)).encode() + b"\r\n\r\n" + data)
        head, _, answer = _raw(live_daemon.url, req).partition(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0], (enc, head, answer[:300])
        assert json.loads(answer)["choices"][0]["message"], enc


def test_control_switch_with_a_long_workload_name_is_a_400(live_daemon):
    from ostinatod.control.client import ControlAPIError, call

    with pytest.raises(ControlAPIError) as e:
        call("POST", "/residency/switch", {"workload": "w" * 5000}, socket=live_daemon.control_socket)
    assert e.value.status == 400 and e.value.code == "invalid_workload"


# ---- item 9: residency sets naming a GPU that is not there --------------------------------------

def test_a_set_naming_a_missing_gpu_is_refused_naming_the_gpus_there():
    from ostinatod.engine import native
    from ostinatod.engine.placement import check_devices
    from ostinatod.residency.sets import ResidencyError

    check_devices([0, 1], 2)
    for devices, n_gpus, said in (([7], 1, "names GPU 7, but this machine has 1 GPU (GPU 0)"),
                                  ([0, 2, 3], 2, "names GPU 2, 3, but this machine has 2 GPUs (GPUs 0..1)")):
        with pytest.raises(ResidencyError, match=re.escape(said)):
            check_devices(devices, n_gpus, "x.json: ")
    check_devices([7], 0)  # a CPU build: every pool is a CPU buffer (CI's several-GPU runs)
    if not native.has_gpu():  # the count the engine checks against, read from llama.cpp's backends
        assert native.gpu_count() == 0
