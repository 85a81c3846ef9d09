"""``ostinato bench engines``: Ostinato against stock llama.cpp on the same model and sessions.

One command (docs/design.md "Testing and measuring"; paper arXiv 2611.11533 Section 4 for the metrics):

1. writes (or reuses) a synthetic real-shape MoE model (Qwen3-30B-A3B shape, Q4_0 experts,
   ``--layers`` 24 by default) with :func:`ostinatod.synth.writer.write_synthetic_moe`;
2. splits the recorded sessions into development and held-out sets by task
   (:func:`ostinatod.sessions.split_sessions`);
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
   ``ik-llama-server`` (only when named) ik_llama.cpp's llama-server with its own MoE options and
                     the same expert bytes on the GPU (:mod:`.bench_ik`; binary in
                     ``$OSTINATO_IK_SERVER``),
   ``llama-server-moe-cache`` (only when named) upstream llama.cpp's llama-server with every
                     expert in host memory and its MoE cache (``--moe-cache-mib``) at the pool's
                     bytes (:mod:`.bench_moe_cache`; binary in ``$OSTINATO_MOE_CACHE_SERVER``),
   ``stock-all-gpu`` the reference limit, not a baseline at equal memory: every layer and every
                     expert on the GPU (``experts = stock``, ``n_cpu_moe = 0``), run when the model
                     fits the free GPU memory (skipped with a note otherwise; on a machine without
                     GPU it runs CPU-only like every other engine, noted);
   ``ostinato-1gpu`` (only when named, with ``--gpus N`` > 1) the Ostinato engine on the first GPU
                     alone (CUDA_VISIBLE_DEVICES=0) with a one-GPU plan at the same ``--budget-frac``:
                     the same model on one GPU in the same run; ``ratios_gpus_vs_one_gpu`` compares;
   ``ostinato-no-prefetch``, ``ostinato-prefetch1``, ``ostinato-copy1d``, ``ostinato-class-slots``,
   ``ostinato-hybrid``, ``ostinato-cpu-split``, ``ostinato-pool-quarter``, ``ostinato-ggml-cpu``,
   ``ostinato-cpu-prefetch``, ``ostinato-cpu-spin``, ``ostinato-pairs-avx2``, ``ostinato-pairs-avx512`` (the CPU branch
   kernel's dot products two weight rows per pass, setting ``cpu_branch_row_pairs``), ``ostinato-no-dprefetch``, ``ostinato-dprefetch1``,
   ``ostinato-dprefetch4``, ``ostinato-cpu8``, ``ostinato-cpu8-spin``, ``ostinato-cpu8-dprefetch4``,
   ``ostinato-copy2``, ``ostinato-copy4``, ``ostinato-copy32``, ``ostinato-barriers``,
   ``ostinato-dprefetch-auto`` (decode prefetch's count from the calibration, setting
   ``decode_prefetch_experts = "auto"``; the count and why: ``decode_prefetch_choice`` of the
   engine's stats in the JSON)
   (only when named; the ten before it: decode prefetch off / 1 / 4 experts per layer, the CPU branch on
   8 threads, with 4096 pauses before a yield, with 4 experts per layer, decode prefetch's copy
   kernel on 2 / 4 / 32 blocks, default 8, the CPU branch's team with a barrier after each phase
   instead of claims, ``cpu_branch_claims = false``) the Ostinato engine with the same
                     plan and prefill prefetch off /
                     one layer deep / one upload copy per expert matrix instead of one 2D copy per
                     expert / the pool layout with one tensor per matrix (whole-expert slots off)
                     / the hybrid upload pass with its adapted CPU share / the cost model's CPU
                     share of a long prefill's cold experts (off by default) / the decode graph's
                     CPU-branch pool on a quarter of the cores and the context's threads on the rest
                     / the decode graph's CPU branch on ggml's graph compute instead of its own kernel
                     / its kernel with a software prefetch two weight rows ahead / its team
                     spinning 32768 pauses before it yields (settings ``prefill_prefetch = false``, ``prefill_prefetch_depth = 1``,
                     ``upload_copy_2d = false``,
                     ``pool_whole_expert_slots = false``, ``upload_cpu_share = -1``,
                     ``prefill_cpu_split = true``, ``decode_threads`` +
                     ``n_threads``, ``cpu_branch_kernel = false``, ``cpu_branch_prefetch_rows = 2``,
                     ``cpu_branch_spins = 32768``):
                     an A/B in one run;
6. with ``--budget-sweep F1,F2,...`` also runs the Ostinato engine at each of those pool budgets
   (the baselines and the limit run once, at ``--budget-frac``);
7. prints a table and writes ``<out-dir>/<name>.json`` and ``<name>.md`` (after every engine, so an
   interrupted run leaves what it measured), and with a sweep ``<name>.svg``
   (:mod:`ostinatod.bench.bench_plot`, also ``ostinato bench plot X.json``).

Figures per engine: decode ms/token (median TPOT), median TTFT after tool outputs, median prefill
time (TTFT) by bucket of new tokens (<128, 128-511, 512-2047, >=2048), total session time (sum of
request times), hot-route share (share of routes computed from GPU-resident experts), ratios to
the best stock baseline per metric (``ratios_vs_best_stock``, > 1: Ostinato is faster), to the
best peer (``ratios_vs_best_peer``: every engine but Ostinato's and the limit) and to the
limit (``ratios_vs_limit``: Ostinato / stock-all-gpu, the slowdown factor, 1 = the limit). For the
Ostinato engine, ``step_breakdown``: the native engine's per-pass times (``cpu_branch_ms``,
``gpu_branch_ms``, ``upload_ms``, ``total_ms`` and any other ``*_ms`` key) as means per decode step
and per prefill, from snapshots of the daemon's expert stats around every replayed turn (before,
after, and at its first decode step); for every daemon engine (Ostinato's and ``stock-*``),
``step_breakdown.worker``: the engine worker's wall-clock parts of a decode step and a prefill pass
(the ``llama_decode`` call to its logits, sampling, the token's way out, the rest of the loop) beside
the client's ms/token, from the same snapshots before and after every turn.

Modules: this one (the command line, the run, the result), :mod:`.bench_prepare` (model, sessions,
development traces, plan), :mod:`.bench_launch` (the engines on loopback, the replay client, the
daemon's expert stats), :mod:`.bench_fit` (whether the limit fits, time estimates),
:mod:`.bench_sweep` (the budget sweep), :mod:`.bench_report` (metrics, ratios,
markdown), :mod:`.bench_breakdown` (the per-step breakdown), :mod:`.bench_steps` (the worker's step
timing), :mod:`.bench_common` (engine names,
metrics, errors, progress, table cells).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ..residency.planner import PlanError, hot_route_share, read_model_shape
from ..sessions import WORKLOAD_OF_SESSION, assistant_turns
from ..synth.shapes import SHAPES, Routing, SynthError
from ..synth.skew import router_strength
from .bench_breakdown import decode_path_warning, hot_shares, summarize_breakdown
from .bench_steps import summarize_worker
from .bench_common import (CHOICES, ENGINES, IK, LIMIT, MOE_CACHE, ONE_GPU, VARIANTS, BenchError, say,
                           variant_settings)
from .bench_fit import Estimator, limit_fit
from .bench_ik import start_ik_server
from .bench_launch import (PEER_UBATCH, StepRecorder, expert_stats, llama_server_binary, replay,
                           start_daemon, start_llama_server)
from .bench_moe_cache import cache_figures, start_moe_cache_server
from .bench_plot import write_plot, write_skew_plot
from .bench_prepare import (collect_dev_traces, engine_counts, layer_mix, one_gpu_plan, plan, prepare_model,
                            select_sessions)
from .bench_report import (engine_metrics, fmt, gpus_vs_one_gpu, machine_info, markdown, ratios, ratios_vs_limit,
                           replay_turns, timeline_summary)
from .bench_skew import parse_skews, run_skew_sweep, skew_markdown, sub_argv
from .bench_sweep import parse_budgets, plan_sweep, sweep_block, sweep_tag

# seconds past --time-limit before an engine still replaying is stopped (its last turn may end)
DEADLINE_GRACE_S = 15.0

WORKLOAD_OF_FILE = WORKLOAD_OF_SESSION  # keyed by file stem: swe.jsonl, tau2.jsonl


def _count(text: str) -> int:
    """argparse type: a whole number >= 1 (turns, sessions, tokens)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _fraction(text: str) -> float:
    """argparse type: a pool budget, a fraction in (0, 1] of the expert bytes."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {x}")
    return x


def _gpus(text: str) -> str:
    """argparse type: 'auto' or a GPU count >= 1 (the planner's rule: resolve_gpus)."""
    if text != "auto":
        _count(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ostinato bench engines",
                                 description="Ostinato vs stock llama.cpp on one model and the same "
                                             "held-out agent sessions (see docs/benchmarks/METHOD.md).")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES),
                    help="synthetic model shape (e.g. tiny, small, qwen3-30b-a3b)")
    ap.add_argument("--layers", type=int, help="layers of the synthetic model (default 24 for "
                    "qwen3-30b-a3b, the shape's own otherwise)")
    ap.add_argument("--quant", default="q4_0", help="expert quantization of the synthetic model")
    ap.add_argument("--narrow", action="store_true", help="the synthetic model at small widths (the shape's "
                    "layers, layer kinds and expert counts; ostinato synth --narrow): routing figures on a "
                    "small machine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, help="benchmark this GGUF instead of a synthetic model")
    ap.add_argument("--sessions-dir", type=Path, default=None,
                    help="recorded sessions (default: the first existing of $OSTINATO_SESSIONS_DIR, "
                         "./shared/sessions, ../shared/sessions, .carry/sessions, /work/shared/sessions)")
    ap.add_argument("--sessions-file", default="swe.jsonl", help="file in --sessions-dir")
    ap.add_argument("--dev-sessions", type=_count, default=3, help="dev sessions replayed for traces")
    ap.add_argument("--dev-turns", type=_count, default=6, help="turns per dev session")
    ap.add_argument("--dev-max-gen", type=_count, default=48, help="generated tokens per dev turn (cap)")
    ap.add_argument("--sessions", type=_count, default=2, help="held-out sessions per engine")
    ap.add_argument("--turns", type=_count, default=16, help="turns per held-out session")
    ap.add_argument("--budget-frac", type=_fraction, default=0.45, help="pool budget (fraction of "
                    "expert bytes)")
    ap.add_argument("--budget-sweep", metavar="F1,F2,...", help="also run the Ostinato engine at "
                    "each of these pool budgets (e.g. 0.25,0.45,0.65,0.85); the baselines and "
                    f"{LIMIT} run once, at --budget-frac; writes a 'sweep' block, a table and "
                    "<name>.svg")
    ap.add_argument("--skew", type=float, metavar="S", help="routing skew of the synthetic model: the "
                    "held-out share of the development top-44%% experts its routers are made for "
                    "(default: the writer's, 0.84; see ostinato synth --skew)")
    ap.add_argument("--skew-sweep", metavar="S1,S2,...", help="run the whole benchmark once per skew "
                    "(e.g. 0.78,0.84,0.88,0.92), each on its own synthetic file of the same shape; "
                    "writes <name>-skewNN.json per skew and <name>.json, .md, .svg: time against skew "
                    f"for ostinato, the best peer and {LIMIT}")
    ap.add_argument("--time-limit", type=float, metavar="S", help="skip (with a note) every engine "
                    "run whose estimate would end past S seconds from the start (the JSON is "
                    "written after every engine either way)")
    ap.add_argument("--gpus", type=_gpus, default="1", help="GPUs to plan for and run on: N (the first N; "
                    "emulated when fewer exist) or 'auto' (all detected). N > 1: one pool per GPU, "
                    "layers split across them; stock engines use llama.cpp's layer split")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ", ".join(CHOICES)
                    + f" ({LIMIT}: every expert on the GPU, the reference limit; run when the "
                    f"model fits the free GPU memory; {IK}: ik_llama.cpp's llama-server at "
                    "stock-layers' GPU memory, its binary named by $OSTINATO_IK_SERVER; "
                    f"{MOE_CACHE}: upstream llama.cpp's llama-server with its MoE cache at the pool's "
                    "bytes, its binary named by $OSTINATO_MOE_CACHE_SERVER; "
                    f"{ONE_GPU}: with --gpus N > 1, Ostinato on the first GPU alone at the same "
                    "pool budget; " + ", ".join(VARIANTS) + ": Ostinato with one option changed "
                    "from its default; default: the first five)")
    ap.add_argument("--no-server", action="store_true", help="skip the llama-server baseline")
    ap.add_argument("--client", default="openai", choices=("openai", "anthropic"))
    ap.add_argument("--n-ctx", type=int, default=32768, help="context per slot")
    ap.add_argument("--threads", type=int, help="CPU threads (default: physical cores)")
    ap.add_argument("--prefill-threshold", type=int, help="Np for Ostinato (default: calibration "
                    "or 512)")
    ap.add_argument("--ubatch", type=int, default=0, help="prefill ubatch of Ostinato (default 0: its "
                    "automatic choice); every other engine runs at the ubatch Ostinato ran at (2048 for "
                    "one that runs before it), so their prefill passes are the same size")
    ap.add_argument("--name", help="result name (default <UTC date>-engines-<shape>-L<layers>, the "
                    "stored runs' naming)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks/runs"))
    ap.add_argument("--work-dir", type=Path, help="keep logs, traces and replay JSON here")
    ap.add_argument("--engine-mode", default="subprocess", choices=("subprocess", "inprocess"),
                    help="engine worker mode of the daemons (default: the daemon's default)")
    ap.add_argument("--no-mix-check", action="store_true", help="run on a synthetic cut whose layer mix "
                    "departs from the real model's proportions (refused otherwise; docs/synthetic-models.md, "
                    "'Representative cuts')")
    ap.add_argument("--hot-shares-only", action="store_true", help="only the per-phase hot-route shares "
                    "of the file: dev traces, the plan at --budget-frac, then the held-out turns (--sessions x "
                    "--turns, at most --dev-max-gen tokens each) through the engine in this process, counted "
                    "per phase on the plan's hot set; no daemon, no peer (writes <name>.json)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def run(a: argparse.Namespace, argv: list[str], on_progress=None) -> dict[str, Any]:
    """The whole benchmark; returns the result dict. ``on_progress(result)`` gets the result so far
    after every engine (``main`` writes it, so that an interrupted run keeps what it measured)."""
    t_start = time.monotonic()
    if a.layers is None and a.shape == "qwen3-30b-a3b" and not a.model:
        a.layers = 24
    if not a.name:   # dated once, at the start: the stored runs' naming (docs/benchmarks/runs)
        a.name = (f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}-engines-"
                  + (Path(a.model).stem if a.model else a.shape + (f"-L{a.layers}" if a.layers else "")))
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in CHOICES]
    if bad:
        raise BenchError(f"unknown engines {bad}; choose from {', '.join(CHOICES)}")
    if a.no_server and "llama-server" in engines:
        engines.remove("llama-server")
    if "ostinato" not in engines:
        raise BenchError("the engine list must include ostinato")
    if a.model and a.skew is not None:
        raise BenchError("--skew makes the routers of a synthetic model: it cannot take --model")
    sweep = parse_budgets(a.budget_sweep)
    run_dir = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ostinato-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    say(f"work dir {run_dir}")
    workload = WORKLOAD_OF_FILE.get(Path(a.sessions_file).stem, "coding")

    model = prepare_model(a)
    mix = layer_mix(model, a)   # BenchError: a cut whose layer mix is not the real model's
    block = read_model_shape(model).model_block()  # parsed once (cached) for the plan as well
    sessions_file, dev, held = select_sessions(a)
    say(f"sessions: dev {[s['id'] for s in dev]}, held-out {[s['id'] for s in held]}")
    # only the held-out sessions go to the replay client: a file with just them
    held_file = run_dir / "held-out.jsonl"
    held_file.write_text("".join(json.dumps(s) + "\n" for s in held))
    n_turns = sum(len(assistant_turns(s)[: a.turns]) for s in held)

    if a.hot_shares_only:
        return hot_shares_only(a, argv, model, block, mix, sessions_file, dev, held, run_dir, workload, t_start)
    say(f"dev traces: {len(dev)} sessions x {a.dev_turns} turns through the Ostinato engine")
    trace = collect_dev_traces(model, block, dev, a, run_dir, workload)
    res, res_path, stock = plan(model, trace, a, run_dir, workload)
    notes: list[str] = []
    warnings: list[str] = []  # also in notes; a list of their own so that a reader can check for them
    plans = {a.budget_frac: (res, res_path, stock)}
    plan_sweep(model, trace, a, run_dir, workload, sweep, plans, notes)
    one = one_gpu_plan(model, trace, a, run_dir, workload, notes) if ONE_GPU in engines else None
    if ONE_GPU in engines and one is None:
        engines.remove(ONE_GPU)
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
    jobs += [(sweep_tag(b), "ostinato", b) for b in sweep if b != a.budget_frac]
    est = Estimator(n_turns, block["n_layer"])
    total = sum(est(e)[0] for _, e, _ in jobs)
    say(f"plan of the run: {len(jobs)} engine runs x {n_turns} turns, estimate ~{total:.0f} s"
        + (f" (time limit {a.time_limit:.0f} s, {time.monotonic() - t_start:.0f} s spent)"
           if a.time_limit else ""))

    results: dict[str, dict[str, Any]] = {}
    sweep_runs: dict[float, dict[str, Any]] = {}

    def assemble() -> dict[str, Any]:
        out = _result(a, argv, model, block, sessions_file, dev, held, workload, res, stock,
                      results, sweep, sweep_runs, plans, fit, notes + warnings)
        out["model"]["layer_mix"] = mix
        # the per-phase hot shares of the main budget's Ostinato run and their check (docs/design.md "Testing and measuring")
        out["hot_shares"] = (results.get("ostinato") or {}).get("hot_shares")
        out["warnings"] = list(warnings)
        if one is not None:
            r1 = one[0]
            out["plan"]["one_gpu"] = {"pool_bytes": r1["plan"]["pool_bytes_total"],
                                      "dev_hot_route_share": r1["plan"]["dev_hot_route_share"]}
            out["ratios_gpus_vs_one_gpu"] = gpus_vs_one_gpu(results)
        return out

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
            elif name == IK:   # BenchError (a note) when its binary is not named
                srv = start_ik_server(model, stock["n_cpu_moe"], run_dir, a)
            elif name == MOE_CACHE:   # the same: a note when its binary is not named
                srv = start_moe_cache_server(model, stock["pool_bytes"], run_dir, a)
            else:
                st = {"ostinato": {"experts": "ostinato", "residency": plans[frac][1], "n_ubatch": a.ubatch},
                      ONE_GPU: {"experts": "ostinato",
                                "residency": one[1] if one else None},
                      LIMIT: {"experts": "stock", "n_cpu_moe": 0, "n_gpu_layers": -1},
                      "stock-layers": {"experts": "stock", "n_cpu_moe": stock["n_cpu_moe"]},
                      "stock-cpu": {"experts": "stock", "n_cpu_moe": block["n_layer"]},
                      **{v: {"experts": "ostinato", "residency": plans[frac][1], "n_ubatch": a.ubatch,
                             **variant_settings(v)}
                         for v in VARIANTS if v == name}}[name]
                if name in (LIMIT, "stock-layers", "stock-cpu"):
                    st["n_ubatch"] = peer_ubatch(a)
                srv = start_daemon(key, model, st, run_dir,
                                   argparse.Namespace(**{**vars(a), "gpus": "1"}) if name == ONE_GPU else a)
        except BenchError as e:
            notes.append(f"{key}: {e}")
            say(notes[-1])
            continue
        try:
            url = srv.wait_ready(a.start_timeout)
            load_s = time.monotonic() - t0
            say(f"engine {key}: ready at {url} after {load_s:.1f} s; replaying")
            native = name in ("ostinato", ONE_GPU) or name in VARIANTS
            if native or name in (LIMIT, "stock-layers", "stock-cpu"):   # the daemon's engines
                rec = StepRecorder(run_dir / f"home-{key}", native=native)
                rec.start()
            t1 = time.monotonic()
            # a crashed or wedged engine is stopped (and named in the notes) instead of holding
            # the replay until its per-request timeout; so is one still replaying at the time limit
            watch = srv.watch(t_start + a.time_limit + DEADLINE_GRACE_S if a.time_limit else None)
            try:
                data = replay(url, held_file, held, a, run_dir / f"replay-{key}.json",
                              on_turn=rec.turn if rec else None,
                              on_first_token=rec.first_token if rec else None)
            finally:
                watch.stop()
                if rec is not None:
                    rec.stop()
            if watch.crashed:
                raise BenchError(f"{watch.reason} (no figures of this engine; log {srv.log_path})")
            if watch.reason:   # the time limit: its finished turns count, the rest are errors
                notes.append(f"{key}: {watch.reason}; its figures are those of the turns it finished")
            est.add(name, time.monotonic() - t1, load_s)
            turns = replay_turns(data)
            m = engine_metrics(turns)
            m["load_s"] = round(load_s, 2)
            if name in ("ostinato", ONE_GPU) or name in VARIANTS:
                ex = expert_stats(run_dir / f"home-{key}")
                m["expert_stats"] = ex
                ub = (ex.get("ubatch") or {}).get("tokens")
                if name == "ostinato" and ub:   # the ubatch every later engine runs at
                    a.peer_ubatch = int(ub)
                m["ubatch"] = ex.get("ubatch")
                m["hot_route_share"] = ex.get("hot_route_share")
                m["step_breakdown"] = summarize_breakdown(rec.rows, turns)
                m["step_breakdown"]["decode_timeline"] = timeline_summary(ex.get("decode_timeline"))
                m["hot_shares"] = hot_shares(m["step_breakdown"], plans[frac][0]["plan"]["pool_bytes_total"]
                                             / max(1, stock["expert_bytes_total"]), key)
                for warn in (*m["hot_shares"]["warnings"], decode_path_warning(ex, key)):
                    if warn:
                        warnings.append(warn)
                        say("WARNING: " + warn)
                (run_dir / f"steps-{key}.json").write_text(json.dumps(rec.rows, indent=1))
            elif name == LIMIT:
                m["hot_route_share"] = 1.0
            elif name == MOE_CACHE:
                m["hot_route_share"] = None   # its cache's hit rate, in its log once it stopped (below)
            else:
                m["hot_route_share"] = 0.0 if name == "stock-cpu" else stock["hot_route_share"]
            if rec is not None:   # every daemon engine: the worker's step timing (bench_steps)
                b = m.setdefault("step_breakdown", {})
                b["worker"] = summarize_worker(rec.timing, turns, b if native else None)
                (run_dir / f"timing-{key}.json").write_text(json.dumps(rec.timing, indent=1))
            if name in ("llama-server", IK, MOE_CACHE):
                m["server_command"] = srv.cmd
            if name not in ("ostinato", ONE_GPU) and name not in VARIANTS:
                m["ubatch"] = {"tokens": peer_ubatch(a), "reason": "Ostinato's" if getattr(a, "peer_ubatch", 0)
                               else "before Ostinato ran"}
            if name == "ostinato":
                sweep_runs[frac] = m
                if frac == a.budget_frac:
                    results["ostinato"] = m
            else:
                results[name] = m
            say(f"engine {key}: decode {fmt(m['decode_ms_per_token'], ' ms/tok')}, TTFT after tool "
                f"{fmt(m['ttft_after_tool_median_s'], ' s', 3)}, session total "
                f"{fmt(m['session_total_s'], ' s')}, hot-route share {fmt(m['hot_route_share'], '', 3)}"
                f", errors {m['errors']}/{m['turns']}; took {time.monotonic() - t0:.0f} s")
        except BenchError as e:
            notes.append(f"{key}: {e}")
            say(f"engine {key} failed: {e}")
        finally:
            srv.stop()
        if name == MOE_CACHE and name in results:   # this server's output: its cache's size and hits
            output = srv.log_path.read_bytes()[srv.log_start:].decode(errors="replace")
            results[name].update(cache_figures(output))
            say(f"engine {key}: MoE cache {fmt(results[name]['moe_cache']['size_mib'], ' MiB', 0)}, decode "
                f"hit rate {fmt(results[name]['hot_route_share'], '', 3)}")
        if on_progress is not None:
            on_progress(assemble())
    out = assemble()
    out["total_s"] = round(time.monotonic() - t_start, 1)
    return out


