"""HTTP and control-socket fuzzing with hypothesis: strategies for request bodies and headers of
every route, a raw HTTP sender that never raises, and a runner that counts answers.

Used by ``tests/daemon/test_fuzz.py`` (a few hundred requests, fast) and by ``ostinato bench
reliability`` (``ostinatod/bench/bench_reliability.py``, thousands). ``hypothesis`` is a test
extra (``pip install 'ostinato[test]'``); it is imported only here.

A *finding* is any answer with status >= 500, a hang (no answer within the timeout) or a daemon
or worker process that died.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# --- what to send ------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "hi"}]
# route -> a valid body (fuzzing mutates it); GET routes have none
HTTP_ROUTES: dict[tuple[str, str], Optional[dict[str, Any]]] = {
    ("GET", "/"): None, ("GET", "/health"): None, ("GET", "/metrics"): None, ("GET", "/v1/models"): None,
    ("POST", "/v1/chat/completions"): {"messages": MSG, "max_tokens": 2},
    ("POST", "/v1/completions"): {"prompt": "hi", "max_tokens": 2},
    ("POST", "/v1/responses"): {"input": "hi", "max_output_tokens": 2},
    ("POST", "/v1/messages"): {"model": "claude-x", "max_tokens": 2, "messages": MSG},
    ("POST", "/v1/messages/count_tokens"): {"model": "claude-x", "messages": MSG},
}
# control routes safe to fuzz while serving (load/unload/pause/resume would drop the model)
CONTROL_ROUTES: dict[tuple[str, str], Optional[dict[str, Any]]] = {
    ("GET", "/status"): None, ("GET", "/models"): None, ("GET", "/residency"): None,
    ("GET", "/profile"): None, ("GET", "/metrics"): None, ("GET", "/requests"): None,
    ("GET", "/events?count=1"): None, ("HEAD", "/events?count=1"): None,
    ("POST", "/residency/plan"): {"workload": "coding"},
    ("POST", "/residency/switch"): {"workload": "coding"},
    ("POST", "/models/load"): {"path": "/nonexistent.gguf"},
}
FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "stream", "tools",
          "tool_choice", "response_format", "stop", "logit_bias", "seed", "system", "input", "text",
          "instructions", "prompt", "thinking", "stop_sequences", "max_output_tokens", "reasoning",
          "chat_template_kwargs", "n", "stream_options", "ignore_eos", "workload", "path", "content",
          "role", "tool_calls", "name", "function", "type", "json_schema", "schema", "parameters"]

_text = st.text(st.characters(codec="utf-8"), max_size=20) | st.sampled_from(
    ["", "..", "a/b", ".x", "\\", "x\x00y", "claude", "ostinato-demo-random-weights@..", "user",
     "assistant", "tool", "json_schema", "function", "auto", "required", "none", "NaN"])
_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False,
                                                                          allow_infinity=False) | _text
json_values = st.recursive(_scalar, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.sampled_from(FIELDS) | _text, kids, max_size=4), max_leaves=12)


@st.composite
def bodies(draw: Callable, base: Optional[dict[str, Any]]) -> bytes:
    """A request body: a mutated valid body, any JSON value, a deep nesting, JSON with NaN or a lone
    surrogate, or raw bytes."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "deep", "special", "bytes"]))
    if kind == "mutate" and base is not None:
        body = json.loads(json.dumps(base))
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(FIELDS + list(base)))
            if draw(st.booleans()) and key in body:
                del body[key]
            else:
                body[key] = draw(json_values)
        if draw(st.booleans()):  # keep generations short
            body.setdefault("max_tokens", 2)
        return json.dumps(body).encode()
    if kind == "deep":
        n = draw(st.integers(10, 3000))
        return draw(st.sampled_from([b"[" * n + b"]" * n, b'{"messages": ' + b"[" * n + b"]" * n + b"}",
                                     b"[" * n]))
    if kind == "special":
        return draw(st.sampled_from([
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            b'{"temperature": NaN, "messages": []}', b'{"top_p": Infinity, "prompt": "x"}',
            b'{"model": "x@\\udfff", "stream": true, "messages": [{"role": "user", "content": "x"}]}',
            b'{"input": "x", "text": {"format": "json"}}', b"\xff\xfe\x00", b"", b"null", b"[]",
            b'{"messages": [{"role": "assistant", "tool_calls": ["x"]}]}']))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    return json.dumps(draw(json_values)).encode()


_HEADER_NAMES = ["Content-Type", "Content-Encoding", "x-ostinato-workload", "x-ostinato-logit-bias",
                 "Authorization", "x-api-key", "Origin", "Host", "User-Agent", "Accept-Encoding",
                 "anthropic-version", "Transfer-Encoding-X"]


