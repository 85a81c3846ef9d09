"""Routing traces: per (layer, expert) route counts of real requests, per model and workload.

The planner ranks experts by these counts (paper arXiv 2611.11533, Section 3.1 step 1 and Rule 1).
File: ``<data>/traces/<fingerprint>/<workload>.json`` in the shared format ``ostinato-trace/1``::

    {"format": "ostinato-trace/1", "model": {"fingerprint", "name", "arch", "n_layer", "n_expert",
     "n_expert_used"}, "workload": "coding",
     "counts_prefill": [[int]*n_expert]*n_layer, "counts_decode": [[int]*n_expert]*n_layer,
     "requests": [{"prompt_tokens", "new_tokens", "generated_tokens", "n_tools"}],
     "max_request_tokens": int}

Counts accumulate across requests and daemon runs. Writers merge their *delta* into the file under
an exclusive ``flock`` and replace it atomically (temp file + ``os.replace``), so several processes
(daemon, benchmark) can record into the same file without losing counts and a crash never leaves a
half-written file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from ..files import write_json_atomic
from ..paths import trace_file
from ..errors import MessageError

log = logging.getLogger(__name__)

TRACE_FORMAT = "ostinato-trace/1"
MAX_REQUEST_RECORDS = 20000  # the request list is for the capacity test; keep the file bounded


class TraceError(MessageError, ValueError):
    """A trace file or request-stats dict that cannot be used (wrong format, shape or model)."""

    code, status = "trace_invalid", 400


def trace_path(fingerprint: str, workload: str, data_dir: Optional[Path] = None) -> Path:
    """Path of the trace file of one model fingerprint and workload (under ``<data>/traces``)."""
    return trace_file(fingerprint, _safe_name(workload), data_dir)


# A workload name becomes a file name (traces, residency sets): letters, digits, ".", "_", "-",
# starting with a letter or digit, at most 64 characters ("..", "/", "\\", NUL, ".x" are refused).
WORKLOAD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def valid_workload(name: object) -> bool:
    """True when ``name`` may be used as a workload name (see ``WORKLOAD_NAME``)."""
    return isinstance(name, str) and WORKLOAD_NAME.fullmatch(name) is not None and ".." not in name


def _safe_name(workload: str) -> str:
    if not valid_workload(workload):
        raise TraceError(f"invalid workload name {workload!r}")
    return workload


@dataclass
class Trace:
    """Route counts of one model and workload.

    ``counts_prefill``/``counts_decode``: int64 arrays of shape (n_layer, n_expert); a route is one
    token-expert selection. Layers without experts (dense layers) keep zero rows.
    """

    model: dict[str, Any]
    workload: str
    counts_prefill: np.ndarray
    counts_decode: np.ndarray
    requests: list[dict[str, int]] = field(default_factory=list)
    max_request_tokens: int = 0

    @classmethod
    def empty(cls, model: dict[str, Any], workload: str) -> "Trace":
        """A trace with zero counts for ``model`` (needs ``n_layer`` and ``n_expert``)."""
        shape = (int(model["n_layer"]), int(model["n_expert"]))
        return cls(dict(model), workload, np.zeros(shape, np.int64), np.zeros(shape, np.int64))

    @property
    def counts(self) -> np.ndarray:
        """Prefill + decode counts, shape (n_layer, n_expert): what the planner ranks by."""
        return self.counts_prefill + self.counts_decode

    @property
    def total_routes(self) -> int:
        return int(self.counts.sum())

    def add_counts(self, prefill: np.ndarray | None, decode: np.ndarray | None) -> None:
        """Add count arrays of shape (n_layer, n_expert). Raises TraceError on a shape mismatch."""
        for name, arr in (("prefill", prefill), ("decode", decode)):
            if arr is None:
                continue
            arr = np.asarray(arr, dtype=np.int64)
            if arr.shape != self.counts_prefill.shape:
                raise TraceError(f"{name} counts have shape {arr.shape}, the model has "
                                 f"{self.counts_prefill.shape} (n_layer, n_expert)")
            if (arr < 0).any():
                raise TraceError(f"{name} counts contain negative values")
            target = self.counts_prefill if name == "prefill" else self.counts_decode
            target += arr

    def add_request(self, prompt_tokens: int, new_tokens: int, generated_tokens: int,
                    n_tools: int) -> None:
        """Record one request's sizes (tokens); ``max_request_tokens`` = max prompt+generated."""
        rec = {"prompt_tokens": int(prompt_tokens), "new_tokens": int(new_tokens),
               "generated_tokens": int(generated_tokens), "n_tools": int(n_tools)}
        self.requests.append(rec)
        if len(self.requests) > MAX_REQUEST_RECORDS:
            del self.requests[: len(self.requests) - MAX_REQUEST_RECORDS]
        self.max_request_tokens = max(self.max_request_tokens,
                                      rec["prompt_tokens"] + rec["generated_tokens"])

    def merge(self, other: "Trace") -> None:
        """Add another trace of the same model (fingerprint checked) into this one."""
        fp_a, fp_b = self.model.get("fingerprint"), other.model.get("fingerprint")
        if fp_a and fp_b and fp_a != fp_b:
            raise TraceError(f"trace of model {fp_b[:12]} cannot be merged into a trace of {fp_a[:12]}")
        self.add_counts(other.counts_prefill, other.counts_decode)
        for r in other.requests:
            self.add_request(r.get("prompt_tokens", 0), r.get("new_tokens", 0),
                             r.get("generated_tokens", 0), r.get("n_tools", 0))
        self.max_request_tokens = max(self.max_request_tokens, int(other.max_request_tokens))

    def to_json(self) -> dict[str, Any]:
        return {"format": TRACE_FORMAT, "model": self.model, "workload": self.workload,
                "counts_prefill": self.counts_prefill.tolist(),
                "counts_decode": self.counts_decode.tolist(),
                "requests": self.requests, "max_request_tokens": int(self.max_request_tokens)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Trace":
        """Parse a trace dict. Raises TraceError on a wrong format or inconsistent shapes."""
        if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
            raise TraceError(f"not an {TRACE_FORMAT} trace (format={data.get('format') if isinstance(data, dict) else None!r})")
        try:
            model = dict(data["model"])
            t = cls.empty(model, str(data.get("workload", "")))
            t.add_counts(np.asarray(data["counts_prefill"], np.int64),
                         np.asarray(data["counts_decode"], np.int64))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"malformed trace: {e}") from e
        t.requests = [dict(r) for r in data.get("requests", [])]
        t.max_request_tokens = int(data.get("max_request_tokens", 0))
        return t

    @classmethod
    def load(cls, path: Path) -> "Trace":
        """Read a trace file. Raises TraceError (bad content) or OSError (unreadable)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}: not JSON ({e})") from e
        try:
            return cls.from_json(data)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from e

    def save(self, path: Path) -> None:
        """Write atomically (temp file in the same directory, then ``os.replace``)."""
        write_json_atomic(Path(path), self.to_json())


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    # 0600 like the traces themselves: the lock file says which workloads are in use
    fd = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as lf:
        os.fchmod(fd, 0o600)  # one made before (0644) is tightened too
        fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def merge_into_file(path: Path, delta: Trace) -> Trace:
    """Add ``delta`` to the trace file at ``path`` (created if missing) under a file lock.

    Returns the merged trace. A corrupt existing file is moved aside to ``*.corrupt`` (logged) rather
    than blocking recording. Raises TraceError if the file belongs to another model.
    """
    path = Path(path)
    with _locked(path):
        merged: Trace
        if path.exists():
            try:
                merged = Trace.load(path)
            except TraceError as e:
                log.warning("trace file %s unreadable (%s); moved aside, starting afresh", path, e)
                os.replace(path, path.with_suffix(".corrupt"))
                merged = Trace.empty(delta.model, delta.workload)
        else:
            merged = Trace.empty(delta.model, delta.workload)
        merged.merge(delta)
        merged.save(path)
        return merged


def counts_from_stats(stats: dict[str, Any], n_layer: int, n_expert: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Extract (prefill, decode) count arrays of shape (n_layer, n_expert) from engine stats.

    Accepts what ``ExpertRuntime.take_request_stats()`` returns: keys ``counts_prefill`` and
    ``counts_decode`` (or ``counts: {"prefill", "decode"}``), each a nested list [n_layer][n_expert],
    a flat list of n_layer*n_expert, a sparse ``{"layer": {"expert": n}}`` dict or a list of
    ``[layer, expert, n]`` triples. Missing keys give zeros. Raises TraceError on bad shapes.
    """
    src = stats.get("counts") if isinstance(stats.get("counts"), dict) else stats
    out = []
    for key in ("prefill", "decode"):
        raw = src.get(f"counts_{key}", src.get(key))
        out.append(_to_array(raw, n_layer, n_expert, key))
    return out[0], out[1]


