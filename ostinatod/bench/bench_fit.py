"""``ostinato bench engines``: whether the limit engine fits the GPUs, and how long each engine run
will take (the estimates printed before it, and the ``--time-limit`` check)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Optional

from ..residency import planner
from ..residency.planner import estimate_gpu_need, read_model_shape
from .bench_common import LIMIT

# seconds per replayed turn on the H200 machine at 48 layers (first H200 runs: session s / 16 turns); only
# for the time estimates printed before each engine, rescaled by the first engine measured
PRIOR_TURN_S = {"ostinato": 1.6, "stock-all-gpu": 0.65, "stock-layers": 3.6, "llama-server": 3.9,
                "ik-llama-server": 3.3,  # llama-server's x 40.4 / 47.3 s (their replays of the same 12 turns, qwen35moe, 2026-12-03)
                "llama-server-moe-cache": 3.3,  # a guess (ik's) until its first run
                "stock-cpu": 7.0}
PRIOR_LOAD_S = 30.0


def limit_fit(model: Path, a: argparse.Namespace, gpus: Optional[list] = None) -> dict[str, Any]:
    """Whether ``stock-all-gpu`` can run: the model's bytes (every expert, the dense weights, the
    output head), its f16 KV cache for the daemon's 2 slots x ``--n-ctx`` and one ubatch of compute
    (the planner's :func:`estimate_gpu_need`), plus a 1 GiB margin, against the free memory of the
    GPUs the engines use (the hardware probe: NVML via :func:`detect_gpus`).

    Returns ``{"run": bool, "gpu": bool (False: no GPU, runs CPU-only), "need_bytes", "free_bytes",
    "note": str or None}``."""

    found = planner.detect_gpus() if gpus is None else gpus
    n = str(getattr(a, "gpus", 1))
    used = found if not n.isdigit() else found[: int(n)]
    shape = read_model_shape(model)
    need = estimate_gpu_need(shape, range(shape.n_layer), 2 * a.n_ctx, last=True)
    need_b = shape.total_expert_bytes + need["dense"] + need["kv"] + need["compute"] + 2**30
    if not used:
        return {"run": True, "gpu": False, "need_bytes": need_b, "free_bytes": None,
                "note": f"{LIMIT}: no GPU found: it runs CPU-only like the other engines (the same "
                        "placement as stock-layers on a CPU build), so its figures are not the "
                        "all-GPU limit here; ratios_vs_limit only check the plumbing"}
    free = sum(g.free_bytes or 0 for g in used)
    ok = all(g.free_bytes is not None for g in used) and need_b <= free
    return {"run": ok, "gpu": True, "need_bytes": need_b, "free_bytes": free,
            "note": None if ok else
            f"{LIMIT}: skipped, the model does not fit: needs ~{need_b / 2**30:.1f} GiB (experts, "
            f"dense weights, KV cache for 2 x {a.n_ctx} tokens, compute, 1 GiB margin), "
            f"{free / 2**30:.1f} GiB free on {len(used)} GPU(s); no ratios_vs_limit"}


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
            src = f"the reference H200 run's ratio to {ref}, measured here"
        else:
            t, src = prior * self.n_layer / 48, "the reference H200 run's figure, scaled by layers"
        load = statistics.mean(self.load_s) if self.load_s else PRIOR_LOAD_S
        return self.n_turns * t + load, (f"{self.n_turns} turns x {t:.2f} s/turn ({src}) + load "
                                         f"~{load:.0f} s")
