"""``ostinato bench engines``: upstream llama.cpp's ``llama-server`` with its MoE cache as a peer
engine (``llama-server-moe-cache``).

Upstream llama.cpp keeps the experts of host-resident MoE layers (``-cmoe``) in host memory and,
with ``--moe-cache-mib N``, the most recently used of them in an N MiB device buffer: one LRU over
the slots of all the layers whose experts have the same layout, used for batches of up to 32 tokens
(decode); larger batches upload the experts they use as before. It is the strongest stock
configuration a user with one GPU can pick, and the closest to Ostinato's (every expert in host
memory, a pool of them on the GPU). The bench starts it at Ostinato's GPU expert memory:

- ``-ngl 999 -cmoe``: every tensor on the GPU but the experts, all of which stay in host memory;
- ``--moe-cache-mib`` = Ostinato's pool at the run's ``--budget-frac`` (``plan.pool_bytes``, in
  whole MiB, rounded down): the same expert bytes on the GPU;
- ``-lm none``: the model is read into memory instead of mapped, so the host experts lie in the
  GPU's pinned host buffer (upstream's docs/moe-cache.md: the device uploads pinned experts at the
  full speed of the link; mapped ones are not pinned);
- the rest as ``llama-server``: 2 slots of ``--n-ctx`` tokens, the same threads and CPUs
  (:func:`.bench_launch.server_placement`), ``--jinja``, the ubatch Ostinato ran at
  (:func:`.bench_launch.peer_batch_flags`), ``--cache-reuse 0``.

``--moe-cache-cpu-share`` (the CPU computes a share of the misses) came later upstream than the
newest llama.cpp source a package registry carries (:data:`MOE_CACHE_SDIST`), so it is not passed;
``OSTINATO_MOE_CACHE_ARGS`` appends arguments (shell words) for a source that has it. The cache's
hit rate is in its log when the server stops (:func:`cache_figures`).

The binary is not part of our build: ``OSTINATO_MOE_CACHE_SERVER`` names it
(``scripts/device-run.sh`` stage ``mcbuild`` builds it with CUDA from the llama.cpp source in the
``xllamacpp`` sdist that ``scripts/moe-cache-carry.sh`` puts in ``.carry/``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path
from typing import Any, Optional, Sequence

from .bench_common import MOE_CACHE, BenchError
from .bench_launch import Server, free_port, gpu_env, peer_batch_flags, server_placement

MOE_CACHE_ENV = "OSTINATO_MOE_CACHE_SERVER"
MOE_CACHE_ARGS_ENV = "OSTINATO_MOE_CACHE_ARGS"
# the newest registry package that carries llama.cpp's source with --moe-cache-mib (llama.cpp
# b11549 in thirdparty/llama.cpp; scripts/moe-cache-carry.sh downloads it; its one home)
MOE_CACHE_SDIST = "xllamacpp==2026.10.11549"
MIB = 2**20

# its log: the cache's size at load, and its hits and misses when the server stops
# ("ubatch <= 8": decode and short batches; "ubatch  > 8": up to 32 tokens)
_SIZE = re.compile(r"MoE cache size = +([\d.]+) MiB for +([\d.]+) MiB of host experts")
_STATS = re.compile(r"llama_moe_cache: ubatch +(<=|>) 8: hits = (\d+), misses = (\d+), "
                    r"hit rate = [\d.]+%, uploaded = ([\d.]+) MiB")


def moe_cache_server_binary(env: Optional[dict[str, str]] = None) -> Path:
    """Upstream llama.cpp's llama-server named by ``$OSTINATO_MOE_CACHE_SERVER``. Raises
    BenchError (the bench skips the engine with that note) when unset or not an executable file."""
    env = os.environ if env is None else env
    p = env.get(MOE_CACHE_ENV)
    if not p:
        raise BenchError(f"binary not found: set {MOE_CACHE_ENV} to a llama-server with --moe-cache-mib "
                         f"(built from the {MOE_CACHE_SDIST} sdist by scripts/device-run.sh stage "
                         "mcbuild); engine skipped")
    path = Path(p)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BenchError(f"{MOE_CACHE_ENV}={p} is not an executable file; engine skipped")
    return path


def cache_mib(pool_bytes: int) -> int:
    """``--moe-cache-mib`` for Ostinato's pool of ``pool_bytes`` bytes: whole MiB, rounded down
    (never more expert memory than Ostinato's). Raises BenchError below 1 MiB (0 would turn the
    cache off)."""
    mib = int(pool_bytes) // MIB
    if mib < 1:
        raise BenchError(f"a pool of {pool_bytes} bytes is under 1 MiB: no MoE cache to give; engine skipped")
    return mib


def moe_cache_server_command(binary: Path, model: Path, port: int, mib: int, threads: int,
                             n_ctx: int, extra: str = "",
                             batch: Sequence[str] = ("-b", "2048", "-ub", "2048")) -> list[str]:
    """The command line of ``llama-server-moe-cache`` (see the module docstring): every expert in
    pinned host memory, a ``mib`` MiB MoE cache on the GPU, 2 slots of ``n_ctx`` tokens each,
    ``threads`` for decode and batch, the ``batch`` flags, ``extra`` (shell words) appended."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(n_ctx * 2), "-np", "2", "-ngl", "999", "-cmoe", "--moe-cache-mib", str(mib),
            "-lm", "none", "-t", str(threads), "-tb", str(threads), "--jinja", *batch,
            "--cache-reuse", "0"] + shlex.split(extra)


