"""Golden fixtures of the protocol encoders (ostinatod/server/encoders/): engine events in, wire out.

Each file in tests/fixtures/encoders/ holds one case: the encoder, its arguments (ids, model,
echoed request fields), the engine events with the usage known at each (or the final ``done`` for
non-streaming answers) and the expected answer: the JSON body, or the SSE frames of the stream.
Ids come from a counter so the files are stable. Regenerate after an intended wire change with
``python tests/unit/test_encoders.py`` and review the diff.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ostinatod.engine.events import event_from_data
from ostinatod.server.encoders import anthropic, openai_chat, responses

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "encoders"


def _ids():
    n = iter(range(1, 10_000))
    return lambda prefix: f"{prefix}{next(n):04d}"


def _stream(enc, start, events) -> list[dict]:
    """Frames of a stream as they go on the wire (each serialised when it is produced)."""
    out = [f.to_json() for f in start]
    for e in events:
        frames = enc.feed(event_from_data(e["type"], e.get("data") or {}), e.get("usage") or {})
        out += [json.loads(json.dumps(f.to_json())) for f in frames]
    if hasattr(enc, "end"):
        out += [f.to_json() for f in enc.end()]
    return out


def run_case(case: dict) -> object:
    """The encoder's output for one fixture case."""
    a, ids = case["args"], _ids()
    kind = case["encoder"]
    if kind == "openai_chat.chat_completion":
        return openai_chat.chat_completion(a["rid"], a["model"], a["created"], case["done"], case["usage"], ids)
    if kind == "openai_chat.text_completion":
        return openai_chat.text_completion(a["rid"], a["model"], a["created"], case["done"], case["usage"])
    if kind == "openai_chat.ChatStream":
        enc = openai_chat.ChatStream(a["rid"], a["model"], a["created"], a["include_usage"], ids)
        return _stream(enc, enc.start(), case["events"])
    if kind == "openai_chat.CompletionStream":
        enc = openai_chat.CompletionStream(a["rid"], a["model"], a["created"], a["include_usage"])
        return _stream(enc, [], case["events"])
    if kind == "responses.response_body":
        return responses.response_body(a["request"], a["rid"], a["model"], a["created"], case["done"],
                                       case["usage"], ids)
    if kind == "responses.ResponseStream":
        enc = responses.ResponseStream(a["request"], a["rid"], a["model"], a["created"], ids)
        return _stream(enc, enc.start(), case["events"])
    if kind == "anthropic.message_body":
        return anthropic.message_body(a["rid"], a["model"], case["done"], case["usage"], ids)
    if kind == "anthropic.MessageStream":
        enc = anthropic.MessageStream(a["rid"], a["model"], ids)
        return _stream(enc, enc.start(a["start_usage"]), case["events"])
    raise ValueError(f"unknown encoder {kind}")


CASES = sorted(FIXTURES.glob("*.json"))


def test_every_protocol_has_streaming_and_plain_fixtures():
    kinds = {json.loads(p.read_text())["encoder"] for p in CASES}
    assert {"openai_chat.chat_completion", "openai_chat.ChatStream", "openai_chat.text_completion",
            "openai_chat.CompletionStream", "responses.response_body", "responses.ResponseStream",
            "anthropic.message_body", "anthropic.MessageStream"} <= kinds


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_golden(path):
    case = json.loads(path.read_text())
    assert run_case(case) == case["expected"]


def test_frames_on_the_wire():
    from ostinatod.server.encoders import DONE_SENTINEL, PING_COMMENT, Frame
    assert PING_COMMENT.encode() == b": ping\n\n"
    assert DONE_SENTINEL.encode() == b"data: [DONE]\n\n"
    assert Frame({"a": "é"}, event="x").encode() == 'event: x\ndata: {"a":"é"}\n\n'.encode()


if __name__ == "__main__":  # regenerate the expected outputs from the inputs
    for p in CASES:
        c = json.loads(p.read_text())
        c["expected"] = run_case(c)
        p.write_text(json.dumps(c, indent=1, ensure_ascii=False) + "\n")
        print("wrote", p, file=sys.stderr)
