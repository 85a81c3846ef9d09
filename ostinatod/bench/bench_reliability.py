"""``ostinato bench reliability``: the long part of the reliability suite (docs/reliability.md).

Starts a daemon of its own (subprocess engine worker, a fresh OSTINATO_HOME) on the tiny synthetic
model (or ``--model``), then, in order:

1. fuzz: ``--requests`` hypothesis-generated requests over every HTTP route (bodies, headers) and
   ``--control-requests`` over the control socket (``ostinatod/bench/fuzz.py``);
2. concurrent greedy clients: ``--clients`` threads sending the same prompts at temperature 0;
3. slow connections: ``--slow`` half-sent request headers held open while /health is timed;
4. schema stall (a huge tool schema must not stall the others): ``--stalls`` requests whose tool has 3,000 properties (count_tokens
   and chat) and one 60 MiB prompt, while a bystander sends small chats; the engine kills
   (worker restarts) and the bystander's answers are counted;
5. keep-alive lockout: ``--keepalive`` connections (above the cap of 512) that each sent one
   GET and stay open, then a new client's /health;
6. distinct tools: ``--tool-requests`` requests, each with a tool definition no other had; the
   worker's RSS after the first tenth and at the end;
7. bad GGUF loads: ``ostinato load`` of copies of the model that llama.cpp refuses (unknown
   architecture, missing tensor, no tokenizer, no expert count) and of a vocab-only one; the
   reason given, and whether the served model stayed;
8. crashes: ``--kills`` times kill -9 of the worker in the middle of a stream, then one SIGSTOP
   of the worker; each time the seconds until /health is 200 again (recovery);
9. grammar: a regex pattern of 64 ``(a|b|c)*`` groups on every route that takes a
   schema or grammar, and a tool with a 20,000-value enum, while a bystander streams;
10. huge prompt: a prompt of about 80% of the context while a bystander streams (its longest
    token gap, and alone);
11. slow bodies: ``--slow-bodies`` connections that send complete headers and then a byte every
    4 s, while a new client's chat is timed;
12. control paths: load and residency switch naming a FIFO, a directory, /dev/zero, a
    5,000-character path, a 300-character file name and a NUL byte;

and prints the figures: requests, 5xx, hangs, daemon and worker alive, RSS (daemon + worker)
before and after, recovery times, and the tracebacks in the daemon's log and stdio (malformed HTTP
must be one line each). Exit code 0 when there were no 5xx, no hangs, no traceback, both processes are
alive, RSS grew less than 10% (fuzzing, and the distinct tools), the engine was never killed by
the schema stall or the grammar attacks, the bystanders and the new clients were served, every
grammar attack was a 4xx, no control path answer was a 5xx, every bad GGUF left the model
served, and, with ``--deterministic``, no concurrent greedy output differed from the sequential
ones; 1 otherwise. ``--json FILE`` writes the figures. Every attack is bounded in count and time
and goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import psutil

from . import fuzz
from ..control.client import ControlAPIError, call
from ..synth.writer import write_synthetic_moe
from .bench_launch import terminate


def _health(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _wait_healthy(url: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _health(url) == 200:
            return time.monotonic() - t0
        time.sleep(0.1)
    return float("inf")


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return -1, {}


def _rss(pid: int) -> int:
    """RSS of the daemon plus its engine worker (other short-lived children, e.g. a hardware probe,
    are not counted)."""
    try:
        p = psutil.Process(pid)
        total = p.memory_info().rss
        for c in p.children():
            try:
                if "worker_main" in " ".join(c.cmdline()):
                    total += c.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return 0


def _workers(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


class Daemon:
    """An ``ostinatod run`` of its own in a fresh home."""

    def __init__(self, model: Path, extra: list[str]):
        self.home = Path(tempfile.mkdtemp(prefix="ostinato-reliability-"))
        env = dict(os.environ, OSTINATO_HOME=str(self.home), OSTINATOD_DETACHED="1")
        (self.home / "state").mkdir(parents=True)
        self.out = open(self.home / "state" / "stdio.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "ostinatod.daemon_cli", "run", "--port", "0",
                                      "--model", str(model), "--engine-mode", "subprocess", *extra],
                                     env=env, stdin=subprocess.DEVNULL, stdout=self.out, stderr=self.out)
        info = self.home / "run" / "ostinatod.json"
        deadline = time.monotonic() + 300
        self.url = ""
        while not self.url and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.url = json.loads(info.read_text())["http_url"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                time.sleep(0.1)
        if not self.url or _wait_healthy(self.url, 300) == float("inf"):
            raise SystemExit(f"daemon did not start; see {self.home}/state")
        self.port = int(self.url.rsplit(":", 1)[1])
        self.socket = str(self.home / "run" / "control.sock")

    def stop(self) -> None:
        terminate(self.proc)
        self.out.close()


def _greedy(d: Daemon, clients: int, prompts: int, max_tokens: int = 8) -> dict[str, Any]:
    """The same prompts at temperature 0 (``max_tokens`` each): sequentially twice, then from
    ``clients`` threads."""
    texts = [f"Prompt number {i}: write some code about item {i * 7}." for i in range(prompts)]

    def one(t: str) -> Optional[str]:
        code, body = _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": t}],
                                                            "max_tokens": max_tokens, "temperature": 0})
        return body["choices"][0]["message"].get("content") if code == 200 else None

    seq1 = [one(t) for t in texts]
    seq2 = [one(t) for t in texts]
    results: list[tuple[int, Optional[str]]] = []
    lock = threading.Lock()

    def worker() -> None:
        for i, t in enumerate(texts):
            r = one(t)
            with lock:
                results.append((i, r))

    th = [threading.Thread(target=worker) for _ in range(clients)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    failed = sum(1 for _, r in results if r is None) + sum(1 for r in seq1 + seq2 if r is None)
    return {"requests": len(results) + 2 * len(texts), "failed": failed,
            "sequential_runs_equal": sum(a == b for a, b in zip(seq1, seq2)), "prompts": len(texts),
            "concurrent_equal_to_sequential": sum(1 for i, r in results if r in (seq1[i], seq2[i])),
            "concurrent_differing": sum(1 for i, r in results if r != seq1[i] or r != seq2[i]),
            "concurrent_outputs": len(results)}


def _hold(d: Daemon, n: int, prime: Any) -> tuple[int, int, float]:
    """Open ``n`` connections, ``prime(socket)`` each, and time a new client's /health while
    they are held: (connections held, its status, its seconds)."""
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", d.port), timeout=5)
            prime(s)
            socks.append(s)
        except OSError:
            break
    t0 = time.monotonic()
    code = _health(d.url, timeout=30)
    health_s = time.monotonic() - t0
    for s in socks:
        s.close()
    return len(socks), code, round(health_s, 3)


def _slow(d: Daemon, n: int) -> dict[str, Any]:
    held, code, secs = _hold(d, n, lambda s: s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n"
                                                        b"Host: localhost\r\nX-Slow: "))
    return {"opened": held, "health_status_meanwhile": code, "health_seconds": secs}


def _health_body(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}")
    except (OSError, ValueError):
        return {}


def big_tool(n_props: int, name: str = "big") -> dict[str, Any]:
    """An OpenAI tool whose parameters have ``n_props`` string properties."""
    props = {f"field_{i}": {"type": "string", "description": f"value {i}"} for i in range(n_props)}
    return {"type": "function", "function": {"name": name, "description": "many fields",
                                             "parameters": {"type": "object", "properties": props}}}


def _schema_stall(d: Daemon, n: int) -> dict[str, Any]:
    """``n`` big-schema requests (count_tokens and chat alternately, one at a time) and a 60 MiB
    prompt while a bystander thread sends small chats; worker restarts counted."""
    restarts0 = _health_body(d.url).get("restarts", 0)
    stop = threading.Event()
    by: list[tuple[int, float]] = []

    def bystander() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            code, _ = _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2}, timeout=60)
            by.append((code, time.monotonic() - t0))
            time.sleep(0.2)
    th = threading.Thread(target=bystander)
    th.start()
    attacks: dict[str, int] = {}
    t_attack = time.monotonic()
    tool = big_tool(3000)
    for i in range(n):
        if i % 2:
            code, _ = _post(d.url + "/v1/messages/count_tokens", {
                "model": "claude-x", "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "big", "input_schema": tool["function"]["parameters"]}]}, timeout=60)
        else:
            code, _ = _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "tools": [tool], "max_tokens": 2}, timeout=60)
        attacks[str(code)] = attacks.get(str(code), 0) + 1
    attack_s = time.monotonic() - t_attack
    t0 = time.monotonic()
    huge, _ = _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (60 << 20)}],
                                                     "max_tokens": 2}, timeout=120)
    huge_s = time.monotonic() - t0
    stop.set()
    th.join(120)
    time.sleep(2)  # a worker killed at the end has its exit seen by then
    restarts1 = _health_body(d.url).get("restarts", 0)
    return {"attacks": n, "attack_statuses": attacks, "attack_seconds": round(attack_s, 2),
            "prompt_60mib_status": huge, "prompt_60mib_seconds": round(huge_s, 2),
            "bystander_requests": len(by), "bystander_ok": sum(1 for c, _ in by if c == 200),
            "bystander_max_s": round(max((s for _, s in by), default=0.0), 2),
            "engine_kills": restarts1 - restarts0}


class _Bystander:
    """A thread sending small chats (``stream``: one streamed answer of many tokens at a time,
    timing the gaps between its tokens) until :meth:`stop`; counts and the slowest answer or
    longest token gap."""

    def __init__(self, d: Daemon, stream: bool = False):
        self.d, self.stream = d, stream
        self.answers: list[tuple[int, float]] = []
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            if self.stream:
                code = self._streamed()
            else:
                code, _ = _post(self.d.url + "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
            self.answers.append((code, time.monotonic() - t0))
            time.sleep(0.2)

    def _streamed(self) -> int:
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        req = urllib.request.Request(self.d.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                last = None
                for line in r:
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append(now - last)
                    last = now
                    if self._stop.is_set():
                        break
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return -1

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._th.join(130)
        return {"requests": len(self.answers), "ok": sum(1 for c, _ in self.answers if c == 200),
                "max_s": round(max((s for _, s in self.answers), default=0.0), 2),
                **({"tokens": len(self.gaps) + 1, "max_token_gap_s": round(max(self.gaps, default=0.0), 3)}
                   if self.stream else {})}


STALL_PATTERN = "^" + "(a|b|c)*" * 64 + "$"  # held one sampling call for minutes


def _grammar_attacks(d: Daemon) -> dict[str, Any]:
    """The grammar attacks while a bystander streams: the 64-group regex pattern on
    every route that takes a schema or grammar, and a tool with a 20,000-value enum; their
    statuses and seconds, the bystander's longest token gap, worker restarts."""
    restarts0 = _health_body(d.url).get("restarts", 0)
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": STALL_PATTERN}}}
    msgs = [{"role": "user", "content": "hi"}]
    enum_tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": list(range(20000))}}}}}
    attacks = {
        "chat response_format": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        "chat tool parameter": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "tool_choice": "required",
                                                         "tools": [{"type": "function", "function": {
                                                             "name": "t", "parameters": schema}}]}),
        "completions json_schema": ("/v1/completions", {"prompt": "x", "max_tokens": 8, "json_schema": schema}),
        "llama-server grammar": ("/completion", {"prompt": "x", "n_predict": 8,
                                                 "grammar": "root ::= " + '("a" | "b" | "c")* ' * 64}),
        "responses text.format": ("/v1/responses", {"input": "hi", "max_output_tokens": 8, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": schema}}}),
        "anthropic tool": ("/v1/messages", {"model": "claude-x", "max_tokens": 8, "messages": msgs, "tools": [
            {"name": "t", "input_schema": schema}]}),
        "20,000-value enum": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "tools": [enum_tool]}),
    }
    by = _Bystander(d, stream=True)
    time.sleep(1.0)
    out: dict[str, Any] = {}
    for name, (path, body) in attacks.items():
        t0 = time.monotonic()
        code, _ = _post(d.url + path, body, timeout=120)
        out[name] = {"status": code, "seconds": round(time.monotonic() - t0, 2)}
    time.sleep(1.0)
    bystander = by.stop()
    return {"attacks": out, "bystander": bystander,
            "engine_kills": _health_body(d.url).get("restarts", 0) - restarts0}


