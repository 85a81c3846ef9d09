"""The ``deterministic`` setting: batch shapes that do not depend on other requests or on the
cache (pure functions; the worker loop applies them).

Why greedy outputs differ without it (measured in docs/reliability.md): a forward pass computes a
token's logits with kernels whose reduction order depends on the batch's shape (how many tokens,
from how many sequences). The same prompt therefore gives slightly different logits when it is
batched with another slot's decode token, when a cached prefix moves the prefill chunk
boundaries, or when its last token is evaluated inside a prompt chunk instead of alone; a near
tie between two tokens then flips the greedy choice, and the outputs diverge from there.

With ``deterministic = true`` the worker
- puts one sequence in each forward pass (no cross-slot batching; slots take turns per step);
- cuts prompts into chunks at absolute positions that are multiples of the chunk size
  (``n_ubatch``), so the boundaries do not depend on how much of the prompt was cached;
- evaluates the last prompt token alone, in a pass of its own;
- reuses a cached prefix only as far as it was computed by such whole aligned prompt chunks
  (generated tokens and partial chunks are evaluated again).
"""

from __future__ import annotations


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
