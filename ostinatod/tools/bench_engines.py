"""``ostinato bench engines``: Ostinato against stock llama.cpp on the same model and sessions.

One command (issue 3, "Speed"; paper arXiv 2611.11533 Section 4 for the metrics):

1. writes (or reuses) a synthetic real-shape MoE model (Qwen3-30B-A3B shape, Q4_0 experts,
   ``--layers`` 24 by default) with :func:`ostinatod.tools.synth.write_synthetic_moe`;
2. splits the recorded sessions into development and held-out sets by task
   (:func:`ostinatod.tools.sessions.split_sessions`);
3. collects development routing traces by replaying a few turns of dev sessions through the
   Ostinato engine (in process, all experts cold: only the route counts matter);
4. plans a residency set with the pool budget at ``--budget-frac`` (45%) of the expert bytes;
5. runs the held-out sessions (``--sessions`` K, ``--turns`` N) through each engine, every one a
   real daemon (or llama-server) on loopback driven by the same replay client
   (``ostinato bench replay``):
   ``ostinato``      the resident expert pool with split/upload paths,
   ``stock-layers``  llama.cpp layer placement at equal GPU memory (``n_cpu_moe`` chosen so the
                     GPU-resident expert bytes match the pool's bytes; with ``--gpus N`` > 1
                     llama.cpp's own layer split over the N GPUs, by free memory),
   ``stock-cpu``     all experts on the CPU (attention on the GPU),
   ``llama-server``  the stock llama-server binary of the same build (``ostinato build
                     --with-server``), same n_cpu_moe as stock-layers;
6. prints a table and writes ``<out-dir>/<name>.json`` and ``<name>.md``.

Figures per engine: decode ms/token (median TPOT), median TTFT after tool outputs, median prefill
time (TTFT) by bucket of new tokens (<128, 128-511, 512-2047, >=2048), total session time (sum of
request times), hot-route share (share of routes computed from GPU-resident experts), and ratios to
the best stock baseline per metric (> 1: Ostinato is faster).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from ..paths import get_paths
from .sessions import WORKLOAD_OF_SESSION

BUCKETS = ((0, 128, "<128"), (128, 512, "128-511"), (512, 2048, "512-2047"), (2048, 1 << 62, ">=2048"))
ENGINES = ("ostinato", "stock-layers", "stock-cpu", "llama-server")
STOCK = ("stock-layers", "stock-cpu", "llama-server")
WORKLOAD_OF_FILE = WORKLOAD_OF_SESSION  # keyed by file stem: swe.jsonl, tau2.jsonl
_T0 = time.monotonic()


class BenchError(RuntimeError):
    """The benchmark cannot continue (missing model writer, engine failed to start, ...)."""


def say(msg: str) -> None:
    """Progress line with elapsed seconds (stdout, flushed: the lead watches it live)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# model, sessions
# --------------------------------------------------------------------------------------------

def prepare_model(a: argparse.Namespace) -> Path:
    """The model to benchmark: ``--model``, or a synthetic one written once into the models dir."""
    if a.model:
        if not Path(a.model).is_file():
            raise BenchError(f"model not found: {a.model}")
        return Path(a.model).resolve()
    from ..synth.writer import write_synthetic_moe

    d = get_paths().models_dir
    d.mkdir(parents=True, exist_ok=True)
    layers = f"-L{a.layers}" if a.layers else ""
    path = d / f"bench-qwen3moe-{a.shape}{layers}-{a.quant}-s{a.seed}.gguf"
    if path.exists():
        say(f"model: reusing {path} ({path.stat().st_size / 2**30:.2f} GiB)")
        return path
    say(f"model: writing {path.name} (qwen3moe, shape {a.shape}, layers {a.layers or 'default'}, "
        f"{a.quant} experts)")
    write_synthetic_moe(path, arch="qwen3moe", shape=a.shape, n_layer=a.layers, quant=a.quant,
                        seed=a.seed, progress=a.verbose)
    say(f"model: written, {path.stat().st_size / 2**30:.2f} GiB")
    return path


