"""Text of a generation: UTF-8 hold-back of token pieces, stop strings, delta merging.

Pure Python; the worker feeds it token pieces (bytes) as they are sampled.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


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
                best = i
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