def _to_array(raw: Any, n_layer: int, n_expert: int, what: str) -> np.ndarray:
    a = np.zeros((n_layer, n_expert), np.int64)
    if raw is None:
        return a
    try:
        if isinstance(raw, dict):
            for layer, row in raw.items():
                if isinstance(row, dict):
                    for e, n in row.items():
                        a[int(layer), int(e)] += int(n)
                else:
                    a[int(layer)] += np.asarray(row, np.int64)
            return a
        arr = np.asarray(raw, np.int64)
        if arr.shape == (n_layer, n_expert):
            return arr.copy()
        if arr.ndim == 1 and arr.size == n_layer * n_expert:
            return arr.reshape(n_layer, n_expert).copy()
        if arr.ndim == 2 and arr.shape[1] == 3:
            np.add.at(a, (arr[:, 0], arr[:, 1]), arr[:, 2])
            return a
        if arr.size == 0:
            return a
    except (ValueError, IndexError, TypeError) as e:
        raise TraceError(f"{what} counts do not fit ({n_layer}, {n_expert}): {e}") from e
    raise TraceError(f"{what} counts have shape {np.shape(raw)}, expected ({n_layer}, {n_expert})")


class TraceRecorder:
    """Accumulates per-request expert counts into trace files (one per workload) for one model.

    Used by the engine worker after each request::

        rec = TraceRecorder(model_block(path))            # once per loaded model
        rec.record(workload, rt.take_request_stats(), prompt_tokens=..., new_tokens=...,
                   generated_tokens=..., n_tools=len(req.tools or []))
        rec.close()                                       # at unload: flushes what is pending

    Cheap per request: counts are added to in-memory arrays; the file is merged at most every
    ``flush_interval_s`` seconds (0 = after every request) and on :meth:`flush`/:meth:`close`.
    Thread-safe. Errors while writing are logged, never raised into the request path.
    """

    def __init__(self, model: dict[str, Any], data_dir: Optional[Path] = None,
                 flush_interval_s: float = 10.0):
        for k in ("fingerprint", "n_layer", "n_expert"):
            if k not in model:
                raise TraceError(f"model block lacks {k!r}")
        self.model = dict(model)
        self.data_dir = data_dir
        self.flush_interval_s = flush_interval_s
        self._pending: dict[str, Trace] = {}
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()  # first flush after one interval

    def path(self, workload: str) -> Path:
        return trace_path(self.model["fingerprint"], workload, self.data_dir)

    def record(self, workload: str, stats: dict[str, Any] | None, *, prompt_tokens: int = 0,
               new_tokens: int = 0, generated_tokens: int = 0, n_tools: int = 0) -> None:
        """Add one request. ``stats`` as accepted by :func:`counts_from_stats` (None: sizes only)."""
        try:
            pre, dec = counts_from_stats(stats or {}, int(self.model["n_layer"]),
                                         int(self.model["n_expert"]))
        except TraceError as e:
            log.warning("request stats not recorded in the trace: %s", e)
            return
        with self._lock:
            t = self._pending.get(workload)
            if t is None:
                t = self._pending[workload] = Trace.empty(self.model, workload)
            t.add_counts(pre, dec)
            t.add_request(prompt_tokens, new_tokens, generated_tokens, n_tools)
            due = time.monotonic() - self._last_flush >= self.flush_interval_s
        if due:
            self.flush()

    def record_done(self, workload: Optional[str], done: dict[str, Any], n_tools: int = 0) -> None:
        """Record a finished request from its ``done`` event data (``usage`` + ``experts``, as the
        engine worker emits them). Requests without expert stats (stock runs) are skipped."""
        ex = done.get("experts")
        if not isinstance(ex, dict) or ex.get("error") or ex.get("active") is False:
            return
        u = done.get("usage") or {}
        self.record(workload or "coding", ex, prompt_tokens=u.get("prompt_tokens", 0),
                    new_tokens=u.get("prefilled_tokens", 0),
                    generated_tokens=u.get("completion_tokens", 0), n_tools=n_tools)

    def flush(self) -> None:
        """Merge pending counts into the files now (errors logged, pending kept for a retry)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._last_flush = time.monotonic()
        for workload, delta in pending.items():
            if not valid_workload(workload):  # never a file name: dropped, never raised
                log.warning("trace counts of invalid workload name %r dropped", workload)
                continue
            try:
                merge_into_file(self.path(workload), delta)
            except Exception as e:  # noqa: BLE001 - flushing must never raise into the worker
                log.warning("could not write trace of workload %r: %r", workload, e)
                if not isinstance(e, (OSError, TraceError)):
                    continue  # not a transient failure: do not retry forever
                with self._lock:  # keep the counts for the next flush
                    cur = self._pending.get(workload)
                    if cur is None:
                        self._pending[workload] = delta
                    else:
                        cur.merge(delta)

    def close(self) -> None:
        self.flush()


def load_traces(paths: Iterable[Path], fingerprint: Optional[str] = None) -> Trace:
    """Load and sum several trace files; all must belong to one model (and to ``fingerprint``).

    Raises TraceError on a model mismatch or bad file, FileNotFoundError when one is missing.
    """
    total: Optional[Trace] = None
    for p in paths:
        t = Trace.load(Path(p))
        if fingerprint and t.model.get("fingerprint") != fingerprint:
            raise TraceError(f"{p}: trace is for model {str(t.model.get('fingerprint'))[:12]}, "
                             f"not {fingerprint[:12]}")
        if total is None:
            total = t
        else:
            total.merge(t)
    if total is None:
        raise TraceError("no trace files given")
    return total
