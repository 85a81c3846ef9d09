"""A host-memory prefix cache of KV slot states (like llama-server's ``--cache-ram``).

When a slot's cache is about to be lost -- another conversation takes the slot -- the worker saves
the slot's KV state (``llama_state_seq_get_data``) here with its tokens; when a request's prompt
shares a longer prefix with a saved state than with any slot, the state is put back into the
request's slot (``llama_state_seq_set_data``) and only the rest of the prompt is prefilled. So an
agent session's KV state survives other agents' requests and side requests even with few slots.

The cache holds at most ``budget`` bytes; the least recently used states go first.
:class:`PrefixCache` is pure Python (any object with ``len()`` as data); :func:`use_host_cache`
does the llama.cpp calls for the worker.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import psutil

from .slots import Slot, SlotChoice, common_prefix

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger("ostinatod.engine")

# A state is worth saving (and restoring) only when it spares at least this many prompt tokens.
MIN_TOKENS = 256


@dataclass
class Saved:
    """One saved slot state: ``tokens`` whose KV is in ``data`` (positions 0..n-1)."""

    tokens: list[int]
    data: Any
    used: float = field(default_factory=time.monotonic)

    @property
    def n_bytes(self) -> int:
        return len(self.data)


class PrefixCache:
    """Saved slot states within a byte budget (see module doc)."""

    def __init__(self, budget: int, min_tokens: int = MIN_TOKENS):
        self.budget, self.min_tokens = int(budget), min_tokens
        self.entries: list[Saved] = []
        self.saves = self.hits = self.restored_tokens = self.dropped = 0

    @property
    def n_bytes(self) -> int:
        return sum(e.n_bytes for e in self.entries)

    def worth_saving(self, tokens: Sequence[int], n_keep: int) -> bool:
        """Whether a slot holding ``tokens`` that keeps only ``n_keep`` of them should be saved
        first: it would lose at least ``min_tokens`` tokens that no saved state already holds."""
        if len(tokens) - n_keep < self.min_tokens or self.budget <= 0:
            return False
        return not any(len(e.tokens) >= len(tokens) and common_prefix(e.tokens, tokens) == len(tokens)
                       for e in self.entries)

    def put(self, tokens: Sequence[int], data: Any) -> bool:
        """Keep a state (True), dropping the states it covers (their tokens are a prefix of
        ``tokens``) and then the least recently used ones until it fits; False when it alone is
        over the budget."""
        size = len(data)
        if size > self.budget:
            return False
        tokens = list(tokens)
        self.entries = [e for e in self.entries
                        if not (len(e.tokens) <= len(tokens) and common_prefix(e.tokens, tokens) == len(e.tokens))]
        self.entries.sort(key=lambda e: e.used)
        while self.entries and self.n_bytes + size > self.budget:
            self.entries.pop(0)
            self.dropped += 1
        self.entries.append(Saved(tokens, data))
        self.saves += 1
        return True

    def best(self, prompt: Sequence[int], whole: bool = False, at_most: Optional[int] = None
             ) -> Optional[tuple[Saved, int]]:
        """The saved state sharing the longest prefix with ``prompt`` and that prefix's length
        (None when no state shares ``min_tokens`` tokens). ``whole``: only states whose tokens are
        all a prefix of ``prompt`` (recurrent and hybrid memories cannot drop a suffix after a
        restore); ``at_most``: only prefixes of at most that many tokens."""
        got: Optional[tuple[Saved, int]] = None
        for e in self.entries:
            n = common_prefix(e.tokens, prompt)
            if whole and n != len(e.tokens):
                continue
            if at_most is not None and n > at_most:
                continue
            if n >= self.min_tokens and (got is None or n > got[1]):
                got = (e, n)
        return got

    def take(self, entry: Saved, n_used: int) -> Any:
        """Remove ``entry`` (it goes back into a slot, which holds it from now on) and return its
        data; ``n_used``: the prompt tokens it spares (stats)."""
        self.entries.remove(entry)
        self.hits += 1
        self.restored_tokens += n_used
        return entry.data

    def stats(self) -> dict[str, int]:
        """``{"entries", "bytes", "budget", "saves", "hits", "restored_tokens", "dropped"}``."""
        return {"entries": len(self.entries), "bytes": self.n_bytes, "budget": self.budget,
                "saves": self.saves, "hits": self.hits, "restored_tokens": self.restored_tokens,
                "dropped": self.dropped}


def prefix_cache_budget(settings: Settings) -> int:
    """Bytes the host-memory prefix cache may hold: ``settings.cache_ram_mb`` MiB (None: 1/8 of the
    RAM, at most 8 GiB; 0: no cache)."""
    mb = settings.cache_ram_mb
    if mb is None:
        mb = min(8192, psutil.virtual_memory().total // 8 // 2 ** 20)
    return int(mb) * 2 ** 20


def make_prefix_cache(settings: Settings) -> Optional[PrefixCache]:
    """The cache of :func:`prefix_cache_budget` bytes (None when that is 0)."""
    budget = prefix_cache_budget(settings)
    return PrefixCache(budget) if budget else None


def use_host_cache(pc: PrefixCache, ctx: Any, mem: Any, prompt: Sequence[int], target: Slot,
                   c: SlotChoice, whole: bool = False, disk: Any = None) -> tuple[SlotChoice, int]:
    """Around a slot choice ``c`` (worker loop thread): save ``target``'s state when the request
    would drop much of it (also to ``disk``, a :class:`.disk_cache.DiskPrefixCache`), and put a
    saved state back into ``target`` when it holds more of ``prompt`` than ``c`` keeps (``whole``: only states that are all a prefix of ``prompt``, for
    memories that cannot be cut back). Returns the (possibly new) choice and the tokens restored."""
    kept_own = 0 if c.copy_from is not None else c.n_keep
    if pc.worth_saving(target.tokens, kept_own):
        data = save_state(ctx, target.id)
        if data is not None:
            pc.put(target.tokens, data)
            if disk is not None and not disk.covered(target.tokens):  # kept across restarts too
                disk.save(target.tokens, data)
    hit = pc.best(prompt, whole=whole, at_most=len(prompt) - 1 if whole else None)
    if hit is None or min(hit[1], len(prompt) - 1) <= c.n_keep:
        return c, 0
    entry, n = hit
    n = min(n, len(prompt) - 1)
    if not restore_state(ctx, mem, target, pc.take(entry, n)):
        return SlotChoice(target=target.id, n_keep=0), 0
    target.tokens = list(entry.tokens)
    return SlotChoice(target=target.id, n_keep=n), n


def restore_checkpoint(pc: Optional[PrefixCache], ctx: Any, mem: Any, prompt: Sequence[int],
                       target: Slot, n_keep: int) -> int:
    """For a memory that cannot drop a suffix (recurrent or hybrid): instead of prefilling
    ``prompt`` from scratch, put back the latest checkpoint (:meth:`PrefixCache.checkpoint`) that
    is wholly a prefix of ``prompt`` and no longer than ``n_keep``. Returns the tokens now in
    ``target`` (0: it was emptied; prefill everything)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    hit = pc.best(prompt, whole=True, at_most=min(n_keep, len(prompt) - 1)) if pc is not None else None
    if hit is not None and restore_state(ctx, mem, target, pc.take(hit[0], hit[1])):
        target.tokens = list(hit[0].tokens)
        return len(target.tokens)
    llama_cpp.llama_memory_seq_rm(mem, target.id, -1, -1)
    target.tokens = []
    target.checkpoint = None
    return 0


