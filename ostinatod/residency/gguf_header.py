"""Fast GGUF header reader shared by the worker's file check, the residency fingerprint and the planner.

``gguf.GGUFReader`` builds numpy views of every vocabulary entry (tens of seconds of CPU for a
151k-token vocabulary on a loaded 2-core machine); this reads the header sequentially with the
``gguf`` package's type tables, keeps scalar/string metadata and numeric arrays up to
:data:`MAX_ARRAY` entries (per-layer hyper-parameters), skips the rest (the vocabulary), and reads
every tensor's name, shape, type, size and data offset. No tensor data is read.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

# gguf.GGUFValueType -> struct format, for the scalar types
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
               11: "<q", 12: "<d"}
MAX_ARRAY = 4096  # numeric metadata arrays longer than this are skipped (vocabulary scores, ...)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in ggml order (ne0 first), ``n_bytes`` of its data and its
    ``offset`` relative to the data section."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    n_bytes: int
    offset: int

    @property
    def type_name(self) -> str:
        return gguf.GGMLQuantizationType(self.ggml_type).name


@dataclass(frozen=True)
class GGUFHeader:
    """Parsed header: ``kv`` metadata (strings, scalars, short numeric arrays as lists),
    ``tensors`` in file order, ``data_start`` (absolute byte offset of the data section)."""

    version: int
    kv: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_start: int

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture") or "")

    def arch_kv(self, key: str, default: Any = None) -> Any:
        """``<arch>.<key>`` metadata value, or ``default``."""
        return self.kv.get(f"{self.arch}.{key}", default)

    @property
    def data_end(self) -> int:
        """Absolute end of the last tensor's data (the file must be at least this long)."""
        return max((self.data_start + t.offset + t.n_bytes for t in self.tensors),
                   default=self.data_start)


def _parse(path: Path) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0
        size = len(mm)

        def take(fmt: str) -> Any:
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > size:
                raise ValueError("header ends early")
            (v,) = struct.unpack_from(fmt, mm, pos)
            pos += n
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > size:
                raise ValueError("header ends early")
            v = mm[pos:pos + n].decode("utf-8", errors="replace")
            pos += n
            return v

        def value(vtype: int) -> Any:
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, count = take("<I"), take("<Q")
                if etype in _SCALAR_FMT:
                    fmt = _SCALAR_FMT[etype]
                    width = struct.calcsize(fmt)
                    if pos + width * count > size:
                        raise ValueError("header ends early")
                    if count <= MAX_ARRAY:
                        vals = list(struct.unpack_from(f"<{count}{fmt[1]}", mm, pos))
                        pos += width * count
                        return vals
                    pos += width * count
                    return None
                for _ in range(count):
                    value(etype)
                return None
            if vtype not in _SCALAR_FMT:
                raise ValueError(f"unknown metadata value type {vtype}")
            return take(_SCALAR_FMT[vtype])

        if mm[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        pos = 4
        version = take("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = take("<Q"), take("<Q")
        kv: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            kv[key] = value(take("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            n_dims = take("<I")
            dims = tuple(take("<Q") for _ in range(n_dims))
            ttype, offset = take("<I"), take("<Q")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name} has unknown type {ttype}") from None
            n_el = 1
            for d in dims:
                n_el *= d
            tensors.append(TensorInfo(name, dims, ttype, n_el // block * type_size, offset))
        align = int(kv.get("general.alignment") or gguf.GGUF_DEFAULT_ALIGNMENT)
        data_start = (pos + align - 1) // align * align
    return GGUFHeader(version, kv, tuple(tensors), data_start)


@functools.lru_cache(maxsize=16)
def _cached(key: tuple[str, int, int]) -> GGUFHeader:
    return _parse(Path(key[0]))


def read_header(path: Path | str) -> GGUFHeader:
    """Parse (cached per path, mtime and size) the header of the GGUF file ``path``.

    Raises FileNotFoundError for a missing file and ValueError (with the reason) for a file that is
    not a GGUF or whose header is damaged or truncated. Does not check that the tensor data is
    complete: compare :attr:`GGUFHeader.data_end` with the file size for that.
    """
    p = Path(path)
    st = p.stat()
    try:
        return _cached((str(p.resolve()), st.st_mtime_ns, st.st_size))
    except struct.error as e:
        raise ValueError(f"damaged GGUF header ({e})") from e