def _served_ctx(d: Daemon) -> int:
    """The context per slot the daemon serves (``/v1/models``), 0 if unknown."""
    try:
        with urllib.request.urlopen(d.url + "/v1/models", timeout=10) as r:
            return int(json.loads(r.read())["data"][0].get("context_length") or 0)
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def _huge_prompt(d: Daemon, n_ctx: int) -> dict[str, Any]:
    """A prompt of about 80% of the served context per slot (``n_ctx`` if unknown) while a
    bystander streams: the bystander's longest token gap before (alone) and while the prompt is
    prefilled, and the prompt's own time."""
    n_ctx = _served_ctx(d) or n_ctx
    alone = _Bystander(d, stream=True)
    time.sleep(3.0)
    base = alone.stop()
    by = _Bystander(d, stream=True)
    time.sleep(0.5)
    n_words = int(n_ctx * 0.8)
    for _ in range(4):  # about a token a word; fewer words while the prompt does not fit
        words = " ".join(("hello", "world", "again", "there")[i % 4] for i in range(n_words))
        t0 = time.monotonic()
        code, body = _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                                            "max_tokens": 2}, timeout=600)
        secs = time.monotonic() - t0
        if code != 400:
            break
        n_words //= 2
    during = by.stop()
    return {"prompt_tokens": (body.get("usage") or {}).get("prompt_tokens"), "status": code,
            "seconds": round(secs, 2), "bystander_alone": base, "bystander_during": during}


