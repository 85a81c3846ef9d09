"""The served context per slot: what the settings ask for, as far as the memory left after the model
and its expert pool holds the KV cache of every slot, so that a load never fails on the KV cache
and an agent is told the context it really gets.

Pure arithmetic; :func:`.loading.load_model` measures the free memory after the model load (the
dense weights and the expert pool are allocated then) and calls :func:`fit_context` before it
creates the llama.cpp context, whose unified KV cache holds ``n_slots`` x the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MiB = 1 << 20
# a context lowered for memory is a multiple of this (llama.cpp pads the KV cache to 256 cells)
CONTEXT_STEP = 256
# below this a lowered context would not hold one agent's system prompt and tools: not lowered further
MIN_FIT_CONTEXT = 4096


@dataclass(frozen=True)
class ContextFit:
    """``n_ctx`` tokens per slot served; ``reason`` says why it is below what was asked (None: not
    lowered for memory; a clamp to the training context is not a memory reason)."""

    n_ctx: int
    asked: int
    reason: Optional[str] = None
    #: memory still free after the KV cache and the reserve (None: unknown)
    left_bytes: Optional[int] = None


def fit_context(asked: int, n_ctx_train: int, n_slots: int, kv_bytes_per_token: int,
                free_bytes: Optional[int], reserve_bytes: int = 0, where: str = "memory") -> ContextFit:
    """The context per slot to serve.

    ``asked``: the ``n_ctx`` setting (tokens per slot); clamped to ``n_ctx_train`` (0: unknown).
    The KV cache needs ``kv_bytes_per_token`` x ``n_slots`` x the context (f16 K and V of every
    layer, :class:`..residency.model.ModelInfo`'s figure). ``free_bytes``: memory free for it after
    the model load (None: unknown, nothing is lowered); ``reserve_bytes`` stays free for compute
    buffers and a margin. When the KV cache does not fit, the largest multiple of
    :data:`CONTEXT_STEP` that does is served, never below :data:`MIN_FIT_CONTEXT` (context creation
    then fails with its own error if even that does not fit); ``where`` names the memory in the
    reason ("GPU memory", "host memory").
    """
    want = min(int(asked), int(n_ctx_train)) if n_ctx_train and n_ctx_train > 0 else int(asked)
    per_ctx_token = max(0, int(kv_bytes_per_token)) * max(1, int(n_slots))
    if free_bytes is None or per_ctx_token == 0:
        left = None if free_bytes is None else int(free_bytes) - int(reserve_bytes)
        return ContextFit(want, int(asked), None, left)
    room = int(free_bytes) - int(reserve_bytes)
    if want * per_ctx_token <= room:
        return ContextFit(want, int(asked), None, room - want * per_ctx_token)
    fit = max(0, room) // per_ctx_token // CONTEXT_STEP * CONTEXT_STEP
    n = max(min(MIN_FIT_CONTEXT, want), fit)
    reason = (f"the KV cache of {n_slots} slot(s) x {want} tokens needs "
              f"{want * per_ctx_token // MiB} MiB and {max(0, room) // MiB} MiB of {where} is free for it "
              f"after the model and its expert pool ({int(reserve_bytes) // MiB} MiB kept for compute "
              "buffers and margin)")
    return ContextFit(n, int(asked), reason, max(0, room - n * per_ctx_token))
