"""``ostinato bench cpu-branch``: the CPU branch alone on a model's real expert tensors.

For each model (``--model``, or small synthetic ones per ``--quants`` at ``--shape``'s real per-layer
sizes), one MoE layer's experts are loaded in host memory and, per (experts E, tokens n, threads T),
the CPU branch's own kernel (native/src/cpu_branch/kernel.cpp) and llama.cpp's own CPU ``mul_mat_id``
graph compute the same routes from the same inputs; their outputs are compared bit for bit. In the
same run the host's read bandwidth is measured per thread count. Reported per row: GB/s of expert
bytes read (each distinct expert once) for both, the kernel's share of the read bandwidth, and per
(model, tokens, threads, prefetch) a fit of the kernel's time against the bytes read, ``t = alpha +
bytes / bw`` (paper Sec. 3.2: C(r) = alpha + beta r with beta = expert bytes / bw): alpha is the
fixed cost of one layer's CPU branch, bw its effective bandwidth. ``--prefetch-rows 0,2`` runs the
kernel at each software-prefetch distance (setting ``cpu_branch_prefetch_rows``) in the same call;
``--memory model,anon,huge`` reads the experts from the model's own memory, from a private copy with
4 KiB pages and from one with transparent huge pages, with the host's read bandwidth and the page
sizes (``/proc/self/smaps``) of each. Every kernel row also says where its
time went (``phases_us``: grouping, the team's start, the input's quantisation, gate/up rows,
activations, down rows, barrier waits or, on the claim board, the handoffs between phases; the
threads that took part in ``threads_used``); ``--spins 256,1000000000`` runs the kernel with its team's
threads yielding after that many pauses while they wait (the default) and spinning on;
``--claims 1,0`` runs the kernel's team on its claim board (the default: the threads on a core take
the work's items one at a time, nobody waits for a thread that is not running) and with a barrier
after each phase (setting ``cpu_branch_claims``); ``--row-pairs 0,1,2`` runs the kernel with ggml-cpu's vec_dot row by row (the default) and with its
row-pair dot products in AVX2 and in AVX-512 (setting ``cpu_branch_row_pairs``); ``--swiglu-limit L``
computes the experts' activation as ggml's clamped SwiGLU with that limit (deepseek4's experts; 0, the
default: plain SwiGLU), the rows then saying what share of the activation's inputs the clamp changed.
Experts of a K-quant type with 8 or more tokens are computed as ggml-cpu's tiled kernel computes them,
all tokens at once (``tiled``: how many, on AMX or AVX-512 VNNI); ``--amx 1,0`` runs them on AMX tiles and
on AVX-512 VNNI (``--amx 2,3``: AMX with one of its two schemes at every token count, for choosing
where it switches). ``--tokens`` defaults to 1, 8, 32 and 64 tokens per pass.
See docs/engine.md, "CPU branch kernel".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ..engine import native
from ..engine.native import ExpertEngineError
from ..hardware import default_threads
from ..residency.cost import fit_cpu_bandwidth
from ..synth.shapes import SynthError
from ..synth.writer import write_synthetic_moe
from .bench_common import BenchError, say


def _ints(s: str, least: int = 1) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}") from None
    if not out or any(v < least for v in out):
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {s!r}")
    return out


def _rows(s: str) -> list[int]:
    return _ints(s, least=0)   # the engine refuses distances past its maximum (exit 2)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Adds to one model's native result: per row the kernel's share of the host read bandwidth at
    its thread count and its speed-up over ggml; per (tokens, threads) the alpha/bw fit. Pure."""
    bw = {int(b["threads"]): float(b["gbps"]) for b in result.get("read_bw", [])}
    # ggml is timed once per (experts, tokens, threads), at the first prefetch distance
    ggml = {(r["experts"], r["tokens"], r["threads"]): r["ggml_ms"] for r in result.get("rows", []) if r.get("ggml_ms")}
    for r in result.get("rows", []):
        host = bw.get(int(r["threads"]))
        if host and r.get("kernel_gbps") is not None:
            r["kernel_share_of_read_bw"] = r["kernel_gbps"] / host
        g = ggml.get((r["experts"], r["tokens"], r["threads"]))
        if r.get("kernel_ms") and g:
            r["speedup_vs_ggml"] = g / r["kernel_ms"]

    fits = []
    def key(r: dict[str, Any]) -> tuple:
        return int(r["tokens"]), int(r["threads"]), int(r.get("prefetch_rows", 0)), r.get("memory", "model"), \
            int(r.get("spins", 0)), int(r.get("row_pairs", 0)), int(r.get("claims", 1)), int(r.get("amx", 1))

    for k in sorted({key(r) for r in result.get("rows", [])}):
        f = fit_cpu_bandwidth([r for r in result["rows"] if key(r) == k])
        if f:
            n, t, pf, mem, sp, rp, cl, ax = k
            f.update(tokens=n, threads=t, prefetch_rows=pf, memory=mem, spins=sp, row_pairs=rp, claims=cl, amx=ax,
                     host_read_gbps=bw.get(t))
            fits.append(f)
    result["fits"] = fits
    return result


