"""How a prefill is cut into forward passes: the ubatch, chosen at load. Pure.

Why it matters (paper arXiv 2611.11533, Sec. 3.3, the upload path): a pass at or above the prefill
threshold Np uploads each distinct cold expert its tokens route to, once per pass. A prefill of n
tokens in p passes therefore moves about p times the bytes of one: the distinct cold experts of a
layer are nearly all touched by a few hundred tokens (k routes per token over ~100-150 cold
experts), so each pass of a typical prefill after a tool output (400-1,000 tokens) uploads nearly
the same set again. Measured on the H200 (Qwen3.5-35B-A3B shape, 45% pool): an 863-token prefill
in 2.2 passes of 512 moved 18.6 GB, in 1.1 passes of 2048 9.9 GB, and the wait after a tool output
fell 23%. The GPU's own work per token does not depend on the pass size, so the cost model
C(n, u) = ceil(n / u) * upload(one pass) + n * compute_per_token is smallest for the largest u the
memory allows. What a larger u costs is memory: one pass's compute buffers grow with u
(:func:`..residency.planner.estimate_gpu_need`), taken from what the expert pool and the KV cache
leave free. Without an expert pool on a GPU there is nothing to upload and a small ubatch keeps
other slots' tokens flowing between passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

#: ubatch sizes the automatic choice considers (tokens), smallest first
UBATCH_STEPS = (512, 1024, 2048, 4096)
#: the ubatch without uploads to save (llama.cpp's default)
SMALL_UBATCH = 512


@dataclass(frozen=True)
class UbatchChoice:
    """The context's ubatch (tokens) and why (for the log, ``info()`` and the docs)."""

    ubatch: int
    reason: str


def choose_ubatch(asked: int, n_batch: int, uploads: bool, free_bytes: Optional[int],
                  compute_bytes: Callable[[int], int]) -> UbatchChoice:
    """The ubatch of the context.

    ``asked``: the ``n_ubatch`` setting (0: automatic). ``n_batch``: the logical batch (a pass never
    exceeds it). ``uploads``: the engine has an expert pool on a GPU with cold experts (passes
    upload them). ``free_bytes``: memory free on the pool's device after the model, the pool and
    the KV cache (None: unknown). ``compute_bytes(u)``: one pass's compute buffers at ubatch u.

    Automatic: with uploads, the largest of :data:`UBATCH_STEPS` up to ``n_batch`` whose compute
    buffers fit ``free_bytes`` beside those of the smallest step (which the context fit already kept
    free); else :data:`SMALL_UBATCH`. Never below 32 or above ``n_batch``.
    """
    top = max(32, n_batch)
    if asked > 0:
        return UbatchChoice(min(asked, top), "set")
    small = min(SMALL_UBATCH, top)
    if not uploads:
        return UbatchChoice(small, "no uploads to save (no expert pool on a GPU)")
    steps = [u for u in UBATCH_STEPS if u <= top] or [small]
    if top not in steps and top > steps[-1] and top <= UBATCH_STEPS[-1]:
        steps.append(top)
    best = small
    for u in steps:
        extra = compute_bytes(u) - compute_bytes(small)
        if free_bytes is None or extra <= free_bytes:
            best = max(best, u)
    why = "the largest whose compute buffers fit" + ("" if free_bytes is not None else " (free memory unknown)")
    return UbatchChoice(best, f"{why}: each pass uploads its cold experts once")


def passes(n_tokens: int, ubatch: int) -> int:
    """Forward passes of a prefill of ``n_tokens`` at ``ubatch`` tokens per pass (0 for none)."""
    if n_tokens <= 0:
        return 0
    return -(-n_tokens // max(1, ubatch))
