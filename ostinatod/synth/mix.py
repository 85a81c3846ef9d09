"""Layer mix of a cut: which kinds of layers a synthetic file with fewer layers than the real model
keeps, and the check that a file's mix is the real model's in proportion, so that a cut's
figures stand for the real model's.

A layer has a kind on two axes: ``ffn`` (``dense``: a dense FFN; ``hash``: MoE routed by token id,
deepseek4's ``ffn_gate_tid2eid``; ``moe``: MoE routed by a learned router) and ``attn``
(deepseek4: ``c0`` / ``c4`` / ``c128``, the compress ratio; qwen35moe: ``linear`` / ``full``;
others: ``full``). A *representative cut* of ``n`` layers gives each kind of each axis its share
of ``n`` by largest remainder, at least one layer of every kind the real model has when ``n`` is at
least the number of kinds on that axis (so every per-layer shape is in the file). Pure functions:
no file is read here except by :func:`file_layer_kinds`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

from .shapes import ARCH_SHAPES, SHAPES, Shape

# deepseek4's released schedule: two sliding-window layers, then ratio 4 (with the indexer) and
# ratio 128 alternating
_RATIO_KIND = {0: "c0", 4: "c4", 128: "c128"}


def allocate(counts: Mapping[str, int], n: int) -> dict[str, int]:
    """Split ``n`` layers over kinds in proportion to ``counts`` (the real model's layers per kind):
    largest remainder (ties: the kind listed first), then, when ``n`` is at least the number of
    kinds, every kind with a real layer gets at least one (taken from the kind most above its
    quota). Returns {kind: layers}, summing to ``n``. Raises ValueError for n < 0 or no layers."""
    total = sum(counts.values())
    if n < 0 or total <= 0:
        raise ValueError(f"allocate: n = {n}, {total} real layers")
    kinds = [k for k, c in counts.items() if c > 0]
    quota = {k: n * counts[k] / total for k in kinds}
    out = {k: math.floor(quota[k]) for k in kinds}
    rest = n - sum(out.values())
    for k in sorted(kinds, key=lambda k: (-(quota[k] - out[k]), kinds.index(k)))[:rest]:
        out[k] += 1
    if n >= len(kinds):
        for k in kinds:
            if out[k] == 0:
                donor = max((d for d in kinds if out[d] > 1), key=lambda d: (out[d] - quota[d], -kinds.index(d)))
                out[donor] -= 1
                out[k] = 1
    return out


def deepseek4_cut(real: Shape, n: int) -> tuple[int, list[int]]:
    """(hash layers, compress ratios) of a representative ``n``-layer cut of a deepseek4 shape: the
    hash-routed layers lead (llama.cpp routes the first ``hash_layer_count`` layers by token id),
    the ratios in the released order (ratio-0 layers first, then 4 and 128 alternating, 4 first)
    with each ratio's share of the real schedule. A cut with no compressed layer gets ratio 4 on
    its last layer (llama.cpp's deepseek4 cache needs one)."""
    full = _deepseek4_ratios(real.n_layer)
    hashed = allocate({"hash": real.hash_layers, "moe": real.n_layer - real.hash_layers}, n)["hash"]
    per = allocate({r: full.count(r) for r in (0, 4, 128)}, n)
    ratios = [0] * per.get(0, 0)
    n4, n128 = per.get(4, 0), per.get(128, 0)
    while n4 or n128:
        if n4:
            ratios.append(4)
            n4 -= 1
        if n128:
            ratios.append(128)
            n128 -= 1
    if ratios and not any(ratios):
        ratios[-1] = 4
    return hashed, ratios


def _deepseek4_ratios(n_layer: int) -> list[int]:
    return [0 if il < 2 else (4 if (il - 2) % 2 == 0 else 128) for il in range(n_layer)]


def is_real_shape(shape: str) -> bool:
    """Whether ``shape`` (a key of :data:`SHAPES`) is a real model's (its cuts are representative)."""
    return shape in ARCH_SHAPES


def cut_shape(shape: str, n_layer: int | None) -> Shape:
    """The :class:`Shape` of ``shape`` with ``n_layer`` layers (None: its own). A real model's shape
    cut below its depth is the representative cut: deepseek4's hash layers and compress ratios
    (``compress_schedule``) and the dense leading layers (deepseek2, glm4moe) in proportion; the
    test shapes and deeper files keep the leading-layer rule of the writer."""
    s = SHAPES[shape]
    if n_layer is None or n_layer == s.n_layer:
        return s
    s2 = replace(s, n_layer=int(n_layer))
    if not is_real_shape(shape) or n_layer > s.n_layer or n_layer < 1:
        return s2
    arch = ARCH_SHAPES[shape]
    if arch == "deepseek4":
        hashed, ratios = deepseek4_cut(s, n_layer)
        return replace(s2, hash_layers=hashed, compress_schedule=tuple(ratios))
    if arch in ("glm4moe", "deepseek2") and s.n_layer_dense_lead:
        dense = allocate({"dense": s.n_layer_dense_lead, "moe": s.n_layer - s.n_layer_dense_lead}, n_layer)
        return replace(s2, n_layer_dense_lead=dense["dense"])
    return s2


def shape_layer_kinds(arch: str, s: Shape) -> list[dict[str, str]]:
    """Per layer of a shape as the writer lays it out for ``arch``: ``{"ffn", "attn"}`` kinds."""
    n = s.n_layer
    dense = max(0, min(s.n_layer_dense_lead, n - 1)) if arch in ("glm4moe", "deepseek2") else 0
    hashed = min(s.hash_layers, n) if arch == "deepseek4" else 0
    if arch == "deepseek4":
        ratios = list(s.compress_schedule) or _deepseek4_ratios(n)
        if not any(ratios):
            ratios[-1] = 4
        attn = [_RATIO_KIND.get(r, f"c{r}") for r in ratios]
    elif arch == "qwen35moe":
        attn = ["full" if (il + 1) % s.full_attn_interval == 0 else "linear" for il in range(n)]
    else:
        attn = ["full"] * n
    return [{"ffn": "dense" if il < dense else "hash" if il < hashed else "moe", "attn": attn[il]}
            for il in range(n)]


def file_layer_kinds(kv: Mapping[str, Any]) -> tuple[str, list[dict[str, str]]]:
    """(arch, per-layer kinds) of a GGUF from its metadata ``kv`` (the header's key/values, e.g.
    :func:`ostinatod.residency.gguf_header.read_header` ``.kv``): block count,
    ``leading_dense_block_count``, ``hash_layer_count``, ``attention.compress_ratios``,
    ``full_attention_interval``."""
    arch = str(kv.get("general.architecture"))
    n = int(kv.get(f"{arch}.block_count") or 0)
    dense = int(kv.get(f"{arch}.leading_dense_block_count") or 0)
    hashed = int(kv.get(f"{arch}.hash_layer_count") or 0)
    ratios = [int(r) for r in (kv.get(f"{arch}.attention.compress_ratios") or [])]
    interval = int(kv.get(f"{arch}.full_attention_interval") or 0)
    out = []
    for il in range(n):
        ffn = "dense" if il < dense else "hash" if il < hashed else "moe"
        if ratios:
            attn = _RATIO_KIND.get(ratios[il], f"c{ratios[il]}") if il < len(ratios) else "?"
        elif interval:
            attn = "full" if (il + 1) % interval == 0 else "linear"
        else:
            attn = "full"
        out.append({"ffn": ffn, "attn": attn})
    return arch, out


def mix_problems(real: Sequence[Mapping[str, str]], cut: Sequence[Mapping[str, str]]) -> list[str]:
    """How a file's layer kinds ``cut`` depart from the real model's ``real`` in proportion (per
    axis: a kind's count more than one layer away from its quota ``len(cut) * real share``, a kind
    the real model lacks, or a real kind missing where the cut has at least as many layers as the
    axis has kinds). Empty when the mix is representative; a full-depth file must match exactly."""
    n, N, out = len(cut), len(real), []
    if not n or not N:
        return ["no layers"] if not n else []
    for axis in ("ffn", "attn"):
        rc: dict[str, int] = {}
        for k in real:
            rc[k[axis]] = rc.get(k[axis], 0) + 1
        cc: dict[str, int] = {}
        for k in cut:
            cc[k[axis]] = cc.get(k[axis], 0) + 1
        for kind in list(rc) + [k for k in cc if k not in rc]:
            c, q = cc.get(kind, 0), n * rc.get(kind, 0) / N
            if kind not in rc:
                out.append(f"{axis} kind {kind!r}: {c} of {n} layers, the real model has none")
            elif abs(c - q) >= 1 or (n == N and c != rc[kind]) or (c == 0 and n >= len(rc)):
                out.append(f"{axis} kind {kind!r}: {c} of {n} layers, in proportion "
                           f"{q:.2f} ({rc[kind]} of the real model's {N})")
    return out


def check_file_mix(kv: Mapping[str, Any]) -> dict[str, Any] | None:
    """The layer-mix check of a synthetic file from its metadata: ``{"shape", "real_layers",
    "layers", "kinds": {axis: {kind: n}}, "problems": [str]}``, or None when the file is not a
    synthetic file of a real model's shape (a real GGUF, or a test shape: nothing to compare)."""
    shape = kv.get("ostinato.synth.shape")
    if not isinstance(shape, str) or not is_real_shape(shape):
        return None
    arch, kinds = file_layer_kinds(kv)
    real = shape_layer_kinds(ARCH_SHAPES[shape], SHAPES[shape])
    summary: dict[str, dict[str, int]] = {"ffn": {}, "attn": {}}
    for k in kinds:
        for axis in summary:
            summary[axis][k[axis]] = summary[axis].get(k[axis], 0) + 1
    return {"shape": shape, "real_layers": len(real), "layers": len(kinds), "kinds": summary,
            "problems": mix_problems(real, kinds)}
