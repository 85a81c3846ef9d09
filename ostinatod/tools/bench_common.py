"""Shared by the ``ostinato bench engines`` modules: the engine names, the compared metrics, the
error and the progress line."""

from __future__ import annotations

import time

ENGINES = ("ostinato", "stock-all-gpu", "stock-layers", "stock-cpu", "llama-server")
STOCK = ("stock-layers", "stock-cpu", "llama-server")  # the baselines at equal GPU memory
LIMIT = "stock-all-gpu"  # every expert on the GPU: the reference limit, never a baseline
# the Ostinato engine on the first GPU only, same pool budget (a fraction of the expert bytes), in
# a run with --gpus N > 1: what N GPUs buy over one with the same model (never in the default list)
ONE_GPU = "ostinato-1gpu"
# the Ostinato engine with the same plan and one prefill option changed from its default (docs/engine.md
# "Pool views and the hybrid upload pass", "Prefetch"): its daemon settings (never in the default list)
VARIANTS = {"ostinato-no-prefetch": {"prefill_prefetch": False},
            "ostinato-hybrid": {"upload_cpu_share": -1}}
CHOICES = ENGINES + (ONE_GPU,) + tuple(VARIANTS)
METRICS = (("decode", "decode_ms_per_token"), ("ttft_after_tool", "ttft_after_tool_median_s"),
           ("session_total", "session_total_s"))
_T0 = time.monotonic()


class BenchError(RuntimeError):
    """The benchmark cannot continue (missing model writer, engine failed to start, ...)."""


def say(msg: str) -> None:
    """Progress line with elapsed seconds (stdout, flushed: the lead watches it live)."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)
