"""Shared by the ``ostinato bench engines`` modules: the engine names, the compared metrics, the
error and the progress line."""

from __future__ import annotations

import re
import time
from typing import Any

from ..errors import MessageError
from ..hardware import default_threads

ENGINES = ("ostinato", "stock-all-gpu", "stock-layers", "stock-cpu", "llama-server")
STOCK = ("stock-layers", "stock-cpu", "llama-server")  # the baselines at equal GPU memory
LIMIT = "stock-all-gpu"  # every expert on the GPU: the reference limit, never a baseline
# ik_llama.cpp's llama-server (a fork with fused MoE and its own CPU kernels) at the same expert
# bytes on the GPU as stock-layers: a peer, never in the default list (its binary is built apart)
IK = "ik-llama-server"
# upstream llama.cpp's llama-server with its MoE cache (every expert in host memory, the most recently
# used on the GPU) at Ostinato's pool bytes: a peer, never in the default list (built apart)
MOE_CACHE = "llama-server-moe-cache"
# the Ostinato engine on the first GPU only, same pool budget (a fraction of the expert bytes), in
# a run with --gpus N > 1: what N GPUs buy over one with the same model (never in the default list)
ONE_GPU = "ostinato-1gpu"


def _quarter_pool() -> dict:
    """The decode graph's CPU-branch pool on a quarter of the engine's cores and the context's
    threads on the rest: no more OpenMP threads in the process than cores, where libgomp would
    otherwise shorten every wait to 100 spins and sleep (docs/engine.md, "Decode graph", threads).
    The default since the 16-core H200 run (hardware.expert_engine_threads): kept to compare a
    machine's calibrated or set counts with it."""
    p = default_threads()
    q = max(1, p // 4)
    return {"decode_threads": q, "n_threads": max(1, p - q)}


# the Ostinato engine with the same plan and one option changed from its default (docs/engine.md
# "Pool views and the hybrid upload pass", "Prefetch", "Decode graph"): its daemon settings (the
# [engine] table's by their names, settings.ENGINE_KEYS), or a function of the machine that returns
# them (never in the default list; see variant_settings)
VARIANTS = {"ostinato-no-prefetch": {"prefill_prefetch": False},
            "ostinato-prefetch1": {"prefill_prefetch_depth": 1},
            "ostinato-copy1d": {"upload_copy_2d": False},
            "ostinato-class-slots": {"pool_whole_expert_slots": False},
            "ostinato-hybrid": {"upload_cpu_share": -1},
            "ostinato-cpu-split": {"prefill_cpu_split": True},
            "ostinato-pool-quarter": _quarter_pool,
            "ostinato-ggml-cpu": {"cpu_branch_kernel": False},
            "ostinato-cpu-prefetch": {"cpu_branch_prefetch_rows": 2},
            "ostinato-cpu-spin": {"cpu_branch_spins": 32768},
            "ostinato-barriers": {"cpu_branch_claims": False},
            "ostinato-pairs-avx2": {"cpu_branch_row_pairs": "avx2"},
            "ostinato-pairs-avx512": {"cpu_branch_row_pairs": "avx512"},
            "ostinato-no-dprefetch": {"decode_prefetch_experts": 0},
            "ostinato-dprefetch1": {"decode_prefetch_experts": 1},
            "ostinato-dprefetch4": {"decode_prefetch_experts": 4},
            "ostinato-dprefetch-auto": {"decode_prefetch_experts": "auto"},
            "ostinato-copy2": {"decode_prefetch_copy_blocks": 2},
            "ostinato-copy4": {"decode_prefetch_copy_blocks": 4},
            "ostinato-copy32": {"decode_prefetch_copy_blocks": 32},
            "ostinato-cpu8": {"decode_threads": 8},
            "ostinato-cpu8-spin": {"decode_threads": 8, "cpu_branch_spins": 4096},
            "ostinato-cpu8-dprefetch4": {"decode_threads": 8, "decode_prefetch_experts": 4}}
CHOICES = ENGINES + (IK, MOE_CACHE, ONE_GPU) + tuple(VARIANTS)


def is_peer(name: str) -> bool:
    """Whether engine ``name`` is a peer: every engine but Ostinato's own (``ostinato`` and its
    ``ostinato-*`` variants) and the limit (``ratios_vs_best_peer`` takes the best of them)."""
    return name != LIMIT and name != "ostinato" and not name.startswith("ostinato-")


def variant_settings(name: str) -> dict:
    """The daemon settings of the bench variant ``name`` on this machine (KeyError if unknown)."""
    opts = VARIANTS[name]
    return dict(opts() if callable(opts) else opts)


def skew_tag(skew: float) -> str:
    """The file-name tag of a routing skew: 0.84 -> "skew84"."""
    return f"skew{round(skew * 100):02d}"


# lines of a server's log that say its engine died or aborted: raw output of native code (ggml's
# and CUDA's aborts, a C++ terminate, Python's fatal error) and, among the daemon's own log lines,
# only those for a crashed or killed engine worker (a daemon line could quote a request or model
# output, so it is never matched for the native markers)
NATIVE_CRASH_MARKERS = ("GGML_ASSERT", "GGML_ABORT", "ggml_abort", "CUDA error", ": fatal error",
                        "Fatal Python error", "terminate called")
DAEMON_CRASH_MARKERS = ("engine worker exited", "did not answer a ping")
_DAEMON_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")   # the daemon's log format


def crash_lines(text: str, limit: int = 6) -> list[str]:
    """The first ``limit`` distinct lines of a server log ``text`` that say an engine crashed, in
    log order, each stripped and cut to 300 characters: a daemon log line (timestamped) with a
    :data:`DAEMON_CRASH_MARKERS` marker, any other line with a :data:`NATIVE_CRASH_MARKERS` one.
    [] when the log shows no crash (the daemon's "stalled" warning for a slow worker is not one; its
    line for the kill that follows is)."""
    out: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s[:300] in out:
            continue
        markers = DAEMON_CRASH_MARKERS if _DAEMON_LINE.match(s) else NATIVE_CRASH_MARKERS
        if any(m in s for m in markers):
            out.append(s[:300])
            if len(out) >= limit:
                break
    return out


METRICS = (("decode", "decode_ms_per_token"), ("ttft_after_tool", "ttft_after_tool_median_s"),
           ("session_total", "session_total_s"))
_T0 = time.monotonic()


class BenchError(MessageError, RuntimeError):
    """The benchmark cannot continue (missing model writer, engine failed to start, ...)."""

    code, status = "bench_failed", 500


def parse_list(text: str | None, option: str, what: str, ok, bounds: str) -> list[float]:
    """``"0.85,0.25, 0.45"`` -> [0.25, 0.45, 0.85] (sorted, unique; None or "" -> []) for the
    option ``option``; BenchError naming ``what`` (e.g. "fractions") when an item is not a number
    or ``ok(x)`` is false (``bounds`` says the allowed range)."""
    if not text:
        return []
    try:
        xs = sorted({round(float(x), 4) for x in text.split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"{option}: not a comma list of {what}: {text!r}") from None
    if any(not ok(x) for x in xs):
        raise BenchError(f"{option}: {what} must be in {bounds}, got {text!r}")
    return xs


def say(msg: str) -> None:
    """Progress line with elapsed seconds (stdout, flushed: the lead watches it live)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def fmt(v: Any, unit: str = "", nd: int = 2) -> str:
    """``v`` for a markdown table: floats with ``nd`` decimals, then ``unit``; "n/a" for None."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}{unit}"
    return f"{v}{unit}"
