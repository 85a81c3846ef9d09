"""``ostinato bench timeline``: a per-kernel GPU timeline of ONE prefill pass after a tool output
and a few decode steps of the same tokens, Ostinato's engine beside ``stock-all-gpu`` (where our
prefill's and decode step's own GPU work goes, against the limit's).

Per engine, in a fresh subprocess (its own ``OSTINATO_HOME`` with a copy of this machine's hardware
profile, as ``bench engines`` gives each daemon), the model is loaded by the daemon's own worker
(:class:`..engine.worker.Worker` ``.load()``: the same settings as ``bench engines``' daemons, the
Np probe and the automatic ubatch included); then

1. ``--context-tokens`` C deterministic tokens are prefilled on sequence 0 (not timed: the turn's
   cached context), in steps of the context's ubatch as the worker does;
2. the timed prefill: ``--prompt-tokens`` N more tokens, one ``llama_decode`` per ubatch, then a
   synchronize (range ``timeline:prefill``);
3. ``--decode-steps`` D one-token steps, each ``llama_decode`` + synchronize (``timeline:decode:i``).

Tokens come from a seeded generator (:class:`..engine.np_probe.Passes`), the same for every engine.
Wall times (ms, ``time.perf_counter``) are always recorded. Where torch imports and sees a CUDA
device and the native engine is a GPU build, the timed calls (and the context prefill, so that the
ranges and CUDA graphs are in one trace) run under ``torch.profiler`` (CPU + CUDA activities: CUPTI
records llama.cpp's kernels, CUDA-graph kernels included) in the same process; the chrome trace is
written gzipped per engine and summarized by :mod:`.timeline_trace` (GPU busy time, compute-stream
gaps, memcpy, per-kernel and per-layer time). torch is imported lazily here only; without it, or
without a GPU, the summary has wall times and a note saying no profiler ran. A child that dies
under the profiler is run once more without it (noted).

Outputs in ``--out-dir``: ``timeline.json``, ``timeline.md``, ``timeline-<engine>.trace.json.gz``
and the children's logs ``timeline-<engine>.log``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ..paths import get_paths
from .bench_common import LIMIT, VARIANTS, BenchError, say, variant_settings
from .bench_launch import settings_env
from .timeline_md import markdown
from .timeline_trace import PHASE_PREFIX, summarize_trace

ENGINE_CHOICES = ("ostinato", LIMIT) + tuple(VARIANTS)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ostinato bench timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--residency", help="residency set of the ostinato engines (a bench work dir's "
                    "residency.json; ostinato-residency/1); required when an ostinato engine runs")
    ap.add_argument("--prompt-tokens", type=int, default=420, help="tokens of the timed prefill (N)")
    ap.add_argument("--context-tokens", type=int, default=2000,
                    help="tokens in the KV cache before it (C, prefilled untimed)")
    ap.add_argument("--decode-steps", type=int, default=8, help="timed one-token steps after it (D)")
    ap.add_argument("--engines", default=f"ostinato,{LIMIT}",
                    help=f"comma list of {', '.join(('ostinato', LIMIT))} or ostinato-* variants")
    ap.add_argument("--n-ctx", type=int, default=32768, help="context per slot (bench engines' default)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: the daemon's)")
    ap.add_argument("--ubatch", type=int, default=0, help="ostinato's n_ubatch (0: automatic, the daemon's)")
    ap.add_argument("--prefill-threshold", type=int, help="Np of ostinato (default: calibration or probe)")
    ap.add_argument("--seed", type=int, default=0, help="the tokens' generator seed")
    ap.add_argument("--layer-marker", default="rms_norm",
                    help="substring of the kernel name that marks layers (timeline_trace.per_layer)")
    ap.add_argument("--trace-from", choices=("context", "load"), default="context",
                    help="start the profiler before the context prefill (default: torch is imported after "
                         "the load) or before the load (torch first: its CUDA runtime and cuBLAS may "
                         "then be the ones llama.cpp's kernels use; the notes list them)")
    ap.add_argument("--no-profile", action="store_true", help="wall times only, even with torch and CUDA")
    ap.add_argument("--out-dir", default="timeline-out", help="where the results go")
    ap.add_argument("--work-dir", help="the children's homes (default: a temporary dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)    # internal: run one engine from this spec file
    return ap


def engine_settings(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """The daemon settings of engine ``name``, as ``bench engines`` starts its daemon."""
    base = {"model": str(Path(a.model).resolve()), "n_ctx": a.n_ctx, "n_slots": 2, "n_threads": a.threads,
            "prefill_threshold": a.prefill_threshold, "log_level": "INFO", "cache_disk_mb": 0}
    if name == LIMIT:
        return {**base, "experts": "stock", "n_cpu_moe": 0, "n_gpu_layers": -1}
    own = {**base, "experts": "ostinato", "residency": str(Path(a.residency).resolve()), "n_ubatch": a.ubatch}
    return own if name == "ostinato" else {**own, **variant_settings(name)}


# ---- the child: one engine in its own process ---------------------------------------------------

def _torch(spec: dict[str, Any]) -> tuple[Any, str]:
    """(torch, "") when the profiler can run, else (None, why not)."""
    if not spec["profile"]:
        return None, "no profiler: off for this run (--no-profile, or the rerun after a failure under it)"
    try:
        import torch  # lazy: a dev tool's optional dependency, never the package's
        import torch.profiler  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: wall times only
        return None, f"no profiler: torch does not import ({type(e).__name__}: {e})"
    try:
        if not torch.cuda.is_available():
            return None, "no profiler: torch sees no CUDA device"
    except Exception as e:  # noqa: BLE001
        return None, f"no profiler: torch.cuda failed ({type(e).__name__}: {e})"
    return torch, ""


class _Profile:
    """torch.profiler around the timed calls, or nothing; ``rng(name)`` marks a phase."""

    def __init__(self, torch: Any):
        self.torch, self.prof = torch, None

    def start(self) -> None:
        if self.torch is not None and self.prof is None:
            p = self.torch.profiler
            self.prof = p.profile(activities=[p.ProfilerActivity.CPU, p.ProfilerActivity.CUDA])
            self.prof.start()

    def rng(self, name: str) -> Any:
        if self.prof is None:
            import contextlib
            return contextlib.nullcontext()
        return self.torch.profiler.record_function(PHASE_PREFIX + name)

    def stop(self, path: Path) -> Optional[Path]:
        if self.prof is None:
            return None
        self.prof.stop()
        raw = path.with_suffix("")            # x.trace.json.gz -> x.trace.json
        self.prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(path, "wb", compresslevel=6) as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
        return path


def _cuda_libraries() -> list[str]:
    """Paths of the CUDA runtime and cuBLAS mapped in this process (Linux /proc/self/maps; [] elsewhere
    or without them): which copies the timed kernels came from when torch shares the process."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "/libcudart" in ln or "/libcublas" in ln}
    except OSError:
        return []
    return sorted(paths)


