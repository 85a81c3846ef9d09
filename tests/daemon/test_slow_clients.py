"""Slow request bodies cannot lock anyone out: a body must arrive above a minimum
rate (``http_body_min_rate``) within ``http_body_timeout_s``, and at the connection cap the
bodies furthest behind are closed first. The attack's flood is 600 connections against the cap of
512; here the same mechanism with a cap of 16 and 40 connections (real sockets on loopback)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from ostinatod.server.request_input import BodyProgress

HEADERS = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: 100000\r\n\r\n")


def test_body_progress_deficit():
    p = BodyProgress()
    p.t0 -= 10
    p.n = 4096
    assert p.deficit(1024, p.t0 + 10) == 1024 * 10 - 4096
    assert p.deficit(100, p.t0 + 10) < 0  # ahead of a slower minimum


@pytest.fixture(scope="module")
def capped_daemon(start_daemon, tiny_model):
    return start_daemon("--model", str(tiny_model), "--n-ctx", "512", "--n-slots", "1", "--n-threads", "1",
                        "--engine-mode", "subprocess", "--http-max-connections", "16",
                        "--http-body-min-rate", "1024", "--max-tokens-default", "2")


def _port(d) -> int:
    return int(d.url.rsplit(":", 1)[1])


def _slow_body(port: int, stop: threading.Event, answers: list) -> None:
    """Complete headers, then one byte a second (the attack, faster)."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
    except OSError:
        answers.append("refused")
        return
    try:
        s.sendall(HEADERS)
        while not stop.is_set():
            s.sendall(b" ")
            s.settimeout(1.0)
            try:
                data = s.recv(4096)
            except socket.timeout:
                continue
            answers.append(data.split(b"\r\n", 1)[0].decode() if data else "closed")
            return
    except OSError:
        answers.append("closed")
    finally:
        s.close()


def test_a_new_client_is_served_during_a_slow_body_flood(capped_daemon):
    d = capped_daemon
    stop = threading.Event()
    answers: list = []
    flood = [threading.Thread(target=_slow_body, args=(_port(d), stop, answers), daemon=True) for _ in range(40)]
    for th in flood:
        th.start()
    time.sleep(1.0)  # every slot of the cap taken by slow bodies, more knocking
    try:
        t0 = time.monotonic()
        req = urllib.request.Request(d.url + "/v1/chat/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        served_in = time.monotonic() - t0
    finally:
        stop.set()
        for th in flood:
            th.join(10)
    assert served_in < 30
    # the flood was closed (furthest behind first) or answered 408 for its rate, never served
    assert answers and all(a in ("closed", "refused") or a.startswith("HTTP/1.1 408") for a in answers), answers
    with urllib.request.urlopen(d.url + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
    assert "Traceback" not in d.log()


def test_a_body_below_the_minimum_rate_is_408_naming_the_setting(capped_daemon):
    d = capped_daemon
    with socket.create_connection(("127.0.0.1", _port(d)), timeout=30) as s:
        s.sendall(HEADERS)
        t0 = time.monotonic()
        data = b""
        while time.monotonic() - t0 < 20 and b"\r\n\r\n" not in data:
            s.sendall(b" ")
            s.settimeout(1.0)
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                continue
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"http_body_min_rate" in data
