"""The worker's admission of requests into KV slots: the slot choice with the longest cached prefix,
the host-memory and disk prefix caches (restore on admit, slots written to disk when idle),
checkpoints of recurrent/hybrid memory, and the ``start``/``progress`` events."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import determinism, sampling
from .prefix_cache import restore_checkpoint, rewind_to_checkpoint, save_state, use_host_cache
from .slots import choose_slot
from .task import Task
from .events import ProgressEvent, StartEvent


log = logging.getLogger("ostinatod.engine")


class AdmitMixin:
    """Slot admission methods of :class:`.worker.Worker` (loop thread)."""

    def _disk_cache(self) -> Any:
        """The prefix cache on disk for this model and context (None: off, or it cannot be used)."""
        from ..paths import get_paths
        from .disk_cache import DiskPrefixCache, model_key
        from .prefix_cache import MIN_TOKENS
        if not self.settings.cache_disk_mb or self.deterministic or self.uncuttable_model():
            return None
        try:
            key = model_key(Path(self.model_path), self.n_ctx_slot,
                            f"{getattr(self.settings, 'cache_type_k', '')}/{getattr(self.settings, 'cache_type_v', '')}")
            return DiskPrefixCache(get_paths().state / "prefix-cache", self.settings.cache_disk_mb * 2 ** 20,
                                   key, MIN_TOKENS)
        except OSError as e:
            log.warning("prefix cache on disk off: %s", e)
            return None

    def uncuttable_model(self) -> bool:
        """Recurrent or hybrid memory (its states are checkpoints; not kept on disk)."""
        import llama_cpp
        return bool(llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(self.model))

    def persist_slots(self, idle_only: bool = True) -> int:
        """Write the KV state of each slot that holds at least MIN_TOKENS tokens not yet on disk
        (loop thread; the file is written in the background). Returns the states queued."""
        if self.dcache is None:
            return 0
        n = 0
        for s in self.slots:
            if (idle_only and s.task is not None) or len(s.tokens) < self.dcache.min_tokens:
                continue
            if self._persisted.get(s.id) == len(s.tokens) or self.dcache.covered(s.tokens):
                continue
            data = save_state(self.ctx, s.id)
            if data is not None:
                self.dcache.save(s.tokens, data)
                self._persisted[s.id] = len(s.tokens)
                n += 1
        return n

    def _restore_from_disk(self, prompt: list[int], target: Any, c: Any) -> tuple[Any, int]:
        """Put the disk's state that shares the longest prefix with ``prompt`` into ``target`` when
        it holds more of it than the choice ``c`` keeps; returns the (new) choice and the tokens
        restored."""
        from .prefix_cache import restore_state
        from .slots import SlotChoice
        hit = self.dcache.best(prompt)
        if hit is None or min(hit[1], len(prompt) - 1) <= c.n_keep:
            return c, 0
        entry, n = hit
        n = min(n, len(prompt) - 1)
        data = self.dcache.load(entry)
        if data is None:
            return c, 0
        import ctypes
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if not restore_state(self.ctx, self.mem, target, buf):
            log.warning("prefix cache on disk: %s could not be put back; prefilling", entry.path.name)
            return SlotChoice(target=target.id, n_keep=0), 0
        target.tokens = list(entry.tokens)
        self._persisted[target.id] = len(entry.tokens)
        log.info("prefix cache on disk: %d prompt tokens restored into slot %d", n, target.id)
        return SlotChoice(target=target.id, n_keep=n), n

    # ---- slots ----------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Give waiting requests (FIFO) a free slot, reusing the longest cached prefix."""
        import llama_cpp
        while self._waiting:
            free = [s for s in self.slots if s.task is None]
            if not free:
                return
            t = self._waiting.pop(0)
            if not self._active:  # a request boundary: nothing is generating
                self.switcher.auto_switch(t)
            c = choose_slot(free, t.prompt, time.monotonic())
            if self.deterministic:  # a slot's stream holds only what it computed itself
                c = determinism.own_slot_only(c, self.slots[c.target].tokens, t.prompt)
            target = self.slots[c.target]
            restored = 0
            ck = target.checkpoint
            if (self.uncuttable and ck is not None and c.copy_from is None
                    and len(ck.tokens) < len(target.tokens) and c.n_keep < len(target.tokens)):
                # the slot is cut back: its recurrent state goes back to the end of its last prompt
                # (reused when the new prompt extends that prompt, as an agent's next turn does;
                # else the whole state saved for the host cache below is that boundary's)
                if rewind_to_checkpoint(self.ctx, self.mem, target):
                    c = replace(c, n_keep=min(c.n_keep, len(target.tokens)))
                    with self._lock:
                        self._counters["checkpoint_rewinds"] += 1
                else:
                    c = replace(c, n_keep=0)
            if self.pcache is not None and not self.deterministic:
                c, restored = use_host_cache(self.pcache, self.ctx, self.mem, t.prompt, target, c,
                                             whole=self.uncuttable, disk=self.dcache)
            if self.dcache is not None and c.copy_from is None and not restored:
                c, restored = self._restore_from_disk(t.prompt, target, c)
            if c.copy_from is not None:  # share the other conversation's prefix (cells, no copy)
                src = self.slots[c.copy_from]
                llama_cpp.llama_memory_seq_rm(self.mem, target.id, -1, -1)
                llama_cpp.llama_memory_seq_cp(self.mem, src.id, target.id, 0, c.n_copy)
                target.tokens = src.tokens[:c.n_copy]
                target.checkpoint = None
            n_keep = c.n_keep
            if self.deterministic:
                valid = self._det_valid.get(c.copy_from if c.copy_from is not None else target.id, 0)
                n_keep = determinism.aligned_keep(n_keep, valid, self.n_prefill_step)
                self._det_valid[target.id] = n_keep
            if n_keep < len(target.tokens):
                if llama_cpp.llama_memory_seq_rm(self.mem, target.id, n_keep, -1):
                    target.tokens = target.tokens[:n_keep]
                else:   # recurrent/hybrid memory: back to the latest checkpoint within the prefix
                    n_keep = restore_checkpoint(self.pcache, self.ctx, self.mem, t.prompt, target, n_keep)
                    restored = max(restored, n_keep)
            target.task = t
            target.last_used = time.monotonic()
            t.slot = target
            t.n_cached = n_keep
            t.pending = t.prompt[n_keep:]
            t.t_prefill_start = time.monotonic()
            with self._lock:
                self._counters["prompt_tokens"] += len(t.prompt)
                self._counters["cached_tokens"] += n_keep
            self._active.append(t)
            self._emit(t, StartEvent(len(t.prompt), n_keep, target.id, restored or None,
                                     t.residency_switch, t.residency_skipped))
            self._progress(t)

    def _progress(self, t: Task) -> None:
        """The ``progress`` event of a request that asked for it (``return_progress``): prompt
        tokens, cached, processed so far (cached + prefilled), ms since its prefill began."""
        if t.req.return_progress:
            self._emit(t, ProgressEvent(len(t.prompt), t.n_cached, len(t.prompt) - len(t.pending),
                                        round((time.monotonic() - t.t_prefill_start) * 1000, 3)))

    def _release(self, t: Task) -> None:
        if t.slot is not None:
            t.slot.task = None
            t.slot.last_used = time.monotonic()
        if t.sampler is not None:
            sampling.free_sampler(t.sampler)
            t.sampler = None
        if t.parser is not None:
            t.parser.close()
            t.parser = None
