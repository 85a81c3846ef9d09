"""The tensors of a synthetic model: random but valid quant blocks, the embedding and routers that
carry the routing signal, and one tensor plan per architecture (qwen3moe, deepseek2, gpt-oss here;
glm4moe, minimax-m2, qwen35moe and deepseek4 in :mod:`.archs`). Each matrix's type comes from the
quant recipe (:mod:`.quants`)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from .quants import LAYOUTS, QUANTIZABLE, RECIPES, Recipe, fit, nbytes, random_blocks, tensor_type
from .shapes import FINE_NAMES, IDENT, MISC, NAME, NUMBER, Routing, SYNTAX, Shape, SynthError, WORD
from .skew import router_strength


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


@dataclass
class _T:
    """One planned tensor: GGUF name, numpy shape (logical), type, and a maker returning the
    array to write (float32/float16 for float types, uint8 blocks for quant types)."""

    name: str
    shape: tuple[int, ...]
    qtype: QT
    make: Callable[[], np.ndarray]


# --------------------------------------------------------------------------------------------
# model construction


@dataclass
class _Ctx:
    arch: str
    shape: Shape
    routing: Routing
    seed: int
    qexp: QT           # experts
    qmat: QT           # attention / dense matrices / embedding / output
    classes: np.ndarray  # (n_vocab,)
    n_vocab: int
    pool: np.ndarray | None = None
    recipe: Recipe | None = None  # None: uniform, experts qexp and the rest qmat
    merged: bool = False          # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    C: np.ndarray = field(default=None)  # (n_class, d) class directions
    prefs: np.ndarray = field(default=None)  # (n_layer, n_class, n_expert)
    copy_at: int | None = None  # layer of the copy head (None: no copy head)
    n_copy: int = 0             # copy subspace: the last n_copy hidden dims
    _copies: np.ndarray | None = None  # (n_vocab, n_copy): the copy head's write per token
    _ds4: dict | None = None  # deepseek4's copy-layer attention matrices, float (archs.ds4_copy_mats)

    def __post_init__(self):
        d = self.shape.n_embd
        self.copy_at = copy_layer(self.arch, self.shape) if self.routing.copy_head else None
        if self.copy_at is not None:
            self.n_copy = min(self.routing.copy_dims, d // 4)
        rng = _rng(self.seed, "class_directions")
        nc = len(FINE_NAMES)
        q, _ = np.linalg.qr(rng.standard_normal((d - self.n_copy, nc)))
        self.C = np.zeros((nc, d))
        self.C[:, :d - self.n_copy] = q.T  # orthonormal rows, one per fine class, none in the copy dims
        L, E = self.shape.n_layer, self.shape.n_expert
        self.prefs = np.empty((L, nc, E))
        rc = self.routing.related_corr
        for il in range(L):
            rg = _rng(self.seed, f"ranking.{il}")
            keys = rg.standard_normal((nc, E))
            for a, b in ((SYNTAX, IDENT), (WORD, NAME), (NUMBER, MISC)):
                keys[b] = rc * keys[a] + math.sqrt(1 - rc ** 2) * keys[b]
            for c in range(nc):
                rank = np.argsort(np.argsort(-keys[c]))
                self.prefs[il, c] = -np.log1p(rank)

    # branch outputs: total over the depth ~ branch_scale of the residual
    def out_std(self, fan_in: int) -> float:
        return self.routing.branch_scale / math.sqrt(self.shape.n_layer) / math.sqrt(fan_in)

    def qt(self, role: str, il: int, row: int) -> QT:
        """Type of a matrix of ``role`` in layer ``il`` whose rows have ``row`` values (the copy
        head's attention and, with a copy head, the output: the writer's float type, since the
        output is computed from the copy head's weights)."""
        s = self.shape
        if self.copy_at is not None and (role == "output" or (il == self.copy_at and role.startswith("attn"))):
            return fit(self.qmat, row)
        if self.recipe is None:
            rec = Recipe("uniform", 0, self.qexp, self.qmat)
        else:
            rec = self.recipe
        lead = min(s.n_layer_dense_lead, s.n_layer - 1) if self.arch in ("deepseek2", "glm4moe") else 0
        t = tensor_type(rec, role, il, s.n_layer, s.n_expert, max(1, s.n_head // max(1, s.n_head_kv)),
                        (lead, s.n_layer - 1))
        return fit(t, row)

    def mat(self, name: str, shape: tuple[int, ...], std: float, role: str, il: int = -1) -> "_T":
        """A Gaussian matrix (``name`` without ``.weight``): quantized from floats where gguf can,
        random blocks of the same spread otherwise."""
        qt = self.qt(role, il, shape[-1])
        if qt in QUANTIZABLE or qt in (QT.F16, QT.F32):
            return _T(name + ".weight", shape, qt, _gauss(self, name, shape, std, qt))
        return _T(name + ".weight", shape, qt, _experts(self, name, shape, std, qt))

    def exp(self, name: str, shape: tuple[int, ...], std: float, role: str, il: int) -> "_T":
        """An expert tensor (routed or shared): random blocks (f16 floats for f16)."""
        qt = self.qt(role, il, shape[-1])
        return _T(name + ".weight", shape, qt, _experts(self, name, shape, std, qt))


def _embedding(cx: _Ctx) -> np.ndarray:
    """token_embd, numpy (n_vocab, n_embd) f32, zero in the copy dims but the last (the anchor, 1 in
    every row). With a copy head it also keeps ``cx._copies``, what the copy head writes into the
    copy dims for each token (for the output)."""
    d, rho, dn = cx.shape.n_embd, cx.routing.class_energy, cx.shape.n_embd - cx.n_copy
    rng = _rng(cx.seed, "token_embd")
    out = np.zeros((cx.n_vocab, d), dtype=np.float32)
    step = 16384
    for i in range(0, cx.n_vocab, step):
        cls = cx.classes[i:i + step]
        noise = rng.standard_normal((len(cls), dn))
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        out[i:i + step] = math.sqrt(d) * math.sqrt(rho) * cx.C[cls]
        out[i:i + step, :dn] += math.sqrt(d) * math.sqrt(1 - rho) * noise
    if cx.copy_at is not None:
        out[:, d - 1] = 1.0  # the anchor: the copy head's constant query and key
        own = COPY_WRITES.get(cx.arch)
        cx._copies = own(cx, out) if own else (out @ _copy_value(cx).T) @ _copy_out_rows(cx).T
    return out


# --------------------------------------------------------------------------------------------
# the copy head
#
# A random-weight model's greedy tokens are a fixed function of the previous token: every turn's
# reply walks the same few tokens, whose routes the planner learns from the development turns,
# so decode steps route almost only to hot experts, and the bench would not see the CPU branch. The copy head makes a
# generated token a copy of a token of its own context instead. One attention head (head 0 of the
# first full-attention layer) writes the values of the position it attends to into the last
# ``n_copy`` hidden dims (the copy subspace), which no embedding, class direction or router row
# uses; the output matrix reads only those dims (row v = the copy of token v), so the argmax is
# the copied token. The head picks the position by its distance alone: its query and keys are
# constant vectors (read from the anchor dim, the last hidden dim, 1 in every embedding row; or
# from the attention biases, glm4moe), and their rotary phases put the peak of the score at the
# distance ``copy_lag`` (:func:`copy_spectrum`). So a reply replays its context from ``copy_lag``
# tokens back, and its tokens are drawn like the context's tokens, by occurrence: a head that
# chose by content (as an earlier one did) picks each distinct token once whatever its count, so
# its copies ran to rarer tokens and decode routed colder than prefill. It is a function of the
# weights alone (no position counter or engine state), the same on every engine path; being one
# layer, it is the same at every depth.

COPY_ARCHS = ("qwen3moe", "glm4moe", "minimax-m2", "qwen35moe", "deepseek4")
COPY_SPAN = 4096  # distances over which copy_spectrum keeps the peak at the lag clear of the rest
# arch -> f(cx, embedding) -> (n_vocab, n_copy): the copy head's write per token, for an arch whose
# copy head is not head 0 of a GQA attention (:mod:`.archs` registers deepseek4's)
COPY_WRITES: dict[str, Callable[["_Ctx", np.ndarray], np.ndarray]] = {}


def copy_layer(arch: str, s: Shape) -> int | None:
    """Layer of the copy head: the first full-attention layer of an architecture in
    :data:`COPY_ARCHS` (qwen35moe: the first of every ``full_attn_interval``; deepseek4: the first
    uncompressed, sliding-window layer), else None."""
    if arch not in COPY_ARCHS:
        return None
    if arch == "deepseek4":
        from .mix import shape_layer_kinds

        return next((il for il, k in enumerate(shape_layer_kinds(arch, s)) if k["attn"] == "c0"), None)
    if arch == "qwen35moe":
        return next((il for il in range(s.n_layer) if (il + 1) % s.full_attn_interval == 0), None)
    return 0


def rope_thetas(n_rot: int, base: float) -> np.ndarray:
    """Rotary angle per position of each of the ``n_rot / 2`` dim pairs, ``base^(-2i / n_rot)``
    (ggml's rope without scaling), float64 (n_rot // 2,)."""
    return base ** (-2.0 * np.arange(n_rot // 2) / n_rot)


def copy_spectrum(n_rot: int, base: float, lag: int, span: int = COPY_SPAN) -> tuple[np.ndarray, float]:
    """Weights of the copy head's rotary pairs and the score's worst side lobe.

    With a constant query of pair amplitudes ``sqrt(w_i)`` and a constant key rotated by
    ``theta_i * lag`` against it, the score at distance t is ``sum_i w_i cos(theta_i (t - lag))``,
    largest (``sum w``) at t = ``lag``. Pairs whose angle is below a cut add a near-constant to
    every score; the cut and the weighting (equal, or ``sqrt(theta_i)``, which favours the sharper
    pairs) are the ones of a few whose highest score at another distance in ``[0, span)`` is
    lowest. Returns
    (w, (n_rot // 2,) summing to 1, zero below the cut; that highest other score, < 1)."""
    th = rope_thetas(n_rot, base)
    t = np.arange(span, dtype=np.float64) - lag
    best = None
    for cut, pw in ((c, p) for c in (0.5, 0.1, 0.03, 0.01, 0.003, 0.001, 0.0) for p in (0.5, 0.0)):
        w = np.where(th >= cut, th ** pw, 0.0)
        if not w.any():
            continue
        w = w / w.sum()
        f = np.cos(np.outer(t, th)) @ w
        side = float(np.max(np.delete(f, lag))) if 0 <= lag < span else float(np.max(f))
        if best is None or side < best[1] - 1e-9:
            best = (w, side)
    return best


def rotary_dims(s: Shape, arch: str) -> int:
    """Rotary dims of an attention head of ``arch`` at shape ``s`` (``rope.dimension_count``):
    ``s.n_rot``, else the arch's rule (glm4moe, minimax-m2: half the head; qwen35moe: a quarter;
    deepseek4: ``qk_rope_dim``; the others: the whole head)."""
    if s.n_rot:
        return s.n_rot
    return {"glm4moe": s.head_dim // 2, "minimax-m2": s.head_dim // 2,
            "qwen35moe": s.head_dim // 4,
            "deepseek4": s.qk_rope_dim if s.qk_rope_dim < s.head_dim else s.head_dim // 2}.get(arch, s.head_dim)


def _rope(cx: _Ctx) -> tuple[int, float]:
    """(rotary dims, rope base) of the copy layer's attention, as the writer's keys give them."""
    base = {"qwen3moe": 1e6, "glm4moe": 1e6, "minimax-m2": 5e6, "qwen35moe": 1e7, "deepseek4": 1e4}[cx.arch]
    n_rot = cx.shape.head_dim if cx.arch == "qwen3moe" else rotary_dims(cx.shape, cx.arch)
    return n_rot, base


def _span(cx: _Ctx) -> int:
    # deepseek4's copy layer sees its sliding window only
    return min(COPY_SPAN, cx.shape.sliding_window) if cx.arch == "deepseek4" else COPY_SPAN


def copy_peak(cx: _Ctx) -> float:
    """The copy head's score at the lag: ``copy_sharpness`` over the gap to the worst side lobe,
    so that the lag's position outscores every other by ``copy_sharpness``."""
    n_rot, base = _rope(cx)
    return cx.routing.copy_sharpness / (1.0 - copy_spectrum(n_rot, base, cx.routing.copy_lag, _span(cx))[1])


def copy_qk(cx: _Ctx) -> tuple[np.ndarray, np.ndarray]:
    """The copy head's constant query and key before rope, float32 (head_dim,) each: pair i of the
    query ``(a_i, 0)``, of the key ``a_i (cos theta_i lag, sin theta_i lag)``, zero in the
    unrotated dims; ``sum a_i^2 = copy_peak * sqrt(head_dim)``, so that q.k / sqrt(head_dim) is
    the peak score (what glm4moe's biases give; the q/k norms of the other archs rescale them).
    Pairs as ggml rotates them: NEOX, dims i and i + n_rot / 2 (qwen35moe's IMROPE pairs the same
    on text); deepseek4: NORM, dims 2i and 2i + 1 of the last n_rot dims."""
    n_rot, base = _rope(cx)
    w, _ = copy_spectrum(n_rot, base, cx.routing.copy_lag, _span(cx))
    hd, h = cx.shape.head_dim, n_rot // 2
    a = np.sqrt(w * copy_peak(cx) * math.sqrt(hd))
    ph = rope_thetas(n_rot, base) * cx.routing.copy_lag
    q, k = np.zeros(hd), np.zeros(hd)
    if cx.arch == "deepseek4":
        o = hd - n_rot
        q[o:hd:2] = a
        k[o:hd:2], k[o + 1:hd:2] = a * np.cos(ph), a * np.sin(ph)
    else:
        q[:h] = a
        k[:h], k[h:n_rot] = a * np.cos(ph), a * np.sin(ph)
    return q.astype(np.float32), k.astype(np.float32)


def _copy_value(cx: _Ctx) -> np.ndarray:
    """Value rows of the copy head (KV head 0), float32 (head_dim, n_embd): the first rows of the
    copy layer's attn_v as :func:`_attn_gqa` draws them, none on the anchor."""
    s = cx.shape
    name = f"blk.{cx.copy_at}.attn_v"
    a = _rng(cx.seed, name).standard_normal((s.n_head_kv * s.head_dim, s.n_embd), dtype=np.float32)
    v = a[:s.head_dim] * np.float32(s.n_embd ** -0.5)
    v[:, s.n_embd - 1] = 0.0
    return v


def _copy_out_rows(cx: _Ctx) -> np.ndarray:
    """The copy head's output block, float32 (n_copy, head_dim): head 0's columns of the copy
    layer's attn_output in the copy dims (the last row, the anchor's, zero), sized so that the copy
    is ``copy_gain`` times the embedding (qwen35moe: x 2 for its sigmoid output gate, 0.5 on
    head 0)."""
    s, g = cx.shape, cx.routing.copy_gain
    std = g * math.sqrt(s.n_embd / (s.head_dim * (cx.n_copy - 1))) * (2.0 if cx.arch == "qwen35moe" else 1.0)
    r = _rng(cx.seed, "copy_head.out").standard_normal((cx.n_copy, s.head_dim), dtype=np.float32) * np.float32(std)
    r[-1] = 0.0
    return r


def _copy_attn(cx: _Ctx, name: str, shape: tuple[int, ...], std: float, role: str, gate: bool) -> Callable[[], np.ndarray]:
    """Maker of a copy-layer attention matrix: head 0's query rows and every key row read only the
    anchor (glm4moe: nothing, its biases carry them; with ``gate``, qwen35moe's per-head [q, gate]
    rows, head 0's gate rows zero); the other query rows random; no value row reads the anchor;
    attn_output with head 0 writing only the copy dims and the other heads only the rest."""
    s, qt = cx.shape, cx.qt(role, cx.copy_at, shape[-1])
    hd, d = s.head_dim, s.n_embd

    def make():
        a = _rng(cx.seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)
        if role in ("attn_q", "attn_k"):
            q, k = copy_qk(cx)
            rows = q if role == "attn_q" else np.tile(k, s.n_head_kv)
            n = len(rows)
            a[:n] = 0.0
            if cx.arch != "glm4moe":
                a[:n, d - 1] = rows  # the anchor is 1: the rows' own sizes (the q/k norms rescale them)
            if gate and role == "attn_q":
                a[hd:2 * hd] = 0.0
        elif role == "attn_v":
            a[:, d - 1] = 0.0
        elif role == "attn_o":
            dn = d - cx.n_copy
            a[dn:] = 0.0
            a[:dn, :hd] = 0.0
            a[dn:, :hd] = _copy_out_rows(cx)
        return float_tensor(a, qt)
    return make


def copy_qk_bias(cx: _Ctx, il: int, role: str, n: int, std: float) -> Callable[[], np.ndarray]:
    """Maker of a q or k bias (``role`` attn_q / attn_k, ``n`` values, Gaussian of ``std``
    elsewhere): on the copy layer of glm4moe, head 0's query and every key are the copy head's
    constant vectors (:func:`copy_qk`)."""
    name = f"blk.{il}.{role}.bias"

    def make():
        a = _rng(cx.seed, name).standard_normal((n,), dtype=np.float32) * np.float32(std)
        if il == cx.copy_at:
            q, k = copy_qk(cx)
            rows = q if role == "attn_q" else np.tile(k, n // cx.shape.head_dim)
            a[:len(rows)] = rows
        return a
    return make


def qk_norm_weight(cx: _Ctx, il: int, n: int) -> Callable[[], np.ndarray]:
    """Weight of a q or k RMS norm (``n`` values) of layer ``il``: ones; on the copy layer
    ``(copy_peak / sqrt(head_dim))^0.5``, so that the copy head's normalised query and key score
    :func:`copy_peak` at the lag."""
    v = math.sqrt(copy_peak(cx) / math.sqrt(cx.shape.head_dim)) if il == cx.copy_at else 1.0
    return lambda: np.full((n,), v, dtype=np.float32)


def _copy_output(cx: _Ctx) -> np.ndarray:
    """output.weight with a copy head, numpy (n_vocab, n_embd) f32: row v is the copy of token v
    (its embedding through the copy head's values and output block) in the copy dims, zero
    elsewhere, scaled so that logits are a few units."""
    d = cx.shape.n_embd
    if cx._copies is None:
        _embedding(cx)
    rows = cx._copies
    rows *= np.float32(8.0 / math.sqrt(d)) / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-6)
    out = np.zeros((cx.n_vocab, d), dtype=np.float32)
    out[:, d - cx.n_copy:] = rows
    cx._copies = None
    return out


def _router(cx: _Ctx, il: int) -> np.ndarray:
    """ffn_gate_inp of layer il, numpy (n_expert, n_embd) f32: logits = A * P + B * z."""
    d, rho, r = cx.shape.n_embd, cx.routing.class_energy, cx.routing
    A, B = router_strength(r, cx.shape.n_expert, cx.shape.n_expert_used), r.spread
    g = A / math.sqrt(d * rho)          # x_hat . C[c] = sqrt(d * rho)
    s = B / math.sqrt(1 - rho)          # x_hat noise part has norm sqrt(d (1 - rho))
    rng = _rng(cx.seed, f"blk.{il}.ffn_gate_inp")
    R = rng.standard_normal((cx.shape.n_expert, d)) / math.sqrt(d)
    R[:, d - cx.n_copy:] = 0.0  # routers ignore the copy dims
    W = g * cx.prefs[il].T @ cx.C + s * R
    if cx.copy_at is not None and il >= cx.copy_at:
        # the copy doubles the residual's energy: the RMS norm shrinks the router input by this
        W *= math.sqrt(1 + cx.routing.copy_gain ** 2)
    return W.astype(np.float32)


def _gauss(cx: _Ctx, name: str, shape: tuple[int, ...], std: float, qtype: QT) -> Callable[[], np.ndarray]:
    def make():
        a = _rng(cx.seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)
        return float_tensor(a, qtype)
    return make


def _ones(shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    return lambda: np.ones(shape, dtype=np.float32)


def _experts(cx: _Ctx, name: str, shape: tuple[int, ...], std: float, qtype: QT | None = None) -> Callable[[], np.ndarray]:
    qtype = cx.qexp if qtype is None else qtype

    def make():
        rng = _rng(cx.seed, name)
        if qtype in _BLOCK:
            return random_quant_blocks(shape, qtype, std, rng, cx.pool)
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float16)
    return make


def _routed_experts(cx: "_Ctx", p: str, E: int, F: int, d: int, il: int = -1, merged: bool = False) -> list:
    """The routed-expert tensors of one layer (prefix ``p``) in file order: gate, down, up, or
    with ``merged`` down and ``ffn_gate_up_exps`` (E, 2F, d): per expert F gate rows, then F up
    rows (the layout llama.cpp's ``build_moe_ffn`` splits)."""
    down = cx.exp(p + "ffn_down_exps", (E, d, F), 2 * cx.out_std(F), "exp_down", il)
    if merged:
        return [down, cx.exp(p + "ffn_gate_up_exps", (E, 2 * F, d), d ** -0.5, "exp_gate_up", il)]
    return [cx.exp(p + "ffn_gate_exps", (E, F, d), d ** -0.5, "exp_gate", il), down,
            cx.exp(p + "ffn_up_exps", (E, F, d), d ** -0.5, "exp_up", il)]


def _shared_experts(cx: "_Ctx", p: str, Fs: int, d: int, il: int) -> list:
    """The shared expert of one layer (gate, down, up), FFN size ``Fs``."""
    return [cx.exp(p + "ffn_gate_shexp", (Fs, d), d ** -0.5, "shexp_gate", il),
            cx.exp(p + "ffn_down_shexp", (d, Fs), 2 * cx.out_std(Fs), "shexp_down", il),
            cx.exp(p + "ffn_up_shexp", (Fs, d), d ** -0.5, "shexp_up", il)]


def _token_embd(cx: "_Ctx") -> "_T":
    d = cx.shape.n_embd
    qt = cx.qt("embd", -1, d)
    return _T("token_embd.weight", (cx.n_vocab, d), qt, lambda: float_tensor(_embedding(cx), qt))


def _output_tensors(cx: "_Ctx", d: int, qm=None) -> list:
    """Final norm and output projection."""
    if cx.copy_at is not None:
        qt = cx.qt("output", -1, d)
        return [_T("output_norm.weight", (d,), QT.F32, _ones((d,))),
                _T("output.weight", (cx.n_vocab, d), qt, lambda: float_tensor(_copy_output(cx), qt))]
    return [_T("output_norm.weight", (d,), QT.F32, _ones((d,))),
            cx.mat("output", (cx.n_vocab, d), 3.0 / math.sqrt(d), "output")]


def _attn_gqa(cx: _Ctx, p: str, il: int, q_rows: int | None = None) -> list[_T]:
    """q, k, v, output of a GQA attention (``q_rows``: rows of attn_q, default n_head * head_dim)."""
    s = cx.shape
    d, hd = s.n_embd, s.head_dim
    shapes = {"attn_q": ((q_rows or s.n_head * hd, d), d ** -0.5), "attn_k": ((s.n_head_kv * hd, d), d ** -0.5),
              "attn_v": ((s.n_head_kv * hd, d), d ** -0.5),
              "attn_o": ((d, s.n_head * hd), cx.out_std(s.n_head * hd))}
    names = {"attn_q": "attn_q", "attn_k": "attn_k", "attn_v": "attn_v", "attn_o": "attn_output"}
    if il == cx.copy_at:
        return [_T(p + names[r] + ".weight", shp, cx.qt(r, il, shp[-1]),
                   _copy_attn(cx, p + names[r], shp, std, r, gate=q_rows is not None))
                for r, (shp, std) in shapes.items()]
    return [cx.mat(p + names[r], shp, std, r, il) for r, (shp, std) in shapes.items()]


def _plan_qwen3moe(cx: _Ctx) -> list[_T]:
    s = cx.shape
    d, hd, E, F = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp
    ts = [_token_embd(cx)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        ts += [
            _T(p + "attn_norm.weight", (d,), QT.F32, _ones((d,))),
            *_attn_gqa(cx, p, il),
            _T(p + "attn_q_norm.weight", (hd,), QT.F32, qk_norm_weight(cx, il, hd)),
            _T(p + "attn_k_norm.weight", (hd,), QT.F32, qk_norm_weight(cx, il, hd)),
            _T(p + "ffn_norm.weight", (d,), QT.F32, _ones((d,))),
            _T(p + "ffn_gate_inp.weight", (E, d), QT.F32, (lambda il=il: _router(cx, il))),
            *_routed_experts(cx, p, E, F, d, il),
        ]
    ts += _output_tensors(cx, d)
    return ts


def _kv_dims(w: gguf.GGUFWriter, cx: _Ctx, n_ff: int, n_head_kv: int, k_len: int, v_len: int) -> None:
    """The hyper-parameters every architecture writes first, in llama.cpp's key names."""
    s, a = cx.shape, cx.arch
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.context_length", s.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", n_ff)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", k_len)
    w.add_uint32(f"{a}.attention.value_length", v_len)


def _kv_experts(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    w.add_uint32(f"{a}.expert_count", s.n_expert)
    w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)


def _kv_qwen3moe(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    _kv_dims(w, cx, s.n_ff_exp * s.n_expert_used, s.n_head_kv, s.head_dim, s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 1000000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    _kv_experts(w, cx)


def _plan_deepseek2(cx: _Ctx) -> list[_T]:
    """DeepSeek-V3-style layout: MLA attention (q/kv LoRA, split k_b/v_b), first
    ``n_layer_dense_lead`` layers dense, then routed experts + shared expert + selection bias
    ``exp_probs_b`` (sigmoid gating, normalised top-k weights)."""
    s = cx.shape
    d, E, F, S = s.n_embd, s.n_expert, s.n_ff_exp, s.n_expert_shared
    H, nope, rope, vh, kvr, qr = s.n_head, s.qk_nope_dim, s.qk_rope_dim, s.v_head_dim, s.kv_lora_rank, s.q_lora_rank
    n_ff = s.n_ff_dense or 4 * F

    ts = [_token_embd(cx)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        ts.append(_T(p + "attn_norm.weight", (d,), QT.F32, _ones((d,))))
        if qr > 0:
            ts += [_T(p + "attn_q_a_norm.weight", (qr,), QT.F32, _ones((qr,))),
                   cx.mat(p + "attn_q_a", (qr, d), d ** -0.5, "attn", il),
                   cx.mat(p + "attn_q_b", (H * (nope + rope), qr), qr ** -0.5, "attn_q", il)]
        else:
            ts.append(cx.mat(p + "attn_q", (H * (nope + rope), d), d ** -0.5, "attn_q", il))
        ts += [_T(p + "attn_kv_a_norm.weight", (kvr,), QT.F32, _ones((kvr,))),
               cx.mat(p + "attn_kv_a_mqa", (kvr + rope, d), d ** -0.5, "attn", il),
               cx.mat(p + "attn_k_b", (H, kvr, nope), nope ** -0.5, "attn_k", il),
               cx.mat(p + "attn_v_b", (H, vh, kvr), kvr ** -0.5, "attn_v", il),
               cx.mat(p + "attn_output", (d, H * vh), cx.out_std(H * vh), "attn_o", il),
               _T(p + "ffn_norm.weight", (d,), QT.F32, _ones((d,)))]
        if il < _n_dense(s):
            ts += _dense_ffn(cx, p, n_ff, il)
            continue
        ts += [
            _T(p + "ffn_gate_inp.weight", (E, d), QT.F32, (lambda il=il: _router(cx, il))),
            _T(p + "exp_probs_b.bias", (E,), QT.F32, (lambda il=il: _probs_bias(cx, il))),
            *_routed_experts(cx, p, E, F, d, il, cx.merged),
            *_shared_experts(cx, p, F * S, d, il),
        ]
    ts += _output_tensors(cx, d)
    return ts


def _dense_ffn(cx: _Ctx, p: str, n_ff: int, il: int) -> list[_T]:
    d = cx.shape.n_embd
    return [cx.mat(p + "ffn_gate", (n_ff, d), d ** -0.5, "ffn_gate", il),
            cx.mat(p + "ffn_down", (d, n_ff), 2 * cx.out_std(n_ff), "ffn_down", il),
            cx.mat(p + "ffn_up", (n_ff, d), d ** -0.5, "ffn_up", il)]


def _n_dense(s: Shape) -> int:
    # leading dense layers (deepseek2), keeping at least one MoE layer
    return max(0, min(s.n_layer_dense_lead, s.n_layer - 1))


def _probs_bias(cx: _Ctx, il: int) -> np.ndarray:
    """exp_probs_b of a deepseek2 layer: small per-expert selection biases (added to the sigmoid
    probabilities for the top-k choice only), enough to change some selections."""
    return (0.05 * _rng(cx.seed, f"blk.{il}.exp_probs_b").standard_normal(cx.shape.n_expert)).astype(np.float32)


def _kv_deepseek2(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    # MLA: one compressed KV "head"
    _kv_dims(w, cx, s.n_ff_dense or 4 * s.n_ff_exp, 1, s.kv_lora_rank + s.qk_rope_dim, s.kv_lora_rank)
    w.add_uint32(f"{a}.attention.key_length_mla", s.qk_nope_dim + s.qk_rope_dim)
    w.add_uint32(f"{a}.attention.value_length_mla", s.v_head_dim)
    w.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora_rank)
    w.add_uint32(f"{a}.attention.kv_lora_rank", s.kv_lora_rank)
    w.add_uint32(f"{a}.rope.dimension_count", s.qk_rope_dim)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.leading_dense_block_count", _n_dense(s))
    w.add_uint32(f"{a}.expert_count", s.n_expert)
    w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    w.add_uint32(f"{a}.expert_shared_count", s.n_expert_shared)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    w.add_float32(f"{a}.expert_weights_scale", 1.0)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid (LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)


def _plan_gpt_oss(cx: _Ctx) -> list[_T]:
    """gpt-oss layout (llama.cpp arch "gpt-oss"): GQA attention with q/k/v/o biases and attention
    sinks, sliding-window attention on every other layer, post-attention norm, router with bias,
    MXFP4 experts with per-expert biases (SwiGLU-OAI)."""
    s = cx.shape
    d, hd, E, F = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp

    def bias(name: str, shape: tuple[int, ...], std: float) -> _T:
        return _T(name + ".bias", shape, QT.F32, _gauss(cx, name + ".bias", shape, std, QT.F32))

    ts = [_token_embd(cx)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        gate_e, down_e, up_e = _routed_experts(cx, p, E, F, d, il)
        q, k, v, o = _attn_gqa(cx, p, il)
        ts += [
            _T(p + "attn_norm.weight", (d,), QT.F32, _ones((d,))),
            q, bias(p + "attn_q", (s.n_head * hd,), 0.02),
            k, bias(p + "attn_k", (s.n_head_kv * hd,), 0.02),
            v, bias(p + "attn_v", (s.n_head_kv * hd,), 0.02),
            o, bias(p + "attn_output", (d,), 0.002),
            _T(p + "attn_sinks.weight", (s.n_head,), QT.F32, _gauss(cx, p + "attn_sinks", (s.n_head,), 1.0, QT.F32)),
            _T(p + "post_attention_norm.weight", (d,), QT.F32, _ones((d,))),
            _T(p + "ffn_gate_inp.weight", (E, d), QT.F32, (lambda il=il: _router(cx, il))),
            bias(p + "ffn_gate_inp", (E,), 0.05),
            gate_e,
            bias(p + "ffn_gate_exps", (E, F), 0.02),
            down_e,
            bias(p + "ffn_down_exps", (E, d), 0.002),
            up_e,
            bias(p + "ffn_up_exps", (E, F), 0.02),
        ]
    ts += _output_tensors(cx, d)
    return ts


def _kv_gpt_oss(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    _kv_dims(w, cx, s.n_ff_exp, s.n_head_kv, s.head_dim, s.head_dim)
    w.add_uint32(f"{a}.attention.sliding_window", 128)
    w.add_float32(f"{a}.rope.freq_base", 150000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    _kv_experts(w, cx)


_PLANS = {"qwen3moe": (_plan_qwen3moe, _kv_qwen3moe), "deepseek2": (_plan_deepseek2, _kv_deepseek2),
          "gpt-oss": (_plan_gpt_oss, _kv_gpt_oss)}