def hot_shares_only(a: argparse.Namespace, argv: list[str], model: Path, block: dict[str, Any],
                    mix: Optional[dict[str, Any]], sessions_file: Path, dev: list[dict], held: list[dict],
                    run_dir: Path, workload: str, t_start: float) -> dict[str, Any]:
    """``--hot-shares-only``: the file's per-phase hot-route shares at ``--budget-frac`` without the
    engines' runs. One in-process load of the Ostinato engine (all experts cold) replays the dev
    turns and the held-out turns (``--sessions`` x ``--turns``, at most ``--dev-max-gen`` tokens
    each); the dev counts give the plan, exactly as in a full run, and the held-out counts per phase
    on the plan's hot experts give the shares (what the engine counts as hot with that pool).
    Returns the result dict (``hot_shares``: :func:`.bench_breakdown.hot_shares`, with its warnings)."""
    say(f"hot shares: dev {len(dev)} x {a.dev_turns} turns, held-out {len(held)} x {a.turns} turns "
        f"through the Ostinato engine (all cold, in process)")
    tr = engine_counts(model, block, [("dev", dev, a.dev_turns, a.dev_max_gen),
                                      ("held-out", held, a.turns, a.dev_max_gen)], a, run_dir, workload)
    tr["dev"].save(run_dir / "trace-dev.json")
    # the held-out counts do not depend on the plan (all experts cold): kept, a plan can be scored on them later
    tr["held-out"].save(run_dir / "trace-held-out.json")
    res, _, stock = plan(model, tr["dev"], a, run_dir, workload)
    h = tr["held-out"]

    def phase(c) -> dict[str, Any]:
        n = int(c.sum())
        share = hot_route_share(c, res["gpus"]) if n else None
        return {"hot_route_share": None if share is None else round(float(share), 4), "routes": n}

    b = {"prefill": phase(h.counts_prefill), "decode_step": phase(h.counts_decode)}
    hs = hot_shares(b, res["plan"]["pool_bytes_total"] / max(1, stock["expert_bytes_total"]), "ostinato")
    hs["routes"] = {"prefill": b["prefill"]["routes"], "decode": b["decode_step"]["routes"]}
    for w in hs["warnings"]:
        say("WARNING: " + w)
    say(f"hot shares at a {hs['pool_frac']:.1%} pool: prefill {fmt(hs['prefill'], '', 3)}, decode "
        f"{fmt(hs['decode'], '', 3)} (held-out routes: {hs['routes']['prefill']} prefill, "
        f"{hs['routes']['decode']} decode)")
    return {"name": a.name, "mode": "hot-shares-only",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "ostinato bench engines " + " ".join(argv),
            "model": {**block, "file": model.name, "bytes": model.stat().st_size, "layer_mix": mix},
            "sessions": {"file": str(sessions_file), "dev": [s["id"] for s in dev],
                         "held_out": [s["id"] for s in held], "turns_per_session": a.turns,
                         "dev_turns_per_session": a.dev_turns, "max_gen": a.dev_max_gen, "workload": workload},
            "plan": {"budget_frac": a.budget_frac, "pool_bytes": res["plan"]["pool_bytes_total"],
                     "dev_hot_route_share": res["plan"]["dev_hot_route_share"]},
            "hot_shares": hs, "engines": {}, "warnings": list(hs["warnings"]),
            "total_s": round(time.monotonic() - t_start, 1)}