def save_state(ctx: Any, seq: int) -> Any:
    """The KV state of sequence ``seq`` (a ctypes byte array), or None when it cannot be read."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    try:
        n = llama_cpp.llama_state_seq_get_size(ctx, seq)
        buf = (ctypes.c_uint8 * n)()
        got = llama_cpp.llama_state_seq_get_data(ctx, buf, n, seq)
    except Exception as e:  # never fail a request for the cache
        log.warning("host cache: saving sequence %d failed: %s", seq, e)
        return None
    if not got:
        return None
    return buf if got == n else (ctypes.c_uint8 * got).from_buffer_copy(bytes(buf)[:got])


def restore_state(ctx: Any, mem: Any, slot: Slot, data: Any) -> bool:
    """Put a saved state into ``slot``'s sequence (emptied first; left empty on failure)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    llama_cpp.llama_memory_seq_rm(mem, slot.id, -1, -1)
    slot.tokens = []
    slot.checkpoint = None
    try:
        ok = llama_cpp.llama_state_seq_set_data(ctx, data, len(data), slot.id)
    except Exception as e:
        log.warning("host cache: restoring into slot %d failed: %s", slot.id, e)
        ok = 0
    if not ok:
        llama_cpp.llama_memory_seq_rm(mem, slot.id, -1, -1)
    return bool(ok)


