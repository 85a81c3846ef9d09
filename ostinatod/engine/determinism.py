"""The ``deterministic`` setting: batch shapes that do not depend on other requests or on the
cache (pure functions; the worker loop applies them).

Why greedy outputs differ without it (measured in docs/reliability.md): a forward pass computes a
token's logits with kernels whose reduction order depends on the batch's shape (how many tokens,
from how many sequences). The same prompt therefore gives slightly different logits when it is
batched with another slot's decode token, when a cached prefix moves the prefill chunk
boundaries, or when its last token is evaluated inside a prompt chunk instead of alone; a near
tie between two tokens then flips the greedy choice, and the outputs diverge from there.

A cause of the same kind lies outside the batch: in llama.cpp's unified KV cache all slots share
one buffer, so where a sequence's cells lie, and how many cells a forward pass attends over
(``n_kv``: the highest used cell, padded to 256), depend on what the other slots hold; the
attention's reductions over the cells (split across threads by ``n_kv``) then round
differently, and two sequential runs of the same prompt can differ when the other slots differ.

With ``deterministic = true`` the worker
- gives each slot a KV stream of its own (``kv_unified = false``), and a slot reuses only what it
  computed itself (no prefix copied from another slot, no host-cache restore), so a sequence's
  cells are its positions in order and ``n_kv`` follows from its own length;
- puts one sequence in each forward pass (no cross-slot batching; slots take turns per step);
- cuts prompts into chunks at absolute positions that are multiples of the chunk size
  (``n_ubatch``), so the boundaries do not depend on how much of the prompt was cached;
- evaluates the last prompt token alone, in a pass of its own;
- reuses a cached prefix only as far as it was computed by such whole aligned prompt chunks
  (generated tokens and partial chunks are evaluated again).
"""

from __future__ import annotations

from .slots import SlotChoice, common_prefix


def aligned_keep(n_keep: int, valid: int, step: int) -> int:
    """Cached tokens to keep: within the prefix computed by whole aligned prompt chunks
    (``valid``), rounded down to a chunk boundary."""
    return (min(n_keep, valid) // step) * step


def chunk_len(pos: int, n_pending: int, step: int) -> int:
    """Prompt tokens to evaluate next for a sequence at position ``pos`` with ``n_pending`` prompt
    tokens left: up to the next multiple of ``step``, never the last prompt token (it goes
    alone)."""
    if n_pending <= 1:
        return n_pending
    return min(n_pending - 1, step - pos % step)


def extends_valid(valid: int, pos: int, k: int, step: int) -> int:
    """The aligned-valid prefix after evaluating ``k`` prompt tokens at ``pos``: grows only by
    whole aligned chunks that continue it."""
    if pos == valid and pos % step == 0 and k == step:
        return pos + k
    return valid


def own_slot_only(c: SlotChoice, own_tokens: list[int], prompt: list[int]) -> SlotChoice:
    """``c`` without a prefix copied from another slot: the target keeps only the prefix it holds
    itself (its own stream; copies across streams are not cell-for-cell)."""
    if c.copy_from is None:
        return c
    return SlotChoice(target=c.target, n_keep=min(common_prefix(own_tokens, prompt), len(prompt) - 1))
