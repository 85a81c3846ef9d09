"""Tensor plans and hyper-parameters of the newer MoE architectures: glm4moe (GLM-4.5/4.6/4.7-Air),
minimax-m2, qwen35moe (Qwen3.5/3.6 MoE: gated delta-net linear attention + gated full attention)
and deepseek4 (DeepSeek-V4-Flash: hyper-connections, compressed attention with an indexer,
hash-routed leading layers, grouped low-rank output).

Tensor names, shapes and required keys are those of the llama.cpp vendored by llama-cpp-python
0.3.36 (``src/models/<arch>.cpp``: ``load_arch_hparams`` / ``load_arch_tensors``; names in
``src/llama-arch.cpp``). Shapes below are numpy shapes (ggml's ``ne`` reversed). Multi-token
prediction (nextn) layers are not written: llama.cpp loads the trunk without them.
:data:`PLANS` is the registry of every architecture (these and :mod:`.tensors`' three).
"""

from __future__ import annotations

import math

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from .shapes import Shape
from .skew import router_strength
from .copy_head import COPY_WRITES, copy_peak, copy_qk, copy_qk_bias, qk_norm_weight, rotary_dims
from .quants import _rng, float_tensor
from .tensors import (_PLANS as _BASE_PLANS, _Ctx, _T, _attn_gqa, _dense_ffn, _gauss, _kv_dims,
                      _kv_experts, _ones, _output_tensors, _probs_bias, _routed_experts,
                      _router, _shared_experts, _token_embd)


def _norm(name: str, n: int) -> _T:
    return _T(name + ".weight", (n,), QT.F32, _ones((n,)))


