"""``ostinato bench engines``: the engines on loopback (our daemon with the settings of each
engine, the stock llama-server), the replay client against them, and the daemon's expert stats
through its control API (totals after a run, snapshots around every turn for the step breakdown)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from ..hardware import cpu_placement, default_threads
from ..paths import get_paths, home_paths
from ..residency import planner
from ..settings import ENGINE_KEYS, load_settings
from .bench_breakdown import turn_breakdown
from .bench_steps import timing_turn
from .bench_common import BenchError, crash_lines, say
from .replay import run_replay


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it; free when this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            try:
                return r.status, json.loads(body)
            except ValueError:
                return r.status, body.decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def terminate(proc: subprocess.Popen, grace: float = 30, group: bool = False) -> None:
    """Stop a server process: SIGTERM, up to ``grace`` seconds for a clean exit, then SIGKILL (to
    its whole process group when ``group``, for servers started in a session of their own)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(10)


class Server:
    """A server process on loopback (our daemon or llama-server), stopped by :meth:`stop`."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 url_file: Optional[Path] = None, url: Optional[str] = None,
                 cpus: Optional[list[int]] = None):
        self.name, self.log_path, self.cmd = name, log_path, list(cmd)
        # where this process's output starts in a log an earlier run in the same work dir appended to
        self.log_start = log_path.stat().st_size if log_path.exists() else 0
        self._log = open(log_path, "ab")
        # cpus: the server process (and so every thread it makes) runs on these CPUs only
        pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pre)
        self.url_file, self.url = url_file, url
        # other logs of this server that can show its engine's crash (the daemon's own log file)
        self.extra_logs: tuple[Path, ...] = ()

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode}; log "
                                 f"{self.log_path}:\n{self.tail()}")
            if self.url is None and self.url_file is not None:
                try:
                    self.url = json.loads(self.url_file.read_text())["http_url"]
                except (OSError, ValueError, KeyError):
                    pass
            if self.url and _get(self.url + "/health", 2)[0] == 200:
                return self.url
            time.sleep(0.3)
        raise BenchError(f"{self.name} not ready after {timeout:.0f} s; log {self.log_path}:\n{self.tail()}")

    def watch(self, deadline: Optional[float], poll_s: float = 1.0) -> "Watch":
        """Start a :class:`Watch` of this server (its log and :attr:`extra_logs`): stops it at the
        first engine crash they show, at its exit or at ``deadline`` (time.monotonic(); None:
        none), so that a replay against it ends with errors instead of waiting on a dead or wedged
        engine."""
        return Watch(self, deadline, poll_s)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        terminate(self.proc, group=True)
        self._log.close()


class Watch:
    """A thread that stops ``server`` (:meth:`Server.stop`'s signals) when its logs (its own output
    since it started and what its :attr:`Server.extra_logs` gain from now on, read as they grow)
    show an engine crash (:func:`.bench_common.crash_lines`), when it exits, or when ``deadline``
    (time.monotonic()) passes; :attr:`reason` says why (None while none), :attr:`crashed` whether
    it was a crash or an exit (not the deadline). :meth:`stop` ends the watch (the server keeps
    running)."""

    def __init__(self, server: Server, deadline: Optional[float], poll_s: float = 1.0):
        self.server, self.deadline = server, deadline
        self.reason: Optional[str] = None
        self.crashed = False
        self._lines: list[str] = []
        self._pos = {p: (p.stat().st_size if p.exists() else 0) for p in server.extra_logs}
        self._pos[server.log_path] = server.log_start
        self._rest = {p: b"" for p in self._pos}   # a line not complete yet, per log
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), daemon=True,
                                        name=f"watch-{server.name}")
        self._thread.start()

    def _new_lines(self) -> list[str]:
        out = []
        for p, pos in self._pos.items():
            try:
                with open(p, "rb") as f:
                    f.seek(pos)
                    data = f.read()
            except OSError:
                continue
            self._pos[p] = pos + len(data)
            data = self._rest[p] + data
            cut = data.rfind(b"\n") + 1
            self._rest[p] = data[cut:]
            out += data[:cut].decode(errors="replace").splitlines()
        return out

    def _run(self, poll_s: float) -> None:
        while not self._done.wait(poll_s):
            why = None
            if self.server.proc.poll() is not None:
                why = f"{self.server.name} exited with {self.server.proc.returncode}"
            else:
                self._lines += crash_lines("\n".join(self._new_lines()))
                if self._lines:
                    why = f"{self.server.name} crashed: " + " | ".join(self._lines[:6])
            self.crashed = why is not None
            if why is None and self.deadline is not None and time.monotonic() > self.deadline:
                why = f"{self.server.name} stopped at the run's time limit while replaying"
            if why is not None:
                self.reason = why
                say(f"engine {self.server.name}: {why}; stopping it")
                terminate(self.server.proc, grace=5, group=True)
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)


def gpu_env(a: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """``env`` with CUDA_VISIBLE_DEVICES limited to the first ``--gpus`` N GPUs when the machine
    has more (so every engine, stock ones included, uses the same GPUs); unchanged when the
    variable is already set, when --gpus is "auto", or when there are no more GPUs than N."""
    n = str(getattr(a, "gpus", 1))
    if "CUDA_VISIBLE_DEVICES" in env or not n.isdigit():
        return env

    if len(planner.detect_gpus()) > int(n):
        env = dict(env, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(int(n))))
    return env


def settings_env(settings: dict[str, Any]) -> dict[str, str]:
    """The daemon's settings ``settings`` as its environment variables (``OSTINATO_<NAME>``; the
    [engine] table's by their nested variable ``OSTINATO_ENGINE__<NAME>``); None values are left out."""
    return {f"OSTINATO_{'ENGINE__' if k in ENGINE_KEYS else ''}{k.upper()}": str(v)
            for k, v in settings.items() if v is not None}