def _slow_bodies(d: Daemon, n: int, interval: float = 4.0, hold_s: float = 12.0) -> dict[str, Any]:
    """``n`` connections that send complete headers (``Content-Length: 100000``) and then one
    byte every ``interval`` s (a flood seen in an attack, one thread, non-blocking sockets); a new client's
    chat is timed meanwhile. Counts how the flood's connections ended."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n")
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", d.port), timeout=5)
            s.sendall(head)
            s.setblocking(False)
            socks.append(s)
        except OSError:
            break
    ended: dict[str, int] = {}
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    stop = threading.Event()

    def feed() -> None:
        nxt = time.monotonic()
        while not stop.is_set() and sel.get_map():
            if time.monotonic() >= nxt:
                for key in list(sel.get_map().values()):
                    try:
                        key.fileobj.send(b" ")
                    except OSError:
                        pass
                nxt = time.monotonic() + interval
            for key, _ in sel.select(timeout=0.2):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                what = data.split(b"\r\n", 1)[0].decode(errors="replace")[:20] if data else "closed"
                ended[what] = ended.get(what, 0) + 1
                sel.unregister(s)
                s.close()
    th = threading.Thread(target=feed, daemon=True)
    th.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    code, _ = _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}, timeout=60)
    client_s = time.monotonic() - t0
    time.sleep(max(0.0, hold_s - (time.monotonic() - t0)))
    stop.set()
    th.join(10)
    still = len(sel.get_map())
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return {"opened": len(socks), "new_client_status": code, "new_client_seconds": round(client_s, 3),
            "flood_ended": ended, "flood_still_open": still}


def _control_paths(d: Daemon) -> dict[str, Any]:
    """Load and residency-switch requests naming paths that are not regular files (a FIFO, a
    directory, /dev/zero, a 5,000-character path, a 300-character file name, a NUL byte): the
    status and code of each answer (none may be 5xx)."""
    fifo = d.home / "fifo.gguf"
    if not fifo.exists():
        os.mkfifo(fifo)
    paths = {"FIFO": str(fifo), "directory": str(d.home), "/dev/zero": "/dev/zero",
             "5,000-character path": "/m/" + "a" * 5000, "300-character name": str(d.home / ("r" * 300)),
             "NUL byte": "/m/a\0b"}
    out: dict[str, Any] = {}
    for route in ("/models/load", "/residency/switch"):
        for name, p in paths.items():
            try:
                call("POST", route, {"path": p}, socket=Path(d.socket))
                said = "200"
            except ControlAPIError as e:
                said = f"{e.status} {e.code}"
            out[f"{route} {name}"] = said
    return {"answers": out, "n_5xx": sum(1 for v in out.values() if v.startswith("5"))}


def _keepalive(d: Daemon, n: int) -> dict[str, Any]:
    """``n`` connections that each sent one GET /health, read the answer and stay open; then a
    new client's /health."""
    def prime(s: Any) -> None:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data = b""
        while not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    held, code, secs = _hold(d, n, prime)
    return {"held": held, "health_status_meanwhile": code, "health_seconds": secs}