def default_sessions_dir() -> Path:
    """Where the recorded sessions are, on this machine or the GPU machine (see --sessions-dir)."""
    root = Path(__file__).resolve().parents[2]
    env = os.environ.get("OSTINATO_SESSIONS_DIR")
    for d in ([Path(env)] if env else []) + [root / "shared" / "sessions",
                                             root.parent / "shared" / "sessions",
                                             root / ".carry" / "sessions", Path("/work/shared/sessions")]:
        if d.is_dir():
            return d
    raise BenchError("recorded sessions not found: pass --sessions-dir (e.g. copy "
                     "../shared/sessions into .carry/sessions for the GPU machine)")


def _assistant_turns(s: dict[str, Any]):
    from .sessions import assistant_turns

    return assistant_turns(s)


def select_sessions(a: argparse.Namespace) -> tuple[Path, list[dict], list[dict]]:
    """(sessions file, dev sessions, held-out sessions) after the task-grouped split.

    Sessions with tool schemas (function calling) come first, so that turns follow tool outputs.
    """
    from .sessions import split_sessions

    f = Path(a.sessions_dir or default_sessions_dir()) / a.sessions_file
    if not f.is_file():
        raise BenchError(f"sessions file not found: {f}")
    dev, held = split_sessions(f, held_out_frac=1 / 3, seed=a.seed)

    def order(ss: list[dict]) -> list[dict]:
        return sorted(ss, key=lambda s: (not s.get("tools"), s["id"]))

    dev = [s for s in order(dev) if len(_assistant_turns(s)) >= 2][: a.dev_sessions]
    held = [s for s in order(held) if len(_assistant_turns(s)) >= 2][: a.sessions]
    if not dev or not held:
        raise BenchError(f"{f}: not enough sessions after the split (dev {len(dev)}, held-out {len(held)})")
    return f, dev, held


# --------------------------------------------------------------------------------------------
# development traces (in-process engine) and plan
# --------------------------------------------------------------------------------------------

def collect_dev_traces(model: Path, block: dict[str, Any], dev: list[dict], a: argparse.Namespace,
                       run_dir: Path, workload: str):
    """Replay ``a.dev_turns`` turns of each dev session through the Ostinato engine in this process
    (all experts cold: an empty residency set) and return the accumulated :class:`Trace`."""
    from ..residency.sets import make_residency, write_residency
    from ..residency.traces import Trace
    from ..engine.types import GenRequest
    from ..engine.worker import Worker
    from ..settings import load_settings
    from .sessions import assistant_text

    empty = write_residency(make_residency(block, {}, workload=workload), run_dir / "residency-empty.json")
    s = load_settings(model=model, experts="ostinato", residency=empty, n_slots=1, n_ctx=a.n_ctx,
                      n_threads=a.threads, engine_mode="inprocess", prefill_threshold=a.prefill_threshold)
    w = Worker(s, model)
    w.load()
    if w.rt is None:
        w.close()
        raise BenchError("the Ostinato expert engine is not active (stale native build? run "
                         "'ostinato build'): no routing counts to plan from")
    th = threading.Thread(target=w.run, name="bench-dev-worker", daemon=True)
    th.start()
    trace = Trace.empty(block, workload)
    n_req = 0
    try:
        for si, sess in enumerate(dev):
            for turn in _assistant_turns(sess)[: a.dev_turns]:
                gen = max(1, min(a.dev_max_gen, len(w.tokenize(assistant_text(turn.target),
                                                               add_special=False))))
                req = GenRequest(id=f"dev-{si}-{turn.index}", messages=turn.context,
                                 tools=sess.get("tools") or None, max_tokens=gen, ignore_eos=True,
                                 temperature=0.0, workload=workload)
                done = _run_one(w, req)
                ex = done.get("experts") or {}
                from ..residency.traces import counts_from_stats

                pre, dec = counts_from_stats(ex, block["n_layer"], block["n_expert"])
                trace.add_counts(pre, dec)
                u = done.get("usage", {})
                trace.add_request(u.get("prompt_tokens", 0), u.get("prefilled_tokens", 0),
                                  u.get("completion_tokens", 0), len(sess.get("tools") or []))
                n_req += 1
            say(f"dev traces: session {si + 1}/{len(dev)} {sess['id']} done "
                f"({trace.total_routes} routes so far)")
    finally:
        w.shutdown()
        th.join(60)
        w.close()
    if trace.total_routes == 0:
        raise BenchError("the engine reported no routes for the dev turns")
    trace.save(run_dir / "trace-dev.json")
    return trace


