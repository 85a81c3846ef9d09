"""``ostinato bench replay``: replay recorded agent sessions through the HTTP API and time each turn
(the session figures of docs/benchmarks/).

For assistant turn *i* of a session the request carries the recorded history up to that turn
(never the generated text of earlier turns) and the session's tools, through the official
``openai`` (Chat Completions) or ``anthropic`` (Messages) Python client, streaming. It asks for
exactly as many tokens as the recorded assistant message has: ``max_tokens`` = that count and the
extra body field ``ignore_eos: true`` (honoured by ostinatod and llama-server), so every engine
does the same work. The count comes from the server's tokenizer (``/v1/messages/count_tokens``,
else llama-server's ``/tokenize``), else characters / 4.

Per turn (client side): TTFT (request sent -> first streamed token, of text, reasoning or tool-call
arguments), TPOT ((last token - first token) / (completion tokens - 1)), total request time; from
the server's usage: prompt tokens, cached prompt tokens, completion tokens. Turns are classed by
what precedes them: "tool" (a tool result), "user" (a user message, incl. text-action
observations) or "first". A turn that fails is recorded with its error and the run exits 1.

JSON written by ``--json`` (also read by ``ostinato bench engines``)::

  {"format": "ostinato-replay/1", "base_url", "client", "model", "sessions_file", "started",
   "sessions": [{"id", "workload", "turns": [{"index", "message_index", "after", "max_tokens",
                 "target_tokens", "target_tokens_source", "ttft_s", "tpot_s", "total_s", "prompt_tokens",
                 "cached_tokens", "new_tokens", "completion_tokens", "finish_reason", "error"}],
                 "summary": {...}}],
   "interleave": bool,
  "summary": {"turns", "errors", "ttft_after_tool_median_s", "ttft_after_user_median_s",
               "ttft_median_s", "tpot_median_s", "total_s", "cached_tokens", "prompt_tokens",
               "cached_share_after_first", ...}}
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import MessageError
from ..sessions import SessionError, Turn, assistant_text, assistant_turns, load_sessions, workload_of
from ..settings import load_settings

REPLAY_FORMAT = "ostinato-replay/1"


class ReplayError(MessageError, RuntimeError):
    """The replay cannot run at all (bad arguments, no sessions selected)."""

    code, status = "replay_failed", 500


# --------------------------------------------------------------------------------------------
# message conversion


def _safe_id(s: Any) -> str:
    # Anthropic tool_use ids must match ^[a-zA-Z0-9_-]+$
    return re.sub(r"[^a-zA-Z0-9_-]", "_", str(s or "call")) or "call"


def to_openai(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recorded messages as Chat Completions messages (they are already OpenAI-shape; this drops
    fields the API does not know and keeps tool_calls/tool_call_id)."""
    out = []
    for m in messages:
        r = {"role": m["role"], "content": m.get("content") or ""}
        if m["role"] == "assistant" and m.get("tool_calls"):
            r["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": c["function"].get("arguments") or "{}"}}
                               for c in m["tool_calls"]]
        if m["role"] == "tool":
            r["tool_call_id"] = m.get("tool_call_id")
        out.append(r)
    return out


def _json_args(s: Any) -> dict[str, Any]:
    if isinstance(s, dict):
        return s
    try:
        v = json.loads(s or "{}")
    except ValueError:
        return {"_raw_arguments": s}  # recorded arguments that are not JSON stay visible
    return v if isinstance(v, dict) else {"_value": v}


