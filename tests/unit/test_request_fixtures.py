"""Golden fixtures of the request side of the three protocols: an HTTP body (and headers) in, the
one internal request (GenRequest) out -- the counterpart of tests/unit/test_encoders.py.

Each file in tests/fixtures/requests/ holds ``protocol`` (openai_chat, responses, anthropic),
``headers``, ``body`` and ``expected`` (the GenRequest as a dict, without its random ``id``).
Regenerate after an intended change with ``python tests/unit/test_request_fixtures.py`` and review
the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest
from multidict import CIMultiDict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "requests"
CASES = sorted(FIXTURES.glob("*.json"))


def build(case: dict) -> dict:
    """The GenRequest the adapter makes of the case's body and headers, as a dict without ``id``."""
    from ostinatod.server import anthropic_api, openai_api, responses_api
    from ostinatod.server.request_input import validate
    from ostinatod.server.state import DaemonState
    from ostinatod.settings import Settings

    state = DaemonState(settings=Settings())
    request = types.SimpleNamespace(headers=CIMultiDict(case.get("headers") or {}))
    body, proto = case["body"], case["protocol"]
    if proto == "openai_chat":
        req = openai_api.chat_request(state, request, validate(openai_api.ChatBody, body))
    elif proto == "responses":
        req = responses_api.responses_request(state, request, validate(responses_api.ResponsesBody, body))
    elif proto == "anthropic":
        req = anthropic_api.build_request(state, request, validate(anthropic_api.MessagesBody, body), "msg_x")
    else:
        raise ValueError(proto)
    out = dataclasses.asdict(req)
    out.pop("id")
    return json.loads(json.dumps(out))


def test_every_protocol_has_request_fixtures():
    assert {json.loads(p.read_text())["protocol"] for p in CASES} == {"openai_chat", "responses", "anthropic"}


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_golden_request(path, tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))  # no user settings.toml
    for k in [k for k in os.environ if k.startswith("OSTINATO_") and k != "OSTINATO_HOME"]:
        monkeypatch.delenv(k)
    case = json.loads(path.read_text())
    assert build(case) == case["expected"]


if __name__ == "__main__":  # regenerate the expected requests
    os.environ["OSTINATO_HOME"] = tempfile.mkdtemp()
    for k in [k for k in os.environ if k.startswith("OSTINATO_") and k != "OSTINATO_HOME"]:
        del os.environ[k]
    for p in CASES:
        c = json.loads(p.read_text())
        c["expected"] = build(c)
        p.write_text(json.dumps(c, indent=1, ensure_ascii=False) + "\n")
        print("wrote", p, file=sys.stderr)