def start_daemon(name: str, model: Path, settings: dict[str, Any], run_dir: Path,
                 a: argparse.Namespace) -> Server:
    """``ostinatod run`` in its own OSTINATO_HOME under ``run_dir`` with ``settings`` as env vars."""
    home = run_dir / f"home-{name}"
    (home / "data").mkdir(parents=True, exist_ok=True)
    prof = get_paths().hardware_profile  # the calibration (Np) of this machine, if any
    if prof.exists():
        shutil.copy(prof, home / "data" / prof.name)
    env = gpu_env(a, dict(os.environ, OSTINATO_HOME=str(home), OSTINATOD_DETACHED="1"))
    base = {"model": model, "n_ctx": a.n_ctx, "n_slots": 2, "engine_mode": a.engine_mode,
            "n_threads": a.threads, "prefill_threshold": a.prefill_threshold, "log_level": "INFO",
            # a rerun in the same work dir must not restore the prompts of the last run from disk
            "cache_disk_mb": 0}
    env.update(settings_env({**base, **settings}))
    cmd = [sys.executable, "-m", "ostinatod.daemon_cli", "run", "--port", "0", "--host", "127.0.0.1"]
    paths = home_paths(home)
    srv = Server(name, cmd, env, run_dir / f"{name}.log", url_file=paths.runtime / "ostinatod.json")
    srv.extra_logs = (paths.log_file,)   # the daemon's log: its line for a crashed engine worker
    return srv


def llama_server_binary() -> Optional[Path]:
    """The stock llama-server of our build (``ostinato build --with-server``), or None."""
    for home in {get_paths().native_dir, Path.home() / ".local/share/ostinato/native"}:
        p = Path(home) / "bin" / "llama-server"
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def server_placement(a: argparse.Namespace) -> tuple[int, Optional[list[int]]]:
    """Threads and CPUs of a server engine (llama-server, ik-llama-server): those of our engine
    worker (:func:`ostinatod.hardware.cpu_placement`: the NUMA-local physical cores on a host with
    several nodes; ``--threads`` or the physical cores), so every engine runs at equal CPUs.
    Returns (threads, CPUs to pin the process to, or None: unpinned)."""
    cpu_set = load_settings().cpu_set   # the daemons' setting (file or OSTINATO_CPU_SET)
    place = cpu_placement(cpu_set)
    return a.threads or default_threads(cpu_set), place["cpus"] if place["pin"] else None