def to_anthropic(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Recorded OpenAI-shape messages as (system, messages) for the Messages API.

    Leading system messages become ``system``; later ones become user text. Assistant tool calls
    become ``tool_use`` blocks (arguments parsed from JSON), tool messages ``tool_result`` blocks
    in a user turn; consecutive turns of one role are merged (the API alternates roles). A context
    without any user/tool message gets a one-word user message, since the API needs one.
    """
    system_parts: list[str] = []
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        system_parts.append(messages[i].get("content") or "")
        i += 1

    def push(role: str, blocks: list[dict[str, Any]]) -> None:
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": list(blocks)})

    for m in messages[i:]:
        role, text = m["role"], m.get("content") or ""
        if role in ("user", "system"):
            push("user", [{"type": "text", "text": text if role == "user" else f"[system]\n{text}"}])
        elif role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
            for c in m.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": _safe_id(c.get("id")), "name": c["function"]["name"],
                               "input": _json_args(c["function"].get("arguments"))})
            push("assistant", blocks or [{"type": "text", "text": "."}])
        elif role == "tool":
            push("user", [{"type": "tool_result", "tool_use_id": _safe_id(m.get("tool_call_id")),
                           "content": text}])
    if not out or out[0]["role"] != "user":
        out.insert(0, {"role": "user", "content": [{"type": "text", "text": "Hi"}]})
    return "\n\n".join(system_parts), out


def tools_openai(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Session tools as Chat Completions tools (already in that shape)."""
    return [{"type": "function", "function": t["function"]} for t in tools if t.get("function")]


def tools_anthropic(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Session tools as Messages API tools (name, description, input_schema)."""
    out = []
    for t in tools:
        fn = t.get("function") or {}
        if not fn.get("name"):
            continue
        out.append({"name": fn["name"], "description": fn.get("description") or "",
                    "input_schema": fn.get("parameters") or {"type": "object", "properties": {}}})
    return out


# --------------------------------------------------------------------------------------------
# token counts


class TokenCounter:
    """Counts the tokens of a recorded assistant message with the server's tokenizer.

    Tries, in order, and remembers what worked: ``POST /v1/messages/count_tokens`` (ostinatod:
    the count of a one-message conversation holding the text minus that of an empty one),
    ``POST /tokenize`` (llama-server), then ``len(text) / 4``. ``count`` returns (tokens >= 1,
    source name)."""

    def __init__(self, base_url: str, model: str, api_key: str, timeout: float = 60.0):
        self.base = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json", "x-api-key": api_key,
                        "Authorization": f"Bearer {api_key}", "anthropic-version": "2023-06-01"}
        self.timeout = timeout
        self.model = model
        self.method: Optional[str] = None
        self._empty: Optional[int] = None

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), headers=self.headers)
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def _count_tokens(self, text: str) -> int:
        return int(self._post("/v1/messages/count_tokens", {
            "model": self.model, "messages": [{"role": "user", "content": text}]})["input_tokens"])

    def _tokenize(self, text: str) -> int:
        return len(self._post("/tokenize", {"content": text, "add_special": False})["tokens"])

    def count(self, text: str) -> tuple[int, str]:
        if not text:
            return 1, "empty"
        methods = [self.method] if self.method else ["count_tokens", "tokenize"]
        for m in methods:
            try:
                if m == "count_tokens":
                    if self._empty is None:
                        self._empty = self._count_tokens("")
                    n = self._count_tokens(text) - self._empty
                elif m == "tokenize":
                    n = self._tokenize(text)
                else:
                    break
                self.method = m
                return max(1, n), m
            except Exception:  # noqa: BLE001 - try the next method; the fallback is documented
                continue
        self.method = "chars/4"
        return max(1, round(len(text) / 4)), "chars/4"


# --------------------------------------------------------------------------------------------
# one turn


@dataclass
class TurnResult:
    """Figures of one replayed turn (see module docstring for the JSON keys)."""

    index: int
    message_index: int
    after: str
    max_tokens: int
    target_tokens_source: str
    target_tokens: Optional[int] = None
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    total_s: Optional[float] = None
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    new_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None

    def finish(self, t0: float, t_first: Optional[float], t_last: Optional[float], n_stream: int) -> None:
        self.total_s = time.perf_counter() - t0
        if t_first is not None:
            self.ttft_s = t_first - t0
        n = self.completion_tokens if self.completion_tokens is not None else n_stream
        if t_first is not None and t_last is not None and n and n > 1:
            self.tpot_s = (t_last - t_first) / (n - 1)
        if self.prompt_tokens is not None:
            self.new_tokens = self.prompt_tokens - (self.cached_tokens or 0)


def _cached_from_timings(timings: Any, prompt_tokens: Optional[int]) -> Optional[int]:
    """Cached prompt tokens from a llama.cpp server's ``timings`` (``prompt_n``: the prompt tokens
    it prefilled), for servers whose usage has no ``prompt_tokens_details`` (ik_llama.cpp's); None
    when either is missing."""
    n = timings.get("prompt_n") if isinstance(timings, dict) else None
    if not isinstance(n, int) or n < 0 or prompt_tokens is None:
        return None
    return max(0, prompt_tokens - n)


def _openai_turn(client, model: str, session: dict, turn: Turn, res: TurnResult, on_first=None) -> None:
    kw: dict[str, Any] = {}
    tools = tools_openai(session.get("tools") or [])
    if tools:
        kw["tools"] = tools
    t0 = time.perf_counter()
    t_first = t_last = None
    n_stream = 0
    stream = client.chat.completions.create(
        model=model, messages=to_openai(turn.context), max_tokens=res.max_tokens, stream=True,
        stream_options={"include_usage": True}, temperature=0, extra_body={"ignore_eos": True}, **kw)
    try:
        for chunk in stream:
            now = time.perf_counter()
            for ch in chunk.choices or []:
                d = ch.delta
                got = bool(getattr(d, "content", None)) or bool(getattr(d, "tool_calls", None)) or \
                    bool(getattr(d, "reasoning_content", None) or (getattr(d, "model_extra", None) or {}).get("reasoning_content"))
                if got:
                    n_stream += 1
                    if t_first is None:
                        t_first = now
                        if on_first is not None:
                            on_first()
                    t_last = now
                if ch.finish_reason:
                    res.finish_reason = ch.finish_reason
            if chunk.usage is not None:
                u = chunk.usage
                res.prompt_tokens = u.prompt_tokens
                res.completion_tokens = u.completion_tokens
                det = getattr(u, "prompt_tokens_details", None)
                res.cached_tokens = getattr(det, "cached_tokens", None) if det is not None else None
                if res.cached_tokens is None:
                    res.cached_tokens = _cached_from_timings(getattr(chunk, "timings", None), u.prompt_tokens)
    finally:
        stream.close()
    res.finish(t0, t_first, t_last, n_stream)


def _anthropic_turn(client, model: str, session: dict, turn: Turn, res: TurnResult, on_first=None) -> None:
    system, messages = to_anthropic(turn.context)
    kw: dict[str, Any] = {}
    tools = tools_anthropic(session.get("tools") or [])
    if tools:
        kw["tools"] = tools
    if system:
        kw["system"] = system
    t0 = time.perf_counter()
    t_first = t_last = None
    n_stream = 0
    # temperature travels in the body: recent anthropic clients dropped the keyword
    stream = client.messages.create(model=model, messages=messages, max_tokens=res.max_tokens, stream=True,
                                    extra_body={"ignore_eos": True, "temperature": 0}, **kw)
    try:
        for ev in stream:
            now = time.perf_counter()
            if ev.type == "message_start":
                u = ev.message.usage
                res.prompt_tokens = (u.input_tokens or 0) + (getattr(u, "cache_read_input_tokens", None) or 0)
                res.cached_tokens = getattr(u, "cache_read_input_tokens", None)
            elif ev.type == "content_block_delta":
                d = ev.delta
                if (getattr(d, "text", None) or getattr(d, "partial_json", None) or getattr(d, "thinking", None)):
                    n_stream += 1
                    if t_first is None:
                        t_first = now
                        if on_first is not None:
                            on_first()
                    t_last = now
            elif ev.type == "message_delta":
                if ev.usage is not None and ev.usage.output_tokens is not None:
                    res.completion_tokens = ev.usage.output_tokens
                if ev.delta.stop_reason:
                    res.finish_reason = ev.delta.stop_reason
    finally:
        stream.close()
    res.finish(t0, t_first, t_last, n_stream)


# --------------------------------------------------------------------------------------------
# the run


def _med(xs: list[Optional[float]]) -> Optional[float]:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def summarize(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and totals over turn dicts (errors counted, not timed)."""
    ok = [t for t in turns if not t.get("error")]
    return {
        "turns": len(turns), "errors": len(turns) - len(ok),
        "ttft_after_tool_median_s": _med([t["ttft_s"] for t in ok if t["after"] == "tool"]),
        "ttft_after_user_median_s": _med([t["ttft_s"] for t in ok if t["after"] == "user"]),
        "ttft_first_median_s": _med([t["ttft_s"] for t in ok if t["after"] == "first"]),
        "ttft_median_s": _med([t["ttft_s"] for t in ok]),
        "tpot_median_s": _med([t["tpot_s"] for t in ok]),
        "total_s": sum(t["total_s"] or 0.0 for t in ok),
        "new_tokens_median": _med([t["new_tokens"] for t in ok]),
        "completion_tokens": sum(t["completion_tokens"] or 0 for t in ok),
        "cached_tokens": sum(t["cached_tokens"] or 0 for t in ok),
        "prompt_tokens": sum(t["prompt_tokens"] or 0 for t in ok),
        # share of the prompt tokens served from the cache in turns after a session's first one:
        # what interleaved agents keep of their prefix (1.0: nothing re-prefilled but the new turn)
        "cached_share_after_first": _share([t for t in ok if t["after"] != "first"]),
    }


def _share(turns: list[dict[str, Any]]) -> Optional[float]:
    prompt = sum(t["prompt_tokens"] or 0 for t in turns)
    return round(sum(t["cached_tokens"] or 0 for t in turns) / prompt, 4) if prompt else None


def select(sessions: list[dict[str, Any]], ids: Optional[list[str]], limit: Optional[int]) -> list[dict[str, Any]]:
    """Sessions named by ``ids`` (in that order; unknown ids raise ReplayError), else all, then
    the first ``limit``."""
    if ids:
        by_id = {s["id"]: s for s in sessions}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ReplayError(f"unknown session ids: {', '.join(missing)}")
        sessions = [by_id[i] for i in ids]
    if limit is not None:
        sessions = sessions[:limit]
    if not sessions:
        raise ReplayError("no sessions selected")
    return sessions


def run_replay(sessions: list[dict[str, Any]], base_url: str, client: str = "openai",
               model: str = "default", max_turns: Optional[int] = None, api_key: str = "ostinato",
               timeout: float = 600.0, log=None, sessions_file: str = "",
               cap_tokens: Optional[int] = None, interleave: bool = False,
               on_first_token=None) -> dict[str, Any]:
    """Replay ``sessions`` against ``base_url`` (no /v1) and return the result dict (module doc).

    ``client``: "openai" or "anthropic"; ``max_turns``: first M assistant turns per session;
    ``cap_tokens``: generate at most this many tokens per turn (quick runs; the recorded count is
    kept in ``target_tokens``); ``interleave``: the sessions take turns, round-robin (turn 1 of each
    session, then turn 2 of each, ...), as agents working side by side do -- the summary's
    ``cached_share_after_first`` then says how much of its prefix each session kept;
    ``on_first_token()`` runs once in each turn that streams a token, as soon as the first one has
    arrived (after its TTFT was taken: a harness may observe the server from then on without adding
    to the TTFT; what it does then may still slow the turn's first decode steps). Never raises
    for a failing turn: its error is recorded and the next turn runs.
    """
    if client not in ("openai", "anthropic"):
        raise ReplayError(f"unknown client {client!r} (openai or anthropic)")
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if client == "openai":
        import openai  # lazy: optional client SDK

        cl = openai.OpenAI(base_url=base + "/v1", api_key=api_key, timeout=timeout, max_retries=0)
        one = _openai_turn
    else:
        import anthropic  # lazy: optional client SDK

        cl = anthropic.Anthropic(base_url=base, api_key=api_key, timeout=timeout, max_retries=0)
        one = _anthropic_turn
    counter = TokenCounter(base, model, api_key)
    result: dict[str, Any] = {"format": REPLAY_FORMAT, "base_url": base, "client": client, "model": model,
                              "sessions_file": sessions_file, "max_turns": max_turns,
                              "cap_tokens": cap_tokens,
                              "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                              "sessions": []}
    recs = [{"id": s["id"], "workload": s.get("workload"), "turns": []} for s in sessions]
    plans = [assistant_turns(s)[: max_turns if max_turns is not None else None] for s in sessions]
    if interleave:  # round-robin over the sessions
        order = [(i, p[k]) for k in range(max((len(p) for p in plans), default=0))
                 for i, p in enumerate(plans) if k < len(p)]
    else:
        order = [(i, t) for i, p in enumerate(plans) for t in p]
    try:
        for i, t in order:
            s, rec = sessions[i], recs[i]
            scl = cl.with_options(default_headers={"x-ostinato-workload": workload_of(s)})
            n, src = counter.count(assistant_text(t.target))
            res = TurnResult(t.index, t.message_index, t.after, min(n, cap_tokens) if cap_tokens else n, src,
                             target_tokens=n)
            try:
                one(scl, model, s, t, res, on_first=on_first_token)
                if res.ttft_s is None:
                    res.error = "no token streamed"
            except Exception as e:  # noqa: BLE001 - recorded per turn, never dropped
                res.error = f"{type(e).__name__}: {str(e)[:500]}"
            rec["turns"].append(dict(res.__dict__))
            if log:
                log(_turn_line(s["id"], res))
    finally:
        cl.close()
    for rec in recs:
        rec["summary"] = summarize(rec["turns"])
    result["sessions"] = recs
    result["interleave"] = interleave
    result["token_count_method"] = counter.method
    result["summary"] = summarize([t for s in result["sessions"] for t in s["turns"]])
    return result


def _fmt(x: Optional[float], scale: float = 1.0, nd: int = 3) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}"


def _turn_line(sid: str, r: TurnResult) -> str:
    if r.error:
        return f"  {sid} turn {r.index} ({r.after}): ERROR {r.error}"
    return (f"  {sid} turn {r.index} ({r.after}): new {r.new_tokens} cached {r.cached_tokens} "
            f"out {r.completion_tokens}/{r.max_tokens} ttft {_fmt(r.ttft_s)} s tpot {_fmt(r.tpot_s, 1e3, 1)} ms "
            f"total {_fmt(r.total_s)} s")


def table(result: dict[str, Any]) -> str:
    """Plain-text table: one row per session plus the overall medians."""
    head = ("session", "turns", "err", "TTFT tool s", "TTFT user s", "TPOT ms", "new tok", "cached tok",
            "cached %", "total s")
    rows = []
    for s in result["sessions"]:
        m = s["summary"]
        rows.append((s["id"], str(m["turns"]), str(m["errors"]), _fmt(m["ttft_after_tool_median_s"]),
                     _fmt(m["ttft_after_user_median_s"]), _fmt(m["tpot_median_s"], 1e3, 1),
                     _fmt(m["new_tokens_median"], 1, 0), str(m.get("cached_tokens", 0)),
                     _fmt(m.get("cached_share_after_first"), 100, 1), _fmt(m["total_s"], 1, 2)))
    m = result["summary"]
    rows.append(("ALL (medians over turns)" + (", interleaved" if result.get("interleave") else ""),
                 str(m["turns"]), str(m["errors"]), _fmt(m["ttft_after_tool_median_s"]),
                 _fmt(m["ttft_after_user_median_s"]), _fmt(m["tpot_median_s"], 1e3, 1),
                 _fmt(m["new_tokens_median"], 1, 0), str(m.get("cached_tokens", 0)),
                 _fmt(m.get("cached_share_after_first"), 100, 1), _fmt(m["total_s"], 1, 2)))
    w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([line(head), line(tuple("-" * x for x in w))] + [line(r) for r in rows])


def _default_model(base: str, api_key: str) -> str:
    try:
        req = urllib.request.Request(base.rstrip("/").removesuffix("/v1") + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}", "x-api-key": api_key})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]
    except Exception:  # noqa: BLE001 - any name works for a single-model server
        return "default"


def main(argv: list[str] | None = None) -> int:
    """``ostinato bench replay``; exit 0 when every turn was answered, 1 when some failed,
    2 for bad arguments or an unreadable sessions file."""
    ap = argparse.ArgumentParser(prog="ostinato bench replay",
                                 description="Replay recorded agent sessions through the HTTP API and time each turn.")
    ap.add_argument("--sessions", required=True, help="sessions JSONL (../shared/sessions/ format)")
    ap.add_argument("--client", choices=("openai", "anthropic"), default="openai")
    ap.add_argument("--base-url", default=None, help="server URL (default: http://127.0.0.1:<settings port>)")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None, help="API key (default: settings api_key or 'ostinato')")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N sessions")
    ap.add_argument("--max-turns", type=int, default=None, help="replay only the first M assistant turns per session")
    ap.add_argument("--ids", nargs="+", default=None, help="session ids to replay (in this order)")
    ap.add_argument("--cap-tokens", type=int, default=None,
                    help="generate at most N tokens per turn (quick runs; default: the recorded length)")
    ap.add_argument("--interleave", action="store_true",
                    help="sessions take turns round-robin, like agents side by side (reports the share "
                    "of cached prompt tokens after each session's first turn)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quiet", action="store_true", help="no per-turn lines")
    a = ap.parse_args(argv)
    try:
        st = load_settings()
        base = a.base_url or f"http://127.0.0.1:{st.port}"
        key = a.api_key or st.api_key or "ostinato"
    except Exception:  # noqa: BLE001 - a broken settings file must not block a replay with flags
        base, key = a.base_url or "http://127.0.0.1:8385", a.api_key or "ostinato"
    try:
        sessions = select(load_sessions(a.sessions), a.ids, a.limit)
    except (SessionError, ReplayError) as e:
        print(f"ostinato bench replay: {e}", file=sys.stderr)
        return 2
    model = a.model or _default_model(base, key)
    say = None if a.quiet else (lambda s: print(s, flush=True))
    print(f"replaying {len(sessions)} session(s) from {a.sessions} against {base} "
          f"({a.client} client, model {model})", flush=True)
    result = run_replay(sessions, base, a.client, model, a.max_turns, key, a.timeout, say, str(a.sessions),
                        a.cap_tokens, a.interleave)
    print()
    print(table(result))
    print(f"token counts from: {result.get('token_count_method')}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.json}")
    errors = result["summary"]["errors"]
    if errors:
        print(f"{errors} turn(s) failed", file=sys.stderr)
        return 1
    return 0
