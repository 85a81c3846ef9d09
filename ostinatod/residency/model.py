"""One description of a GGUF model: validation, fingerprint, MoE shape and sizes, one cache.

Every part of Ostinato that needs facts about a model file asks :func:`describe_model` (or
:func:`check_model_file`, which also checks the file is complete): the engine worker before
llama.cpp sees the file, the residency sets and traces (their ``model`` block), the planner
(expert bytes, size classes, KV bytes per token) and the control API (fingerprint). The header is
read once per (path, mtime, size) with the fast reader of :mod:`.gguf_header`; no weights are read.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .gguf_header import GGUFHeader, read_header
from ..errors import MessageError

_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_[a-z_]*exps\.(weight|bias)$")


class ModelFileError(MessageError, ValueError):
    """A model file that cannot be described: missing, not a GGUF, damaged or truncated."""

    code, status = "model_invalid", 400


@dataclass(frozen=True)
class ModelInfo:
    """What Ostinato knows about a GGUF file (sizes in bytes, counts in tokens/experts).

    ``fingerprint``: hex sha256 of the architecture, ``block_count``, ``expert_count``,
    ``expert_used_count`` and every tensor's name, shape and type (copies of one file agree, a
    re-quantised file differs). ``arch`` is "" when the file names none.
    ``expert_bytes[l]``: bytes of ONE expert of layer l (0 for dense layers); ``size_class[l]``: key
    of the layer's expert tensor types and shapes (experts of one class can share pool slots);
    ``dense_layer_bytes[l]``: non-expert bytes of layer l; ``other_bytes``: tensors outside the
    layers (output head, norms; token_embd excluded: llama.cpp keeps it on the host);
    ``kv_bytes_per_token``: K+V bytes per token over all layers (f16 cache).
    """

    fingerprint: str
    name: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    path: str = ""
    n_ctx_train: int = 0
    is_demo: bool = False
    size_bytes: int = 0
    data_end: int = 0
    n_embd: int = 0
    n_vocab: int = 0
    n_head: int = 0
    n_ff_exp: int = 0
    expert_bytes: list[int] = field(default_factory=list)
    size_class: list[str] = field(default_factory=list)
    dense_layer_bytes: list[int] = field(default_factory=list)
    other_bytes: int = 0
    kv_bytes_per_token: int = 0
    n_tensors: int = 0
    has_expert_tensors: bool = False  # routed-expert tensors (``blk.N.ffn_*_exps``) are present

    def model_block(self) -> dict[str, Any]:
        """The shared ``model`` block of trace and residency files:
        ``{"fingerprint", "name", "arch", "n_layer", "n_expert", "n_expert_used"}``."""
        return {"fingerprint": self.fingerprint, "name": self.name, "arch": self.arch,
                "n_layer": self.n_layer, "n_expert": self.n_expert,
                "n_expert_used": self.n_expert_used}

    @property
    def moe_layers(self) -> list[int]:
        return [l for l in range(self.n_layer) if self.expert_bytes[l] > 0]

    @property
    def total_expert_bytes(self) -> int:
        return sum(b * self.n_expert for b in self.expert_bytes)

    @property
    def complete(self) -> bool:
        """Whether the file holds all the tensor data its header names."""
        return self.data_end <= self.size_bytes


def _file_key(path: Path) -> tuple[str, int, int]:
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise ModelFileError(f"model file not found: {path}") from e
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    return (str(path.resolve()), st.st_mtime_ns, st.st_size)


_CACHE: "OrderedDict[tuple[str, int, int], ModelInfo]" = OrderedDict()
_CACHE_SIZE = 16
_lock = threading.Lock()


def describe_model(path: Path | str) -> ModelInfo:
    """The :class:`ModelInfo` of the GGUF file ``path`` (cached per path, mtime and size: parsing a
    150k-token vocabulary takes seconds). Raises ModelFileError for a missing file or one that is
    not a readable GGUF; does not check that the tensor data is complete (see
    :func:`check_model_file`). Thread-safe."""
    key = _file_key(Path(path))
    with _lock:
        got = _CACHE.get(key)
    if got is None:
        got = _describe(key)
        with _lock:
            _CACHE[key] = got
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return got


def cached_description(path: Path | str) -> Optional[ModelInfo]:
    """The description of ``path`` if :func:`describe_model` already has it, else None (never
    reads the file's header: for live snapshots that must not wait)."""
    try:
        key = _file_key(Path(path))
    except ModelFileError:
        return None
    with _lock:
        return _CACHE.get(key)


def require_arch(info: ModelInfo) -> ModelInfo:
    """``info``, or ModelFileError when the file names no architecture (planner, residency sets)."""
    if not info.arch:
        raise ModelFileError(f"{info.path}: GGUF has no general.architecture")
    return info


def check_model_file(path: Path | str) -> ModelInfo:
    """Validate ``path`` as a complete GGUF file (before llama.cpp sees it: a foreign or truncated
    file must not crash the worker) and describe it. Raises ModelFileError saying what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{p} is not a GGUF file (magic {magic!r})")
    try:
        info = describe_model(p)
    except ModelFileError as e:
        raise ModelFileError(f"{p} is truncated or damaged: not a readable GGUF header "
                             f"({e.__cause__ or e})") from e
    if info.n_tensors == 0:
        raise ModelFileError(f"{p} is a vocab-only GGUF (a tokenizer, no weight tensors), not a model")
    if not info.complete:
        raise ModelFileError(f"{p} is truncated: tensor data needs {info.data_end} bytes, "
                             f"the file has {info.size_bytes}")
    if info.has_expert_tensors and not 0 < info.n_expert_used <= info.n_expert:
        # llama.cpp asserts on this (the worker would abort while loading)
        raise ModelFileError(f"{p} has expert tensors but {info.arch}.expert_count = {info.n_expert} and "
                             f"{info.arch}.expert_used_count = {info.n_expert_used} (needs 1 <= used <= count)")
    return info


def _describe(key: tuple[str, int, int]) -> ModelInfo:
    path = Path(key[0])
    try:
        hdr = read_header(path)
    except (OSError, ValueError) as e:  # foreign, truncated or vanished file
        raise ModelFileError(f"{path}: not a readable GGUF file ({e})") from e
    return _from_header(path, hdr, key[2])


def _fingerprint(hdr: GGUFHeader) -> str:
    h = hashlib.sha256()
    for k in ("block_count", "expert_count", "expert_used_count"):
        h.update(f"{k}={hdr.arch_kv(k)};".encode())
    h.update(f"arch={hdr.arch};".encode())
    for t in hdr.tensors:
        # gguf's reader lists shapes in ggml order, as read_header does
        h.update(f"{t.name}:{list(t.shape)}:{t.ggml_type};".encode())
    return h.hexdigest()


def _from_header(path: Path, hdr: GGUFHeader, size: int) -> ModelInfo:
    kvs = hdr.kv

    def kv(key: str, default: Any = None) -> Any:
        v = kvs.get(key)
        return default if v is None else v

    def num(key: str) -> int:
        v = kvs.get(key)
        return int(v) if isinstance(v, (int, float)) else 0

    arch = hdr.arch
    n_layer = num(f"{arch}.block_count")
    n_expert = num(f"{arch}.expert_count")
    n_embd = num(f"{arch}.embedding_length")
    n_head = kv(f"{arch}.attention.head_count", 0) or 0
    n_head_kv = kv(f"{arch}.attention.head_count_kv", n_head) or n_head
    n_head = int(max(n_head) if isinstance(n_head, list) else n_head)
    heads_kv = (list(n_head_kv) if isinstance(n_head_kv, list) else [int(n_head_kv)] * n_layer)
    head_dim = n_embd // n_head if n_head else 0
    k_len = int(kv(f"{arch}.attention.key_length", head_dim) or head_dim)
    v_len = int(kv(f"{arch}.attention.value_length", head_dim) or head_dim)
    kv_per_token = sum(int(h) * (k_len + v_len) * 2 for h in heads_kv[:n_layer])

    exp_bytes = [0] * n_layer
    dense = [0] * n_layer
    classes: list[list[str]] = [[] for _ in range(n_layer)]
    other = 0
    n_vocab = 0
    for t in hdr.tensors:
        m = _EXPS_RE.match(t.name)
        if t.name == "token_embd.weight":
            n_vocab = int(t.shape[-1]) if len(t.shape) > 1 else 0
            continue
        if m and n_expert and int(m.group(1)) < n_layer:
            l = int(m.group(1))
            exp_bytes[l] += int(t.n_bytes)
            classes[l].append(f"{t.name.split('.', 2)[2]}:{t.type_name}:"
                              f"{'x'.join(str(int(s)) for s in t.shape)}")
        elif t.name.startswith("blk.") and int(t.name.split(".")[1]) < n_layer:
            dense[int(t.name.split(".")[1])] += int(t.n_bytes)
        else:
            other += int(t.n_bytes)
    return ModelInfo(
        path=str(path), fingerprint=_fingerprint(hdr), name=str(kv("general.name") or path.stem),
        arch=arch, n_layer=n_layer, n_expert=n_expert,
        n_expert_used=num(f"{arch}.expert_used_count"), n_ctx_train=num(f"{arch}.context_length"),
        is_demo=bool(kvs.get("ostinato.demo")), size_bytes=size, data_end=hdr.data_end,
        n_tensors=len(hdr.tensors), has_expert_tensors=any(_EXPS_RE.match(t.name) for t in hdr.tensors),
        n_embd=n_embd, n_vocab=n_vocab, n_head=n_head,
        n_ff_exp=num(f"{arch}.expert_feed_forward_length"),
        expert_bytes=[b // n_expert if n_expert else 0 for b in exp_bytes],
        size_class=["|".join(sorted(c)) for c in classes], dense_layer_bytes=dense,
        other_bytes=other, kv_bytes_per_token=kv_per_token)
