"""The tensors of a synthetic model: the embedding and routers that carry the routing signal, and
one tensor plan per architecture (qwen3moe, deepseek2, gpt-oss here; glm4moe, minimax-m2, qwen35moe
and deepseek4 in :mod:`.archs`). Each matrix's type comes from the quant recipe, and random but
valid quant blocks from :mod:`.quants`; the copy head's weights from :mod:`.copy_head`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from .copy_head import COPY_WRITES, _copy_attn, _copy_out_rows, _copy_value, copy_layer, qk_norm_weight
from .quants import (QUANTIZABLE, RECIPES, Recipe, _BLOCK, _rng, fit, float_tensor, random_quant_blocks,
                     tensor_type)
from .shapes import FINE_NAMES, IDENT, MISC, NAME, NUMBER, Routing, SYNTAX, Shape, SynthError, WORD
from .skew import router_strength


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
