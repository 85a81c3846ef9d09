"""Recorded agent sessions (../shared/sessions/, format in its README.md): loading, replay turns,
and the development / held-out split by task.

A session is a dict {"id", "workload", "source", "tools", "messages"} with OpenAI-shape messages.
Assistant turn *k* of a session is its k-th assistant message; its context is every message before
it (the README's replay note), and the recorded message is the completion for that context.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .errors import MessageError


class SessionError(MessageError, ValueError):
    """A sessions file is missing or malformed (the message names the file and line)."""

    code, status = "sessions_invalid", 400



# Workload of a recorded session (its "workload" field) as the daemon names it: the replay sends it
# in the x-ostinato-workload header so that traces and residency sets are kept per workload.
WORKLOAD_OF_SESSION = {"swe": "coding", "tau2": "customer-service"}


def workload_of(session: dict) -> str:
    """The daemon workload of a recorded session ("coding" for unknown kinds)."""
    return WORKLOAD_OF_SESSION.get(str(session.get("workload")), "coding")

def load_sessions(path: str | Path) -> list[dict[str, Any]]:
    """Sessions of a JSON Lines file, in file order.

    Checks what the replay relies on: each line is a JSON object with a string ``id``, a list of
    ``messages`` with ``role`` in system/user/assistant/tool, and a ``tools`` list (missing: []).
    Raises SessionError (file:line and the reason) on anything else, and for duplicate ids.
    """
    p = Path(path)
    if not p.is_file():
        raise SessionError(f"{p}: no such sessions file")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                s = json.loads(line)
            except ValueError as e:
                raise SessionError(f"{p}:{n}: not JSON ({e})") from None
            if not isinstance(s, dict) or not isinstance(s.get("id"), str):
                raise SessionError(f"{p}:{n}: a session must be an object with a string 'id'")
            msgs = s.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise SessionError(f"{p}:{n}: session {s['id']!r} has no 'messages' list")
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                    raise SessionError(f"{p}:{n}: session {s['id']!r} message {i} has no valid role")
            s.setdefault("tools", [])
            if not isinstance(s["tools"], list):
                raise SessionError(f"{p}:{n}: session {s['id']!r}: 'tools' must be a list")
            if s["id"] in seen:
                raise SessionError(f"{p}:{n}: duplicate session id {s['id']!r}")
            seen.add(s["id"])
            out.append(s)
    return out


@dataclass(frozen=True)
class Turn:
    """One replayable assistant turn: ``index`` (0-based among the session's assistant turns),
    ``message_index`` (position of the recorded assistant message), ``context`` (messages before
    it), ``target`` (the recorded assistant message) and ``after``: "first" for the first turn,
    "tool" when the last context message is a tool result, else "user" (a user message, which in
    text-action sessions is the environment's observation)."""

    index: int
    message_index: int
    context: list[dict[str, Any]]
    target: dict[str, Any]
    after: str


def assistant_turns(session: dict[str, Any]) -> list[Turn]:
    """The session's assistant turns in order (see :class:`Turn`)."""
    msgs = session["messages"]
    turns: list[Turn] = []
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        prev = msgs[i - 1]["role"] if i > 0 else "system"
        after = "first" if not turns else ("tool" if prev == "tool" else "user")
        turns.append(Turn(len(turns), i, msgs[:i], m, after))
    return turns


def assistant_text(message: dict[str, Any]) -> str:
    """Text of an assistant message as a Hermes-style model would emit it: content, then each tool
    call as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` (used to size the
    number of tokens to generate)."""
    parts = [message.get("content") or ""]
    for c in message.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args)
        parts.append('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (fn.get("name", ""), args))
    return "\n".join(p for p in parts if p)


_HEX = re.compile(r"^[0-9a-f]{6,}$")


def task_key(session_id: str) -> str:
    """The task a session belongs to; sessions of one task stay on one side of a split.

    swe: ``swe-sweagent-marshmallow-1867-<format>`` and ``swe-mini-<owner>__<repo>-<n>`` map to
    ``swe:<repo>-<n>`` (the same SWE-bench instance recorded by either agent is one task);
    ``swe-sweagent-ctf-<cat>-<name>`` to ``swe:ctf-<cat>-<name>``.
    tau2: ``tau2-<domain>-task<N>-[gpt41-]<sim>`` maps to ``tau2:<domain>-task<N>``; telecom
    sessions name only their issue type (``tau2-telecom-<issue>-[gpt41-]<sim>``), so all sessions of
    one issue type are one group (conservative: no task can leak across the split).
    Other ids: the id without a trailing hex simulation suffix.
    """
    parts = session_id.split("-")
    if session_id.startswith("swe-sweagent-ctf-"):
        return "swe:" + session_id[len("swe-sweagent-"):]
    m = re.match(r"^swe-sweagent-([a-z0-9_]+-\d+)(?:-.*)?$", session_id)
    if m:
        return "swe:" + m.group(1)
    m = re.match(r"^swe-mini-[^_]+__(.+-\d+)$", session_id)
    if m:
        return "swe:" + m.group(1)
    if session_id.startswith("tau2-"):
        rest = [p for p in parts[1:] if p != "gpt41" and not _HEX.match(p)]
        return "tau2:" + "-".join(rest)
    while len(parts) > 1 and _HEX.match(parts[-1]):
        parts.pop()
    return "-".join(parts)


def split_sessions(file: str | Path | Iterable[dict[str, Any]], held_out_frac: float = 1 / 3,
                   seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split sessions into (development, held-out) lists by task (:func:`task_key`).

    ``file``: a JSONL path or already loaded sessions. Tasks are shuffled with ``seed`` and taken
    into the held-out side while that brings its session count closer to ``held_out_frac`` of the
    total; both sides keep file order. Deterministic for a given input and seed. Raises
    ValueError when ``held_out_frac`` is not in (0, 1).
    """
    if not 0 < held_out_frac < 1:
        raise ValueError("held_out_frac must be between 0 and 1")
    sessions = load_sessions(file) if isinstance(file, (str, Path)) else list(file)
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(sessions):
        groups.setdefault(task_key(s["id"]), []).append(i)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    target = held_out_frac * len(sessions)
    held: set[int] = set()
    for k in keys:
        n = len(groups[k])
        if abs(len(held) + n - target) < abs(len(held) - target):
            held.update(groups[k])
    dev = [s for i, s in enumerate(sessions) if i not in held]
    out = [s for i, s in enumerate(sessions) if i in held]
    return dev, out


def main(argv: list[str] | None = None) -> int:
    """``python -m ostinatod.sessions FILE [--held-out-frac F] [--seed S]``: print the split."""
    ap = argparse.ArgumentParser(prog="ostinato sessions", description="dev / held-out split by task")
    ap.add_argument("file")
    ap.add_argument("--held-out-frac", type=float, default=1 / 3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    dev, held = split_sessions(a.file, a.held_out_frac, a.seed)
    print(json.dumps({"dev": [s["id"] for s in dev], "held_out": [s["id"] for s in held]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
