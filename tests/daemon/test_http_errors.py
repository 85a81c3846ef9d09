"""Bad input and failures give clear, protocol-shaped errors and the daemon keeps serving."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from conftest import LIVE_N_CTX
from helpers import post



def test_malformed_json_openai_and_anthropic_shapes(live_daemon):
    code, body = post(live_daemon.url + "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert code == 400 and body["error"]["code"] == "invalid_json"
    assert body["error"]["type"] == "invalid_request_error"
    code, body = post(live_daemon.url + "/v1/messages?beta=true", b"not json")
    assert code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    code, body = post(live_daemon.url + "/v1/responses", b"[1, 2]")
    assert code == 400 and body["error"]["code"] == "invalid_json"


def test_unknown_model(oai, ant):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as e2:
        ant.messages.create(model="llama-3", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e2.value.body["error"]["type"] == "not_found_error"


def test_bad_params(oai, ant):
    model = oai.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=7)
    assert e.value.code == "invalid_request" and "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                    tools=[{"type": "function", "function": {"name": "a"}}],
                                    tool_choice={"type": "function", "function": {"name": "b"}})
    assert "unknown tool" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e2:
        ant.messages.create(model="claude-x", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert "max_tokens" in e2.value.body["error"]["message"]


def test_context_too_long(oai, ant, live_daemon):
    model = oai.models.list().data[0].id
    long = "word " * (LIVE_N_CTX * 2)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": long}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as e2:
        ant.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": long}])
    assert "context_length_exceeded" in e2.value.body["error"]["message"]
    # still serving
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "ok"}], max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_unknown_route_is_json_404(live_daemon):
    code, body = post(live_daemon.url + "/v1/embeddings", b"{}")
    assert code == 404 and body["error"]["code"] == "not_found"


def test_api_key_required_when_configured(keyed_daemon):
    d = keyed_daemon(2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=d.url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=d.url + "/v1", api_key="sekret", max_retries=0).models.list()
    assert ok.data
    m = anthropic.Anthropic(base_url=d.url, api_key="sekret", max_retries=0).messages.create(
        model="claude-x", max_tokens=1, messages=[{"role": "user", "content": "x"}])  # x-api-key
    assert m.type == "message"
    with urllib.request.urlopen(d.url + "/health") as r:  # health stays open
        assert r.status == 200


def test_worker_killed_mid_stream_then_recovers(oai, live_daemon):
    model = oai.models.list().data[0].id
    workers = live_daemon.worker_pids()
    assert workers, "expected a subprocess engine worker"
    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "go"}],
                                         max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    got = 0
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            got += 1
            if got == 3:
                for pid in workers:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    assert "engine_crashed" in str(e.value) or "crash" in str(e.value).lower()
    assert live_daemon.proc.poll() is None  # the daemon itself survives
    live_daemon.wait_healthy(420)  # a model reload is slow on a busy 2-core machine
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "again"}], max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert set(live_daemon.worker_pids()).isdisjoint(workers)  # a new worker


def test_non_streaming_client_disconnect_stops_the_generation(live_daemon):
    # a client that gives up on a long non-streaming request must not leave the engine generating
    from ostinatod.control import client as ctl
    body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story."}],
                       "max_tokens": 4000, "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(live_daemon.url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "user-agent": "gives-up/1"})
    # socket timeout: the client closes the connection (0.5 s: with 1.5 s the shared daemon, whose
    # n_ctx 2048 caps the request, once answered in full before the timeout)
    with pytest.raises(OSError):
        urllib.request.urlopen(req, timeout=0.5)
    deadline = time.monotonic() + 30
    rec = None
    while time.monotonic() < deadline:
        d = ctl.call("GET", "/requests?limit=20", socket=live_daemon.control_socket)
        rec = next((r for r in d["recent"] if r.get("client") and "gives-up" in str(r.get("client"))
                    or r.get("status") == "client_disconnected"), None)
        if rec is not None and not d["active"]:
            break
        time.sleep(0.3)
    assert rec is not None and rec["status"] == "client_disconnected", rec
    assert (rec.get("completion_tokens") or 0) < 4000
    # and the engine is free again: a short request answers
    code, out = post(live_daemon.url + "/v1/chat/completions",
                     json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode())
    assert code == 200 and out["choices"]
