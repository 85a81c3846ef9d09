"""The daemon that ``ostinato bench reliability`` attacks: an ``ostinatod run`` of its own in a fresh
home (:class:`Daemon`), and the plain HTTP calls, health checks and RSS readings the attacks use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from .bench_launch import terminate


def health_status(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_healthy(url: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if health_status(url) == 200:
            return time.monotonic() - t0
        time.sleep(0.1)
    return float("inf")


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return -1, {}


def rss_of(pid: int) -> int:
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


def worker_pids(pid: int) -> list[int]:
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
        if not self.url or wait_healthy(self.url, 300) == float("inf"):
            raise SystemExit(f"daemon did not start; see {self.home}/state")
        self.port = int(self.url.rsplit(":", 1)[1])
        self.socket = str(self.home / "run" / "control.sock")

    def stop(self) -> None:
        terminate(self.proc)
        self.out.close()


def health_body(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}")
    except (OSError, ValueError):
        return {}


class Bystander:
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
                code, _ = post_json(self.d.url + "/v1/chat/completions", {
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
