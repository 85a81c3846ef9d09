"""Helpers of the hardening tests (test_stalls_and_lockouts.py, test_malformed_input.py,
test_full_disk.py): a JSON POST to a daemon's route, its /health and a small chat body."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from helpers import post as post_json


def post(url: str, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST ``body`` as JSON to ``url + path``: (HTTP status, answer body) whatever the status."""
    return post_json(url + path, json.dumps(body).encode(), timeout=timeout)


def health(url: str) -> dict:
    """The daemon's /health answer (its body also when the status is not 200)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def chat(n: int = 4, **kw) -> dict:
    """A chat completions body: one user message, ``n`` tokens at most, greedy, ``kw`` added."""
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": n, "temperature": 0, **kw}
