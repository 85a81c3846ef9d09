"""``ostinato bench engines``, before the engines run: the model, the dev/held-out sessions, the
development routing traces (the Ostinato engine in this process) and the residency plan with the
stock placement at equal memory."""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ..engine.types import GenRequest
from ..engine.worker import Worker
from ..paths import get_paths
from ..residency.gguf_header import read_header
from ..residency.planner import (phase_costs_for, plan_residency, read_model_shape, resolve_gpus,
                                 staging_regions_for)
from ..residency.sets import make_residency, write_residency
from ..residency.traces import Trace, counts_from_stats
from ..sessions import assistant_text, assistant_turns, split_sessions
from ..settings import load_settings
from ..synth.mix import check_file_mix
from ..synth.shapes import ARCH_SHAPES, Routing, SYNTH_FORMAT
from ..synth.writer import write_synthetic_moe
from .bench_common import BenchError, say, skew_tag


def prepare_model(a: argparse.Namespace) -> Path:
    """The model to benchmark: ``--model``, or a synthetic one written once into the models dir
    (routers made for ``--skew`` when given). Raises BenchError, SynthError."""
    if a.model:
        if not Path(a.model).is_file():
            raise BenchError(f"model not found: {a.model}")
        return Path(a.model).resolve()

    d = get_paths().models_dir
    d.mkdir(parents=True, exist_ok=True)
    layers = f"-L{a.layers}" if a.layers else ""
    skew = getattr(a, "skew", None)
    narrow = bool(getattr(a, "narrow", False))
    tag = (f"-{skew_tag(skew)}" if skew is not None else "") + ("-narrow" if narrow else "") \
        + f"-v{SYNTH_FORMAT.rsplit('/', 1)[-1]}"
    arch = ARCH_SHAPES.get(a.shape, "qwen3moe")   # a real model's shape is written in its own architecture
    # the writer's format version in the name: a file of an older writer is not reused
    path = d / f"bench-{arch}-{a.shape}{layers}-{a.quant}-s{a.seed}{tag}.gguf"
    if path.exists():
        say(f"model: reusing {path} ({path.stat().st_size / 2**30:.2f} GiB)")
        return path
    say(f"model: writing {path.name} ({arch}, shape {a.shape}, layers {a.layers or 'default'}, "
        f"{a.quant} experts" + (f", routing skew {skew}" if skew is not None else "") + ")")
    write_synthetic_moe(path, arch=arch, shape=a.shape, n_layer=a.layers, quant=a.quant,
                        seed=a.seed, progress=a.verbose, narrow=narrow,
                        routing=Routing(skew=skew) if skew is not None else None)
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


def select_sessions(a: argparse.Namespace) -> tuple[Path, list[dict], list[dict]]:
    """(sessions file, dev sessions, held-out sessions) after the task-grouped split.

    Sessions with tool schemas (function calling) come first, so that turns follow tool outputs.
    """
    f = Path(a.sessions_dir or default_sessions_dir()) / a.sessions_file
    if not f.is_file():
        raise BenchError(f"sessions file not found: {f}")
    dev, held = split_sessions(f, held_out_frac=1 / 3, seed=a.seed)

    def order(ss: list[dict]) -> list[dict]:
        return sorted(ss, key=lambda s: (not s.get("tools"), s["id"]))

    dev = [s for s in order(dev) if len(assistant_turns(s)) >= 2][: a.dev_sessions]
    held = [s for s in order(held) if len(assistant_turns(s)) >= 2][: a.sessions]
    if not dev or not held:
        raise BenchError(f"{f}: not enough sessions after the split (dev {len(dev)}, held-out {len(held)})")
    return f, dev, held


# --------------------------------------------------------------------------------------------
# development traces (in-process engine) and plan
# --------------------------------------------------------------------------------------------

