"""Text of a generation: UTF-8 hold-back of token pieces, stop strings, delta merging.

Pure Python; the worker feeds it token pieces (bytes) as they are sampled.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Sequence

log = logging.getLogger("ostinatod.engine")


class Utf8Text:
    """Incremental UTF-8 decoding of token pieces: bytes of an unfinished character are held back.

    ``text`` is what decoded so far; ``buf`` the held-back bytes (at most a few)."""

    def __init__(self) -> None:
        self.buf = b""
        self.text = ""

    def add(self, piece: bytes) -> None:
        self.buf += piece
        # decode the longest valid prefix; at most 3 trailing bytes can be an unfinished character
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                s = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.text += s
            self.buf = self.buf[cut:]
            return
        if len(self.buf) > 8:  # not UTF-8 at all: keep the text flowing
            self.text += self.buf.decode("utf-8", errors="replace")
            self.buf = b""

    def cut(self, n: int) -> None:
        """Keep the first ``n`` characters (a stop string was found there); drop held-back bytes."""
        self.text = self.text[:n]
        self.buf = b""

    def flush(self) -> str:
        if self.buf:
            self.text += self.buf.decode("utf-8", errors="replace")
            self.buf = b""
        return self.text


class StopScanner:
    """Finds the earliest stop string in a growing text, looking at the new text only.

    An occurrence found now must end in the text added since the previous call (an earlier one
    would have been found then), so the search starts ``len(longest stop) - 1`` characters before
    the previous end: each call costs O(new text + longest stop), not O(whole output)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._reach = max((len(s) for s in self.stops), default=1) - 1
        self._scanned = 0
        self.matched: Optional[str] = None  # the stop string that :meth:`find` found last

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str) -> Optional[int]:
        """Index where the earliest stop string starts in ``text`` (which only ever grows between
        calls), or None."""
        start = max(0, self._scanned - self._reach)
        self._scanned = len(text)
        best = None
        for s in self.stops:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best, self.matched = i, s
        return best

    def partial_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string (held
        back from streaming until it is known not to be a stop)."""
        return partial_stop_len(text, self.stops)


def find_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    """Index where the earliest stop string starts in ``text``, or None (whole-text reference of
    :meth:`StopScanner.find`)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """One delta event's data from the chat parser's diffs (content, reasoning, tool calls)."""
    out: dict[str, Any] = {}
    for d in deltas:
        if "content" in d:
            out["content"] = out.get("content", "") + d["content"]
        if "reasoning" in d:
            out["reasoning"] = out.get("reasoning", "") + d["reasoning"]
        if "tool_calls" in d:
            out.setdefault("tool_calls", []).extend(d["tool_calls"])
    return out


def call_text(call: dict[str, Any]) -> str:
    """A tool call written as plain text, ``name(arguments)``: how a call that cannot be returned
    as a call goes back (no model markup)."""
    fn = call.get("function") or call
    return f"{fn.get('name') or ''}({fn.get('arguments') or ''})"


def settle_tool_calls(message: dict[str, Any], finish_reason: Optional[str],
                      tool_choice: Any = None) -> tuple[dict[str, Any], Optional[str]]:
    """The final assistant message and finish reason of a generation, with every tool call a
    valid call or gone (docs/api.md "Tool calls"): a call is returned only when its arguments parse
    as a JSON object (a call cut by the length limit does not) and tools were not switched off
    (``tool_choice`` "none"); any other call is dropped, never written into the content (no model
    markup or half-written call in text). The finish reason is "tool_calls" when valid calls
    remain; otherwise "length" when the output was cut, else "stop"."""
    calls = message.get("tool_calls") or []
    if not calls:
        return message, finish_reason
    keep, dropped = [], []
    for tc in calls:
        fn = tc.get("function") or tc
        args = fn.get("arguments")
        try:
            ok = isinstance(json.loads(args) if isinstance(args, str) else args, dict)
        except (json.JSONDecodeError, TypeError):
            ok = False
        (keep if ok and tool_choice != "none" else dropped).append(tc)
    if not dropped:
        return message, "tool_calls"
    log.debug("dropped %d tool call(s) (%s): %s", len(dropped),
              "tool_choice none" if tool_choice == "none" else "arguments incomplete or not an object",
              "; ".join(call_text(tc)[:200] for tc in dropped))
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if keep:
        out["tool_calls"] = keep
        return out, "tool_calls"
    if out.get("content") is None:
        out["content"] = ""
    return out, "length" if finish_reason == "length" else "stop"
