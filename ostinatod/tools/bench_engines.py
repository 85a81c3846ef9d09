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
                     --with-server``), same n_cpu_moe as stock-layers,
   ``stock-all-gpu`` the reference limit, not a baseline at equal memory: every layer and every
                     expert on the GPU (``experts = stock``, ``n_cpu_moe = 0``), run when the model
                     fits the free GPU memory (skipped with a note otherwise; on a machine without
                     GPU it runs CPU-only like every other engine, noted);
6. with ``--budget-sweep F1,F2,...`` also runs the Ostinato engine at each of those pool budgets
   (the baselines and the limit run once, at ``--budget-frac``);
7. prints a table and writes ``<out-dir>/<name>.json`` and ``<name>.md`` (after every engine, so an
   interrupted run leaves what it measured), and with a sweep ``<name>.svg``
   (:mod:`ostinatod.tools.bench_plot`, also ``ostinato bench plot X.json``).

Figures per engine: decode ms/token (median TPOT), median TTFT after tool outputs, median prefill
time (TTFT) by bucket of new tokens (<128, 128-511, 512-2047, >=2048), total session time (sum of
request times), hot-route share (share of routes computed from GPU-resident experts), ratios to
the best stock baseline per metric (``ratios_vs_best_stock``, > 1: Ostinato is faster) and to the
limit (``ratios_vs_limit``: Ostinato / stock-all-gpu, the slowdown factor, 1 = the limit). For the
Ostinato engine, ``step_breakdown``: the native engine's per-pass times (``cpu_branch_ms``,
``gpu_branch_ms``, ``upload_ms``, ``total_ms`` and any other ``*_ms`` key) as means per decode step
and per prefill, from snapshots of the daemon's expert stats around every replayed turn (before,
after, and at its first decode step).
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
ENGINES = ("ostinato", "stock-all-gpu", "stock-layers", "stock-cpu", "llama-server")
STOCK = ("stock-layers", "stock-cpu", "llama-server")  # the baselines at equal GPU memory
LIMIT = "stock-all-gpu"  # every expert on the GPU: the reference limit, never a baseline
METRICS = (("decode", "decode_ms_per_token"), ("ttft_after_tool", "ttft_after_tool_median_s"),
           ("session_total", "session_total_s"))
# seconds per replayed turn on the H200 machine at 48 layers (issue 9: session s / 16 turns); only
# for the time estimates printed before each engine, rescaled by the first engine measured
PRIOR_TURN_S = {"ostinato": 1.6, "stock-all-gpu": 0.65, "stock-layers": 3.6, "llama-server": 3.9,
                "stock-cpu": 7.0}
PRIOR_LOAD_S = 30.0
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