def _tool_rss(d: Daemon, n: int, threads: int = 4) -> dict[str, Any]:
    """``n`` chat requests, each with a tool no other request had; the worker's RSS after the
    first tenth of them (caches warm) and at the end."""
    worker = next(iter(_workers(d.proc.pid)), None)
    counter = iter(range(n))
    lock = threading.Lock()
    codes: dict[str, int] = {}
    mid: dict[str, int] = {}
    t0 = time.monotonic()

    def one() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            tool = {"type": "function", "function": {
                "name": f"tool_{i}", "description": f"does thing {i}",
                "parameters": {"type": "object", "properties": {f"arg_{i}": {"type": "string"},
                                                                "count": {"type": "integer"}},
                               "required": [f"arg_{i}"]}}}
            code, _ = _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "tools": [tool], "max_tokens": 1}, timeout=60)
            with lock:
                codes[str(code)] = codes.get(str(code), 0) + 1
                if i == n // 10 and worker is not None:
                    mid["rss"] = psutil.Process(worker).memory_info().rss
    th = [threading.Thread(target=one) for _ in range(threads)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    end = psutil.Process(worker).memory_info().rss if worker is not None else 0
    rss0 = mid.get("rss", 0)
    return {"requests": n, "statuses": codes, "seconds": round(time.monotonic() - t0, 1),
            "worker_rss_after_first_tenth_bytes": rss0, "worker_rss_end_bytes": end,
            "growth_pct": round(100.0 * (end - rss0) / rss0, 1) if rss0 else None,
            "same_worker": worker in _workers(d.proc.pid)}


# ways to spoil a GGUF that llama.cpp refuses (or would abort on: no expert count, refused before
# it sees the file): byte strings of the header swapped for others of the same length (offsets stay
# valid), with the words the refusal contains
BAD_GGUFS: dict[str, tuple[list[tuple[bytes, bytes]], str]] = {
    "unknown architecture": ([(b"qwen3moe", b"qwen3xyz")], "unknown model architecture"),
    "missing tensor": ([(b"blk.0.attn_q.weight", b"blk.0.attn_x.weight")], "not found"),
    "no tokenizer": ([(b"tokenizer.ggml.tokens", b"tokenizer.ggml.tokenx")], "tokenizer"),
    "no expert count": ([(b"qwen3moe.expert_count", b"qwen3moe.expert_counx")], "expert_count"),
}


def patch_gguf(src: Path, dst: Path, swaps: list[tuple[bytes, bytes]] = (), no_tensors: bool = False) -> Path:
    """A copy of the GGUF ``src`` at ``dst`` with byte strings swapped for others of the same
    length (an architecture, key or tensor name), or with a tensor count of 0 (a vocab-only
    file). Raises ValueError when a string is missing or the lengths differ."""
    data = bytearray(Path(src).read_bytes())
    for old, new in swaps:
        if len(old) != len(new) or old not in data:
            raise ValueError(f"cannot swap {old!r} for {new!r} in {src}")
        data = data.replace(old, new)
    if no_tensors:
        data[8:16] = (0).to_bytes(8, "little")  # GGUF header: magic, version, n_tensors, n_kv
    Path(dst).write_bytes(bytes(data))
    return Path(dst)


def _bad_ggufs(d: Daemon, model: Path) -> dict[str, Any]:
    """Load each spoilt copy of ``model`` through the control API; what the answer said and
    whether the model stayed served."""
    out: dict[str, Any] = {}
    cases = {k: (sw, word, False) for k, (sw, word) in BAD_GGUFS.items()}
    cases["vocab-only"] = ([], "vocab-only", True)
    for kind, (swaps, word, no_tensors) in cases.items():
        bad = patch_gguf(model, d.home / f"bad-{kind.replace(' ', '-')}.gguf", swaps, no_tensors)
        t0 = time.monotonic()
        try:
            call("POST", "/models/load", {"path": str(bad)}, socket=Path(d.socket))
            said = "loaded"
        except ControlAPIError as e:
            said = str(e)
        h = _health_body(d.url)
        out[kind] = {"said": said[:200], "reason_named": word in said.lower(),
                     "model_stayed": h.get("status") == "ok" and h.get("model") == model.stem,
                     "seconds": round(time.monotonic() - t0, 1)}
        bad.unlink()
    return out


def _crashes(d: Daemon, kills: int) -> dict[str, Any]:
    recover: list[float] = []
    for _ in range(kills):
        result: dict[str, Any] = {}

        def stream() -> None:
            body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            req = urllib.request.Request(d.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    result["code"], result["tail"] = r.status, r.read()[-300:]
            except OSError as e:
                result["error"] = repr(e)
        th = threading.Thread(target=stream)
        th.start()
        time.sleep(0.5)
        for pid in _workers(d.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.3)
        recover.append(_wait_healthy(d.url, 300) + 0.3)
        th.join(130)
    stop_s = float("inf")
    pids = _workers(d.proc.pid)
    if pids:
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        time.sleep(0.2)
        while time.monotonic() - t0 < 300:
            if set(_workers(d.proc.pid)) - set(pids) and _health(d.url) == 200:
                stop_s = time.monotonic() - t0
                break
            time.sleep(0.1)
        try:
            os.kill(pids[0], signal.SIGCONT)
        except ProcessLookupError:
            pass
    return {"kills": kills, "recovery_s": [round(x, 2) for x in recover],
            "recovery_max_s": round(max(recover), 2) if recover else None,
            "sigstop_recovery_s": round(stop_s, 2)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    model = Path(a.model) if a.model else _tiny_model()
    d = Daemon(model, ["--n-ctx", str(a.n_ctx), "--n-slots", "2", "--max-tokens-default", "4",
                       "--worker-ping-timeout-s", "3"] + (["--n-threads", str(a.threads)] if a.threads else [])
               + (["--deterministic"] if a.deterministic else []))
    out: dict[str, Any] = {"model": str(model), "daemon_home": str(d.home), "deterministic": a.deterministic}
    try:
        for _ in range(3):
            _post(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}],
                                                   "max_tokens": 4})
        time.sleep(2)
        rss0 = _rss(d.proc.pid)
        t0 = time.monotonic()
        http = fuzz.fuzz(f"127.0.0.1:{d.port}", fuzz.HTTP_ROUTES, a.requests, port=d.port, timeout=a.timeout)
        ctl = fuzz.fuzz(d.socket, fuzz.CONTROL_ROUTES, a.control_requests, timeout=a.timeout)
        out["fuzz"] = {"http_requests": http.requests, "http_by_status": http.by_status, "http_5xx": http.n_5xx,
                       "http_hangs": http.n_hangs, "control_requests": ctl.requests,
                       "control_by_status": ctl.by_status, "control_5xx": ctl.n_5xx, "control_hangs": ctl.n_hangs,
                       "seconds": round(time.monotonic() - t0, 1), "max_answer_s": round(max(http.max_seconds,
                                                                                              ctl.max_seconds), 2),
                       "examples_5xx": (http.server_errors + ctl.server_errors)[:5],
                       "examples_hangs": (http.hangs + ctl.hangs)[:5],
                       "examples_dropped": (http.dropped + ctl.dropped)[:5]}
        out["greedy"] = _greedy(d, a.clients, a.prompts, a.greedy_tokens)
        out["slow_connections"] = _slow(d, a.slow)
        rss1 = _rss(d.proc.pid)  # before the crashes and loads: a restarted worker starts from scratch
        out["schema_stall"] = _schema_stall(d, a.stalls)
        out["keepalive"] = _keepalive(d, a.keepalive)
        out["grammar"] = _grammar_attacks(d)
        out["huge_prompt"] = _huge_prompt(d, a.n_ctx)
        out["slow_bodies"] = _slow_bodies(d, a.slow_bodies)
        out["control_paths"] = _control_paths(d)
        out["tools"] = _tool_rss(d, a.tool_requests)
        out["bad_gguf"] = _bad_ggufs(d, model)
        out["crashes"] = _crashes(d, a.kills)
        out["rss"] = {"before_bytes": rss0, "after_bytes": rss1,
                      "growth_pct": round(100.0 * (rss1 - rss0) / rss0, 1) if rss0 else None}
        out["alive"] = {"daemon": d.proc.poll() is None, "worker": bool(_workers(d.proc.pid)),
                        "healthy": _wait_healthy(d.url, 120) != float("inf")}
    finally:
        d.stop()
        out["log"] = _log_noise(d.home / "state")
    f, r = out.get("fuzz", {}), out.get("rss", {})
    st, ka, tl, g = (out.get(k, {}) for k in ("schema_stall", "keepalive", "tools", "greedy"))
    gr, hp, sb, cp = (out.get(k, {}) for k in ("grammar", "huge_prompt", "slow_bodies", "control_paths"))
    grb, hpb = gr.get("bystander", {}), hp.get("bystander_during", {})
    out["ok"] = bool(f and f["http_5xx"] == 0 and f["control_5xx"] == 0 and f["http_hangs"] == 0
                     and f["control_hangs"] == 0 and all(out["alive"].values())
                     and out["log"]["traceback_lines"] == 0
                     and (r.get("growth_pct") or 0) < 10
                     and st.get("engine_kills") == 0 and st.get("bystander_ok") == st.get("bystander_requests")
                     and ka.get("health_status_meanwhile") == 200
                     and (tl.get("growth_pct") or 0) < 10 and tl.get("same_worker")
                     and all(v["reason_named"] and v["model_stayed"] for v in out.get("bad_gguf", {}).values())
                     and (not a.deterministic or g.get("concurrent_differing") == 0)
                     and gr.get("engine_kills") == 0 and grb.get("ok") == grb.get("requests")
                     and all(400 <= v["status"] < 500 for v in gr.get("attacks", {}).values())
                     and hp.get("status") in (200, 400) and hpb.get("ok") == hpb.get("requests")
                     and sb.get("new_client_status") == 200 and cp.get("n_5xx") == 0)
    return out


