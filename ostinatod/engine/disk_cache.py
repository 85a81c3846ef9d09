"""The host-memory prefix cache's states kept on disk, so an agent session comes back warm after the
daemon restarts (every login): its system prompt and tools (Claude Code's are ~12k tokens) need
not be prefilled again.

A state (a slot's KV, ``llama_state_seq_get_data``, for exact ``tokens``) is written in the
background to one file under ``<state dir>/prefix-cache/``: a header (magic, JSON with the model
key, the token count and the data's length and CRC-32), the tokens (int32), the data. The model key
names the model file (path, size, mtime) and the context (tokens per slot, KV types): a state is
only put back into the same model with the same KV layout. At load the headers are read (not the
data); a file that is truncated, damaged or of another model is ignored with a log line, never
served. The files stay within ``budget`` bytes: the oldest go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any, Optional, Sequence

from .slots import common_prefix

log = logging.getLogger("ostinatod.engine")

MAGIC = b"OSTPFX1\n"
_HEAD = struct.Struct("<I")  # length of the JSON header


def model_key(model_path: Path, n_ctx_slot: int, extra: str = "") -> str:
    """The identity a saved state is valid for: the model file (resolved path, size, mtime in ns),
    the context per slot and ``extra`` (the KV cache types): a hex digest."""
    st = model_path.stat()
    ident = f"{model_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{n_ctx_slot}|{extra}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


@dataclass
class DiskEntry:
    """One state file: its ``path``, ``tokens`` and data length ``n_data`` (bytes)."""

    path: Path
    tokens: list[int]
    n_data: int


class DiskPrefixCache:
    """States on disk for one model key (see module doc). Writes run on a background thread."""

    def __init__(self, folder: Path, budget: int, key: str, min_tokens: int):
        self.folder, self.budget, self.key, self.min_tokens = Path(folder), int(budget), key, min_tokens
        self.folder.mkdir(parents=True, exist_ok=True)
        self.entries: list[DiskEntry] = []
        self._lock = threading.Lock()
        self._queue: "Queue[Optional[tuple[list[int], bytes]]]" = Queue()
        self._writer = threading.Thread(target=self._write_loop, name="ostinato-disk-cache", daemon=True)
        self._writer.start()
        self.writes = self.hits = self.ignored = 0
        self._scan()

    # ---- reading --------------------------------------------------------------------------------

    def _read_header(self, path: Path) -> tuple[dict[str, Any], list[int], int]:
        """(header, tokens, offset of the data) of a state file. Raises ValueError when the file
        is not a whole state file of this format."""
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a prefix-cache file")
            raw = f.read(_HEAD.size)
            if len(raw) != _HEAD.size:
                raise ValueError("truncated header")
            (n,) = _HEAD.unpack(raw)
            head = json.loads(f.read(n))
            toks = array("i")
            toks.frombytes(f.read(4 * int(head["n_tokens"])))
            if len(toks) != head["n_tokens"]:
                raise ValueError("truncated tokens")
            offset = f.tell()
        if path.stat().st_size != offset + int(head["n_data"]):
            raise ValueError(f"{path.stat().st_size - offset} bytes of state, {head['n_data']} expected")
        return head, toks.tolist(), offset

    def _scan(self) -> None:
        for path in sorted(self.folder.glob("*.state")):
            try:
                head, toks, _ = self._read_header(path)
            except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
                log.warning("prefix cache on disk: %s ignored (%s)", path.name, e)
                self.ignored += 1
                continue
            if head.get("model") != self.key:
                log.info("prefix cache on disk: %s is of another model or context; ignored", path.name)
                self.ignored += 1
                continue
            self.entries.append(DiskEntry(path, toks, int(head["n_data"])))
        if self.entries:
            log.info("prefix cache on disk: %d states of this model (%.1f MiB) in %s", len(self.entries),
                     sum(e.n_data for e in self.entries) / 2 ** 20, self.folder)

    def best(self, prompt: Sequence[int], at_most: Optional[int] = None) -> Optional[tuple[DiskEntry, int]]:
        """The state sharing the longest prefix (at least ``min_tokens``; with ``at_most``, only
        states all of whose tokens are a prefix of ``prompt`` no longer than that) and its length."""
        got = None
        with self._lock:
            entries = list(self.entries)
        for e in entries:
            n = common_prefix(e.tokens, prompt)
            if at_most is not None and (n != len(e.tokens) or n > at_most):
                continue
            if n >= self.min_tokens and (got is None or n > got[1]):
                got = (e, n)
        return got

    def load(self, entry: DiskEntry) -> Optional[bytes]:
        """The data of ``entry``, checked against its header (None, logged, and the file dropped,
        when it is damaged)."""
        try:
            head, toks, offset = self._read_header(entry.path)
            with open(entry.path, "rb") as f:
                f.seek(offset)
                data = f.read()
            if head.get("model") != self.key or toks != entry.tokens:
                raise ValueError("header changed")
            if zlib.crc32(data) != head["crc32"]:
                raise ValueError("checksum mismatch")
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            log.warning("prefix cache on disk: %s not used (%s)", entry.path.name, e)
            self._drop(entry)
            return None
        self.hits += 1
        os.utime(entry.path)  # recently used: evicted last
        return data

    # ---- writing --------------------------------------------------------------------------------

    def covered(self, tokens: Sequence[int]) -> bool:
        """Whether a state of ``tokens`` (or of a longer sequence that starts with them) is on disk."""
        with self._lock:
            return any(len(e.tokens) >= len(tokens) and common_prefix(e.tokens, tokens) == len(tokens)
                       for e in self.entries)

    def save(self, tokens: Sequence[int], data: Any) -> None:
        """Queue a state for writing (``data``: bytes or a ctypes buffer, copied now)."""
        if self.budget <= 0 or len(tokens) < self.min_tokens or len(data) > self.budget:
            return
        self._queue.put((list(tokens), bytes(data)))

    def flush(self) -> None:
        """Wait until the queued states are written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the engine
                log.warning("prefix cache on disk: writing a state failed: %s", e)
            finally:
                self._queue.task_done()

    def _write(self, tokens: list[int], data: bytes) -> None:
        name = hashlib.sha256(array("i", tokens).tobytes()).hexdigest()[:24] + ".state"
        path = self.folder / name
        head = json.dumps({"model": self.key, "n_tokens": len(tokens), "n_data": len(data),
                           "crc32": zlib.crc32(data)}).encode()
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + _HEAD.pack(len(head)) + head + array("i", tokens).tobytes())
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            # states whose tokens the new one holds are not needed any more
            covered = [e for e in self.entries if e.path != path and len(e.tokens) <= len(tokens)
                       and common_prefix(e.tokens, tokens) == len(e.tokens)]
            self.entries = [e for e in self.entries if e.path != path and e not in covered]
            self.entries.append(DiskEntry(path, tokens, len(data)))
        for e in covered:
            e.path.unlink(missing_ok=True)
        self.writes += 1
        self._evict()

    def _evict(self) -> None:
        """Remove the least recently used files until the folder's states fit the budget (files
        of other models count too: they are removed first)."""
        files = []
        for p in self.folder.glob("*.state"):
            try:
                st = p.stat()
            except OSError:
                continue
            mine = any(e.path == p for e in self.entries)
            files.append((mine, st.st_mtime, st.st_size, p))
        total = sum(f[2] for f in files)
        for mine, _, size, p in sorted(files):
            if total <= self.budget:
                break
            p.unlink(missing_ok=True)
            total -= size
            with self._lock:
                self.entries = [e for e in self.entries if e.path != p]

    def _drop(self, entry: DiskEntry) -> None:
        with self._lock:
            self.entries = [e for e in self.entries if e is not entry]
        entry.path.unlink(missing_ok=True)

    def stats(self) -> dict[str, int]:
        """``{"entries", "bytes", "budget", "writes", "hits", "ignored"}``."""
        with self._lock:
            return {"entries": len(self.entries), "bytes": sum(e.n_data for e in self.entries),
                    "budget": self.budget, "writes": self.writes, "hits": self.hits, "ignored": self.ignored}