@st.composite
def headers(draw: Callable, port: int) -> list[tuple[str, bytes]]:
    """Headers: mostly a JSON content type, plus random values of the headers the daemon reads."""
    out: list[tuple[str, bytes]] = []
    ctype = draw(st.sampled_from([b"application/json"] * 6 + [b"text/plain", b"application/x-www-form-urlencoded",
                                                                b"application/json; charset=latin-1", b""]))
    if ctype:
        out.append(("Content-Type", ctype))
    for name in draw(st.lists(st.sampled_from(_HEADER_NAMES[1:]), max_size=3, unique=True)):
        if name == "Host":
            value = draw(st.sampled_from([f"localhost:{port}", "evil.example", "127.0.0.1", "[::1]:1"])).encode()
        else:
            value = draw(st.binary(min_size=0, max_size=24).filter(lambda b: b"\r" not in b and b"\n" not in b
                                                                   and b"\x00" not in b)
                         | st.sampled_from([b"gzip", b"{}", b"[1]", b"..", b"Bearer x", b"http://x.example"]))
        out.append((name, value))
    return out


# --- how to send it ----------------------------------------------------------------------------
@dataclass
class Answer:
    status: int  # 0: no answer (connection closed, refused); -1: timed out (a hang)
    seconds: float
    head: bytes = b""


def send(target: str, method: str, path: str, body: bytes, hdrs: list[tuple[str, bytes]],
         timeout: float = 60.0) -> Answer:
    """One request on a fresh connection to ``target`` ("127.0.0.1:PORT" or a Unix socket path);
    never raises. The answer's body is read (streams to their end)."""
    t0 = time.monotonic()
    try:
        if target.startswith("/"):
            conn: http.client.HTTPConnection = _UnixConnection(target, timeout)
        else:
            host, port = target.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        conn.putrequest(method, path, skip_host=any(k.lower() == "host" for k, _ in hdrs),
                        skip_accept_encoding=True)
        for k, v in hdrs:
            conn.putheader(k, v)
        if method != "GET" or body:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body if body else None)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return Answer(r.status, time.monotonic() - t0, data[:300])
    except socket.timeout:
        return Answer(-1, time.monotonic() - t0)
    except (OSError, http.client.HTTPException) as e:
        return Answer(0, time.monotonic() - t0, repr(e).encode()[:300])


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


@dataclass
class Tally:
    """What a fuzz run saw."""

    requests: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    server_errors: list[dict[str, Any]] = field(default_factory=list)  # status >= 500 (first 20)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)  # closed without an answer (first 20)
    max_seconds: float = 0.0

    def add(self, route: tuple[str, str], body: bytes, hdrs: list, a: Answer) -> None:
        self.requests += 1
        self.by_status[a.status] = self.by_status.get(a.status, 0) + 1
        self.max_seconds = max(self.max_seconds, a.seconds)
        rec = {"route": " ".join(route), "status": a.status, "body": body[:200].decode("utf-8", "replace"),
               "headers": [(k, v.decode("latin-1")) for k, v in hdrs], "answer": a.head.decode("utf-8", "replace")}
        if a.status >= 500 and len(self.server_errors) < 20:
            self.server_errors.append(rec)
        if a.status == -1 and len(self.hangs) < 20:
            self.hangs.append(rec)
        if a.status == 0 and len(self.dropped) < 20:
            self.dropped.append(rec)

    @property
    def n_5xx(self) -> int:
        return sum(n for s, n in self.by_status.items() if s >= 500)

    @property
    def n_hangs(self) -> int:
        return self.by_status.get(-1, 0)


def fuzz(target: str, routes: dict[tuple[str, str], Optional[dict[str, Any]]], n: int, port: int = 0,
         tally: Optional[Tally] = None, timeout: float = 60.0, seed: Optional[int] = None) -> Tally:
    """Send ``n`` hypothesis-generated requests (routes, bodies, headers) to ``target``; count the
    answers in ``tally`` (findings never stop the run)."""
    tally = tally or Tally()
    keys = list(routes)

    @settings(max_examples=n, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck), phases=[__import__("hypothesis").Phase.generate])
    @given(data=st.data())
    def one(data: Any) -> None:
        route = data.draw(st.sampled_from(keys))
        body = data.draw(bodies(routes[route])) if route[0] == "POST" else b""
        hdrs = data.draw(headers(port))
        tally.add(route, body, hdrs, send(target, route[0], route[1], body, hdrs, timeout))

    one()
    return tally