def peer_ubatch(a: argparse.Namespace) -> int:
    """The ubatch of an engine other than Ostinato: the one Ostinato ran at, once it has run."""
    return int(getattr(a, "peer_ubatch", 0) or PEER_UBATCH)


def _result(a, argv, model, block, sessions_file, dev, held, workload, res, stock, results, sweep,
            sweep_runs, plans, fit, notes) -> dict[str, Any]:
    out = {
        "name": a.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": "ostinato bench engines " + " ".join(argv),
        # --model: the file's own name says its shape and quant (the synthetic model's defaults do not)
        "model": {**block, "file": model.name, "shape": None if a.model else a.shape,
                  "quant": None if a.model else a.quant,
                  "skew": None if a.model else a.skew, "router_strength": None if a.model else
                  round(router_strength(Routing(skew=a.skew), block["n_expert"], block["n_expert_used"]), 4),
                  "bytes": model.stat().st_size},
        "sessions": {"file": str(sessions_file), "dev": [s["id"] for s in dev],
                     "held_out": [s["id"] for s in held], "turns_per_session": a.turns,
                     "dev_turns_per_session": a.dev_turns, "workload": workload},
        "plan": {"budget_frac": a.budget_frac, "pool_bytes": res["plan"]["pool_bytes_total"],
                 "dev_hot_route_share": res["plan"]["dev_hot_route_share"], "stock": stock,
                 "limit_fit": fit},
        "engines": dict(results),
        "ratios_vs_best_stock": ratios(results),
        "ratios_vs_best_peer": ratios(results, peers=True),
        "ratios_vs_limit": ratios_vs_limit(results),
        "notes": list(notes),
    }
    if sweep:
        out["sweep"] = sweep_block(a, sweep, sweep_runs, plans, results)
    return out


