"""Liveness is progress: the watchdog reads the engine loop's own progress (the
native call it is inside, and for how long), not a ping another thread answers. A request whose
grammar keeps one sampling call busy is reported "stalled" with its id by /health and /metrics,
ends with ``engine_stalled`` past ``engine_stall_timeout_s``, and the restarted worker serves the
others; a token slower than ``grammar_token_timeout_s`` ends its request with ``grammar_too_slow``
while the engine goes on. Real HTTP on loopback, subprocess worker, the tiny model."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from helpers import post as post_json


def _post(url: str, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    return post_json(url + path, json.dumps(body).encode(), timeout=timeout)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _alts(k: int) -> str:
    return "root ::= " + '("a" | "b" | "c")* ' * k


@pytest.fixture(scope="module")
def stall_daemon(start_daemon, tiny_model):
    """Grammar cost checks off (so a stalling grammar gets through), a 4 s stall bound, a 0.1 s
    bound per grammar token; schema-size limit off and 1 s to render (a 1,200-property tool takes
    longer on a 2-core machine, quiet or loaded)."""
    return start_daemon("--model", str(tiny_model), "--n-ctx", "1024", "--n-slots", "2", "--n-threads", "1",
                        "--engine-mode", "subprocess", "--max-pattern-ambiguity", "1000000",
                        "--engine-stall-timeout-s", "4", "--grammar-token-timeout-s", "0.1",
                        "--max-tokens-default", "8", "--max-schema-properties", "1000000",
                        "--template-timeout-s", "1")


def test_a_stalled_sampling_call_is_reported_failed_and_the_worker_restarted(stall_daemon):
    d = stall_daemon
    restarts = json.loads(_get(d.url + "/health")[1])["restarts"]
    out: dict = {}

    def culprit() -> None:
        t0 = time.monotonic()
        out["answer"] = _post(d.url, "/completion", {"prompt": "x", "n_predict": 4, "grammar": _alts(64)})
        out["seconds"] = time.monotonic() - t0

    th = threading.Thread(target=culprit)
    th.start()
    health: dict = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = json.loads(_get(d.url + "/health")[1])
        if health.get("status") == "stalled" and health.get("stall"):
            break
        time.sleep(0.2)
    assert health.get("status") == "stalled", health
    assert health["stall"]["what"] == "sampling" and len(health["stall"]["requests"]) == 1
    rid = health["stall"]["requests"][0]
    metrics = _get(d.url + "/metrics")[1]
    assert f'ostinato_engine_stalled{{request_id="{rid}",what="sampling"}} 1.0' in metrics
    # a bystander sent during the stall waits for the restarted worker and is served
    code, r = _post(d.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2})
    assert code == 200, r
    th.join(60)
    code, r = out["answer"]
    assert code == 400 and r["error"]["code"] == "engine_stalled", r
    assert "engine_stall_timeout_s = 4" in r["error"]["message"]
    h = json.loads(_get(d.url + "/health")[1])
    assert h["status"] == "ok" and h["restarts"] == restarts + 1
    assert "stalled" in h["last_exit"]["reason"] and rid in h["last_exit"]["reason"]


def test_a_slow_grammar_token_ends_its_request_and_the_engine_goes_on(stall_daemon):
    d = stall_daemon
    restarts = json.loads(_get(d.url + "/health")[1])["restarts"]
    code, r = _post(d.url, "/completion", {"prompt": "x", "n_predict": 8, "grammar": _alts(12)})
    assert code == 400 and r["error"]["code"] == "grammar_too_slow", r
    assert "grammar_token_timeout_s = 0.1" in r["error"]["message"]
    code, r = _post(d.url, "/completion", {"prompt": "x", "n_predict": 4, "grammar": 'root ::= "a"{4}'})
    assert code == 200 and r["content"] == "aaaa"
    assert json.loads(_get(d.url + "/health")[1])["restarts"] == restarts  # no restart needed


def test_template_timeout_under_load_is_503_with_retry_after(stall_daemon):
    """Two slow renders at once (1,200-property tools: 2.5-8 s each on a 2-core machine): the
    1 s limit passes while the other one renders too, so the timeout is load, a 503 to retry."""
    from ostinatod.bench.bench_reliability_attacks import big_tool
    d = stall_daemon
    out: list = []

    def attack(i: int) -> None:
        req = urllib.request.Request(d.url + "/v1/chat/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2,
                                                      "tools": [big_tool(1200, f"big{i}")]}).encode())
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                out.append((r.status, {}, {}))
        except urllib.error.HTTPError as e:
            out.append((e.code, json.loads(e.read()), dict(e.headers)))
    threads = [threading.Thread(target=attack, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    for code, body, headers in out:
        assert code == 503 and body["error"]["code"] == "template_timeout", body
        assert headers.get("Retry-After") and "other requests" in body["error"]["message"]