def layer_mix(model: Path, a: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The layer-mix check of ``model`` (:func:`ostinatod.synth.mix.check_file_mix`: None for a file
    that is not a synthetic file of a real model's shape). Raises BenchError when its mix departs
    from the real model's proportions, unless ``a.no_mix_check`` (then the problems stay in the
    returned dict, with ``"overridden": True``)."""
    mix = check_file_mix(read_header(model).kv)
    if mix and mix["problems"]:
        if not getattr(a, "no_mix_check", False):
            raise BenchError(f"{model.name} is a cut of {mix['shape']} ({mix['layers']} of "
                             f"{mix['real_layers']} layers) whose layer mix is not the real model's: "
                             + "; ".join(mix["problems"]) + ". Write a representative cut (ostinato synth "
                             "--shape ... --layers N) or pass --no-mix-check")
        mix["overridden"] = True
        say(f"model: layer mix not the real model's, checked off by --no-mix-check: {'; '.join(mix['problems'])}")
    return mix


def collect_dev_traces(model: Path, block: dict[str, Any], dev: list[dict], a: argparse.Namespace,
                       run_dir: Path, workload: str):
    """Replay ``a.dev_turns`` turns of each dev session through the Ostinato engine in this process
    (all experts cold: an empty residency set) and return the accumulated :class:`Trace`."""
    trace = engine_counts(model, block, [("dev", dev, a.dev_turns, a.dev_max_gen)], a, run_dir, workload)["dev"]
    trace.save(run_dir / "trace-dev.json")
    return trace


def engine_counts(model: Path, block: dict[str, Any], groups: list[tuple[str, list[dict], int, int]],
                  a: argparse.Namespace, run_dir: Path, workload: str) -> dict[str, Any]:
    """Replay, per group ``(label, sessions, turns, max_gen)``, ``turns`` turns of each session
    through the Ostinato engine in this process (one load; all experts cold: an empty residency
    set; greedy, ``min(max_gen, recorded reply)`` tokens per turn) and return ``{label: Trace}``,
    the engine's route counts per phase. Raises BenchError."""
    empty = write_residency(make_residency(block, {}, workload=workload), run_dir / "residency-empty.json")
    s = load_settings(model=model, experts="ostinato", residency=empty, n_slots=1, n_ctx=a.n_ctx,
                      n_threads=a.threads, engine_mode="inprocess", prefill_threshold=a.prefill_threshold,
                      cache_disk_mb=0)   # a prompt restored from an earlier run's disk cache counts no routes
    w = Worker(s, model)
    w.load(probe_np=False)   # all experts cold here: an Np probed now would not be the served one
    if w.rt is None:
        w.close()
        raise BenchError("the Ostinato expert engine is not active (stale native build? run "
                         "'ostinato build'): no routing counts to plan from")
    th = threading.Thread(target=w.run, name="bench-counts-worker", daemon=True)
    th.start()
    out = {}
    try:
        for label, sessions, turns, max_gen in groups:
            out[label] = _replay_counts(w, block, label, sessions, turns, max_gen, workload)
    finally:
        w.shutdown()
        th.join(60)
        w.close()
    return out


def _replay_counts(w, block: dict[str, Any], label: str, sessions: list[dict], turns: int, max_gen: int,
                   workload: str):
    trace = Trace.empty(block, workload)
    for si, sess in enumerate(sessions):
        for turn in assistant_turns(sess)[:turns]:
            gen = max(1, min(max_gen, len(w.tokenize(assistant_text(turn.target), add_special=False))))
            req = GenRequest(id=f"{label}-{si}-{turn.index}", messages=turn.context,
                             tools=sess.get("tools") or None, max_tokens=gen, ignore_eos=True,
                             temperature=0.0, workload=workload)
            done = _run_one(w, req)
            ex = done.get("experts") or {}
            pre, dec = counts_from_stats(ex, block["n_layer"], block["n_expert"])
            trace.add_counts(pre, dec)
            u = done.get("usage", {})
            trace.add_request(u.get("prompt_tokens", 0), u.get("prefilled_tokens", 0),
                              u.get("completion_tokens", 0), len(sess.get("tools") or []))
        say(f"{label} traces: session {si + 1}/{len(sessions)} {sess['id']} done "
            f"({trace.total_routes} routes so far)")
    if trace.total_routes == 0:
        raise BenchError(f"the engine reported no routes for the {label} turns")
    return trace


def _run_one(w, req, timeout: float = 900) -> dict[str, Any]:
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
    shape = read_model_shape(model)
    frac = a.budget_frac if budget_frac is None else budget_frac
    # the daemon's settings (prefetch on by default): the staging regions its pools will hold
    # the phases priced as the served engine will run them: the bench's Np and ubatch where given
    costs = phase_costs_for(np_tokens=getattr(a, "prefill_threshold", None),
                            ubatch=getattr(a, "ubatch", None), model_fingerprint=shape.fingerprint)
    res = plan_residency(shape, dev, workload=workload, gpus=resolve_gpus(getattr(a, "gpus", 1)),
                         budget_frac=frac, source_traces=[str(run_dir / "trace-dev.json")],
                         staging_regions=staging_regions_for(), costs=costs)
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

    def size(b: float) -> str:   # tiny test models have pools of a few KiB
        return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"

    say(f"plan at {frac:.0%}: {len(res['gpus'])} GPU(s), "
        f"{sum(len(v) for g in res['gpus'] for v in g['hot'].values())} hot experts, pool "
        f"{size(pool)} = {pool / shape.total_expert_bytes:.1%} of expert bytes, dev hot-route "
        f"share {res['plan']['dev_hot_route_share']:.1%}; stock-layers: n_cpu_moe {n_cpu_moe} "
        f"({gpu_layers} layers' experts = {size(stock['gpu_expert_bytes'])} on the GPU)")
    return res, path, stock


def one_gpu_plan(model: Path, trace, a: argparse.Namespace, run_dir: Path, workload: str,
                 notes: list[str]) -> Optional[tuple[dict, Path, dict]]:
    """The plan of the ``ostinato-1gpu`` engine: the same model and traces planned for the first GPU
    alone at the same ``--budget-frac`` (so the one pool holds what the N pools hold together).
    Returns what :func:`plan` returns, or None with a note when it cannot run (``--gpus`` is 1 or
    'auto': nothing to compare; the planner refuses the budget on one GPU)."""
    n = str(getattr(a, "gpus", 1))
    if not n.isdigit() or int(n) < 2:
        notes.append(f"ostinato-1gpu: skipped, --gpus {n} (it compares a run on N > 1 GPUs with one GPU)")
        say(notes[-1])
        return None
    try:
        return plan(model, trace, argparse.Namespace(**{**vars(a), "gpus": "1"}), run_dir, workload,
                    file_name="residency-1gpu.json")
    except ValueError as e:  # PlanError: the one GPU's capacity test leaves no room at this budget
        notes.append(f"ostinato-1gpu: no one-GPU plan at {a.budget_frac:.0%}: {e}")
        say(notes[-1])
        return None