def cache_figures(log: str) -> dict[str, Any]:
    """The MoE cache's figures from a ``llama-server-moe-cache`` log ``log`` (text; the stats lines
    appear when the server stops): ``{"moe_cache": {"size_mib", "host_experts_mib", "small": {hits,
    misses, hit_rate, uploaded_mib}, "large": {...}}, "hot_route_share": hit rate of "small"}``.
    ``small`` is batches of up to 8 tokens (decode), ``large`` 9 to 32; the hit rate counts each
    expert once per batch, so for one token it is the share of routes computed from cached
    experts. A figure the log lacks (the server killed, the cache off) is None."""
    out: dict[str, Any] = {"size_mib": None, "host_experts_mib": None, "small": None, "large": None}
    sizes = _SIZE.findall(log)
    if sizes:   # one line per GPU
        out["size_mib"] = round(sum(float(s) for s, _ in sizes), 2)
        out["host_experts_mib"] = round(sum(float(h) for _, h in sizes), 2)
    for op, hits, misses, uploaded in _STATS.findall(log):
        h, m = int(hits), int(misses)
        out["small" if op == "<=" else "large"] = {
            "hits": h, "misses": m, "hit_rate": round(h / (h + m), 4) if h + m else None,
            "uploaded_mib": float(uploaded)}
    share = out["small"]["hit_rate"] if out["small"] else None
    return {"moe_cache": out, "hot_route_share": share}


def start_moe_cache_server(model: Path, pool_bytes: int, run_dir: Path, a: argparse.Namespace):
    """Start ``llama-server-moe-cache`` on a free loopback port (a :class:`.bench_launch.Server`)
    with a MoE cache of ``pool_bytes`` (Ostinato's pool); its environment is ours without our
    llama.cpp's library path (it links its own ggml)."""
    binary = moe_cache_server_binary()
    threads, cpus = server_placement(a)
    port = free_port()
    cmd = moe_cache_server_command(binary, model, port, cache_mib(pool_bytes), threads, a.n_ctx,
                                   os.environ.get(MOE_CACHE_ARGS_ENV, ""), batch=peer_batch_flags(a))
    return Server(MOE_CACHE, cmd, gpu_env(a, dict(os.environ)), run_dir / f"{MOE_CACHE}.log",
                  url=f"http://127.0.0.1:{port}", cpus=cpus)