def peer_batch_flags(a: argparse.Namespace) -> list[str]:
    """``-b``/``-ub`` of a server engine: the ubatch Ostinato ran at (``a.peer_ubatch``, set by
    ``bench engines`` after its run; :data:`PEER_UBATCH` before), so every engine's prefill passes
    are the same size."""
    ub = int(getattr(a, "peer_ubatch", 0) or PEER_UBATCH)
    return ["-b", str(max(2048, ub)), "-ub", str(ub)]


#: the ubatch of engines that run before Ostinato has chosen one (its automatic choice where the
#: memory allows: ostinatod/engine/prefill_plan.py)
PEER_UBATCH = 2048


def start_llama_server(binary: Path, model: Path, n_cpu_moe: int, run_dir: Path,
                       a: argparse.Namespace) -> Server:
    """Stock llama-server: all layers on the GPU except the experts of the first n_cpu_moe layers;
    threads and CPUs of :func:`server_placement`; the batch flags of :func:`peer_batch_flags`."""
    port = free_port()
    threads, cpus = server_placement(a)
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(a.n_ctx * 2), "-np", "2", "-ngl", "999", "--n-cpu-moe", str(n_cpu_moe),
           "-t", str(threads), "-tb", str(threads), "--jinja", *peer_batch_flags(a),
           "--cache-reuse", "0"]
    env = gpu_env(a, dict(os.environ))
    try:
        import llama_cpp  # lazy: the native engine, loaded only where it runs

        lib = Path(llama_cpp.__file__).parent / "lib"
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    except ImportError:
        pass
    return Server("llama-server", cmd, env, run_dir / "llama-server.log",
                  url=f"http://127.0.0.1:{port}", cpus=cpus)