def _native_stats(rt: Any) -> Optional[dict[str, Any]]:
    """Ostinato's own figures of the calls since the last take (None for stock)."""
    if rt is None:
        return None
    s = rt.take_request_stats()
    keep = ("passes", "tokens", "paths", "hot_route_share", "upload_bytes", "upload_ms", "cpu_branch_ms",
            "total_ms", "distinct_cold_experts", "decode_graph_steps")
    return {k: s.get(k) for k in keep if k in s}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Load one engine as the daemon's worker does, run the context prefill, the timed prefill and
    the decode steps (module docstring); returns the child's result (wall ms, native stats, trace)."""
    from ..engine import native
    from ..engine.np_probe import Passes
    from ..engine.worker import Worker
    from ..settings import load_settings

    # torch after the load unless the trace starts before it: torch's wheels load their own CUDA
    # runtime and cuBLAS, and llama.cpp's CUDA library, loaded first, keeps the ones it was built with
    early = spec["trace_from"] == "load"
    torch, why = _torch(spec) if early else (None, "")
    prof = _Profile(torch)
    settings = load_settings()   # the engine's settings come as the daemon's: environment variables
    w = Worker(settings, Path(spec["model"]))
    if torch is not None:
        prof.start()
    t0 = time.perf_counter()
    w.load()
    load_s = time.perf_counter() - t0
    if not early:
        torch, why = _torch(spec)
        prof = _Profile(torch)
    notes = [why] if why else []
    libs = _cuda_libraries()
    if libs:
        notes.append("CUDA libraries in this process: " + ", ".join(libs))
    if torch is not None and not native.has_gpu():
        prof.prof and prof.prof.stop()
        prof = _Profile(None)
        notes.append("no profiler: the native engine is a CPU build")
    prof.start()
    step = int(w.n_prefill_step)
    c, n, d = int(spec["context_tokens"]), int(spec["prompt_tokens"]), int(spec["decode_steps"])
    if c + n + d > w.n_ctx_slot:
        raise BenchError(f"C + N + D = {c + n + d} tokens exceed the context per slot ({w.n_ctx_slot})")
    passes = Passes(w, max(step, 1), seed=int(spec["seed"]))
    toks = passes.toks(c + n + d)
    wall: dict[str, Any] = {"load_s": round(load_s, 2)}
    try:
        def prefill(pos0: int, count: int) -> float:
            t = time.perf_counter()
            for i in range(0, count, step):
                passes.decode(toks[pos0 + i: pos0 + min(count, i + step)], pos0 + i)
            return round((time.perf_counter() - t) * 1e3, 3)

        with prof.rng("context"):
            wall["context_ms"] = prefill(0, c)
        _native_stats(w.rt)
        with prof.rng("prefill"):
            wall["prefill_ms"] = prefill(c, n)
        native_prefill = _native_stats(w.rt)
        wall["decode_ms"] = []
        for i in range(d):
            with prof.rng(f"decode:{i}"):
                wall["decode_ms"].append(round(passes.decode([toks[c + n + i]], c + n + i), 3))
        native_decode = _native_stats(w.rt)
    finally:
        passes.free()
    trace = prof.stop(Path(spec["trace"]))
    ub = {"ubatch": step, "reason": w.ubatch_reason}
    out = {"engine": spec["engine"], "wall": wall, "ubatch": ub, "prefill_passes": -(-n // step),
           "n_layer": int(w.gguf.n_layer) if w.gguf else 0, "expert_engine": w.rt is not None,
           "gpu_build": bool(native.has_gpu()),
           "np": getattr(w.rt, "prefill_threshold", None) if w.rt else None,
           "native": {"prefill": native_prefill, "decode": native_decode} if w.rt else None,
           "trace": str(trace) if trace else None, "notes": notes}
    w.close()
    return out


# ---- the parent ---------------------------------------------------------------------------------

def _spawn(name: str, a: argparse.Namespace, out_dir: Path, work: Path, profile: bool) -> dict[str, Any]:
    """Run engine ``name`` in a fresh process; its result, or ``{"error": ...}`` with the log's tail."""
    home = work / f"home-{name}"
    (home / "data").mkdir(parents=True, exist_ok=True)
    prof = get_paths().hardware_profile   # this machine's calibration (Np), as bench engines' daemons
    if prof.exists():
        shutil.copy(prof, home / "data" / prof.name)
    spec = {"engine": name, "model": str(Path(a.model).resolve()), "context_tokens": a.context_tokens,
            "prompt_tokens": a.prompt_tokens, "decode_steps": a.decode_steps, "seed": a.seed,
            "trace_from": a.trace_from, "profile": profile,
            "trace": str(out_dir / f"timeline-{name}.trace.json.gz")}
    spec_path, res_path = work / f"spec-{name}.json", work / f"result-{name}.json"
    spec_path.write_text(json.dumps(spec))
    res_path.unlink(missing_ok=True)
    env = dict(os.environ, OSTINATO_HOME=str(home), **settings_env(engine_settings(name, a)))
    log = out_dir / f"timeline-{name}.log"
    with open(log, "ab") as f:
        rc = subprocess.call([sys.executable, "-m", "ostinatod.bench.bench_timeline", "--child", str(spec_path),
                              "--model", a.model, "--out-dir", str(res_path)], env=env, stdout=f, stderr=f)
    if rc == 0 and res_path.exists():
        return json.loads(res_path.read_text())
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    return {"engine": name, "error": f"the child exited with {rc}", "log_tail": tail}


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Every engine in turn; returns the result (module docstring) and writes it to ``--out-dir``."""
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINE_CHOICES]
    if bad or not engines:
        raise BenchError(f"unknown engines {bad}; choose from ostinato, {LIMIT} or ostinato-* variants")
    if any(e != LIMIT for e in engines) and not a.residency:
        raise BenchError("--residency is required for the ostinato engines (a bench work dir's residency.json)")
    if not Path(a.model).is_file():
        raise BenchError(f"no model file {a.model}")
    if min(a.prompt_tokens, a.decode_steps) < 1 or a.context_tokens < 0:
        raise BenchError("--prompt-tokens and --decode-steps must be >= 1, --context-tokens >= 0")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ostinato-timeline-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": Path(a.model).name, "residency": a.residency,
                              "context_tokens": a.context_tokens, "prompt_tokens": a.prompt_tokens,
                              "decode_steps": a.decode_steps, "layer_marker": a.layer_marker,
                              "trace_from": a.trace_from, "engines": {}, "notes": []}
    for name in engines:
        say(f"timeline: {name}: load, {a.context_tokens} context tokens, prefill of {a.prompt_tokens}, "
            f"{a.decode_steps} decode steps")
        t0 = time.monotonic()
        r = _spawn(name, a, out_dir, work, profile=not a.no_profile)
        if "error" in r and not a.no_profile:
            result["notes"].append(f"{name}: {r['error']} with the profiler on; run again without it")
            say(result["notes"][-1])
            r2 = _spawn(name, a, out_dir, work, profile=False)
            r2.setdefault("notes", []).append(f"no profiler: the run with it failed ({r['error']}; "
                                              f"log timeline-{name}.log)")
            r = r2
        if r.get("trace"):
            try:
                with gzip.open(r["trace"], "rt") as f:
                    r["timeline"] = summarize_trace(json.load(f), r["n_layer"], r["prefill_passes"],
                                                    a.layer_marker)
                r["notes"].extend(r["timeline"].pop("notes"))
            except Exception as e:  # noqa: BLE001 - the trace is kept; its summary is what failed
                r["notes"].append(f"the trace could not be summarized: {type(e).__name__}: {e}")
        result["engines"][name] = r
        say(f"timeline: {name} done in {time.monotonic() - t0:.0f} s: "
            + (r.get("error") or f"prefill {r['wall']['prefill_ms']:.1f} ms, decode "
               f"{sum(r['wall']['decode_ms']) / max(1, len(r['wall']['decode_ms'])):.2f} ms/step"))
        write(result, out_dir)
    return result


def write(result: dict[str, Any], out_dir: Path) -> None:
    """``timeline.json`` and ``timeline.md`` in ``out_dir``."""
    (out_dir / "timeline.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "timeline.md").write_text(markdown(result))


def main(argv: Optional[list[str]] = None) -> int:
    """``ostinato bench timeline ...``; 0 when every engine ran, 1 when one failed, 2 on bad options."""
    a = build_parser().parse_args(argv)
    if a.child:   # the engine's process: --out-dir is the result file
        res = run_child(json.loads(Path(a.child).read_text()))
        Path(a.out_dir).write_text(json.dumps(res))
        return 0
    try:
        res = run(a)
    except BenchError as e:
        print(f"ostinato bench timeline: {e}", file=sys.stderr)
        return 2
    print(markdown(res))
    return 1 if any("error" in r for r in res["engines"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
