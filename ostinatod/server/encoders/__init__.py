"""Protocol encoders: the engine's events and result turned into each protocol's wire answer.

Pure functions and small state machines (no aiohttp, no engine client): given the engine events of
one request (and the usage known at that point) they return the JSON body of a non-streaming
answer, or the SSE frames of a stream. The HTTP handlers (``openai_api``, ``responses_api``,
``anthropic_api``) only write what these return. Golden request/response fixtures per protocol are
in tests/fixtures/encoders/ (tests/unit/test_encoders.py).

- :mod:`.openai_chat`: ``/v1/chat/completions`` and ``/v1/completions``;
- :mod:`.responses`: ``/v1/responses``;
- :mod:`.anthropic`: ``/v1/messages``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

IdFactory = Callable[[str], str]


def new_id(prefix: str) -> str:
    """Random request/item id with a protocol prefix (``chatcmpl-``, ``msg_``, ``resp_`` ...)."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Frame:
    """One SSE frame: ``data`` (a JSON value, or a raw string such as ``[DONE]``) with an optional
    ``event`` name; or, with ``comment``, an SSE comment line (keep-alive while the engine is
    silent; clients ignore it)."""

    data: Any = None
    event: Optional[str] = None
    comment: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        """The frame as a JSON object (golden fixtures)."""
        return {k: v for k, v in (("event", self.event), ("data", self.data), ("comment", self.comment))
                if v is not None}

    def encode(self) -> bytes:
        """The frame's bytes on the wire."""
        if self.comment is not None:
            return f": {self.comment}\n\n".encode()
        payload = (self.data if isinstance(self.data, str)
                   else json.dumps(self.data, ensure_ascii=False, separators=(",", ":")))
        head = f"event: {self.event}\n" if self.event else ""
        return f"{head}data: {payload}\n\n".encode()


PING_COMMENT = Frame(comment="ping")
DONE_SENTINEL = Frame(data="[DONE]")

