"""llama-server's own answer shapes (its tools/server/server-task.cpp and server-common.cpp):
``timings``, the native ``/completion`` answer and its stream chunks, ``prompt_progress``.

Pure: the engine's ``done`` data and events in, JSON out.
"""

from __future__ import annotations

from typing import Any, Optional

from ...engine.events import DeltaEvent, ErrorEvent
from . import Frame


def timings(done: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``timings`` of a generation from the engine's ``done`` data (its ``usage``
    and ``timings`` in seconds): ``cache_n`` (prompt tokens reused), ``prompt_n`` (prefilled),
    ``prompt_ms``, ``prompt_per_token_ms``, ``prompt_per_second``, ``predicted_n``,
    ``predicted_ms``, ``predicted_per_token_ms``, ``predicted_per_second`` (ms from the first
    output token to the last; 0 per second where no time passed)."""
    u, t = done.get("usage") or {}, done.get("timings") or {}
    cache_n = int(u.get("cached_tokens") or 0)
    prompt_n = int(u.get("prefilled_tokens") if u.get("prefilled_tokens") is not None
                   else (u.get("prompt_tokens") or 0) - cache_n)
    predicted_n = int(u.get("completion_tokens") or 0)
    prompt_ms = float(t.get("prefill_s") or 0.0) * 1000
    predicted_ms = float(t.get("decode_s") or 0.0) * 1000
    # llama-server counts the generation steps after the first token (sampled with the prefill)
    steps = max(0, predicted_n - 1)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0}


def prompt_progress(data: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``prompt_progress`` of an engine ``progress`` event."""
    return {k: data.get(k) for k in ("total", "cache", "processed", "time_ms")}


def progress_timings(data: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``timings`` beside a ``prompt_progress`` (with ``timings_per_token``): the
    prompt tokens prefilled so far and their time, nothing predicted yet. The first event, before
    any prompt token is computed, has ``prompt_n`` 0 and ``prompt_ms`` 0."""
    cache = int(data.get("cache") or 0)
    prompt_n = max(0, int(data.get("processed") or 0) - cache)
    return timings({"usage": {"cached_tokens": cache, "prefilled_tokens": prompt_n, "completion_tokens": 0},
                    "timings": {"prefill_s": float(data.get("time_ms") or 0.0) / 1000 if prompt_n else 0.0}})


def stop_type(done: dict[str, Any]) -> str:
    """llama-server's ``stop_type``: "word" (a client's stop string), "eos" (the model ended),
    "limit" (n_predict or the context reached)."""
    if done.get("finish_reason") == "length":
        return "limit"
    return "word" if done.get("stop_sequence") else "eos"


def probabilities(entries: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities`` of the engine's logprob entries (the same
    fields: ``id``, ``token``, ``bytes``, ``logprob``, ``top_logprobs``)."""
    return [{"id": e.get("id"), "token": e["token"], "bytes": e["bytes"], "logprob": e["logprob"],
             "top_logprobs": [{"id": a.get("id"), "token": a["token"], "bytes": a["bytes"],
                               "logprob": a["logprob"]} for a in e.get("top_logprobs") or []]}
            for e in entries or []]


def completion(done: dict[str, Any], model: Optional[str], prompt: str, settings: dict[str, Any],
               n_probs: int = 0, fields: Optional[list[str]] = None) -> dict[str, Any]:
    """The answer of ``POST /completion`` (llama-server's native API): ``content``, ``tokens``
    (the output token ids where the engine gave them), ``id_slot``, ``stop`` (true),
    ``tokens_predicted``, ``tokens_evaluated``, ``generation_settings`` (``settings``),
    ``prompt``, ``has_new_line``, ``truncated`` (false: a prompt is never cut), ``stop_type``,
    ``stopping_word``, ``tokens_cached``, ``timings`` and, with ``n_probs``,
    ``completion_probabilities``. ``fields`` (``response_fields``): only those, ``a/b`` naming a
    nested value."""
    u = done.get("usage") or {}
    content = (done.get("message") or {}).get("content") or done.get("text") or ""
    res: dict[str, Any] = {
        "index": 0, "content": content, "tokens": list(done.get("tokens") or []),
        "id_slot": done.get("slot", -1), "stop": True, "model": model,
        "tokens_predicted": int(u.get("completion_tokens") or 0),
        "tokens_evaluated": int(u.get("prompt_tokens") or 0), "generation_settings": settings,
        "prompt": prompt, "has_new_line": "\n" in content, "truncated": False,
        "stop_type": stop_type(done), "stopping_word": done.get("stop_sequence") or "",
        "tokens_cached": int(u.get("prompt_tokens") or 0) + int(u.get("completion_tokens") or 0),
        "timings": timings(done)}
    if n_probs:
        res["completion_probabilities"] = probabilities(done.get("logprobs"))
    return nested_values(fields, res) if fields else res


def nested_values(fields: list[str], res: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``response_fields``: ``{field: value}`` for each one that is there, a
    ``/`` in a field naming a nested value (the key stays the whole path)."""
    out: dict[str, Any] = {}
    for f in fields:
        v: Any = res
        for part in str(f).split("/"):
            if not isinstance(v, dict) or part not in v:
                break
            v = v[part]
        else:
            out[f] = v
    return out


class CompletionStream:
    """The SSE chunks of a streamed ``/completion``: one ``{"content", "tokens", "stop": false,
    "id_slot", "tokens_predicted", "tokens_evaluated"}`` per delta (with its
    ``completion_probabilities``, ``timings`` when ``timings_per_token``, ``prompt_progress``
    chunks when ``return_progress``), then the final answer with ``stop: true``."""

    def __init__(self, model: Optional[str], prompt: str, settings: dict[str, Any], n_probs: int = 0,
                 timings_per_token: bool = False, return_progress: bool = False):
        self.model, self.prompt, self.settings, self.n_probs = model, prompt, settings, n_probs
        self.timings_per_token, self.return_progress = timings_per_token, return_progress
        self.n = 0

    def feed(self, ev: Any, u: dict[str, int], live_timings: Optional[dict[str, Any]] = None) -> list[Frame]:
        """The frames of one engine event."""
        if ev.type == "progress":
            if not self.return_progress:
                return []
            c = {"index": 0, "content": "", "tokens": [], "stop": False,
                 "prompt_progress": prompt_progress(ev.data)}
            if self.timings_per_token:
                c["timings"] = progress_timings(ev.data)
            return [Frame(c)]
        if isinstance(ev, DeltaEvent):
            text = ev.content or ""
            lp = ev.logprobs or []
            if not text and not lp:
                return []
            self.n += 1
            c: dict[str, Any] = {"index": 0, "content": text, "tokens": [],
                                 "stop": False, "id_slot": -1,
                                 "tokens_predicted": u.get("completion_tokens", 0),
                                 "tokens_evaluated": u.get("prompt_tokens", 0)}
            if self.n_probs and lp:
                c["completion_probabilities"] = probabilities(lp)
            if self.timings_per_token and live_timings is not None:
                c["timings"] = live_timings
            return [Frame(c)]
        if ev.type == "done":
            final = completion(ev.data, self.model, self.prompt, self.settings)
            final["content"] = ""  # streamed already
            return [Frame(final)]
        if isinstance(ev, ErrorEvent):
            return [Frame({"error": {"code": ev.status, "message": ev.message or "",
                                     "type": ev.code or "engine_error"}})]
        return []