# llama.h's LLAMA_STATE_SEQ_FLAGS_*: only the partial part of a hybrid memory (its recurrent
# layers' state), and its tensors kept in the context's own device buffers (one state per sequence)
STATE_PARTIAL_ONLY = 1
STATE_ON_DEVICE = 2


@dataclass
class SlotCheckpoint:
    """A slot's recurrent state right after a prompt of ``tokens`` (a message boundary).

    Only the recurrent layers' state is saved (``STATE_PARTIAL_ONLY``): the attention layers'
    cells stay in the KV cache, and going back to the checkpoint cuts them past ``len(tokens)``.
    With ``STATE_ON_DEVICE`` in ``flags`` the tensors stay in llama.cpp's per-sequence device
    buffers and ``meta`` holds only the host part (cell positions, shapes); else ``meta`` holds
    everything. Saving at every prompt's end costs a device-to-device copy of the recurrent state
    (tens of MB for Qwen3.5), where a whole-state copy to host memory costs the attention KV of the
    whole prompt over the link, on the critical path of the first token."""

    tokens: list[int]
    meta: Any
    flags: int


def save_slot_checkpoint(ctx: Any, slot: Slot) -> bool:
    """Save ``slot``'s recurrent state as its :class:`SlotCheckpoint` (worker loop thread; replaces
    the previous one). Tries the device form first, then the host form. False (and no checkpoint)
    when llama.cpp cannot save it; never raises."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    slot.checkpoint = None
    for flags in (STATE_PARTIAL_ONLY | STATE_ON_DEVICE, STATE_PARTIAL_ONLY):
        try:
            n = llama_cpp.llama_state_seq_get_size_ext(ctx, slot.id, flags)
            if not n:
                continue
            buf = (ctypes.c_uint8 * n)()
            got = llama_cpp.llama_state_seq_get_data_ext(ctx, buf, n, slot.id, flags)
        except Exception as e:  # never fail a request for the cache
            log.warning("slot %d: saving its recurrent state failed: %s", slot.id, e)
            continue
        if got:
            meta = buf if got == n else (ctypes.c_uint8 * got).from_buffer_copy(bytes(buf)[:got])
            slot.checkpoint = SlotCheckpoint(list(slot.tokens), meta, flags)
            return True
    return False


def rewind_to_checkpoint(ctx: Any, mem: Any, slot: Slot) -> bool:
    """Take ``slot`` back to its checkpoint: its recurrent state as saved, its attention cells past
    the checkpoint's tokens dropped; ``slot.tokens`` cut to match. False when the slot has no valid
    checkpoint (its tokens no longer start with the checkpoint's) or llama.cpp refuses; a refusal
    after the state was touched leaves the slot empty, never half restored."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    ck = slot.checkpoint
    n = len(ck.tokens) if ck is not None else 0
    if ck is None or len(slot.tokens) < n or slot.tokens[:n] != ck.tokens:
        slot.checkpoint = None
        return False
    try:
        ok = llama_cpp.llama_state_seq_set_data_ext(ctx, ck.meta, len(ck.meta), slot.id, ck.flags)
    except Exception as e:
        log.warning("slot %d: restoring its recurrent state failed: %s", slot.id, e)
        ok = 0
    if ok and llama_cpp.llama_memory_seq_rm(mem, slot.id, n, -1):
        slot.tokens = slot.tokens[:n]
        return True
    llama_cpp.llama_memory_seq_rm(mem, slot.id, -1, -1)
    slot.tokens = []
    slot.checkpoint = None
    return False