# what a traceback in the daemon's output starts with (Python's, and aiohttp's two error lines)
_NOISE = ("Traceback (most recent call last)", "Error handling request", "Unhandled exception")


def _log_noise(state: Path) -> dict[str, Any]:
    """Traceback lines in the daemon's log and stdio under ``state`` (a Python traceback's first
    line and aiohttp's error line before it each count): ``{"traceback_lines": n, "lines": the
    first three}``."""
    hits: list[str] = []
    for name in ("ostinatod.log", "stdio.log"):
        try:
            text = (state / name).read_text(errors="replace")
        except OSError:
            continue
        hits += [line for line in text.splitlines() if any(n in line for n in _NOISE)]
    return {"traceback_lines": len(hits), "lines": hits[:3]}


def _tiny_model() -> Path:
    cache = Path(os.environ.get("OSTINATO_TEST_CACHE", Path.home() / ".cache" / "ostinato-test"))
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "tiny-qwen3moe.gguf"
    if not path.exists():
        write_synthetic_moe(path, arch="qwen3moe", shape="tiny")
    return path


def report(out: dict[str, Any]) -> str:
    f, g, s, c, r, al = (out.get(k, {}) for k in ("fuzz", "greedy", "slow_connections", "crashes", "rss", "alive"))
    st, ka, tl = (out.get(k, {}) for k in ("schema_stall", "keepalive", "tools"))
    gr, hp, sb, cp = (out.get(k, {}) for k in ("grammar", "huge_prompt", "slow_bodies", "control_paths"))
    grb, hpa, hpd = gr.get("bystander", {}), hp.get("bystander_alone", {}), hp.get("bystander_during", {})
    lines = [
        f"model            {out['model']}{'  (deterministic = true)' if out.get('deterministic') else ''}",
        f"fuzzed requests  HTTP {f.get('http_requests')} ({f.get('http_5xx')} 5xx, {f.get('http_hangs')} hangs), "
        f"control {f.get('control_requests')} ({f.get('control_5xx')} 5xx, {f.get('control_hangs')} hangs) "
        f"in {f.get('seconds')} s; slowest answer {f.get('max_answer_s')} s",
        f"  HTTP statuses  {f.get('http_by_status')}",
        f"  control        {f.get('control_by_status')}",
        f"greedy clients   {g.get('requests')} requests, {g.get('failed')} failed; sequential runs equal "
        f"{g.get('sequential_runs_equal')}/{g.get('prompts')}; concurrent equal to a sequential run "
        f"{g.get('concurrent_equal_to_sequential')}/{g.get('concurrent_outputs')}, differing from a "
        f"sequential run {g.get('concurrent_differing')}",
        f"slow connections {s.get('opened')} half-sent headers open; /health meanwhile {s.get('health_status_meanwhile')} "
        f"in {s.get('health_seconds')} s",
        f"schema stall     {st.get('attacks')} 3,000-property requests {st.get('attack_statuses')} in "
        f"{st.get('attack_seconds')} s, 60 MiB prompt {st.get('prompt_60mib_status')} in "
        f"{st.get('prompt_60mib_seconds')} s; engine kills {st.get('engine_kills')}; bystander "
        f"{st.get('bystander_ok')}/{st.get('bystander_requests')} served, slowest {st.get('bystander_max_s')} s",
        f"keep-alive       {ka.get('held')} idle kept-alive connections held; new client /health "
        f"{ka.get('health_status_meanwhile')} in {ka.get('health_seconds')} s",
        *[f"grammar          {k}: {v['status']} in {v['seconds']} s" for k, v in gr.get("attacks", {}).items()],
        f"  meanwhile      engine kills {gr.get('engine_kills')}; streaming bystander {grb.get('ok')}/"
        f"{grb.get('requests')} served, longest token gap {grb.get('max_token_gap_s')} s",
        f"huge prompt      {hp.get('prompt_tokens')} tokens: {hp.get('status')} in {hp.get('seconds')} s; "
        f"bystander's longest token gap {hpd.get('max_token_gap_s')} s ({hpd.get('ok')}/{hpd.get('requests')} "
        f"served), alone {hpa.get('max_token_gap_s')} s",
        f"slow bodies      {sb.get('opened')} connections sending a byte every 4 s; new client "
        f"{sb.get('new_client_status')} in {sb.get('new_client_seconds')} s; flood ended {sb.get('flood_ended')}, "
        f"{sb.get('flood_still_open')} still open",
        f"control paths    {cp.get('n_5xx')} 5xx: " + ", ".join(f"{k}: {v}" for k, v in
                                                           (cp.get("answers") or {}).items()),
        f"distinct tools   {tl.get('requests')} requests {tl.get('statuses')} in {tl.get('seconds')} s; worker RSS "
        f"{tl.get('worker_rss_after_first_tenth_bytes', 0) / 2**20:.0f} MiB after the first tenth, "
        f"{tl.get('worker_rss_end_bytes', 0) / 2**20:.0f} MiB at the end ({tl.get('growth_pct')}%)",
        *[f"bad GGUF         {k}: model stayed {v['model_stayed']}, reason named {v['reason_named']} "
          f"({v['said'][:90]})" for k, v in out.get("bad_gguf", {}).items()],
        f"crashes          {c.get('kills')} kill -9 mid-stream: recovery {c.get('recovery_s')} s; SIGSTOP: "
        f"{c.get('sigstop_recovery_s')} s",
        f"RSS              {r.get('before_bytes', 0) / 2**20:.0f} MiB before, {r.get('after_bytes', 0) / 2**20:.0f} MiB "
        f"after ({r.get('growth_pct')}%)",
        f"alive            daemon {al.get('daemon')}, worker {al.get('worker')}, healthy {al.get('healthy')}",
        f"log              {out.get('log', {}).get('traceback_lines')} traceback lines in the daemon's log and stdio",
        f"result           {'OK' if out.get('ok') else 'FAILED'}",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ostinato bench reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF to serve (default: the tiny synthetic qwen3moe, written if missing)")
    ap.add_argument("--requests", type=int, default=10000, help="fuzzed HTTP requests (default 10000)")
    ap.add_argument("--control-requests", type=int, default=500, help="fuzzed control-socket requests")
    ap.add_argument("--clients", type=int, default=8, help="concurrent greedy clients")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per greedy client")
    ap.add_argument("--greedy-tokens", type=int, default=8, help="output tokens of each greedy request")
    ap.add_argument("--slow", type=int, default=600, help="half-sent request headers held open")
    ap.add_argument("--kills", type=int, default=3, help="kill -9 of the worker mid-stream")
    ap.add_argument("--stalls", type=int, default=8, help="requests with a 3,000-property tool (schema stall)")
    ap.add_argument("--keepalive", type=int, default=600, help="idle kept-alive connections held open")
    ap.add_argument("--slow-bodies", type=int, default=600, help="connections sending a body a byte every 4 s")
    ap.add_argument("--tool-requests", type=int, default=10000, help="requests with distinct tool definitions")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="engine CPU threads")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds without an answer that count as a hang")
    ap.add_argument("--deterministic", action="store_true", help="run the daemon with deterministic = true")
    ap.add_argument("--json", help="write the figures to this file")
    a = ap.parse_args(argv)
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        print("ostinato bench reliability needs hypothesis: pip install 'ostinato[test]'", file=sys.stderr)
        return 2
    out = run(a)
    print(report(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