def _load(path: Path) -> Any:
    """A llama_model of ``path`` with every tensor in host memory and CPU repacking off (the
    layout the CPU branch reads)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    try:
        import llama_cpp._logger as llog  # lazy: the native engine, loaded only where it runs
        llog.set_verbose(False)   # llama.cpp's load log would bury the table
    except Exception:  # pragma: no cover - logging only
        pass
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise BenchError(f"llama.cpp could not load {path}")
    return model


def run(models: Sequence[Path], args: dict[str, Any]) -> list[dict[str, Any]]:
    """The native bench on each model; returns one summarized result per model."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    out = []
    for path in models:
        say(f"cpu-branch: {path.name}")
        model = _load(path)
        try:
            res = native.cpu_branch_bench(model, args)
        finally:
            llama_cpp.llama_model_free(model)
        res["model"] = str(path)
        out.append(summarize(res))
    return out


PHASES = ("prepare", "wake", "quant", "gate_up", "act", "down", "idle")


def table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown tables of the results (rows, then the fits, where the kernel's time went, and the
    memory kinds' read bandwidth and page sizes)."""
    lines = ["| model | types | E | n | T | pf | mem | spins | team | pairs | tiled | MB | kernel ms | GB/s | of read bw | ggml ms | GB/s | x ggml | bitwise |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        name = Path(res["model"]).name
        types = f"{res['type_up']}/{res['type_down']}"
        for r in res["rows"]:
            def f(key: str, fmt: str) -> str:
                v = r.get(key)
                return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "–"
            lines.append(f"| {name} | {types} | {r['experts']} | {r['tokens']} | {r['threads']} | "
                         f"{r.get('prefetch_rows', 0)} | {r.get('memory', 'model')} | {r.get('spins', '–')} | {_team(r)} | {r.get('row_pairs_isa', r.get('row_pairs', '–'))} | {_tiled(r)} | {r['bytes'] / 1e6:.1f} | {f('kernel_ms', '.3f')} | {f('kernel_gbps', '.1f')} | "
                         f"{f('kernel_share_of_read_bw', '.0%')} | {f('ggml_ms', '.3f')} | {f('ggml_gbps', '.1f')} | "
                         f"{f('speedup_vs_ggml', '.2f')} | {r.get('bitwise_equal', '–')} |")
    lines += ["", "| model | n | T | pf | mem | spins | team | pairs | alpha us | bw GB/s | host read GB/s | bw / read |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for fit in res.get("fits", []):
            host = fit.get("host_read_gbps")
            share = f"{fit['bw_gbps'] / host:.0%}" if host else "–"
            lines.append(f"| {Path(res['model']).name} | {fit['tokens']} | {fit['threads']} | "
                         f"{fit.get('prefetch_rows', 0)} | {fit.get('memory', 'model')} | {fit.get('spins', '–')} | {_team(fit)} | {fit.get('row_pairs', '–')} | {fit['alpha_us']:.1f} | "
                         f"{fit['bw_gbps']:.1f} | {host or 0:.1f} | {share} |")
    timed = [(res, r) for res in results for r in res["rows"] if r.get("phases_us")]
    if timed:
        lines += ["", "where the kernel's time went (us, medians; phases end when the last thread arrives)", "",
                  "| model | E | n | T | used | pf | mem | spins | team | pairs | " + " | ".join(PHASES) + " | total |",
                  "|---|---|---|---|---|---|---|---|---|---|" + "---|" * (len(PHASES) + 1)]
        for res, r in timed:
            ph = r["phases_us"]
            lines.append(f"| {Path(res['model']).name} | {r['experts']} | {r['tokens']} | {r['threads']} | "
                         f"{r.get('threads_used', '–')} | "
                         f"{r.get('prefetch_rows', 0)} | {r.get('memory', 'model')} | {r.get('spins', '–')} | {_team(r)} | {r.get('row_pairs_isa', r.get('row_pairs', '–'))} | "
                         + " | ".join(f"{ph.get(k, 0):.1f}" for k in PHASES) + f" | {ph.get('total', 0):.1f} |")
    mems = [(res, m) for res in results for m in res.get("memories", [])]
    if mems:
        lines += ["", "| model | mem | read GB/s per threads | page sizes (smaps) | kernel's answer |", "|---|---|---|---|---|"]
        for res, m in mems:
            info = m.get("info") or {}
            sm = info.get("smaps") or {}
            huge = sum(int(sm.get(k, 0)) for k in ("AnonHugePages_kib", "ShmemPmdMapped_kib", "FilePmdMapped_kib"))
            pages = f"{huge / 1024:.0f} of {int(sm.get('Rss_kib', 0)) / 1024:.0f} MiB huge" if sm else "–"
            answer = {k: v for k, v in info.items() if k != "smaps"}
            lines.append(f"| {Path(res['model']).name} | {m['memory']} | "
                         + ", ".join(f"{b['threads']}: {b['gbps']:.1f}" for b in m.get("read_bw", []))
                         + f" | {pages} | {json.dumps(answer) if answer else '–'} |")
    bw = results[0].get("read_bw", []) if results else []
    if bw:
        lines += ["", "host read bandwidth: " + ", ".join(f"{b['threads']} threads {b['gbps']:.1f} GB/s" for b in bw)]
    return "\n".join(lines)


def _tiled(r: dict[str, Any]) -> str:
    """Experts of a row computed as ggml's tiled kernel does, and on what (native/src/cpu_branch/gemm.h)."""
    n = r.get("tiled_experts")
    return f"{n} {r.get('tiled_isa', '')}".strip() if n else "–"


def _team(r: dict[str, Any]) -> str:
    """How the kernel's team took the work in a row or fit: claims (1, the default) or barriers (0)."""
    return "claims" if int(r.get("claims", 1)) else "barriers"


def main(argv: list[str] | None = None) -> int:
    """``ostinato bench cpu-branch`` (see the module docstring). 0 on success, 1 when an output
    differs from ggml's (bitwise_equal false), 2 on bad arguments or a model that cannot be used."""
    ap = argparse.ArgumentParser(prog="ostinato bench cpu-branch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, action="append", default=[],
                    help="GGUF whose expert tensors to use (repeatable); default: synthetic models per --quants")
    ap.add_argument("--quants", default="q4_0,q8_0,q4_k_m", help="quant recipes of the synthetic models")
    ap.add_argument("--shape", default="tiny", help="shape of the synthetic models (e.g. qwen3-30b-a3b: "
                    "its real per-layer sizes, 2 layers)")
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--layer", type=int, default=-1, help="MoE layer (default: the first)")
    ap.add_argument("--experts", type=_ints, default=[1, 2, 4, 8], help="distinct experts per layer")
    ap.add_argument("--tokens", type=_ints, default=[1, 8, 32, 64], help="tokens per pass (1: a decode step; "
                    "more: each expert's share of a prefill)")
    ap.add_argument("--threads", type=_ints, default=None, help="thread counts (default: 1, half and "
                    "all of the engine's cores)")
    ap.add_argument("--prefetch-rows", type=_rows, default=None, help="the kernel's software prefetch "
                    "distances in weight rows to run, e.g. 0,2,4 (default: the engine's, 0 = off)")
    ap.add_argument("--memory", default="model", help="where the kernel reads the experts from: model "
                    "(the model's own memory), anon (a private copy, 4 KiB pages), huge (a private copy, "
                    "transparent huge pages); comma-separated, each a row of the grid")
    ap.add_argument("--spins", type=_rows, default=None, help="pauses before a waiting thread of the "
                    "kernel's team yields, e.g. 256,1000000000 (default: the engine's, 256)")
    ap.add_argument("--claims", type=_rows, default=None, help="how the kernel's team takes a layer's "
                    "work: 1 claims (the threads on a core take its items one at a time, no barriers), 0 "
                    "a barrier after each phase; e.g. 1,0 runs both (default: the engine's, 1)")
    ap.add_argument("--row-pairs", type=_rows, default=None, help="the kernel's dot products: 0 ggml-cpu's "
                    "vec_dot row by row, 1 row pairs in AVX2, 2 in AVX-512; e.g. 0,1,2 runs all three "
                    "(default: the engine's, 0)")
    ap.add_argument("--amx", type=_rows, default=None, help="where the tiled experts' integer sums run: 1 on "
                    "AMX tiles (where the CPU has them), 0 on AVX-512 VNNI; 2 and 3 on AMX with one scheme "
                    "at every token count (2: sub-block sums scaled per token tile, 3: the weights scaled "
                    "once into two byte planes); e.g. 1,0 runs both (default: 1)")
    ap.add_argument("--swiglu-limit", type=float, default=0.0, help="the experts' activation as ggml's "
                    "clamped SwiGLU with this limit, as deepseek4's experts compute it (0: plain SwiGLU)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--read-bw-mib", type=int, default=1024, help="buffer of the host read-bandwidth test")
    ap.add_argument("--flush-mib", type=int, default=256, help="memory read before every timed run, so "
                    "that the experts come from memory as in a decode step (0: off, warm caches)")
    ap.add_argument("--no-ggml", action="store_true", help="skip llama.cpp's graph (the kernel alone)")
    ap.add_argument("--work-dir", type=Path, default=None, help="where synthetic models are written")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.read_bw_mib < 0 or a.flush_mib < 0:
        ap.error("--reps must be >= 1, --read-bw-mib and --flush-mib >= 0")
    memory = [m for m in a.memory.split(",") if m]
    kinds = ("model", "anon", "huge")
    if not memory or any(m not in kinds for m in memory):
        ap.error(f"--memory takes {', '.join(kinds)}, got {a.memory!r}")
    p = default_threads()
    threads = a.threads or sorted({1, max(1, p // 2), p})
    models = list(a.model)
    for m in models:
        if not m.is_file():
            print(f"ostinato bench cpu-branch: no such model: {m}", file=sys.stderr)
            return 2
    try:
        if not models:
            work = a.work_dir or Path(tempfile.mkdtemp(prefix="ost-cpu-branch-"))
            work.mkdir(parents=True, exist_ok=True)
            for q in [q for q in a.quants.split(",") if q]:
                path = work / f"{a.arch}-{a.shape}-{q}.gguf"
                if not path.exists():
                    say(f"writing {path.name}")
                    try:
                        write_synthetic_moe(path, arch=a.arch, shape=a.shape, n_layer=2, quant=q)
                    except SynthError as e:
                        print(f"ostinato bench cpu-branch: {e}", file=sys.stderr)
                        return 2
                models.append(path)
        args = {"layer": a.layer, "experts": a.experts, "tokens": a.tokens, "threads": threads,
                "reps": a.reps, "ggml": not a.no_ggml, "read_bw_bytes": a.read_bw_mib << 20,
                "flush_bytes": a.flush_mib << 20}
        if a.prefetch_rows:
            args["prefetch_rows"] = a.prefetch_rows
        if memory != ["model"]:
            args["memory"] = memory
        if a.spins:
            args["spins"] = a.spins
        if a.claims is not None:
            args["claims"] = a.claims
        if a.row_pairs:
            args["row_pairs"] = a.row_pairs
        if a.amx is not None:
            args["amx"] = a.amx
        if a.swiglu_limit:
            args["swiglu_limit"] = a.swiglu_limit
        results = run(models, args)
    except (BenchError, Exception) as e:   # a native refusal, a file llama.cpp will not load

        if not isinstance(e, (BenchError, ExpertEngineError)):
            raise
        print(f"ostinato bench cpu-branch: {e}", file=sys.stderr)
        return 2
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps({"command": sys.argv, "threads": threads, "results": results}, indent=1))
    bad = [r for res in results for r in res["rows"] if r.get("bitwise_equal") is False]
    if bad:
        print(f"ostinato bench cpu-branch: {len(bad)} rows differ from llama.cpp's mul_mat_id", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
