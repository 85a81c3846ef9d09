"""The attacks of ``ostinato bench reliability`` (phases 2 to 12 of :mod:`.bench_reliability`): each
takes the running :class:`~.bench_reliability_daemon.Daemon` and returns its figures as a dict."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import psutil

from ..control.client import ControlAPIError, call
from .bench_reliability_daemon import (Daemon, Bystander, health_status, health_body, post_json,
                                       wait_healthy, worker_pids)


def phase_greedy(d: Daemon, clients: int, prompts: int, max_tokens: int = 8) -> dict[str, Any]:
    """The same prompts at temperature 0 (``max_tokens`` each): sequentially twice, then from
    ``clients`` threads."""
    texts = [f"Prompt number {i}: write some code about item {i * 7}." for i in range(prompts)]

    def one(t: str) -> Optional[str]:
        code, body = post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": t}],
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
    code = health_status(d.url, timeout=30)
    health_s = time.monotonic() - t0
    for s in socks:
        s.close()
    return len(socks), code, round(health_s, 3)


def phase_slow(d: Daemon, n: int) -> dict[str, Any]:
    held, code, secs = _hold(d, n, lambda s: s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n"
                                                        b"Host: localhost\r\nX-Slow: "))
    return {"opened": held, "health_status_meanwhile": code, "health_seconds": secs}


def big_tool(n_props: int, name: str = "big") -> dict[str, Any]:
    """An OpenAI tool whose parameters have ``n_props`` string properties."""
    props = {f"field_{i}": {"type": "string", "description": f"value {i}"} for i in range(n_props)}
    return {"type": "function", "function": {"name": name, "description": "many fields",
                                             "parameters": {"type": "object", "properties": props}}}


def phase_schema_stall(d: Daemon, n: int) -> dict[str, Any]:
    """``n`` big-schema requests (count_tokens and chat alternately, one at a time) and a 60 MiB
    prompt while a bystander thread sends small chats; worker restarts counted."""
    restarts0 = health_body(d.url).get("restarts", 0)
    stop = threading.Event()
    by: list[tuple[int, float]] = []

    def bystander() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            code, _ = post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
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
            code, _ = post_json(d.url + "/v1/messages/count_tokens", {
                "model": "claude-x", "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "big", "input_schema": tool["function"]["parameters"]}]}, timeout=60)
        else:
            code, _ = post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "tools": [tool], "max_tokens": 2}, timeout=60)
        attacks[str(code)] = attacks.get(str(code), 0) + 1
    attack_s = time.monotonic() - t_attack
    t0 = time.monotonic()
    huge, _ = post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (60 << 20)}],
                                                     "max_tokens": 2}, timeout=120)
    huge_s = time.monotonic() - t0
    stop.set()
    th.join(120)
    time.sleep(2)  # a worker killed at the end has its exit seen by then
    restarts1 = health_body(d.url).get("restarts", 0)
    return {"attacks": n, "attack_statuses": attacks, "attack_seconds": round(attack_s, 2),
            "prompt_60mib_status": huge, "prompt_60mib_seconds": round(huge_s, 2),
            "bystander_requests": len(by), "bystander_ok": sum(1 for c, _ in by if c == 200),
            "bystander_max_s": round(max((s for _, s in by), default=0.0), 2),
            "engine_kills": restarts1 - restarts0}


STALL_PATTERN = "^" + "(a|b|c)*" * 64 + "$"  # held one sampling call for minutes


def phase_grammar(d: Daemon) -> dict[str, Any]:
    """The grammar attacks while a bystander streams: the 64-group regex pattern on
    every route that takes a schema or grammar, and a tool with a 20,000-value enum; their
    statuses and seconds, the bystander's longest token gap, worker restarts."""
    restarts0 = health_body(d.url).get("restarts", 0)
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
    by = Bystander(d, stream=True)
    time.sleep(1.0)
    out: dict[str, Any] = {}
    for name, (path, body) in attacks.items():
        t0 = time.monotonic()
        code, _ = post_json(d.url + path, body, timeout=120)
        out[name] = {"status": code, "seconds": round(time.monotonic() - t0, 2)}
    time.sleep(1.0)
    bystander = by.stop()
    return {"attacks": out, "bystander": bystander,
            "engine_kills": health_body(d.url).get("restarts", 0) - restarts0}


def _served_ctx(d: Daemon) -> int:
    """The context per slot the daemon serves (``/v1/models``), 0 if unknown."""
    try:
        with urllib.request.urlopen(d.url + "/v1/models", timeout=10) as r:
            return int(json.loads(r.read())["data"][0].get("context_length") or 0)
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def phase_huge_prompt(d: Daemon, n_ctx: int) -> dict[str, Any]:
    """A prompt of about 80% of the served context per slot (``n_ctx`` if unknown) while a
    bystander streams: the bystander's longest token gap before (alone) and while the prompt is
    prefilled, and the prompt's own time."""
    n_ctx = _served_ctx(d) or n_ctx
    alone = Bystander(d, stream=True)
    time.sleep(3.0)
    base = alone.stop()
    by = Bystander(d, stream=True)
    time.sleep(0.5)
    n_words = int(n_ctx * 0.8)
    for _ in range(4):  # about a token a word; fewer words while the prompt does not fit
        words = " ".join(("hello", "world", "again", "there")[i % 4] for i in range(n_words))
        t0 = time.monotonic()
        code, body = post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                                            "max_tokens": 2}, timeout=600)
        secs = time.monotonic() - t0
        if code != 400:
            break
        n_words //= 2
    during = by.stop()
    return {"prompt_tokens": (body.get("usage") or {}).get("prompt_tokens"), "status": code,
            "seconds": round(secs, 2), "bystander_alone": base, "bystander_during": during}


def phase_slow_bodies(d: Daemon, n: int, interval: float = 4.0, hold_s: float = 12.0) -> dict[str, Any]:
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
    code, _ = post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
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


def phase_control_paths(d: Daemon) -> dict[str, Any]:
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


def phase_keepalive(d: Daemon, n: int) -> dict[str, Any]:
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


def phase_tool_rss(d: Daemon, n: int, threads: int = 4) -> dict[str, Any]:
    """``n`` chat requests, each with a tool no other request had; the worker's RSS after the
    first tenth of them (caches warm) and at the end."""
    worker = next(iter(worker_pids(d.proc.pid)), None)
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
            code, _ = post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
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
            "same_worker": worker in worker_pids(d.proc.pid)}


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


def phase_bad_ggufs(d: Daemon, model: Path) -> dict[str, Any]:
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
        h = health_body(d.url)
        out[kind] = {"said": said[:200], "reason_named": word in said.lower(),
                     "model_stayed": h.get("status") == "ok" and h.get("model") == model.stem,
                     "seconds": round(time.monotonic() - t0, 1)}
        bad.unlink()
    return out


def phase_crashes(d: Daemon, kills: int) -> dict[str, Any]:
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
        for pid in worker_pids(d.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.3)
        recover.append(wait_healthy(d.url, 300) + 0.3)
        th.join(130)
    stop_s = float("inf")
    pids = worker_pids(d.proc.pid)
    if pids:
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        time.sleep(0.2)
        while time.monotonic() - t0 < 300:
            if set(worker_pids(d.proc.pid)) - set(pids) and health_status(d.url) == 200:
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
