"""KV slots and the choice of a slot for a new request (pure; the worker applies the choice).

``n_slots`` KV sequences share one unified KV cache; each holds exactly the tokens whose KV is in
the cache. A new request takes the free slot whose cached tokens share the longest common prefix
with its prompt. If that match covers less than :data:`SAME_SESSION_SHARE` of the slot's tokens
(another conversation) while another slot is free, the prefix is shared (``llama_memory_seq_cp``:
cells are shared, no data copied) into the *cheapest* free slot instead: the one whose cache is
cheapest to lose -- the fewest cached tokens, a slot idle for over :data:`STALE_S` counting as
empty, ties to the least recently used. So a title request or a side agent's request never evicts
the main session's long cache, even when the main session used its slot longest ago. Only the tail
beyond the match is dropped. (Ollama's cache slot choice and llama-server's
``--slot-prompt-similarity`` work alike; a slot's cache that is lost anyway can be kept in host
memory: :mod:`.prefix_cache`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# A request continues a slot's conversation in place when it matches at least this share of the
# slot's cached tokens (a re-rendered last turn differs only at the tail); below it the slot is kept
# for its own conversation and the common prefix is shared into another slot.
SAME_SESSION_SHARE = 0.75
# A slot unused this long (seconds) is cheap to evict whatever it holds (its session has ended).
STALE_S = 600.0


@dataclass
class Slot:
    """One KV sequence: ``tokens`` are exactly the tokens whose KV is in the cache (positions 0..n-1)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    task: Optional[Any] = None
    # the recurrent state at the end of this slot's last prompt (hybrid and recurrent models;
    # prefix_cache.SlotCheckpoint), or None
    checkpoint: Optional[Any] = None


@dataclass(frozen=True)
class SlotChoice:
    """Where a request goes: slot ``target``; first copy the first ``n_copy`` cached tokens of slot
    ``copy_from`` into it (None: no copy); then keep its first ``n_keep`` tokens (the prefix reused;
    at least one prompt token is always left to evaluate)."""

    target: int
    n_keep: int
    copy_from: Optional[int] = None
    n_copy: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def eviction_cost(slot: Slot, now: Optional[float] = None) -> tuple[int, float]:
    """How much losing ``slot``'s cache costs (smaller: evict first): its cached tokens (0 when
    idle for over :data:`STALE_S` at ``now``), then its last use."""
    stale = now is not None and now - slot.last_used > STALE_S
    return (0 if stale else len(slot.tokens), slot.last_used)


def choose_slot(free: Sequence[Slot], prompt: Sequence[int], now: Optional[float] = None) -> SlotChoice:
    """The slot of ``free`` (non-empty) for a request with ``prompt`` (see module docstring);
    ``now`` (the slots' clock) lets long-idle slots count as empty."""
    matches = {s.id: common_prefix(s.tokens, prompt) for s in free}
    best = max(free, key=lambda s: (matches[s.id], -s.last_used))
    target, n_match, copy_from = best, matches[best.id], None
    if n_match < SAME_SESSION_SHARE * len(best.tokens) and len(free) > 1:
        # `best` holds another conversation that shares only a prefix with this one (a side
        # request, a subagent): keep it, and share the prefix into the cheapest free slot
        target = min(free, key=lambda s: eviction_cost(s, now))
        if target is not best and matches[target.id] < n_match:
            copy_from = best.id
        else:
            n_match = matches[target.id]
    return SlotChoice(target=target.id, n_keep=min(n_match, len(prompt) - 1),
                      copy_from=copy_from, n_copy=n_match if copy_from is not None else 0)
