"""The copy head of a synthetic model: one attention head (head 0 of the first full-attention layer,
:func:`copy_layer`) that makes a generated token a copy of the token ``copy_lag`` positions back in
its context, so that decode steps route like the context's tokens instead of walking the fixed path
of a random-weight model's greedy tokens. It writes into the copy subspace (the last ``n_copy``
hidden dims), which only the output matrix reads, and chooses the position by distance alone:
constant query and keys whose rotary phases peak at ``copy_lag`` (:func:`copy_spectrum`). Archs:
:data:`COPY_ARCHS`. docs/synthetic-models.md (item 6, "The copy head") and the comment below tell
more.

The ``cx`` arguments are :class:`.tensors._Ctx`, not imported here (:mod:`.tensors` imports this
module); the embedding that computes each token's copy and the output matrix made from them are in
:mod:`.tensors`.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .quants import _rng, float_tensor
from .shapes import Shape


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