def _f32(cx: _Ctx, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> _T:
    def make():
        a = _rng(cx.seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)
        return a + np.float32(mean)
    return _T(name + ".weight" if not name.endswith(".bias") else name, shape, QT.F32, make)


def _router_t(cx: _Ctx, p: str, il: int) -> _T:
    E, d = cx.shape.n_expert, cx.shape.n_embd
    return _T(p + "ffn_gate_inp.weight", (E, d), QT.F32, (lambda il=il: _router(cx, il)))


def _probs_b(cx: _Ctx, p: str, il: int) -> _T:
    return _T(p + "exp_probs_b.bias", (cx.shape.n_expert,), QT.F32, (lambda il=il: _probs_bias(cx, il)))


_n_rot = rotary_dims


# --------------------------------------------------------------------------------------------
# glm4moe


def _n_dense(s: Shape) -> int:
    return max(0, min(s.n_layer_dense_lead, s.n_layer - 1))


def _plan_glm4moe(cx: _Ctx) -> list[_T]:
    """GLM-4.5-Air layout: GQA attention with q/k/v biases and partial rotary, a post-attention
    norm in front of the FFN, the first ``n_layer_dense_lead`` layers dense, then sigmoid-gated
    routed experts with the selection bias ``exp_probs_b`` and one shared expert."""
    s = cx.shape
    d, hd, E, F = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp
    ts = [_token_embd(cx)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        q, k, v, o = _attn_gqa(cx, p, il)
        ts += [_norm(p + "attn_norm", d),
               q, _T(p + "attn_q.bias", (s.n_head * hd,), QT.F32, copy_qk_bias(cx, il, "attn_q", s.n_head * hd, 0.02)),
               k, _T(p + "attn_k.bias", (s.n_head_kv * hd,), QT.F32, copy_qk_bias(cx, il, "attn_k", s.n_head_kv * hd, 0.02)),
               v, _f32(cx, p + "attn_v.bias", (s.n_head_kv * hd,), 0.02),
               o, _norm(p + "post_attention_norm", d)]
        if il < _n_dense(s):
            ts += _dense_ffn(cx, p, s.n_ff_dense or 4 * F, il)
            continue
        ts += [_router_t(cx, p, il), _probs_b(cx, p, il), *_routed_experts(cx, p, E, F, d, il),
               *_shared_experts(cx, p, F * s.n_expert_shared, d, il)]
    return ts + _output_tensors(cx, d)


def _kv_glm4moe(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    _kv_dims(w, cx, s.n_ff_dense or 4 * s.n_ff_exp, s.n_head_kv, s.head_dim, s.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", _n_rot(s, a))
    w.add_float32(f"{a}.rope.freq_base", 1000000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.leading_dense_block_count", _n_dense(s))
    _kv_experts(w, cx)
    w.add_uint32(f"{a}.expert_shared_count", s.n_expert_shared)
    w.add_float32(f"{a}.expert_weights_scale", 1.0)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid


# --------------------------------------------------------------------------------------------
# minimax-m2


def _plan_minimax_m2(cx: _Ctx) -> list[_T]:
    """MiniMax-M2 layout: GQA attention with q/k RMS norms over all heads (not per head), partial
    rotary, sigmoid-gated routed experts with ``exp_probs_b``, no shared expert."""
    s = cx.shape
    d, hd, E, F = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp
    ts = [_token_embd(cx)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        ts += [_norm(p + "attn_norm", d), *_attn_gqa(cx, p, il),
               _T(p + "attn_q_norm.weight", (s.n_head * hd,), QT.F32, qk_norm_weight(cx, il, s.n_head * hd)),
               _T(p + "attn_k_norm.weight", (s.n_head_kv * hd,), QT.F32, qk_norm_weight(cx, il, s.n_head_kv * hd)),
               _norm(p + "ffn_norm", d), _router_t(cx, p, il), *_routed_experts(cx, p, E, F, d, il),
               _probs_b(cx, p, il)]
    return ts + _output_tensors(cx, d)


def _kv_minimax_m2(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    # llama.cpp sizes minimax-m2's experts by feed_forward_length
    _kv_dims(w, cx, s.n_ff_exp, s.n_head_kv, s.head_dim, s.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", _n_rot(s, a))
    w.add_float32(f"{a}.rope.freq_base", 5000000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    _kv_experts(w, cx)
    w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid


# --------------------------------------------------------------------------------------------
# qwen35moe


def _is_recurrent(s: Shape, il: int) -> bool:
    return (il + 1) % s.full_attn_interval != 0


def _plan_qwen35moe(cx: _Ctx) -> list[_T]:
    """Qwen3.5/3.6 MoE layout: every ``full_attn_interval``-th layer gated full attention (q
    projection doubled for the output gate, q/k norms, IMROPE), the others gated delta-net linear
    attention (fused qkv, z gate, causal conv, per-head decay ``ssm_a`` and ``ssm_dt``, beta and
    alpha projections, gated RMS norm, ``ssm_out``); every layer MoE with softmax routing plus one
    shared expert scaled by a sigmoid gate (``ffn_gate_inp_shexp``). ``post_attention_norm`` is
    the FFN's input norm."""
    s = cx.shape
    d, hd, E, F = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp
    dk = dv = s.ssm_d_state
    key_dim, value_dim = dk * s.ssm_n_group, dv * s.ssm_dt_rank
    conv_dim = 2 * key_dim + value_dim
    ts = [_token_embd(cx)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        ts += [_norm(p + "attn_norm", d), _norm(p + "post_attention_norm", d)]
        if not _is_recurrent(s, il):
            ts += [*_attn_gqa(cx, p, il, q_rows=2 * s.n_head * hd),
                   _T(p + "attn_q_norm.weight", (hd,), QT.F32, qk_norm_weight(cx, il, hd)),
                   _T(p + "attn_k_norm.weight", (hd,), QT.F32, qk_norm_weight(cx, il, hd))]
        else:
            nv = s.ssm_dt_rank
            ts += [cx.mat(p + "attn_qkv", (conv_dim, d), d ** -0.5, "attn_qkv", il),
                   cx.mat(p + "attn_gate", (value_dim, d), d ** -0.5, "attn", il),
                   _T(p + "ssm_conv1d.weight", (conv_dim, s.ssm_d_conv), QT.F32,
                      _gauss(cx, p + "ssm_conv1d", (conv_dim, s.ssm_d_conv), 0.5, QT.F32)),
                   _f32(cx, p + "ssm_dt.bias", (nv,), 0.5),
                   _T(p + "ssm_a", (nv,), QT.F32,
                      lambda p=p, nv=nv: -np.exp(_rng(cx.seed, p + "ssm_a").uniform(-1, 1, nv)).astype(np.float32)),
                   cx.mat(p + "ssm_beta", (nv, d), d ** -0.5, "attn", il),
                   cx.mat(p + "ssm_alpha", (nv, d), d ** -0.5, "attn", il),
                   _norm(p + "ssm_norm", dv),
                   cx.mat(p + "ssm_out", (d, value_dim), cx.out_std(value_dim), "attn_o", il)]
        Fs = s.n_ff_shexp or F
        ts += [_router_t(cx, p, il), *_routed_experts(cx, p, E, F, d, il, cx.merged),
               _f32(cx, p + "ffn_gate_inp_shexp", (d,), d ** -0.5),
               *_shared_experts(cx, p, Fs, d, il)]
    return ts + _output_tensors(cx, d)


def _kv_qwen35moe(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    _kv_dims(w, cx, s.n_ff_exp * s.n_expert_used, s.n_head_kv, s.head_dim, s.head_dim)
    n_rot = _n_rot(s, a)
    sec = list(s.rope_sections)
    if not sec:  # the released 11:11:10 split of n_rot / 2
        half = n_rot // 2
        t = math.ceil(half * 11 / 32)
        sec = [t, t, half - 2 * t, 0]
    w.add_uint32(f"{a}.rope.dimension_count", n_rot)
    w.add_array(f"{a}.rope.dimension_sections", [int(x) for x in sec])
    w.add_float32(f"{a}.rope.freq_base", 10000000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    _kv_experts(w, cx)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.n_ff_shexp or s.n_ff_exp)
    w.add_uint32(f"{a}.ssm.conv_kernel", s.ssm_d_conv)
    w.add_uint32(f"{a}.ssm.inner_size", s.ssm_d_state * s.ssm_dt_rank)
    w.add_uint32(f"{a}.ssm.state_size", s.ssm_d_state)
    w.add_uint32(f"{a}.ssm.time_step_rank", s.ssm_dt_rank)
    w.add_uint32(f"{a}.ssm.group_count", s.ssm_n_group)
    w.add_uint32(f"{a}.full_attention_interval", s.full_attn_interval)


# --------------------------------------------------------------------------------------------
# deepseek4


def compress_ratios(n_layer: int) -> list[int]:
    """DeepSeek-V4-Flash's schedule: two uncompressed (sliding-window) layers, then alternating
    ratio-4 (with the indexer) and ratio-128 compressed attention. A model cut below 3 layers gets
    ratio 4 on its last layer: llama.cpp's deepseek4 cache fails (SIGFPE at context creation) on a
    model without any compressed layer."""
    r = [0 if il < 2 else (4 if (il - 2) % 2 == 0 else 128) for il in range(n_layer)]
    if not any(r):
        r[-1] = 4
    return r


def _tid2eid(cx: _Ctx, il: int) -> np.ndarray:
    """Hash routing table of a leading deepseek4 layer, numpy (n_vocab, k) int32: each token's
    k experts are the top k of the same class preference + per-token noise as the routers', so
    the hash layers are as skewed and content-dependent as the learned ones."""
    s, r = cx.shape, cx.routing
    E, k = s.n_expert, s.n_expert_used
    A = router_strength(r, E, k)
    rng = _rng(cx.seed, f"blk.{il}.ffn_gate_tid2eid")
    out = np.empty((cx.n_vocab, k), dtype=np.int32)
    step = 8192
    for i in range(0, cx.n_vocab, step):
        cls = cx.classes[i:i + step]
        logits = A * cx.prefs[il][cls] + r.spread * rng.standard_normal((len(cls), E))
        out[i:i + step] = np.argsort(-logits, axis=1)[:, :k]
    return out


# The copy head of deepseek4 (copy_head.py): the first heads of the first output
# groups of its first sliding-window layer. Their query (through the q LoRA's first rank, which
# reads the anchor alone) and the key's rotary dims are constant, so they pick the position
# ``copy_lag`` back in the window; the single KV head is also the value, so its unrotated dims
# carry the token (read off the class directions, to tell tokens apart), kept small in the raw kv
# so that its RMS norm hardly depends on the token, and scaled up by the norm's weight. Those
# groups' low-rank output reads only the copy heads' unrotated dims and writes only the copy dims.

_KV_ROPE_SHARE = 0.95  # share of the raw kv's energy in the constant rotary part


def ds4_copy_groups(s: Shape) -> int:
    """Output groups that carry deepseek4's copy: enough ranks for the key's unrotated dims."""
    n_nope = s.head_dim - _n_rot(s, "deepseek4")
    return max(1, min(s.o_groups, -(-n_nope // s.o_lora_rank)))


def ds4_copy_mats(cx: _Ctx) -> dict[str, np.ndarray]:
    """deepseek4's copy-layer attention as floats, numpy shapes of the plan: ``attn_q_a``
    (q_lora, d), ``attn_q_b`` (H hd, q_lora), ``attn_kv`` (hd, d), ``attn_kv_a_norm`` (hd,),
    ``attn_output_a`` (o_lora og, H hd / og), ``attn_output_b`` (d, og o_lora). Cached on ``cx``."""
    if cx._ds4 is not None:
        return cx._ds4
    s = cx.shape
    d, hd, H, qr, og, olr = s.n_embd, s.head_dim, s.n_head, s.q_lora_rank, s.o_groups, s.o_lora_rank
    n_rot = _n_rot(s, "deepseek4")
    n_nope, nhg, G, dn = hd - n_rot, H // og, ds4_copy_groups(s), d - cx.n_copy
    p = f"blk.{cx.copy_at}."

    def g(name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
        return _rng(cx.seed, p + name).standard_normal(shape, dtype=np.float32) * np.float32(std)

    q0, k0 = copy_qk(cx)
    qa = g("attn_q_a", (qr, d), d ** -0.5)
    qa[0] = 0.0
    qa[0, d - 1] = 1.0  # rank 0 of the q LoRA: the anchor alone
    qb = g("attn_q_b", (H * hd, qr), qr ** -0.5)
    for h in (gi * nhg for gi in range(G)):
        qb[h * hd:(h + 1) * hd] = 0.0
        qb[h * hd:(h + 1) * hd, 0] = q0 / np.linalg.norm(q0)
    kv = np.zeros((hd, d), dtype=np.float32)
    c = g("attn_kv", (n_nope, d), 1.0)
    c[:, dn:] = 0.0
    c -= (c @ cx.C.T) @ cx.C  # off the class directions: the copy tells tokens, not classes, apart
    c *= np.float32(math.sqrt((1 - _KV_ROPE_SHARE) * hd / n_nope) / np.sqrt((c ** 2).sum(axis=1).mean()))
    kv[:n_nope] = c
    kv[n_nope:, d - 1] = k0[n_nope:] / np.linalg.norm(k0) * math.sqrt(_KV_ROPE_SHARE * hd)
    norm = np.empty(hd, dtype=np.float32)
    norm[:n_nope] = 1.0 / math.sqrt((1 - _KV_ROPE_SHARE) * hd / n_nope)
    norm[n_nope:] = copy_peak(cx) / math.sqrt(_KV_ROPE_SHARE * hd)
    ogd = H * hd // og
    wa = g("attn_output_a", (olr * og, ogd), ogd ** -0.5)
    for gi in range(G):
        rows = slice(gi * olr, (gi + 1) * olr)
        blk = wa[rows, :n_nope] * np.float32(math.sqrt(ogd / n_nope))
        wa[rows] = 0.0
        wa[rows, :n_nope] = blk  # the group's first head, unrotated dims
    wb = g("attn_output_b", (d, og * olr), cx.out_std(og * olr))
    std = cx.routing.copy_gain * math.sqrt(d / ((cx.n_copy - 1) * G * olr))
    wb[:, :G * olr] = 0.0
    wb[dn:d - 1, :G * olr] = _rng(cx.seed, "copy_head.out").standard_normal((d - 1 - dn, G * olr), dtype=np.float32) * np.float32(std)
    wb[dn:, G * olr:] = 0.0
    cx._ds4 = {"attn_q_a": qa, "attn_q_b": qb, "attn_kv": kv, "attn_kv_a_norm": norm,
               "attn_output_a": wa, "attn_output_b": wb}
    return cx._ds4


def ds4_copies(cx: _Ctx, emb: np.ndarray) -> np.ndarray:
    """What deepseek4's copy heads write into the copy dims for each token, float32 (n_vocab,
    n_copy): the embedding ``emb`` (n_vocab, d) RMS-normed, through the copy layer's kv, its norm,
    the unrotated dims and the copy groups' low-rank output (:func:`ds4_copy_mats`)."""
    m, s = ds4_copy_mats(cx), cx.shape
    n_nope = s.head_dim - _n_rot(s, "deepseek4")
    G, olr, dn = ds4_copy_groups(s), s.o_lora_rank, s.n_embd - cx.n_copy
    wa = np.concatenate([m["attn_output_a"][gi * olr:(gi + 1) * olr, :n_nope] for gi in range(G)])
    wb = m["attn_output_b"][dn:, :G * olr]
    out = np.empty((emb.shape[0], cx.n_copy), dtype=np.float32)
    for i in range(0, emb.shape[0], 16384):
        x = emb[i:i + 16384]
        x = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-6)
        kv = x @ m["attn_kv"].T
        kv = kv / np.sqrt((kv ** 2).mean(axis=1, keepdims=True) + 1e-6) * m["attn_kv_a_norm"]
        out[i:i + 16384] = (kv[:, :n_nope] @ wa.T) @ wb.T
    return out


COPY_WRITES["deepseek4"] = ds4_copies


def _ds4_attn(cx: _Ctx, p: str, name: str, shape: tuple[int, ...], std: float, role: str, il: int) -> _T:
    """A deepseek4 attention matrix: the copy head's on the copy layer, else Gaussian."""
    if il != cx.copy_at:
        return cx.mat(p + name, shape, std, role, il)
    qt = cx.qt(role, il, shape[-1])
    return _T(p + name + ".weight", shape, qt, lambda: float_tensor(ds4_copy_mats(cx)[name], qt))


def _plan_deepseek4(cx: _Ctx) -> list[_T]:
    """DeepSeek-V4-Flash layout (see the module docstring); every layer MoE with sqrt-softplus
    scoring, one shared expert; the first ``hash_layers`` layers route by token id
    (``ffn_gate_tid2eid``), the others by router + ``exp_probs_b``."""
    s = cx.shape
    d, hd, H, E, F = s.n_embd, s.head_dim, s.n_head, s.n_expert, s.n_ff_exp
    qr, og, olr, hc = s.q_lora_rank, s.o_groups, s.o_lora_rank, s.hc_mult
    mix = (2 + hc) * hc
    ih, idim = s.indexer_n_head, s.indexer_head_dim
    ratios = list(s.compress_schedule) or compress_ratios(s.n_layer)
    ts = [_token_embd(cx)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        ts += [_norm(p + "attn_norm", d),
               _f32(cx, p + "attn_sinks", (H,), 1.0),
               _ds4_attn(cx, p, "attn_q_a", (qr, d), d ** -0.5, "attn", il),
               _norm(p + "attn_q_a_norm", qr),
               _ds4_attn(cx, p, "attn_q_b", (H * hd, qr), qr ** -0.5, "attn_q", il),
               _ds4_attn(cx, p, "attn_kv", (hd, d), d ** -0.5, "attn_v", il),
               _T(p + "attn_kv_a_norm.weight", (hd,), QT.F32,
                  (lambda: ds4_copy_mats(cx)["attn_kv_a_norm"]) if il == cx.copy_at else _ones((hd,))),
               _ds4_attn(cx, p, "attn_output_a", (olr * og, H * hd // og), (H * hd // og) ** -0.5, "attn", il),
               _ds4_attn(cx, p, "attn_output_b", (d, og * olr), cx.out_std(og * olr), "attn_o", il)]
        for part in ("attn", "ffn"):
            ts += [_f32(cx, p + f"hc_{part}_fn", (mix, hc * d), 0.1 / math.sqrt(hc * d)),
                   _f32(cx, p + f"hc_{part}_base", (mix,), 0.1),
                   _f32(cx, p + f"hc_{part}_scale", (3,), 0.1, mean=1.0)]
        ratio = ratios[il]
        if ratio:
            coff = 2 if ratio == 4 else 1
            ts += [cx.mat(p + "attn_compressor_kv", (coff * hd, d), d ** -0.5, "attn", il),
                   cx.mat(p + "attn_compressor_gate", (coff * hd, d), d ** -0.5, "attn", il),
                   _f32(cx, p + "attn_compressor_ape", (ratio, coff * hd), 0.02),
                   _norm(p + "attn_compressor_norm", hd)]
            if ratio == 4:
                ts += [cx.mat(p + "indexer.proj", (ih, d), d ** -0.5, "attn", il),
                       cx.mat(p + "indexer.attn_q_b", (ih * idim, qr), qr ** -0.5, "attn", il),
                       cx.mat(p + "indexer_compressor_kv", (2 * idim, d), d ** -0.5, "attn", il),
                       cx.mat(p + "indexer_compressor_gate", (2 * idim, d), d ** -0.5, "attn", il),
                       _f32(cx, p + "indexer_compressor_ape", (ratio, 2 * idim), 0.02),
                       _norm(p + "indexer_compressor_norm", idim)]
        ts.append(_router_t(cx, p, il))
        if il < s.hash_layers:
            ts.append(_T(p + "ffn_gate_tid2eid.weight", (cx.n_vocab, s.n_expert_used), QT.I32,
                         (lambda il=il: _tid2eid(cx, il))))
        else:
            ts.append(_probs_b(cx, p, il))
        ts += [_norm(p + "ffn_norm", d), *_routed_experts(cx, p, E, F, d, il),
               *_shared_experts(cx, p, F * s.n_expert_shared, d, il)]
    ts += [_f32(cx, "output_hc_fn", (hc, hc * d), 0.1 / math.sqrt(hc * d)),
           _f32(cx, "output_hc_base", (hc,), 0.1),
           _f32(cx, "output_hc_scale", (1,), 0.1, mean=1.0)]
    return ts + _output_tensors(cx, d)


def _kv_deepseek4(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    _kv_dims(w, cx, s.n_ff_exp, 1, s.head_dim, s.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", _n_rot(s, a))
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora_rank)
    w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    _kv_experts(w, cx)
    w.add_uint32(f"{a}.expert_shared_count", s.n_expert_shared)
    w.add_float32(f"{a}.expert_weights_scale", 1.5)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_uint32(f"{a}.expert_gating_func", 4)  # sqrt-softplus
    w.add_float32(f"{a}.swiglu_clamp_exp", 10.0)
    w.add_uint32(f"{a}.attention.indexer.head_count", s.indexer_n_head)
    w.add_uint32(f"{a}.attention.indexer.key_length", s.indexer_head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", s.indexer_top_k)
    w.add_uint32(f"{a}.attention.output_group_count", s.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", s.o_lora_rank)
    w.add_float32(f"{a}.attention.compress_rope_freq_base", 160000.0)
    w.add_array(f"{a}.attention.compress_ratios", list(s.compress_schedule) or compress_ratios(s.n_layer))
    w.add_uint32(f"{a}.hyper_connection.count", s.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", s.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", 1e-6)
    w.add_uint32(f"{a}.hash_layer_count", min(s.hash_layers, s.n_layer))


PLANS = {**_BASE_PLANS,
         "glm4moe": (_plan_glm4moe, _kv_glm4moe),
         "minimax-m2": (_plan_minimax_m2, _kv_minimax_m2),
         "qwen35moe": (_plan_qwen35moe, _kv_qwen35moe),
         "deepseek4": (_plan_deepseek4, _kv_deepseek4)}
