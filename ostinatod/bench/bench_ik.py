"""``ostinato bench engines``: ik_llama.cpp's ``llama-server`` as a peer engine (``ik-llama-server``).

ik_llama.cpp is the llama.cpp fork people pick for MoE models on one GPU: fused MoE up/gate
kernels, its own CPU matrix kernels, and expert placement by tensor-name regex (``-ot``). The bench
starts its server with its own MoE options at the GPU memory of ``stock-layers``:

- ``-ot <regex>=CPU``: the expert tensors of the first ``n_cpu_moe`` layers in CPU memory (the
  same layers, so the same expert bytes on the GPU, as ``stock-layers`` and ``llama-server``'s
  ``--n-cpu-moe``); every other tensor on the GPU (``-ngl 999``);
- flash attention on (``-fa on``); fused MoE is this version's default (``fused_moe_up_gate =
  true`` in its ``common.h``; the server has only ``-no-fmoe``, and ``-fmoe`` is an unknown
  argument there);
- the same threads and CPUs as ``llama-server`` (:func:`.bench_launch.server_placement`), the
  same context per slot and slots, ``--jinja`` (its chat templates and tool-call parsing).

It is replayed by the same client as every engine (:func:`.bench_launch.replay`). Its usage has no
``prompt_tokens_details``; the replay reads the prefilled tokens from its ``timings.prompt_n``.

The binary is not part of our build: ``OSTINATO_IK_SERVER`` names it (``scripts/device-run.sh``
stage ``ikbuild`` builds it with CUDA from the ``ik-llama-cpp-python`` sdist that
``scripts/ik-carry.sh`` puts in ``.carry/``). ``OSTINATO_IK_ARGS`` appends arguments (shell words),
e.g. ``-rtr`` to try its run-time repacking of the CPU experts; the JSON keeps the command.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Optional, Sequence

from .bench_common import IK, BenchError
from .bench_launch import Server, free_port, gpu_env, peer_batch_flags, server_placement

IK_ENV = "OSTINATO_IK_SERVER"
IK_ARGS_ENV = "OSTINATO_IK_ARGS"
# the sdist whose vendored ik_llama.cpp the device stage builds (scripts/ik-carry.sh downloads it;
# its one home)
IK_SDIST = "ik-llama-cpp-python==0.1.5"
# an expert weight tensor of layer L in ik_llama.cpp's names (its own --n-cpu-moe uses this pattern)
_EXPERT_TENSOR = r"\.ffn_(up|down|gate|gate_up)_exps\.weight$"


def ik_server_binary(env: Optional[dict[str, str]] = None) -> Path:
    """ik_llama.cpp's llama-server named by ``$OSTINATO_IK_SERVER``. Raises BenchError (the bench
    skips the engine with that note) when unset or not an executable file."""
    env = os.environ if env is None else env
    p = env.get(IK_ENV)
    if not p:
        raise BenchError(f"binary not found: set {IK_ENV} to ik_llama.cpp's llama-server (built "
                         f"from the {IK_SDIST} sdist by scripts/device-run.sh stage ikbuild); "
                         "engine skipped")
    path = Path(p)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BenchError(f"{IK_ENV}={p} is not an executable file; engine skipped")
    return path


def expert_override(n_cpu_moe: int) -> Optional[str]:
    """The ``-ot`` value that puts the expert tensors of layers 0 .. ``n_cpu_moe`` - 1 in CPU
    memory, or None for ``n_cpu_moe`` <= 0 (every expert on the GPU). ik_llama.cpp matches each
    pattern with ``std::regex_search`` (ECMAScript) against the tensor name, so it is anchored at
    both ends (``blk.1.`` must not match ``blk.12.``); the list is split at ',' and each item at
    its first '=', so neither character may appear in the regex."""
    if n_cpu_moe <= 0:
        return None
    layers = "|".join(str(i) for i in range(n_cpu_moe))
    return rf"^blk\.({layers}){_EXPERT_TENSOR}=CPU"


def ik_server_command(binary: Path, model: Path, port: int, n_cpu_moe: int, threads: int,
                      n_ctx: int, extra: str = "", trace_log: Optional[Path] = None,
                      batch: Sequence[str] = ("-b", "2048", "-ub", "512")) -> list[str]:
    """The command line of ``ik-llama-server`` (see the module docstring): 2 slots of ``n_ctx``
    tokens each, ``threads`` for decode and batch, ``extra`` (shell words) appended. Its trace log
    goes to ``trace_log`` + ".log" (``--log-file``; without it the server writes ``llama.log`` in
    its working directory, i.e. wherever the bench was started)."""
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(n_ctx * 2), "-np", "2", "-ngl", "999", "-fa", "on",
           "-t", str(threads), "-tb", str(threads), "--jinja", *batch]
    if trace_log is not None:
        cmd += ["--log-file", str(trace_log)]
    ot = expert_override(n_cpu_moe)
    if ot:
        cmd += ["-ot", ot]
    return cmd + shlex.split(extra)


def start_ik_server(model: Path, n_cpu_moe: int, run_dir: Path, a: argparse.Namespace):
    """Start ``ik-llama-server`` on a free loopback port (a :class:`.bench_launch.Server`); its
    environment is ours without our llama.cpp's library path (it links its own ggml)."""
    binary = ik_server_binary()
    threads, cpus = server_placement(a)
    port = free_port()
    cmd = ik_server_command(binary, model, port, n_cpu_moe, threads, a.n_ctx,
                            os.environ.get(IK_ARGS_ENV, ""), trace_log=run_dir / f"{IK}-trace",
                            batch=peer_batch_flags(a))
    return Server(IK, cmd, gpu_env(a, dict(os.environ)), run_dir / f"{IK}.log",
                  url=f"http://127.0.0.1:{port}", cpus=cpus)
