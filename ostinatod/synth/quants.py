"""Quant types and quant recipes of synthetic models: random but valid blocks for every type the
recipes use, and the per-tensor, per-layer type choice of the published mixes.

``gguf`` 0.19 quantizes only Q8_0, Q4_0 and MXFP4 (``gguf.quants.quantize`` raises
NotImplementedError for the K-quants and the IQ types) but dequantizes them all. So tensors of any
other type are written as random blocks whose f16 scale fields are set to sane values: the quant
bits (and the 6-bit / int8 sub-block scales of the K-quants and IQ4_XS) are random bytes, ``d`` is
chosen so that the values have the wanted std (calibrated once per type by dequantizing random
blocks with ``gguf``), ``dmin`` / ``m`` centre the values. Every block is finite.

A recipe maps (tensor role, layer) to a type, like llama.cpp's ``llama_tensor_get_type``
(src/llama-quant.cpp of the vendored commit) does for Q4_K_M, Q5_K_M, Q6_K and IQ4_XS; a type whose
block does not divide the row falls back like llama.cpp does (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; F16 when even 32 does not divide it). See
docs/synthetic-models.md ("Quant recipes") for the tables and the sources.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT


@dataclass(frozen=True)
class Layout:
    """Block layout of a quant type: ``bs`` values in ``nbytes`` bytes; ``d``: byte offset of the
    f16 scale; ``dmin``: byte offset of the f16 min (K-quants) or m (Q5_1), written as
    ``dmin_ratio * d`` so that the values are centred on zero."""

    bs: int
    nbytes: int
    d: int
    dmin: int | None = None
    dmin_ratio: float = 0.0


LAYOUTS: dict[QT, Layout] = {
    QT.Q8_0: Layout(32, 34, 0),
    QT.Q4_0: Layout(32, 18, 0),
    QT.Q5_0: Layout(32, 22, 0),
    QT.Q5_1: Layout(32, 24, 0, dmin=2, dmin_ratio=-16.0),   # x = d*q + m, q in 0..31
    QT.IQ4_NL: Layout(32, 18, 0),
    QT.MXFP4: Layout(32, 17, 0),                            # e8m0 exponent, handled apart
    QT.Q4_K: Layout(256, 144, 0, dmin=2, dmin_ratio=7.5),   # x = d*sc*q - dmin*m, q in 0..15
    QT.Q5_K: Layout(256, 176, 0, dmin=2, dmin_ratio=15.5),  # q in 0..31
    QT.Q6_K: Layout(256, 210, 208),                         # ql, qh, int8 scales, d last
    QT.IQ4_XS: Layout(256, 136, 0),
}

# block quant types that gguf 0.19 can quantize from floats
QUANTIZABLE = {QT.Q8_0, QT.Q4_0, QT.MXFP4}


def nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    """Bytes of a tensor of numpy ``shape`` (last dim contiguous) stored as ``qtype``."""
    n = int(np.prod(shape))
    if qtype in LAYOUTS:
        lay = LAYOUTS[qtype]
        return n // lay.bs * lay.nbytes
    return n * {QT.F32: 4, QT.F16: 2, QT.I32: 4}[qtype]


_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.IQ4_XS: QT.IQ4_NL}


def fit(qtype: QT, row: int) -> QT:
    """``qtype`` if its block divides a row of ``row`` values, else llama.cpp's fallback type
    (F16 when no 32-value block fits either)."""
    if qtype not in LAYOUTS or row % LAYOUTS[qtype].bs == 0:
        return qtype
    alt = _FALLBACK.get(qtype, QT.Q8_0)
    return alt if row % LAYOUTS[alt].bs == 0 else QT.F16


def _set_scales(blocks: np.ndarray, qtype: QT, d: np.ndarray) -> None:
    lay = LAYOUTS[qtype]
    n = blocks.shape[0]
    blocks[:, lay.d:lay.d + 2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    if lay.dmin is not None:
        m = (lay.dmin_ratio * d).astype(np.float16)
        blocks[:, lay.dmin:lay.dmin + 2] = m.view(np.uint8).reshape(n, 2)


@lru_cache(maxsize=None)
def unit_std(qtype: QT) -> float:
    """Std of the values of random blocks of ``qtype`` with d = 1 (measured with gguf)."""
    lay = LAYOUTS[qtype]
    rng = np.random.default_rng(12345)
    blocks = rng.integers(0, 256, size=(512, lay.nbytes), dtype=np.uint8)
    _set_scales(blocks, qtype, np.ones(512))
    vals = gguf.quants.dequantize(blocks, qtype)
    return float(vals.std())


def random_blocks(raw: np.ndarray, qtype: QT, std: float, rng: np.random.Generator) -> np.ndarray:
    """Turn random bytes ``raw`` (one row per block, uint8) into valid blocks of ``qtype`` whose
    values have about ``std``: d = std / unit * U(0.5, 1.5) per block (and the min field to match)."""
    d = std / unit_std(qtype) * rng.uniform(0.5, 1.5, raw.shape[0])
    _set_scales(raw, qtype, d)
    return raw


# --------------------------------------------------------------------------------------------
# random tensors


def _rng(seed: int, name: str) -> np.random.Generator:
    # one independent, reproducible stream per (seed, tensor name)
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


_BLOCK = {t: (lay.bs, lay.nbytes) for t, lay in LAYOUTS.items()}
quant_nbytes = nbytes


def random_quant_blocks(shape: tuple[int, ...], qtype: QT, std: float, rng: np.random.Generator,
                        pool: np.ndarray | None = None) -> np.ndarray:
    """Random valid blocks of a quantised tensor whose values have roughly ``std``.

    ``shape``: numpy shape (last dim a multiple of 32). Returns uint8 bytes shaped
    ``shape[:-1] + (bytes per row,)``. Quants are random bytes (taken at a random offset of
    ``pool`` when given, which is memcpy-fast for GB-sized tensors); f16 scales are
    ``d * U(0.5, 1.5)`` with d chosen from the quant's value spread (K-quants, IQ4 and Q5 types:
    :func:`.quants.random_blocks`).
    """
    bs, bb = _BLOCK[qtype]
    n_blocks = int(np.prod(shape)) // bs
    nbytes = n_blocks * bb
    if pool is not None and pool.size >= nbytes + 4096:
        off = int(rng.integers(0, pool.size - nbytes))
        raw = pool[off:off + nbytes].copy()
        # xor with a per-tensor word so that tensors sharing the pool differ everywhere
        pad = (-raw.size) % 8
        words = np.concatenate([raw, np.zeros(pad, np.uint8)]).view(np.uint64)
        words ^= np.uint64(int(rng.integers(1, 2**63)))
        raw = words.view(np.uint8)[:nbytes].copy() if pad else words.view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    blocks = raw.reshape(n_blocks, bb)
    if qtype == QT.Q8_0:
        d = std / 73.9  # uniform int8 has std ~73.9
        scales = (d * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
        blocks[:, 0:2] = scales.view(np.uint8).reshape(n_blocks, 2)
    elif qtype == QT.Q4_0:
        d = std / 4.61  # uniform nibble - 8 has std ~4.61
        scales = (d * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
        blocks[:, 0:2] = scales.view(np.uint8).reshape(n_blocks, 2)
    elif qtype == QT.MXFP4:
        # e8m0 shared exponent; fp4 e2m1 values span +-6 (std ~3.1): 2^(e-127) * 3.1 ~ std
        e = int(round(math.log2(std / 3.1))) + 127
        blocks[:, 0] = (e + rng.integers(-1, 1, n_blocks, endpoint=True)).astype(np.uint8)
    else:
        random_blocks(blocks, qtype, std, rng)
    return blocks.reshape(tuple(shape[:-1]) + (shape[-1] // bs * bb,))


def float_tensor(arr: np.ndarray, qtype: QT) -> np.ndarray:
    """``arr`` (float) converted to ``qtype``: f32/f16 as floats, quant types as uint8 blocks via
    ``gguf.quants.quantize`` (row-chunked to bound memory)."""
    if qtype == QT.F32:
        return arr.astype(np.float32, copy=False)
    if qtype == QT.F16:
        return arr.astype(np.float16)
    rows = arr.reshape(-1, arr.shape[-1])
    out = np.empty((rows.shape[0], quant_nbytes((arr.shape[-1],), qtype)), dtype=np.uint8)
    step = max(1, (1 << 24) // arr.shape[-1])
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = gguf.quants.quantize(rows[i:i + step].astype(np.float32), qtype)
    return out.reshape(arr.shape[:-1] + (out.shape[-1],))


# --------------------------------------------------------------------------------------------
# recipes

# tensor roles a plan asks a type for
EXPERT_ROLES = {"exp_gate", "exp_up", "exp_down", "exp_gate_up"}
SHEXP_ROLES = {"shexp_gate", "shexp_up", "shexp_down"}
DOWN_ROLES = {"exp_down", "shexp_down", "ffn_down"}


def _more_bits(il: int, n: int) -> bool:
    # llama-quant.cpp use_more_bits: first and last eighth, every third layer in between
    return il < n // 8 or il >= 7 * n // 8 or (il - n // 8) % 3 == 2


@dataclass(frozen=True)
class Recipe:
    """How a quant name picks the type of each tensor (see :func:`tensor_type`)."""

    name: str
    ftype: int                 # general.file_type (llama_ftype) written to the file
    experts: QT | None = None  # uniform recipes: type of routed and shared experts
    rest: QT = QT.Q8_0         # uniform recipes: every other matrix


RECIPES: dict[str, Recipe] = {
    "f16": Recipe("f16", 1, QT.F16, QT.F16),
    "q8_0": Recipe("q8_0", 7, QT.Q8_0),
    "q4_0": Recipe("q4_0", 2, QT.Q4_0),
    "mxfp4": Recipe("mxfp4", 38, QT.MXFP4),
    "q4_k_m": Recipe("q4_k_m", 15),
    "q5_k_m": Recipe("q5_k_m", 17),
    "q6_k": Recipe("q6_k", 18),
    "iq4_xs": Recipe("iq4_xs", 30),
    "ud-q4_k_xl": Recipe("ud-q4_k_xl", 15),
}


def tensor_type(recipe: Recipe, role: str, il: int, n_layer: int, n_expert: int, gqa: int,
                moe_layers: tuple[int, int] = (0, 0)) -> QT:
    """The type of one matrix before the row-size fallback.

    ``role``: ``embd``, ``output``, ``attn_q``, ``attn_k``, ``attn_v``, ``attn_o``, ``attn_qkv``
    (fused / linear-attention input), ``attn`` (any other attention matrix), ``ffn_gate`` /
    ``ffn_up`` / ``ffn_down`` (dense layers), ``exp_*`` (routed experts), ``shexp_*`` (shared
    expert); ``il``: layer (-1 for embd/output); ``gqa``: n_head / n_head_kv; ``moe_layers``:
    (first, last) MoE layer, for the UD recipe's edge layers.
    """
    r = recipe.name
    if role == "embd":
        # carries the routing signal, so it is quantized from floats (gguf can: Q8_0 or F16)
        return recipe.rest if recipe.experts is not None else QT.Q8_0
    if recipe.experts is not None:  # uniform: f16 / q8_0 / q4_0 / mxfp4
        if role in EXPERT_ROLES or role in SHEXP_ROLES:
            return recipe.experts
        return recipe.rest
    if role == "output":
        return QT.Q6_K
    if r == "ud-q4_k_xl":
        # modelled on Unsloth's dynamic UD-Q4_K_XL MoE files: routed experts Q4_K with down one
        # step higher, the first and last two MoE layers' experts one more step up; attention,
        # dense FFN and shared experts Q8_0
        if role in EXPERT_ROLES:
            edge = il < moe_layers[0] + 2 or il > moe_layers[1] - 2
            if role == "exp_down":
                return QT.Q6_K if edge else QT.Q5_K
            return QT.Q5_K if edge else QT.Q4_K
        return QT.Q8_0
    base = {"q4_k_m": QT.Q4_K, "q5_k_m": QT.Q5_K, "q6_k": QT.Q6_K, "iq4_xs": QT.IQ4_XS}[r]
    if n_expert == 8 and role in ("attn_v", "attn_k"):
        return QT.Q8_0  # llama-quant.cpp: 8-expert models get Q8_0 attn_v / attn_k
    if r == "q6_k":
        return base
    if role == "attn_v":
        if r == "iq4_xs":
            return QT.Q5_K if gqa >= 4 else base
        return QT.Q6_K if _more_bits(il, n_layer) else base
    if role in DOWN_ROLES:
        if r == "iq4_xs":
            return QT.Q5_K if il < n_layer // 8 else base
        return QT.Q6_K if _more_bits(il, n_layer) else base
    if role == "attn_qkv":
        return {"q4_k_m": QT.Q5_K, "q5_k_m": QT.Q6_K}.get(r, base)
    if role == "attn_o" and n_expert == 8 and r in ("q4_k_m", "iq4_xs"):
        return QT.Q5_K
    return base