def _run_one(w, req, timeout: float = 900) -> dict[str, Any]:
    import queue

    q: "queue.Queue" = queue.Queue()
    w.submit(req, q.put)
    deadline = time.monotonic() + timeout
    while True:
        ev = q.get(timeout=max(1.0, deadline - time.monotonic()))
        if ev.type == "done":
            return ev.data
        if ev.type == "error":
            raise BenchError(f"dev request {req.id} failed: {ev.data.get('message')}")


def plan(model: Path, dev, a: argparse.Namespace, run_dir: Path, workload: str) -> tuple[dict, Path, dict]:
    """Plan the residency set at ``a.budget_frac``; returns (residency, path, stock placement)."""
    from ..residency.planner import plan_residency, read_model_shape, resolve_gpus, write_residency

    shape = read_model_shape(model)
    res = plan_residency(shape, dev, workload=workload, gpus=resolve_gpus(getattr(a, "gpus", 1)),
                         budget_frac=a.budget_frac, source_traces=[str(run_dir / "trace-dev.json")])
    path = write_residency(res, run_dir / "residency.json")
    pool = res["plan"]["pool_bytes_total"]
    moe = shape.moe_layers
    layer_bytes = shape.expert_bytes[moe[0]] * shape.n_expert
    gpu_layers = min(len(moe), max(0, round(pool / layer_bytes)))
    n_cpu_moe = shape.n_layer - gpu_layers if gpu_layers else shape.n_layer
    stock = {"n_cpu_moe": n_cpu_moe, "gpu_expert_layers": gpu_layers,
             "gpu_expert_bytes": gpu_layers * layer_bytes, "pool_bytes": pool,
             "expert_bytes_total": shape.total_expert_bytes,
             # every token routes k experts in every MoE layer: the GPU's share of routes is the
             # share of MoE layers whose experts it holds
             "hot_route_share": gpu_layers / len(moe)}
    # per GPU: its layer range (first, last) and pool bytes
    stock["gpus"] = [{"device": g["device"], "pool_bytes": c["pool_bytes"],
                      "layers": [g["layers"][0], g["layers"][-1]] if g["layers"] else []}
                     for g, c in zip(res["gpus"], res["plan"]["capacity"])]
    say(f"plan: {len(res['gpus'])} GPU(s), "
        f"{sum(len(v) for g in res['gpus'] for v in g['hot'].values())} hot experts, pool "
        f"{pool / 2**20:.1f} MiB = {pool / shape.total_expert_bytes:.1%} of expert bytes, dev hot-route "
        f"share {res['plan']['dev_hot_route_share']:.1%}; stock-layers: n_cpu_moe {n_cpu_moe} "
        f"({gpu_layers} layers' experts = {stock['gpu_expert_bytes'] / 2**20:.1f} MiB on the GPU)")
    return res, path, stock


# --------------------------------------------------------------------------------------------
# engines: daemons and llama-server on loopback
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
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


