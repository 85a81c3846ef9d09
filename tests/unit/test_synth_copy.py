"""The copy head's choice of position (ostinatod/synth/copy_head.py): a constant
query and key whose rotary phases put the score's peak at the distance ``copy_lag``, whatever
the tokens, so a reply copies its context by occurrence. Pure functions: no file is written."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ostinatod.synth import copy_head, tensors
from ostinatod.synth.shapes import SHAPES, Routing, narrow_shape


def _ctx(arch: str, shape: str, narrow: bool = True, **routing) -> tensors._Ctx:
    s = narrow_shape(SHAPES[shape]) if narrow else SHAPES[shape]
    return tensors._Ctx(arch=arch, shape=s, routing=Routing(copy_head=True, **routing), seed=0,
                        qexp=tensors.QT.Q8_0, qmat=tensors.QT.Q8_0,
                        classes=np.zeros(64, dtype=np.int8), n_vocab=64)


def _rope(x: np.ndarray, pos: int, n_rot: int, base: float, norm: bool = False) -> np.ndarray:
    """ggml's rope of one head vector at ``pos``: NEOX, dims i and i + n_rot/2 rotated by
    pos * theta_i; ``norm`` (deepseek4): dims 2i and 2i + 1 of the last n_rot dims."""
    th = copy_head.rope_thetas(n_rot, base) * pos
    y = x.astype(np.float64).copy()
    if norm:
        o = len(x) - n_rot
        a, b = x[o::2].astype(np.float64), x[o + 1::2].astype(np.float64)
        y[o::2], y[o + 1::2] = a * np.cos(th) - b * np.sin(th), a * np.sin(th) + b * np.cos(th)
        return y
    h = n_rot // 2
    y[:h] = x[:h] * np.cos(th) - x[h:n_rot] * np.sin(th)
    y[h:n_rot] = x[:h] * np.sin(th) + x[h:n_rot] * np.cos(th)
    return y


@pytest.mark.parametrize("n_rot,base", [(16, 1e7), (32, 1e6), (64, 1e6), (128, 1e6)])
def test_copy_spectrum_peaks_at_the_lag(n_rot, base):
    w, side = copy_head.copy_spectrum(n_rot, base, lag=96, span=2048)
    assert w.sum() == pytest.approx(1.0) and (w >= 0).all()
    th = copy_head.rope_thetas(n_rot, base)
    f = np.cos(np.outer(np.arange(2048) - 96, th)) @ w
    assert f.argmax() == 96 and f[96] == pytest.approx(1.0)
    assert np.delete(f, 96).max() == pytest.approx(side) and side < 0.97
    # more rotary pairs, a sharper peak
    assert copy_head.copy_spectrum(128, 1e6, 96, 2048)[1] < copy_head.copy_spectrum(16, 1e7, 96, 2048)[1]


@pytest.mark.parametrize("arch,shape", [("qwen3moe", "qwen3-30b-a3b"), ("glm4moe", "glm-4.5-air"),
                                        ("minimax-m2", "minimax-m2"), ("qwen35moe", "qwen3.5-35b-a3b"),
                                        ("deepseek4", "deepseek-v4-flash")])
def test_copy_head_scores_the_lag_highest_by_the_margin(arch, shape):
    """Query at position p, keys at every earlier position (deepseek4: its 128-token window; rope
    applied as ggml does): the key ``copy_lag`` back scores ``copy_peak`` and beats every other by
    at least ``copy_sharpness``."""
    cx = _ctx(arch, shape, copy_lag=64)
    n_rot, base = copy_head._rope(cx)
    q, k = copy_head.copy_qk(cx)
    hd, ds4 = cx.shape.head_dim, arch == "deepseek4"
    rot = slice(hd - n_rot, hd) if ds4 else slice(0, n_rot)
    assert np.count_nonzero(q) == np.count_nonzero(q[rot]) and np.count_nonzero(k) == np.count_nonzero(k[rot])
    p, first = 3000, (3000 - cx.shape.sliding_window + 1 if ds4 else 0)
    qr = _rope(q, p, n_rot, base, ds4)
    scores = np.array([qr @ _rope(k, j, n_rot, base, ds4) for j in range(first, p + 1)]) / math.sqrt(hd)
    scores = np.concatenate([np.full(first, -np.inf), scores])
    assert scores.argmax() == p - 64
    assert scores[p - 64] == pytest.approx(copy_head.copy_peak(cx), rel=1e-4)
    assert scores[p - 64] - np.delete(scores, p - 64).max() >= cx.routing.copy_sharpness - 1e-3


def test_deepseek4_copy_reads_the_token_and_writes_the_copy_dims():
    """deepseek4's copy layer: the copy heads' query rows read the q LoRA's first rank alone, which
    reads the anchor alone; the kv's rotary rows read the anchor alone, its other rows never;
    the copy groups' output writes only the copy dims (not the anchor), the others never; and the
    copy of each token (through kv, its norm and the output) is told apart from the other tokens'
    by the output rows."""
    from ostinatod.synth import archs

    cx = _ctx("deepseek4", "deepseek-v4-flash")
    s, d = cx.shape, cx.shape.n_embd
    cx.classes = np.random.default_rng(0).integers(0, 6, 512).astype(np.int8)
    cx.n_vocab = 512
    m = archs.ds4_copy_mats(cx)
    n_rot, hd, dn, G, olr = 16, s.head_dim, d - cx.n_copy, archs.ds4_copy_groups(s), s.o_lora_rank
    assert G == 2 and not m["attn_q_a"][0, :d - 1].any() and m["attn_q_a"][0, d - 1] == 1
    assert not m["attn_q_b"][:hd, 1:].any() and m["attn_q_b"][:hd, 0].any()
    assert not m["attn_kv"][hd - n_rot:, :d - 1].any() and not m["attn_kv"][:hd - n_rot, dn:].any()
    wb = m["attn_output_b"]
    assert not wb[:dn, :G * olr].any() and not wb[d - 1].any() and not wb[dn:, G * olr:].any()
    emb = tensors._embedding(cx)
    assert (emb[:, d - 1] == 1).all() and not emb[:, dn:d - 1].any()
    copies = cx._copies.copy()
    out = tensors._copy_output(cx)[:, dn:]
    assert np.mean((copies @ out.T).argmax(axis=1) == np.arange(cx.n_vocab)) > 0.99


def test_copy_layer_weights_read_the_anchor_only():
    """Head 0's query rows and every key row read the anchor (the last dim) alone, so the head
    chooses by distance whatever the token; no value row reads it, so the copy carries the
    token alone; glm4moe's come from its biases."""
    cx = _ctx("qwen3moe", "qwen3-30b-a3b", narrow=False)
    s, d, hd = cx.shape, cx.shape.n_embd, cx.shape.head_dim
    wq = copy_head._copy_attn(cx, "blk.0.attn_q", (s.n_head * hd, d), d ** -0.5, "attn_q", False)()
    wk = copy_head._copy_attn(cx, "blk.0.attn_k", (s.n_head_kv * hd, d), d ** -0.5, "attn_k", False)()
    deq = lambda b: tensors.gguf.quants.dequantize(b, tensors.QT.F16 if b.dtype == np.float16 else cx.qt("attn_q", 0, d))  # noqa: E731
    q, k = (deq(w) for w in (wq, wk))
    assert not q[:hd, :d - 1].any() and q[:hd, d - 1].any() and q[hd:, :d - 1].any()
    assert not k[:, :d - 1].any()
    v = copy_head._copy_value(cx)
    assert not v[:, d - 1].any()
    assert not copy_head._copy_out_rows(cx)[-1].any()
    g = _ctx("glm4moe", "glm-4.5-air", narrow=True)
    gs = g.shape
    bq = copy_head.copy_qk_bias(g, 0, "attn_q", gs.n_head * gs.head_dim, 0.02)()
    bk = copy_head.copy_qk_bias(g, 0, "attn_k", gs.n_head_kv * gs.head_dim, 0.02)()
    qg, kg = copy_head.copy_qk(g)
    assert np.array_equal(bq[:gs.head_dim], qg) and np.array_equal(bk, np.tile(kg, gs.n_head_kv))
    assert not np.array_equal(copy_head.copy_qk_bias(g, 1, "attn_q", gs.n_head * gs.head_dim, 0.02)()[:gs.head_dim], qg)