def plan(model: Path, dev, a: argparse.Namespace, run_dir: Path, workload: str,
         budget_frac: Optional[float] = None, file_name: str = "residency.json") -> tuple[dict, Path, dict]:
    """Plan the residency set at ``budget_frac`` (default ``a.budget_frac``); returns (residency,
    path, stock placement at equal memory)."""
    from ..residency.planner import plan_residency, read_model_shape, resolve_gpus, write_residency

    shape = read_model_shape(model)
    frac = a.budget_frac if budget_frac is None else budget_frac
    res = plan_residency(shape, dev, workload=workload, gpus=resolve_gpus(getattr(a, "gpus", 1)),
                         budget_frac=frac, source_traces=[str(run_dir / "trace-dev.json")])
    path = write_residency(res, run_dir / file_name)
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
    say(f"plan at {frac:.0%}: {len(res['gpus'])} GPU(s), "
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


def limit_fit(model: Path, a: argparse.Namespace, gpus: Optional[list] = None) -> dict[str, Any]:
    """Whether ``stock-all-gpu`` can run: the model's bytes (every expert, the dense weights, the
    output head), its f16 KV cache for the daemon's 2 slots x ``--n-ctx`` and one ubatch of compute
    (the planner's :func:`estimate_gpu_need`), plus a 1 GiB margin, against the free memory of the
    GPUs the engines use (the hardware probe: NVML via :func:`detect_gpus`).

    Returns ``{"run": bool, "gpu": bool (False: no GPU, runs CPU-only), "need_bytes", "free_bytes",
    "note": str or None}``."""
    from ..residency.planner import detect_gpus, estimate_gpu_need, read_model_shape

    found = detect_gpus() if gpus is None else gpus
    n = str(getattr(a, "gpus", 1))
    used = found if not n.isdigit() else found[: int(n)]
    shape = read_model_shape(model)
    need = estimate_gpu_need(shape, range(shape.n_layer), 2 * a.n_ctx, last=True)
    need_b = shape.total_expert_bytes + need["dense"] + need["kv"] + need["compute"] + 2**30
    if not used:
        return {"run": True, "gpu": False, "need_bytes": need_b, "free_bytes": None,
                "note": f"{LIMIT}: no GPU found: it ran CPU-only like the other engines (the same "
                        "placement as stock-layers on a CPU build), so its figures are not the "
                        "all-GPU limit here; ratios_vs_limit only check the plumbing"}
    free = sum(g.free_bytes or 0 for g in used)
    ok = all(g.free_bytes is not None for g in used) and need_b <= free
    return {"run": ok, "gpu": True, "need_bytes": need_b, "free_bytes": free,
            "note": None if ok else
            f"{LIMIT}: skipped, the model does not fit: needs ~{need_b / 2**30:.1f} GiB (experts, "
            f"dense weights, KV cache for 2 x {a.n_ctx} tokens, compute, 1 GiB margin), "
            f"{free / 2**30:.1f} GiB free on {len(used)} GPU(s); no ratios_vs_limit"}


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


def replay(url: str, sessions_file: Path, held: list[dict], a: argparse.Namespace, out: Path,
           on_turn=None) -> dict:
    """Replay the held-out sessions against ``url`` with the one replay client
    (:func:`ostinatod.tools.replay.run_replay`, what ``ostinato bench replay`` runs); the result
    JSON is also written to ``out``. ``on_turn()`` runs after every turn (outside its timing)."""
    from .replay import run_replay

    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        if a.verbose:
            say("    " + line)
        if on_turn is not None:
            on_turn()

    data = run_replay(held, url, client=a.client, model=_model_name(url), max_turns=a.turns,
                      log=log, sessions_file=str(sessions_file))
    out.write_text(json.dumps(data, indent=1))
    out.with_suffix(".log").write_text("\n".join(log_lines) + "\n")
    return data


def control_metrics(home: Path, timeout: float = 10.0) -> dict[str, Any]:
    """The daemon's ``/metrics`` snapshot through the control API (HTTP on its Unix socket; plain
    http.client: cheap enough to poll). Raises on failure."""
    import http.client

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
            "upload_bytes": eng.get("upload_bytes"), "prefill_threshold": eng.get("prefill_threshold")}


# --------------------------------------------------------------------------------------------
# per-step breakdown of the Ostinato engine (native per-pass stats)
# --------------------------------------------------------------------------------------------