def _model_name(url: str) -> str:
    code, body = _get(url + "/v1/models")
    try:
        return body["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return "default"


def replay(url: str, sessions_file: Path, held: list[dict], a: argparse.Namespace, out: Path,
           on_turn=None, on_first_token=None) -> dict:
    """Replay the held-out sessions against ``url`` with the one replay client
    (:func:`ostinatod.bench.replay.run_replay`, what ``ostinato bench replay`` runs); the result
    JSON is also written to ``out``. ``on_turn()`` runs after every turn (outside its timing),
    ``on_first_token()`` in every turn once its first token arrived (after its TTFT was taken)."""
    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        if a.verbose:
            say("    " + line)
        if on_turn is not None:
            on_turn()

    data = run_replay(held, url, client=a.client, model=_model_name(url), max_turns=a.turns,
                      log=log, sessions_file=str(sessions_file), on_first_token=on_first_token)
    out.write_text(json.dumps(data, indent=1))
    out.with_suffix(".log").write_text("\n".join(log_lines) + "\n")
    return data


def control_metrics(home: Path, timeout: float = 10.0) -> dict[str, Any]:
    """The daemon's ``/metrics`` snapshot through the control API (HTTP on its Unix socket; plain
    http.client: cheap enough to poll). Raises on failure."""
    class _Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(str(home / "run" / "control.sock"))
            self.sock = s

    conn = _Unix("ostinato", timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise BenchError(f"control API /metrics: HTTP {r.status}")
        return json.loads(body)
    finally:
        conn.close()


def expert_stats(home: Path) -> dict[str, Any]:
    """The Ostinato daemon's expert counters through the control API (Unix socket)."""
    try:
        snap = control_metrics(home)
    except Exception as e:  # the control API is an optional part: report, don't fail the run
        return {"error": f"control API: {e}"}
    ex = snap.get("experts") or {}
    eng = (snap.get("engine") or {}).get("experts") or {}
    return {"hot_route_share": ex.get("hot_route_share", eng.get("hot_route_share")),
            "paths": ex.get("paths") or eng.get("paths"), "routes": ex.get("routes", eng.get("routes")),
            "cold_routes": ex.get("cold_routes", eng.get("cold_routes")),
            "upload_bytes": eng.get("upload_bytes"), "prefill_threshold": eng.get("prefill_threshold"),
            "prefill": eng.get("prefill"), "decode_graph": eng.get("decode_graph"),
            "decode_graph_steps": eng.get("decode_graph_steps"), "decode_timeline": eng.get("decode_timeline"),
            "decode_prefetch_choice": eng.get("decode_prefetch_choice"),
            "ubatch": (snap.get("engine") or {}).get("ubatch")}


def _native(eng: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The native expert stats of an ``engine`` snapshot, or None (stock llama.cpp, no snapshot)."""
    ex = (eng or {}).get("experts") or {}
    return ex if "passes" in ex else None


class StepRecorder:
    """Snapshots of a daemon's engine stats around every replayed turn (control API): one before
    the first turn and one after every turn, whose worker step timing (``step_timing``, every engine)
    gives ``timing`` (:func:`.bench_steps.timing_turn` per turn); for an Ostinato engine
    (``native``) the native expert stats give ``rows`` (:func:`.bench_breakdown.turn_breakdown`),
    with one more snapshot per turn as soon as its first decode
    step has run (it catches the prefill passes in the ring of the last 32 passes). That one comes
    from a poller, every ``poll_s``, that starts when the turn's first token has arrived
    (:meth:`first_token`, the replay's ``on_first_token``), not before: a stats call takes the
    daemon's GIL and the engine's lock, and this process's GIL, so polling during the prefill could
    add to the measured engine's TTFT alone (the baselines are never polled within a turn, only
    before and after it; the size of that was not separable from run-to-run noise on the H200,
    docs/benchmarks/METHOD.md). It stops at the first snapshot that shows a decode step of the turn."""

    def __init__(self, home: Path, poll_s: float = 0.025, native: bool = True):
        self.home, self.poll_s, self.native = home, poll_s, native
        self.prev: Optional[dict[str, Any]] = None   # the engine snapshot after the last turn
        self._mid: list[Optional[dict[str, Any]]] = [None]   # per armed turn: a late poller writes its own
        self.rows: list[Optional[dict[str, Any]]] = []
        self.timing: list[Optional[dict[str, Any]]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._go = threading.Event()
        self._th: Optional[threading.Thread] = None

    def _snap(self) -> Optional[dict[str, Any]]:
        try:
            return control_metrics(self.home).get("engine") or {}
        except Exception:  # noqa: BLE001 - the breakdown is optional: count and go on
            self.errors += 1
            return None

    @property
    def mid(self) -> Optional[dict[str, Any]]:
        """The current turn's snapshot just after its first decode step, or None (not yet, or missed)."""
        return self._mid[0]

    def _arm(self) -> None:
        self._mid, self._stop, self._go = [None], threading.Event(), threading.Event()
        base, stop, go, mid = _native(self.prev), self._stop, self._go, self._mid
        if base is None or not self.native:
            return
        n_dec = int((base.get("paths") or {}).get("decode", 0) or 0)

        def poll() -> None:
            while not go.wait(self.poll_s):   # the turn's first token (its TTFT taken), or the turn's end
                if stop.is_set():
                    return
            while not stop.is_set():
                snap = _native(self._snap())
                if snap and int((snap.get("paths") or {}).get("decode", 0) or 0) > n_dec:
                    mid[0] = snap
                    return
                stop.wait(self.poll_s)

        self._th = threading.Thread(target=poll, name="bench-step-poll", daemon=True)
        self._th.start()

    def first_token(self) -> None:
        """The current turn's first token has arrived: start polling for its first decode step."""
        self._go.set()

    def _disarm(self) -> None:
        self._stop.set()
        if self._th is not None:
            self._th.join(15)
            self._th = None

    def start(self) -> None:
        self.prev = self._snap()
        self._arm()

    def turn(self) -> None:
        self._disarm()
        cur = self._snap()
        if self.native:
            pn, cn = _native(self.prev), _native(cur)
            self.rows.append(turn_breakdown(pn, cn, self.mid) if cn and pn else None)
        self.timing.append(timing_turn((self.prev or {}).get("step_timing"), (cur or {}).get("step_timing")))
        self.prev = cur
        self._arm()

    def stop(self) -> None:
        self._disarm()