def write_result(result: dict[str, Any], out_dir: Path, plot: bool = True) -> Path:
    """``<out_dir>/<name>.json`` and ``.md`` (and ``.svg`` with a sweep when ``plot``; only the JSON
    for a ``--hot-shares-only`` result)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath = out_dir / f"{result['name']}.json"
    jpath.write_text(json.dumps(result, indent=1))
    if result.get("mode") == "hot-shares-only":
        return jpath
    jpath.with_suffix(".md").write_text(markdown(result))
    if plot and result.get("sweep"):
        write_plot([result], jpath.with_suffix(".svg"))
    return jpath


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``ostinato bench engines`` (dispatched from ostinatod/bench/cli.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.skew_sweep:
        return _main_skew_sweep(a, argv)
    try:
        result = run(a, argv, on_progress=lambda r: write_result(r, a.out_dir, plot=False))
    except (BenchError, PlanError, SynthError) as e:
        print(f"ostinato bench engines: {e}", file=sys.stderr)
        return 1
    jpath = write_result(result, a.out_dir)
    if result.get("mode") == "hot-shares-only":
        print(json.dumps(result["hot_shares"], indent=1))
        say(f"written {jpath}")
        return 0
    print(markdown(result))
    say(f"written {jpath} and {jpath.with_suffix('.md')}"
        + (f" and {jpath.with_suffix('.svg')}" if result.get("sweep") else ""))
    missing = [n for n in ("ostinato",) if n not in result["engines"]]
    return 1 if missing else 0


def _main_skew_sweep(a: argparse.Namespace, argv: list[str]) -> int:
    """``--skew-sweep``: :func:`.bench_skew.run_skew_sweep` with this module's run and writer."""
    def one(sub: argparse.Namespace) -> dict[str, Any]:
        sub_args = sub_argv(argv, sub.skew, sub.name)
        return run(sub, sub_args, on_progress=lambda r: write_result(r, a.out_dir, plot=False))

    try:
        sweep = run_skew_sweep(a, argv, parse_skews(a.skew_sweep), one, lambda r: write_result(r, a.out_dir))
    except (BenchError, PlanError, SynthError) as e:
        print(f"ostinato bench engines: {e}", file=sys.stderr)
        return 1
    a.out_dir.mkdir(parents=True, exist_ok=True)
    jpath = a.out_dir / f"{sweep['name']}.json"
    jpath.write_text(json.dumps(sweep, indent=1))
    jpath.with_suffix(".md").write_text(skew_markdown(sweep))
    write_skew_plot(sweep, jpath.with_suffix(".svg"))
    print(skew_markdown(sweep))
    say(f"written {jpath}, {jpath.with_suffix('.md')} and {jpath.with_suffix('.svg')}")
    rows = sweep["skew_sweep"]["rows"]
    return 0 if all(r["decode"]["ostinato"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