def _ms_keys(d: dict[str, Any]) -> dict[str, float]:
    """The ``*_ms`` figures of a stats dict (any such key: the native side adds new ones)."""
    return {k: float(v) for k, v in d.items()
            if k.endswith("_ms") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _indexed(snap: Optional[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``last_passes`` of a stats snapshot keyed by pass number (0 = the first since load): the ring
    holds the last passes up to the cumulative ``passes`` count, both updated under one lock."""
    if not snap:
        return {}
    n, ring = int(snap.get("passes") or 0), list(snap.get("last_passes") or [])
    return {n - len(ring) + i: p for i, p in enumerate(ring)}


def turn_breakdown(prev: dict[str, Any], cur: dict[str, Any],
                   mid: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Per-turn split of the native engine's pass times between the turn's prefill passes (path
    split/upload) and its decode steps, from snapshots of ``ExpertRuntime.stats()`` (cumulative
    totals, ``paths`` counts, ``last_passes``: the last 32 passes) taken before the turn (``prev``),
    after it (``cur``) and, optionally, just after its first decode steps (``mid``: it holds the
    prefill passes however long the turn is).

    When every prefill pass of the turn was seen (in ``mid`` or ``cur``) the split is exact: decode
    = the turn's cumulative delta minus the prefill passes. Otherwise (no ``mid`` and more than 32
    passes) the decode steps are estimated as ``steps x the mean of the steps seen`` and the
    prefill as the delta minus that (``exact`` False). Keys only in the per-pass dicts (not in the
    totals) are summed over the passes seen. Returns ``{"passes", "seen", "exact",
    "decode_steps", "decode_seen", "decode_ms" (sums over the turn's steps), "decode_cold_routes"
    (mean per step seen), "prefill_passes", "prefill_paths", "prefill_tokens", "prefill_ms" (sums
    over the turn's prefill passes), "gpu_timed" (share of the seen passes with GPU timing)}``."""
    p0 = int(prev.get("passes") or 0)
    dn = int(cur.get("passes") or 0) - p0
    known = {**_indexed(mid), **_indexed(cur)}
    seen = [known[i] for i in range(p0, p0 + dn) if i in known]
    pp, cp = prev.get("paths") or {}, cur.get("paths") or {}
    dpath = {k: int(cp.get(k, 0) or 0) - int(pp.get(k, 0) or 0) for k in set(pp) | set(cp)}
    n_dec = max(0, dpath.get("decode", 0))
    pre_paths = {k: v for k, v in dpath.items() if k != "decode" and v > 0}
    n_pre = sum(pre_paths.values())
    dec_seen = [p for p in seen if p.get("path") == "decode"]
    pre_seen = [p for p in seen if p.get("path") != "decode"]
    tot_prev, tot_cur = _ms_keys(prev), _ms_keys(cur)
    keys = sorted(set(tot_cur).union(*[_ms_keys(p) for p in seen]))

    def ssum(ps: list[dict], k: str) -> float:
        return sum(_ms_keys(p).get(k, 0.0) for p in ps)

    exact = len(seen) == dn
    all_pre = len(pre_seen) >= n_pre
    dec_ms: dict[str, Optional[float]] = {}
    pre_ms: dict[str, Optional[float]] = {}
    for k in keys:
        delta = tot_cur[k] - tot_prev[k] if k in tot_cur and k in tot_prev else None
        mean_dec = ssum(dec_seen, k) / len(dec_seen) if dec_seen else None
        if all_pre:
            pre_ms[k] = ssum(pre_seen, k)
            if len(dec_seen) >= n_dec:
                dec_ms[k] = ssum(dec_seen, k)
            elif delta is not None:
                dec_ms[k] = delta - pre_ms[k]
            else:
                dec_ms[k] = n_dec * mean_dec if mean_dec is not None else None
        else:
            dec_ms[k] = n_dec * mean_dec if mean_dec is not None else (0.0 if n_dec == 0 else None)
            pre_ms[k] = delta - dec_ms[k] if delta is not None and dec_ms[k] is not None else None
    if all_pre:
        pre_tokens: Optional[int] = int(sum(p.get("tokens") or 0 for p in pre_seen))
    else:
        pre_tokens = int(cur.get("tokens") or 0) - int(prev.get("tokens") or 0) - n_dec
    cold = [p.get("cold_routes") for p in dec_seen if p.get("cold_routes") is not None]
    return {"passes": dn, "seen": len(seen), "exact": exact or all_pre,
            "decode_steps": n_dec, "decode_seen": len(dec_seen), "decode_ms": dec_ms,
            "decode_cold_routes": sum(cold) / len(cold) if cold else None,
            "prefill_passes": n_pre, "prefill_paths": pre_paths, "prefill_tokens": pre_tokens,
            "prefill_ms": pre_ms,
            "gpu_timed": (sum(1 for p in seen if p.get("gpu_timed")) / len(seen)) if seen else None}


def summarize_breakdown(rows: list[Optional[dict[str, Any]]], turns: list[dict[str, Any]]
                        ) -> dict[str, Any]:
    """Means per decode step and per prefill over the turns (``rows`` from :func:`turn_breakdown`,
    aligned with ``turns`` from :func:`replay_turns`; None rows: no snapshot). Returns
    ``{"decode_step": {"steps", "sampled_steps", "cold_routes_mean", "mean_ms": {key: ms}},
    "prefill": {"prefills", "passes", "paths", "tokens_mean", "exact_share", "mean_ms"},
    "prefill_after_tool": (the same over turns after tool outputs), "gpu_timed_share", "source"}``.
    """
    def dec(rs: list[dict]) -> dict[str, Any]:
        steps = sum(r["decode_steps"] for r in rs)
        keys = sorted({k for r in rs for k in r["decode_ms"]})
        mean = {}
        for k in keys:
            have = [r for r in rs if r["decode_ms"].get(k) is not None and r["decode_steps"]]
            n = sum(r["decode_steps"] for r in have)
            mean[k] = round(sum(r["decode_ms"][k] for r in have) / n, 4) if n else None
        cold = [(r["decode_cold_routes"], r["decode_seen"]) for r in rs if r["decode_cold_routes"] is not None]
        w = sum(c[1] for c in cold)
        return {"steps": steps, "sampled_steps": sum(r["decode_seen"] for r in rs),
                "cold_routes_mean": round(sum(c * n for c, n in cold) / w, 3) if w else None,
                "mean_ms": mean}

    def pre(rs: list[dict]) -> dict[str, Any]:
        rs = [r for r in rs if r["prefill_passes"] > 0]
        paths: dict[str, int] = {}
        for r in rs:
            for k, v in r["prefill_paths"].items():
                paths[k] = paths.get(k, 0) + v
        keys = sorted({k for r in rs for k in r["prefill_ms"]})
        mean = {}
        for k in keys:
            xs = [r["prefill_ms"][k] for r in rs if r["prefill_ms"].get(k) is not None]
            mean[k] = round(sum(xs) / len(xs), 4) if xs else None
        toks = [r["prefill_tokens"] for r in rs if r["prefill_tokens"] is not None]
        return {"prefills": len(rs), "passes": sum(r["prefill_passes"] for r in rs), "paths": paths,
                "tokens_mean": round(sum(toks) / len(toks), 1) if toks else None,
                "exact_share": round(sum(1 for r in rs if r["exact"]) / len(rs), 3) if rs else None,
                "mean_ms": mean}

    ok = [r for r in rows if r]
    after = [r for r, t in zip(rows, turns) if r and t.get("after") == "tool"]
    timed = [r["gpu_timed"] for r in ok if r["gpu_timed"] is not None]
    return {"decode_step": dec(ok), "prefill": pre(ok), "prefill_after_tool": pre(after),
            "gpu_timed_share": round(sum(timed) / len(timed), 3) if timed else None,
            "turns": len(rows), "turns_with_stats": len(ok),
            "source": "native per-pass stats (control API /metrics, engine.experts) before and after "
                      "every turn and after its first decode step; gpu_branch_ms is measured only in "
                      "timing mode (gpu_timed_share)"}


class StepRecorder:
    """Snapshots of the Ostinato daemon's expert stats around every replayed turn (control API):
    one before the first turn, one after every turn, and one per turn as soon as its first decode
    step has run (a poller every ``poll_s`` while the turn's prefill runs, stopped at the first
    decode step: it catches the prefill passes in the ring of the last 32 passes, at the cost of a
    few stats calls during the prefill)."""

    def __init__(self, home: Path, poll_s: float = 0.025):
        self.home, self.poll_s = home, poll_s
        self.prev: Optional[dict[str, Any]] = None
        self.mid: Optional[dict[str, Any]] = None
        self.rows: list[Optional[dict[str, Any]]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._th: Optional[threading.Thread] = None

    def _snap(self) -> Optional[dict[str, Any]]:
        try:
            ex = (control_metrics(self.home).get("engine") or {}).get("experts") or {}
        except Exception:  # noqa: BLE001 - the breakdown is optional: count and go on
            self.errors += 1
            return None
        return ex if "passes" in ex else None

    def _arm(self) -> None:
        self.mid, self._stop = None, threading.Event()
        base, stop = self.prev, self._stop
        if base is None:
            return
        n_dec = int((base.get("paths") or {}).get("decode", 0) or 0)

        def poll() -> None:
            while not stop.wait(self.poll_s):
                snap = self._snap()
                if snap and int((snap.get("paths") or {}).get("decode", 0) or 0) > n_dec:
                    self.mid = snap
                    return

        self._th = threading.Thread(target=poll, name="bench-step-poll", daemon=True)
        self._th.start()

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
        self.rows.append(turn_breakdown(self.prev, cur, self.mid) if cur and self.prev else None)
        self.prev = cur
        self._arm()

    def stop(self) -> None:
        self._disarm()


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


def ratios_vs_limit(engines: dict[str, dict[str, Any]], o: Optional[dict[str, Any]] = None
                    ) -> dict[str, Any]:
    """Ostinato (``o``, default ``engines["ostinato"]``) divided by ``stock-all-gpu`` per metric: the
    slowdown factor against every expert on the GPU (1 = the limit; issue 9's targets at a 45% pool:
    decode <= 1.4, TTFT after tool <= 1.6, session <= 1.5). None where either figure is missing."""
    o = engines.get("ostinato") or {} if o is None else o
    lim = engines.get(LIMIT) or {}
    return {key: (round(o[m] / lim[m], 3) if o.get(m) and lim.get(m) else None) for key, m in METRICS}


def ratios(engines: dict[str, dict[str, Any]], o: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Ostinato (``o``, default ``engines["ostinato"]``) against the best stock engine at equal
    memory per metric (> 1: Ostinato faster); ``stock-all-gpu`` is not one of them."""
    o = engines.get("ostinato") or {} if o is None else o
    out: dict[str, Any] = {}
    for key, metric in METRICS:
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
    lim = result.get("ratios_vs_limit") or {}
    o, le = eng.get("ostinato") or {}, eng.get(LIMIT) or {}
    lines += ["", "Ratios to the best stock engine at equal memory (best stock / Ostinato, > 1: "
              f"Ostinato faster) and to the limit `{LIMIT}` (Ostinato / {LIMIT}: the slowdown "
              "factor, 1 = every expert on the GPU):", "",
              "| metric | ostinato | best stock | ratio vs best stock | " + LIMIT + " | ratio vs limit |",
              "|---|---:|---|---:|---:|---:|"]
    for (k, m), nd in zip(METRICS, (2, 3, 2)):
        best = r.get(k + "_best_stock")
        lines.append(f"| {k} | {_fmt(o.get(m), '', nd)} | "
                     + (f"{best} {_fmt(eng[best].get(m), '', nd)}" if best in eng else "n/a")
                     + f" | {_fmt(r.get(k), 'x')} | {_fmt(le.get(m), '', nd)} | {_fmt(lim.get(k), 'x')} |")
    lines += _breakdown_md(o.get("step_breakdown"), "Ostinato")
    lines += _sweep_md(result)
    lines.append("")
    for n in result.get("notes", []):
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


def _breakdown_md(b: Optional[dict[str, Any]], who: str) -> list[str]:
    """Markdown lines for a ``step_breakdown`` (means in ms per decode step and per prefill)."""
    if not b:
        return []
    cols = [("decode step", b.get("decode_step") or {}), ("prefill", b.get("prefill") or {}),
            ("prefill after tool", b.get("prefill_after_tool") or {})]
    keys = sorted({k for _, c in cols for k in (c.get("mean_ms") or {})},
                  key=lambda k: (k != "total_ms", k))
    if not keys:
        return []
    d, p = cols[0][1], cols[1][1]
    out = ["", f"{who} per-step breakdown (native pass times, mean ms; {d.get('steps')} decode steps, "
           f"{d.get('sampled_steps')} seen pass by pass; {p.get('prefills')} prefills, paths "
           f"{p.get('paths')}, {_fmt(p.get('exact_share'), '', 2)} of them exact; GPU-branch timing "
           f"on in {_fmt(b.get('gpu_timed_share'), '', 2)} of the passes):", "",
           "| ms | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    for k in keys:
        out.append(f"| {k} | " + " | ".join(_fmt((c.get("mean_ms") or {}).get(k), "", 3) for _, c in cols)
                   + " |")
    out.append("| cold routes / tokens | " + " | ".join(
        [_fmt(d.get("cold_routes_mean"), "", 2)] + [_fmt(c.get("tokens_mean"), "", 0) for _, c in cols[1:]])
        + " |")
    return out


def _sweep_md(result: dict[str, Any]) -> list[str]:
    """Markdown lines for the budget sweep (Ostinato per pool budget; baselines and limit once)."""
    sw = result.get("sweep")
    if not sw:
        return []
    out = ["", f"Budget sweep (Ostinato per pool budget; {sw['note']}):", "",
           "| pool budget | pool MiB | hot-route share | decode ms/token | TTFT after tool s | "
           "session s | decode / TTFT / session vs limit | vs baselines |",
           "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in sw["runs"]:
        o = r.get("ostinato") or {}
        lv, bv = r.get("ratios_vs_limit") or {}, r.get("ratios_vs_baselines") or {}
        out.append(f"| {r['budget_frac']:.0%} | {r['pool_bytes'] / 2**20:.1f} | "
                   f"{_fmt(o.get('hot_route_share'), '', 3)} | {_fmt(o.get('decode_ms_per_token'))} | "
                   f"{_fmt(o.get('ttft_after_tool_median_s'), '', 3)} | {_fmt(o.get('session_total_s'))} | "
                   + " / ".join(_fmt(lv.get(k), "x") for k, _ in METRICS) + " | "
                   + " / ".join(_fmt(bv.get(k), "x") for k, _ in METRICS) + " |")
    for n, e in result["engines"].items():
        if n != "ostinato":
            out.append(f"| {n} (once) | | {_fmt(e.get('hot_route_share'), '', 3)} | "
                       f"{_fmt(e.get('decode_ms_per_token'))} | {_fmt(e.get('ttft_after_tool_median_s'), '', 3)}"
                       f" | {_fmt(e.get('session_total_s'))} | | |")
    return out


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
    ap.add_argument("--budget-sweep", metavar="F1,F2,...", help="also run the Ostinato engine at "
                    "each of these pool budgets (e.g. 0.25,0.45,0.65,0.85); the baselines and "
                    f"{LIMIT} run once, at --budget-frac; writes a 'sweep' block, a table and "
                    "<name>.svg")
    ap.add_argument("--time-limit", type=float, metavar="S", help="skip (with a note) every engine "
                    "run whose estimate would end past S seconds from the start (the JSON is "
                    "written after every engine either way)")
    ap.add_argument("--gpus", default="1", help="GPUs to plan for and run on: N (the first N; "
                    "emulated when fewer exist) or 'auto' (all detected). N > 1: one pool per GPU, "
                    "layers split across them; stock engines use llama.cpp's layer split")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ", ".join(ENGINES)
                    + f" ({LIMIT}: every expert on the GPU, the reference limit; run when the "
                    "model fits the free GPU memory)")
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


def parse_budgets(text: Optional[str]) -> list[float]:
    """``"0.25,0.45"`` -> [0.25, 0.45] (sorted, unique); BenchError outside (0, 1]."""
    if not text:
        return []
    try:
        xs = sorted({round(float(x), 4) for x in text.split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"--budget-sweep: not a comma list of fractions: {text!r}") from None
    if any(not 0 < x <= 1 for x in xs):
        raise BenchError(f"--budget-sweep: fractions must be in (0, 1], got {text!r}")
    return xs


def _tag(frac: float) -> str:
    return f"ostinato-b{round(frac * 100):02d}"


class Estimator:
    """Seconds an engine run will take: turns x seconds per turn + load. Per turn: the engine's own
    measurement in this run, else its prior (``PRIOR_TURN_S``) rescaled by an engine measured in this
    run, else the prior scaled by layers / 48."""

    def __init__(self, n_turns: int, n_layer: int):
        self.n_turns, self.n_layer = n_turns, n_layer
        self.turn_s: dict[str, float] = {}
        self.load_s: list[float] = []

    def add(self, base: str, elapsed_replay_s: float, load_s: float) -> None:
        self.turn_s.setdefault(base, elapsed_replay_s / max(1, self.n_turns))
        self.load_s.append(load_s)

    def __call__(self, base: str) -> tuple[float, str]:
        prior = PRIOR_TURN_S.get(base, PRIOR_TURN_S["ostinato"])
        if base in self.turn_s:
            t, src = self.turn_s[base], "measured in this run"
        elif self.turn_s:
            ref = next(iter(self.turn_s))
            t = self.turn_s[ref] * prior / PRIOR_TURN_S.get(ref, prior)
            src = f"issue 9's ratio to {ref}, measured here"
        else:
            t, src = prior * self.n_layer / 48, "issue 9's H200 figure scaled by layers"
        load = statistics.mean(self.load_s) if self.load_s else PRIOR_LOAD_S
        return self.n_turns * t + load, (f"{self.n_turns} turns x {t:.2f} s/turn ({src}) + load "
                                         f"~{load:.0f} s")


def run(a: argparse.Namespace, argv: list[str], on_progress=None) -> dict[str, Any]:
    """The whole benchmark; returns the result dict. ``on_progress(result)`` gets the result so far
    after every engine (``main`` writes it, so that an interrupted run keeps what it measured)."""
    from ..residency.planner import read_model_shape

    t_start = time.monotonic()
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
    sweep = parse_budgets(a.budget_sweep)
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
    n_turns = sum(len(_assistant_turns(s)[: a.turns]) for s in held)

    say(f"dev traces: {len(dev)} sessions x {a.dev_turns} turns through the Ostinato engine")
    trace = collect_dev_traces(model, block, dev, a, run_dir, workload)
    res, res_path, stock = plan(model, trace, a, run_dir, workload)
    notes: list[str] = []
    plans = {a.budget_frac: (res, res_path, stock)}
    for b in list(sweep):
        if b not in plans:
            try:
                plans[b] = plan(model, trace, a, run_dir, workload, budget_frac=b,
                                file_name=f"residency-{_tag(b)}.json")
            except ValueError as e:  # PlanError: e.g. the capacity test leaves no room
                notes.append(f"{_tag(b)}: no plan at {b:.0%}: {e}; budget left out of the sweep")
                say(notes[-1])
                sweep.remove(b)
    fit = None
    if LIMIT in engines:
        fit = limit_fit(model, a)
        if fit["note"]:
            notes.append(fit["note"])
            say(fit["note"])
        if not fit["run"]:
            engines.remove(LIMIT)
    # jobs: (key, engine, budget); the main budget's Ostinato first, the other sweep budgets last
    jobs = [(n, n, a.budget_frac) for n in engines]
    jobs += [(_tag(b), "ostinato", b) for b in sweep if b != a.budget_frac]
    est = Estimator(n_turns, block["n_layer"])
    total = sum(est(e)[0] for _, e, _ in jobs)
    say(f"plan of the run: {len(jobs)} engine runs x {n_turns} turns, estimate ~{total:.0f} s"
        + (f" (time limit {a.time_limit:.0f} s, {time.monotonic() - t_start:.0f} s spent)"
           if a.time_limit else ""))

    results: dict[str, dict[str, Any]] = {}
    sweep_runs: dict[float, dict[str, Any]] = {}

    def assemble() -> dict[str, Any]:
        return _result(a, argv, model, block, sessions_file, dev, held, workload, res, stock,
                       results, sweep, sweep_runs, plans, fit, notes)

    for key, name, frac in jobs:
        e_s, how = est(name)
        spent = time.monotonic() - t_start
        if a.time_limit and spent + e_s > a.time_limit:
            notes.append(f"{key}: skipped, estimate {e_s:.0f} s ({how}) after {spent:.0f} s exceeds "
                         f"--time-limit {a.time_limit:.0f} s")
            say(notes[-1])
            continue
        say(f"engine {key}: starting; estimate ~{e_s:.0f} s ({how})")
        t0 = time.monotonic()
        rec = None
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
                st = {"ostinato": {"experts": "ostinato", "residency": plans[frac][1]},
                      LIMIT: {"experts": "stock", "n_cpu_moe": 0, "n_gpu_layers": -1},
                      "stock-layers": {"experts": "stock", "n_cpu_moe": stock["n_cpu_moe"]},
                      "stock-cpu": {"experts": "stock", "n_cpu_moe": block["n_layer"]}}[name]
                srv = start_daemon(key, model, st, run_dir, a)
        except BenchError as e:
            notes.append(f"{key}: {e}")
            say(notes[-1])
            continue
        try:
            url = srv.wait_ready(a.start_timeout)
            load_s = time.monotonic() - t0
            say(f"engine {key}: ready at {url} after {load_s:.1f} s; replaying")
            if name == "ostinato":
                rec = StepRecorder(run_dir / f"home-{key}")
                rec.start()
            t1 = time.monotonic()
            try:
                data = replay(url, held_file, held, a, run_dir / f"replay-{key}.json",
                              on_turn=rec.turn if rec else None)
            finally:
                if rec is not None:
                    rec.stop()
            est.add(name, time.monotonic() - t1, load_s)
            turns = replay_turns(data)
            m = engine_metrics(turns)
            m["load_s"] = round(load_s, 2)
            if name == "ostinato":
                ex = expert_stats(run_dir / f"home-{key}")
                m["expert_stats"] = ex
                m["hot_route_share"] = ex.get("hot_route_share")
                m["step_breakdown"] = summarize_breakdown(rec.rows, turns)
                (run_dir / f"steps-{key}.json").write_text(json.dumps(rec.rows, indent=1))
            elif name == LIMIT:
                m["hot_route_share"] = 1.0
            else:
                m["hot_route_share"] = 0.0 if name == "stock-cpu" else stock["hot_route_share"]
            if name == "ostinato":
                sweep_runs[frac] = m
                if frac == a.budget_frac:
                    results["ostinato"] = m
            else:
                results[name] = m
            say(f"engine {key}: decode {_fmt(m['decode_ms_per_token'], ' ms/tok')}, TTFT after tool "
                f"{_fmt(m['ttft_after_tool_median_s'], ' s', 3)}, session total "
                f"{_fmt(m['session_total_s'], ' s')}, hot-route share {_fmt(m['hot_route_share'], '', 3)}"
                f", errors {m['errors']}/{m['turns']}; took {time.monotonic() - t0:.0f} s")
        except BenchError as e:
            notes.append(f"{key}: {e}")
            say(f"engine {key} failed: {e}")
        finally:
            srv.stop()
        if on_progress is not None:
            on_progress(assemble())
    out = assemble()
    out["total_s"] = round(time.monotonic() - t_start, 1)
    return out


def _sweep_block(a, sweep, sweep_runs, plans, results) -> dict[str, Any]:
    runs = []
    for b in sweep:
        res, _, st = plans[b]
        m = sweep_runs.get(b)
        keep = ("decode_ms_per_token", "ttft_after_tool_median_s", "ttft_after_user_median_s",
                "ttft_median_s", "session_total_s", "hot_route_share", "prefill_by_new_tokens",
                "turns", "errors", "load_s", "step_breakdown")
        runs.append({"budget_frac": b, "pool_bytes": res["plan"]["pool_bytes_total"],
                     "dev_hot_route_share": res["plan"]["dev_hot_route_share"],
                     "stock_n_cpu_moe_at_equal_memory": st["n_cpu_moe"],
                     "ostinato": {k: m.get(k) for k in keep} if m else None,
                     "ratios_vs_limit": ratios_vs_limit(results, m) if m else None,
                     "ratios_vs_baselines": ratios(results, m) if m else None})
    return {"budgets": sweep, "baselines_budget_frac": a.budget_frac,
            "note": f"stock baselines and {LIMIT} ran once; the baselines hold the GPU memory of the "
                    f"{a.budget_frac:.0%} pool, so ratios_vs_baselines compare at equal memory only "
                    f"at that budget",
            "runs": runs}


def _result(a, argv, model, block, sessions_file, dev, held, workload, res, stock, results, sweep,
            sweep_runs, plans, fit, notes) -> dict[str, Any]:
    out = {
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
                 "dev_hot_route_share": res["plan"]["dev_hot_route_share"], "stock": stock,
                 "limit_fit": fit},
        "engines": dict(results),
        "ratios_vs_best_stock": ratios(results),
        "ratios_vs_limit": ratios_vs_limit(results),
        "notes": list(notes),
    }
    if sweep:
        out["sweep"] = _sweep_block(a, sweep, sweep_runs, plans, results)
    return out


def write_result(result: dict[str, Any], out_dir: Path, plot: bool = True) -> Path:
    """``<out_dir>/<name>.json`` and ``.md`` (and ``.svg`` with a sweep when ``plot``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath = out_dir / f"{result['name']}.json"
    jpath.write_text(json.dumps(result, indent=1))
    jpath.with_suffix(".md").write_text(markdown(result))
    if plot and result.get("sweep"):
        from .bench_plot import write_plot

        write_plot([result], jpath.with_suffix(".svg"))
    return jpath


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``ostinato bench engines`` (dispatched from ostinatod/tools/bench.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    try:
        result = run(a, argv, on_progress=lambda r: write_result(r, a.out_dir, plot=False))
    except BenchError as e:
        print(f"ostinato bench engines: {e}", file=sys.stderr)
        return 1
    jpath = write_result(result, a.out_dir)
    print(markdown(result))
    say(f"written {jpath} and {jpath.with_suffix('.md')}"
        + (f" and {jpath.with_suffix('.svg')}" if result.get("sweep") else ""))
    missing = [n for n in ("ostinato",) if n not in result["engines"]]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