class Server:
    """A server process on loopback (our daemon or llama-server), stopped by :meth:`stop`."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 url_file: Optional[Path] = None, url: Optional[str] = None):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url_file, self.url = url_file, url

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

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def gpu_env(a: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """``env`` with CUDA_VISIBLE_DEVICES limited to the first ``--gpus`` N GPUs when the machine
    has more (so every engine, stock ones included, uses the same GPUs); unchanged when the
    variable is already set, when --gpus is "auto", or when there are no more GPUs than N."""
    n = str(getattr(a, "gpus", 1))
    if "CUDA_VISIBLE_DEVICES" in env or not n.isdigit():
        return env
    from ..residency.planner import detect_gpus

    if len(detect_gpus()) > int(n):
        env = dict(env, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(int(n))))
    return env


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
            "n_threads": a.threads, "prefill_threshold": a.prefill_threshold, "log_level": "INFO"}
    for k, v in {**base, **settings}.items():
        if v is not None:
            env[f"OSTINATO_{k.upper()}"] = str(v)
    cmd = [sys.executable, "-m", "ostinatod.daemon_cli", "run", "--port", "0", "--host", "127.0.0.1"]
    return Server(name, cmd, env, run_dir / f"{name}.log", url_file=home / "run" / "ostinatod.json")


def llama_server_binary() -> Optional[Path]:
    """The stock llama-server of our build (``ostinato build --with-server``), or None."""
    for home in {get_paths().native_dir, Path.home() / ".local/share/ostinato/native"}:
        p = Path(home) / "bin" / "llama-server"
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def start_llama_server(binary: Path, model: Path, n_cpu_moe: int, run_dir: Path,
                       a: argparse.Namespace) -> Server:
    """Stock llama-server: all layers on the GPU except the experts of the first n_cpu_moe layers."""
    port = _free_port()
    threads = a.threads or _physical_cores()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(a.n_ctx * 2), "-np", "2", "-ngl", "999", "--n-cpu-moe", str(n_cpu_moe),
           "-t", str(threads), "-tb", str(threads), "--jinja", "-b", "2048", "-ub", "512",
           "--cache-reuse", "0"]
    env = gpu_env(a, dict(os.environ))
    try:
        import llama_cpp

        lib = Path(llama_cpp.__file__).parent / "lib"
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    except ImportError:
        pass
    return Server("llama-server", cmd, env, run_dir / "llama-server.log",
                  url=f"http://127.0.0.1:{port}")


def _physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _model_name(url: str) -> str:
    code, body = _get(url + "/v1/models")
    try:
        return body["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return "default"


def replay(url: str, sessions_file: Path, held: list[dict], a: argparse.Namespace, out: Path) -> dict:
    """Replay the held-out sessions against ``url`` with the one replay client
    (:func:`ostinatod.tools.replay.run_replay`, what ``ostinato bench replay`` runs); the result
    JSON is also written to ``out``."""
    from .replay import run_replay

    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        if a.verbose:
            say("    " + line)

    data = run_replay(held, url, client=a.client, model=_model_name(url), max_turns=a.turns,
                      log=log, sessions_file=str(sessions_file))
    out.write_text(json.dumps(data, indent=1))
    out.with_suffix(".log").write_text("\n".join(log_lines) + "\n")
    return data


def expert_stats(home: Path) -> dict[str, Any]:
    """The Ostinato daemon's expert counters through the control API (Unix socket)."""
    import asyncio

    import aiohttp

    sock = home / "run" / "control.sock"

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            async with s.get("http://ostinato/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return await r.json()

    try:
        snap = asyncio.run(go())
    except Exception as e:  # the control API is an optional part: report, don't fail the run
        return {"error": f"control API: {e}"}
    ex = snap.get("experts") or {}
    eng = (snap.get("engine") or {}).get("experts") or {}
    return {"hot_route_share": ex.get("hot_route_share", eng.get("hot_route_share")),
            "paths": ex.get("paths") or eng.get("paths"), "routes": ex.get("routes", eng.get("routes")),
            "cold_routes": ex.get("cold_routes", eng.get("cold_routes")),
            "upload_bytes": eng.get("upload_bytes"), "prefill_threshold": eng.get("prefill_threshold")}


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------

def _med(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def replay_turns(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Flatten a replay JSON into turn dicts: {session, ttft_s, tpot_s, total_s, new_tokens,
    completion_tokens, after (tool|user|first), error}."""
    out = []
    for s in data.get("sessions", []):
        for i, t in enumerate(s.get("turns", [])):
            u = t.get("usage") or {}
            prompt = t.get("prompt_tokens", u.get("prompt_tokens"))
            cached = t.get("cached_tokens", u.get("cached_tokens")) or 0
            new = t.get("new_tokens", t.get("prefilled_tokens"))
            if new is None and prompt is not None:
                new = prompt - cached
            after = t.get("after") or t.get("kind") or ("first" if i == 0 else None)
            out.append({"session": s.get("id"), "ttft_s": t.get("ttft_s"), "tpot_s": t.get("tpot_s"),
                        "total_s": t.get("total_s"), "new_tokens": new,
                        "completion_tokens": t.get("completion_tokens", u.get("completion_tokens")),
                        "after": after, "error": t.get("error")})
    return out


def engine_metrics(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-engine figures from its replay turns (see module docstring)."""
    ok = [t for t in turns if not t.get("error")]
    buckets = {}
    for lo, hi, name in BUCKETS:
        xs = [t["ttft_s"] for t in ok if t["new_tokens"] is not None and lo <= t["new_tokens"] < hi]
        buckets[name] = {"median_s": _med(xs), "turns": len(xs)}
    tpot = _med([t["tpot_s"] for t in ok])
    sessions: dict[str, float] = {}
    for t in ok:
        sessions[t["session"]] = sessions.get(t["session"], 0.0) + (t["total_s"] or 0.0)
    return {
        "decode_ms_per_token": tpot * 1e3 if tpot is not None else None,
        "ttft_after_tool_median_s": _med([t["ttft_s"] for t in ok if t["after"] == "tool"]),
        "ttft_after_user_median_s": _med([t["ttft_s"] for t in ok if t["after"] == "user"]),
        "ttft_median_s": _med([t["ttft_s"] for t in ok]),
        "new_tokens_median": _med([t["new_tokens"] for t in ok if t["new_tokens"] is not None]),
        "prefill_by_new_tokens": buckets,
        "session_total_s": sum(sessions.values()) if ok else None,
        "turns": len(turns), "errors": len(turns) - len(ok),
    }


def ratios(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ostinato against the best stock engine per metric (> 1: Ostinato faster)."""
    o = engines.get("ostinato") or {}
    out: dict[str, Any] = {}
    for key, metric in (("decode", "decode_ms_per_token"), ("ttft_after_tool", "ttft_after_tool_median_s"),
                        ("session_total", "session_total_s")):
        stock = {n: e.get(metric) for n, e in engines.items() if n in STOCK and e.get(metric)}
        if not stock or not o.get(metric):
            out[key] = None
            continue
        best = min(stock, key=stock.get)
        out[key] = round(stock[best] / o[metric], 3)
        out[f"{key}_best_stock"] = best
    return out


def machine_info() -> dict[str, Any]:
    """CPU, RAM and GPUs of this machine (psutil, pynvml)."""
    import psutil

    from ..residency.planner import detect_gpus

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "physical_cores": psutil.cpu_count(logical=False),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpus": [{"name": g.name, "free_gib": round((g.free_bytes or 0) / 2**30, 1)} for g in detect_gpus()],
            "platform": platform.platform()}


def _fmt(v: Any, unit: str = "", nd: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}{unit}"
    return f"{v}{unit}"


def markdown(result: dict[str, Any]) -> str:
    """Markdown table of a result (written next to the JSON)."""
    eng = result["engines"]
    names = list(eng)
    lines = [f"# {result['name']}", "", f"Command: `{result['command']}`", "",
             f"Model: {result['model']['name']} ({result['model']['file']}), "
             f"{result['model']['n_layer']} layers x {result['model']['n_expert']} experts, "
             f"k = {result['model']['n_expert_used']}; pool budget "
             f"{result['plan']['budget_frac']:.0%} of expert bytes; stock-layers n_cpu_moe = "
             f"{result['plan']['stock']['n_cpu_moe']}; GPUs planned: "
             f"{len(result['plan']['stock'].get('gpus') or [None])}.", "",
             f"Machine: {result['machine']['cpu']} ({result['machine']['physical_cores']} cores), "
             f"GPUs: {', '.join(g['name'] for g in result['machine']['gpus']) or 'none'}.", "",
             f"Held-out sessions: {', '.join(result['sessions']['held_out'])} "
             f"({result['sessions']['turns_per_session']} turns each).", "",
             "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    rows = [("decode ms/token", "decode_ms_per_token", "", 2),
            ("median TTFT after tool (s)", "ttft_after_tool_median_s", "", 3),
            ("median TTFT after user (s)", "ttft_after_user_median_s", "", 3),
            ("session total (s)", "session_total_s", "", 2),
            ("hot-route share", "hot_route_share", "", 3)]
    for label, key, unit, nd in rows:
        lines.append(f"| {label} | " + " | ".join(_fmt(eng[n].get(key), unit, nd) for n in names) + " |")
    for _, _, b in BUCKETS:
        lines.append(f"| prefill {b} new tokens (s) | " + " | ".join(
            _fmt((eng[n].get("prefill_by_new_tokens") or {}).get(b, {}).get("median_s"), "", 3)
            + f" ({(eng[n].get('prefill_by_new_tokens') or {}).get(b, {}).get('turns', 0)})"
            for n in names) + " |")
    lines.append("| turns (errors) | " + " | ".join(f"{eng[n].get('turns')} ({eng[n].get('errors')})"
                                                   for n in names) + " |")
    r = result["ratios_vs_best_stock"]
    lines += ["", "Ratios to the best stock engine per metric (> 1: Ostinato faster): "
              + ", ".join(f"{k} {_fmt(r.get(k), 'x')} (vs {r.get(k + '_best_stock')})"
                          for k in ("decode", "ttft_after_tool", "session_total")), ""]
    for n in result.get("notes", []):
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ostinato bench engines",
                                 description="Ostinato vs stock llama.cpp on one model and the same "
                                             "held-out agent sessions (see docs/benchmarks/README.md).")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="synthetic model shape (tiny, small, "
                    "qwen3-30b-a3b)")
    ap.add_argument("--layers", type=int, help="layers of the synthetic model (default 24 for "
                    "qwen3-30b-a3b, the shape's own otherwise)")
    ap.add_argument("--quant", default="q4_0", help="expert quantization of the synthetic model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, help="benchmark this GGUF instead of a synthetic model")
    ap.add_argument("--sessions-dir", type=Path, default=None,
                    help="recorded sessions (default: the first existing of $OSTINATO_SESSIONS_DIR, "
                         "./shared/sessions, ../shared/sessions, .carry/sessions, /work/shared/sessions)")
    ap.add_argument("--sessions-file", default="swe.jsonl", help="file in --sessions-dir")
    ap.add_argument("--dev-sessions", type=int, default=3, help="dev sessions replayed for traces")
    ap.add_argument("--dev-turns", type=int, default=6, help="turns per dev session")
    ap.add_argument("--dev-max-gen", type=int, default=48, help="generated tokens per dev turn (cap)")
    ap.add_argument("--sessions", type=int, default=2, help="held-out sessions per engine")
    ap.add_argument("--turns", type=int, default=16, help="turns per held-out session")
    ap.add_argument("--budget-frac", type=float, default=0.45, help="pool budget (fraction of "
                    "expert bytes)")
    ap.add_argument("--gpus", default="1", help="GPUs to plan for and run on: N (the first N; "
                    "emulated when fewer exist) or 'auto' (all detected). N > 1: one pool per GPU, "
                    "layers split across them; stock engines use llama.cpp's layer split")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ", ".join(ENGINES))
    ap.add_argument("--no-server", action="store_true", help="skip the llama-server baseline")
    ap.add_argument("--client", default="openai", choices=("openai", "anthropic"))
    ap.add_argument("--n-ctx", type=int, default=32768, help="context per slot")
    ap.add_argument("--threads", type=int, help="CPU threads (default: physical cores)")
    ap.add_argument("--prefill-threshold", type=int, help="Np for Ostinato (default: calibration "
                    "or 512)")
    ap.add_argument("--name", help="result name (default engines-<shape>-L<layers>)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--work-dir", type=Path, help="keep logs, traces and replay JSON here")
    ap.add_argument("--engine-mode", default="subprocess", choices=("subprocess", "inprocess"),
                    help="engine worker mode of the daemons (default: the daemon's default)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def run(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The whole benchmark; returns the result dict (also written to ``a.out_dir``)."""
    from ..residency.planner import read_model_shape

    if a.layers is None and a.shape == "qwen3-30b-a3b" and not a.model:
        a.layers = 24
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise BenchError(f"unknown engines {bad}; choose from {', '.join(ENGINES)}")
    if a.no_server and "llama-server" in engines:
        engines.remove("llama-server")
    if "ostinato" not in engines:
        raise BenchError("the engine list must include ostinato")
    run_dir = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ostinato-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    say(f"work dir {run_dir}")
    workload = WORKLOAD_OF_FILE.get(Path(a.sessions_file).stem, "coding")

    model = prepare_model(a)
    block = read_model_shape(model).model_block()  # parsed once (cached) for the plan as well
    sessions_file, dev, held = select_sessions(a)
    say(f"sessions: dev {[s['id'] for s in dev]}, held-out {[s['id'] for s in held]}")
    # only the held-out sessions go to the replay client: a file with just them
    held_file = run_dir / "held-out.jsonl"
    held_file.write_text("".join(json.dumps(s) + "\n" for s in held))

    say(f"dev traces: {len(dev)} sessions x {a.dev_turns} turns through the Ostinato engine")
    trace = collect_dev_traces(model, block, dev, a, run_dir, workload)
    res, res_path, stock = plan(model, trace, a, run_dir, workload)

    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for name in engines:
        say(f"engine {name}: starting")
        t0 = time.monotonic()
        try:
            if name == "llama-server":
                binary = llama_server_binary()
                if binary is None:
                    notes.append("llama-server: binary not found (run 'ostinato build --with-server'); "
                                 "baseline skipped")
                    say(notes[-1])
                    continue
                srv = start_llama_server(binary, model, stock["n_cpu_moe"], run_dir, a)
            else:
                st = {"ostinato": {"experts": "ostinato", "residency": res_path},
                      "stock-layers": {"experts": "stock", "n_cpu_moe": stock["n_cpu_moe"]},
                      "stock-cpu": {"experts": "stock", "n_cpu_moe": block["n_layer"]}}[name]
                srv = start_daemon(name, model, st, run_dir, a)
        except BenchError as e:
            notes.append(f"{name}: {e}")
            say(notes[-1])
            continue
        try:
            url = srv.wait_ready(a.start_timeout)
            load_s = time.monotonic() - t0
            say(f"engine {name}: ready at {url} after {load_s:.1f} s; replaying")
            data = replay(url, held_file, held, a, run_dir / f"replay-{name}.json")
            m = engine_metrics(replay_turns(data))
            m["load_s"] = round(load_s, 2)
            if name == "ostinato":
                ex = expert_stats(run_dir / f"home-{name}")
                m["expert_stats"] = ex
                m["hot_route_share"] = ex.get("hot_route_share")
            else:
                m["hot_route_share"] = 0.0 if name == "stock-cpu" else stock["hot_route_share"]
            results[name] = m
            say(f"engine {name}: decode {_fmt(m['decode_ms_per_token'], ' ms/tok')}, TTFT after tool "
                f"{_fmt(m['ttft_after_tool_median_s'], ' s', 3)}, session total "
                f"{_fmt(m['session_total_s'], ' s')}, hot-route share {_fmt(m['hot_route_share'], '', 3)}"
                f", errors {m['errors']}/{m['turns']}")
        except BenchError as e:
            notes.append(f"{name}: {e}")
            say(f"engine {name} failed: {e}")
        finally:
            srv.stop()

    result = {
        "name": a.name or f"engines-{a.shape}" + (f"-L{a.layers}" if a.layers else ""),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": "ostinato bench engines " + " ".join(argv),
        "model": {**block, "file": model.name, "shape": a.shape, "quant": a.quant,
                  "bytes": model.stat().st_size},
        "sessions": {"file": str(sessions_file), "dev": [s["id"] for s in dev],
                     "held_out": [s["id"] for s in held], "turns_per_session": a.turns,
                     "dev_turns_per_session": a.dev_turns, "workload": workload},
        "plan": {"budget_frac": a.budget_frac, "pool_bytes": res["plan"]["pool_bytes_total"],
                 "dev_hot_route_share": res["plan"]["dev_hot_route_share"], "stock": stock},
        "engines": results,
        "ratios_vs_best_stock": ratios(results),
        "notes": notes,
        "total_s": round(time.monotonic() - _T0, 1),
    }
    return result


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``ostinato bench engines`` (dispatched from ostinatod/tools/bench.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    try:
        result = run(a, argv)
    except BenchError as e:
        print(f"ostinato bench engines: {e}", file=sys.stderr)
        return 1
    a.out_dir.mkdir(parents=True, exist_ok=True)
    jpath = a.out_dir / f"{result['name']}.json"
    jpath.write_text(json.dumps(result, indent=1))
    md = markdown(result)
    jpath.with_suffix(".md").write_text(md)
    print(md)
    say(f"written {jpath} and {jpath.with_suffix('.md')}")
    missing = [n for n in ("ostinato",) if n not in result["engines"]]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
