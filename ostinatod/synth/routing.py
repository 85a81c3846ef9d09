"""Routing checks of a synthetic model: route counts of a text by a numpy forward of the routers or
by the real engine's counters, and the routing report (``ostinato synth --report``)."""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np

from ..engine import native
from ..engine.placement import experts_config
from ..sessions import split_sessions
from .tensors import _Ctx, _embedding, _router
from .vocab import find_vocab, load_tokenizer
from .shapes import QUANTS, Routing, SHAPES, SynthError, TOKEN_IM_END, TOKEN_IM_START

# qwen2 vocabulary ids of "\n" and "assistant" (the generation prompt "<|im_start|>assistant\n")
_NEWLINE, _ASSISTANT = (198,), (77091,)


# --------------------------------------------------------------------------------------------
# routing check (numpy forward of the routers on the token embeddings)


def tokenize(model_path: str | os.PathLike, text: str) -> np.ndarray:
    """Token ids of ``text`` with the model's own tokenizer (llama.cpp, vocab-only load)."""
    import llama_cpp as L  # lazy: the native engine, loaded only where it runs

    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        raise SynthError(f"llama.cpp could not load {model_path}")
    try:
        vocab = L.llama_model_get_vocab(model)
        raw = text.encode("utf-8", errors="replace")
        cap = len(raw) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, cap, False, True)
        if n < 0:
            raise SynthError("tokenize: buffer too small")
        return np.ctypeslib.as_array(ctypes.cast(buf, ctypes.POINTER(ctypes.c_int32)), shape=(n,)).copy()
    finally:
        L.llama_model_free(model)


def router_counts(model_path: str | os.PathLike, token_ids: np.ndarray) -> dict[int, np.ndarray]:
    """Route counts per MoE layer, {layer: (n_expert,) int64}, for ``token_ids``.

    A numpy forward of each layer's router on the token embeddings as stored in the file
    (dequantised): RMS norm, ``ffn_norm`` weight, ``ffn_gate_inp``, the gating (softmax, or sigmoid
    plus ``exp_probs_b`` for the selection), top-k. It ignores what attention and earlier layers add
    to the residual stream (kept small by construction), so it is the routing the writer designed,
    not a replacement for the engine's own route counters.
    """
    r = gguf.GGUFReader(model_path)
    t = {x.name: x for x in r.tensors}
    arch = r.fields["general.architecture"].contents()
    k = int(r.fields[f"{arch}.expert_used_count"].contents())
    eps = float(r.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents())

    def deq(name: str) -> np.ndarray:
        x = t[name]
        return np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), dtype=np.float32)

    ids = np.asarray(token_ids)
    uniq, inv = np.unique(ids, return_inverse=True)
    emb = deq("token_embd.weight")[uniq]
    x = emb / np.sqrt((emb ** 2).mean(axis=1, keepdims=True) + eps)
    out: dict[int, np.ndarray] = {}
    il = 0
    while f"blk.{il}.attn_norm.weight" in t:
        if f"blk.{il}.ffn_gate_inp.weight" in t:
            W = deq(f"blk.{il}.ffn_gate_inp.weight")
            norm = f"blk.{il}.ffn_norm.weight" if f"blk.{il}.ffn_norm.weight" in t else f"blk.{il}.post_attention_norm.weight"
            logits = (x * deq(norm)) @ W.T
            if f"blk.{il}.ffn_gate_inp.bias" in t:
                logits = logits + deq(f"blk.{il}.ffn_gate_inp.bias")
            if f"blk.{il}.exp_probs_b.bias" in t:
                sel = 1 / (1 + np.exp(-logits)) + deq(f"blk.{il}.exp_probs_b.bias")
            else:
                sel = logits  # softmax is monotonic
            top = np.argpartition(-sel, k - 1, axis=1)[:, :k]
            per_tok = np.zeros((len(uniq), W.shape[0]), dtype=np.int64)
            np.put_along_axis(per_tok, top, 1, axis=1)
            out[il] = np.bincount(inv, minlength=len(uniq)) @ per_tok
        il += 1
    return out


def engine_phase_counts(model_path: str | os.PathLike, token_ids: np.ndarray, window: int = 2048,
                        decode: int = 0, n_threads: int | None = None) -> dict[str, dict[int, np.ndarray]]:
    """Route counts per phase and MoE layer, ``{"prefill": {layer: (n_expert,) int64}, "decode":
    {...}}``, as the real engine routes them.

    Runs the model (llama.cpp with Ostinato's native expert engine, all experts cold, CPU) over
    ``token_ids`` in independent windows of ``window`` tokens (the KV cache is cleared between
    windows); with ``decode`` each window ends with the chat template's generation prompt
    (``<|im_end|>\n<|im_start|>assistant\n``, as every turn of a session does) and after its
    prefill ``decode`` tokens are generated greedily, one decode step each, as a reply would.
    The counts are the engine's per (layer, expert) prefill and decode route counters, without
    the last MoE layer (llama.cpp computes it only for the rows that give logits). Unlike
    :func:`router_counts` this includes what attention and earlier layers add to the residual
    stream. Raises SynthError when the native expert engine is not built, llama.cpp fails or the
    model has a single MoE layer.
    """
    import llama_cpp as L  # lazy: the native engine, loaded only where it runs

    if not native.experts_available():
        raise SynthError("the native expert engine is not built (ostinato build)")
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    # all cold: only the counters matter
    model, _, _ = native.load_model(model_path, mp, experts_config({}, device=-1, prefill_threshold=1 << 30))
    if not model:
        raise SynthError(f"llama.cpp could not load {model_path}")
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx = window + decode
        cp.n_batch = cp.n_ubatch = window
        cp.n_threads = cp.n_threads_batch = n_threads or max(1, (os.cpu_count() or 2))
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise SynthError("llama.cpp could not create a context")
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        native.experts_json("ostinato_experts_take_request_stats")  # reset
        ids = np.asarray(token_ids, dtype=np.int32)
        mem = L.llama_get_memory(ctx)
        # a reply starts after the chat template's generation prompt, the same in every turn
        reply = np.asarray([TOKEN_IM_END, *_NEWLINE, TOKEN_IM_START, *_ASSISTANT, *_NEWLINE], dtype=np.int32)
        step = window - len(reply) if decode else window
        for i in range(0, len(ids), step):
            chunk = np.concatenate([ids[i:i + step], reply]) if decode else ids[i:i + step]
            buf = (L.llama_token * len(chunk))(*chunk.tolist())
            if L.llama_decode(ctx, L.llama_batch_get_one(buf, len(chunk))) != 0:
                raise SynthError("llama_decode failed")
            for _ in range(decode):
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
                one = (L.llama_token * 1)(int(np.argmax(logits)))
                if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
                    raise SynthError("llama_decode failed (decode step)")
            L.llama_memory_clear(mem, True)
        st = native.experts_json("ostinato_experts_take_request_stats")
        L.llama_free(ctx)
    finally:
        L.llama_model_free(model)
    out = {}
    for phase in ("prefill", "decode"):
        c = np.asarray(st[f"counts_{phase}"], dtype=np.int64)
        out[phase] = {il: c[il] for il in range(c.shape[0]) if c[il].sum() > 0}
    # llama.cpp runs the last layer only on the rows that give logits (the last token of a
    # batch), so its prefill counts are a few tokens, not the prompt: that layer is left out of
    # both phases
    last = max(out["prefill"], default=None)
    for phase in out:
        out[phase].pop(last, None)
    if not out["prefill"]:
        raise SynthError("route counts need a model with at least two MoE layers (llama.cpp "
                         "computes the last one only for the rows that give logits)")
    return out


def hot_sets(counts: dict[int, np.ndarray], hot_frac: float) -> dict[int, np.ndarray]:
    """Per layer, the ``hot_frac`` most-routed experts of ``counts`` (at least one; ties by
    expert index), as sorted index arrays."""
    out = {}
    for il, c in counts.items():
        n_hot = max(1, round(hot_frac * len(c)))
        out[il] = np.sort(np.argsort(-c, kind="stable")[:n_hot])
    return out


def share_on(counts: dict[int, np.ndarray], hot: dict[int, np.ndarray]) -> float | None:
    """Mean over the layers of ``hot`` of the share of ``counts``' routes that land on the hot
    experts (the Ostinato paper's Sec. 2 statistic); None when no layer has a route."""
    xs = [counts[il][hot[il]].sum() / counts[il].sum() for il in hot if il in counts and counts[il].sum() > 0]
    return float(np.mean(xs)) if xs else None


def _session_text(s: dict) -> str:
    parts = []
    for m in s.get("messages", []):
        parts.append(m.get("content") or "")
        for c in m.get("tool_calls") or []:
            parts.append(json.dumps(c.get("function", {})))
    return "\n".join(parts)


def routing_report(model_path: str | os.PathLike, session_files: list[str | os.PathLike],
                   hot_frac: float = 0.44, seed: int = 0, max_chars: int = 2_000_000,
                   engine: bool = False, decode: int = 0, window: int = 2048) -> dict:
    """Skew and workload dependence of the synthetic routing on recorded sessions.

    Per sessions file: the ``hot_frac`` most-routed experts of each MoE layer on the development
    sessions (``sessions.split_sessions``) and the share of the held-out sessions' routes that they
    receive (the Ostinato paper's Sec. 2 statistic); across files: the Jaccard overlap of their hot
    sets and the share of each file's routes that land on the other file's hot set. Text is capped
    at ``max_chars`` per side. ``engine``: count routes with the real engine
    (:func:`engine_phase_counts`, windows of ``window`` tokens) instead of the numpy router
    forward; ``decode`` (engine only): greedy tokens generated after each window, counted as
    decode steps. Then the hot set is that of all the development routes (prefill and decode, as
    the planner sees them), and ``per_phase`` gives the held-out share of each phase. Returns a
    JSON-able dict.
    """
    if decode and not engine:
        raise SynthError("decode steps are counted by the engine only (engine=True)")
    rep: dict = {"model": str(model_path), "hot_frac": hot_frac, "max_chars": max_chars,
                 "counts_from": "engine" if engine else "numpy router forward", "files": {}}
    if engine:
        rep.update(window=window, decode_per_window=decode)
    hot: dict[str, dict[int, np.ndarray]] = {}
    counts_all: dict[str, dict[int, np.ndarray]] = {}
    for f in session_files:
        name = Path(f).stem
        dev, held = split_sessions(f, seed=seed)
        c: dict = {}
        for side, ss in (("dev", dev), ("held_out", held)):
            text = "\n".join(_session_text(s) for s in ss)[:max_chars]
            ids = tokenize(model_path, text)
            c[side] = (engine_phase_counts(model_path, ids, window, decode) if engine
                       else {"prefill": router_counts(model_path, ids), "decode": {}})
            c[side + "_tokens"] = int(len(ids))
            c[side + "_decode_routes"] = int(sum(v.sum() for v in c[side]["decode"].values()))
        # both phases' routes, as the planner counts them
        dev_all, held_all = ({il: v + c[side]["decode"].get(il, 0) for il, v in c[side]["prefill"].items()}
                             for side in ("dev", "held_out"))
        layers = sorted(dev_all)
        n_exp = len(dev_all[layers[0]])
        hot[name] = hot_sets(dev_all, hot_frac)
        shares = [held_all[il][hot[name][il]].sum() / max(1, held_all[il].sum()) for il in layers]
        counts_all[name] = {il: dev_all[il] + held_all[il] for il in layers}
        rep["files"][name] = {"dev_sessions": len(dev), "held_out_sessions": len(held),
                              "dev_tokens": c["dev_tokens"], "held_out_tokens": c["held_out_tokens"],
                              "n_expert": n_exp, "hot_experts_per_layer": len(hot[name][layers[0]]),
                              "held_out_share_on_dev_hot_set": float(np.mean(shares)),
                              "dev_share_on_own_hot_set": share_on(dev_all, hot[name]),
                              "per_layer_held_out_share": [round(float(x), 4) for x in shares]}
        if decode:
            rep["files"][name]["per_phase"] = {ph: share_on(c["held_out"][ph], hot[name]) for ph in ("prefill", "decode")}
            rep["files"][name]["decode_routes"] = {side: c[side + "_decode_routes"] for side in ("dev", "held_out")}
    names = list(hot)
    if len(names) >= 2:
        a, b = names[:2]
        layers = sorted(hot[a])
        jac = [len(set(hot[a][il]) & set(hot[b][il])) / len(set(hot[a][il]) | set(hot[b][il])) for il in layers]
        rep["cross"] = {"pair": [a, b], "hot_set_jaccard": float(np.mean(jac)),
                        f"{a}_routes_on_{b}_hot_set": share_on(counts_all[a], hot[b]),
                        f"{b}_routes_on_{a}_hot_set": share_on(counts_all[b], hot[a]),
                        f"{a}_routes_on_own_hot_set": share_on(counts_all[a], hot[a]),
                        f"{b}_routes_on_own_hot_set": share_on(counts_all[b], hot[b])}
    return rep


def designed_shares(shape: str, strengths: list[float], session_file: str | os.PathLike,
                    n_layer: int | None = None, hot_frac: float = 0.44, seed: int = 0,
                    max_chars: int = 200_000, copy_head: bool = True) -> dict[float, float]:
    """Held-out share on the development top-``hot_frac`` experts, mean over the layers, for each
    router strength A of ``strengths``: a numpy forward of the writer's own embedding and routers
    (qwen3moe layout of ``shape``, ``n_layer`` layers, softmax top-k; no file is written), what
    :func:`router_counts` computes on a written file. It leaves out what attention and the copy
    head add to the residual; the engine's counts on cut files stay within a few points of it
    (docs/synthetic-models.md, "Skew as a knob"). Text: ``max_chars`` per side of the task-grouped
    split of ``session_file``, tokenized with the qwen2 vocabulary. Returns {A: share}."""
    shp = SHAPES[shape] if n_layer is None else replace(SHAPES[shape], n_layer=int(n_layer))
    dev, held = split_sessions(session_file, seed=seed)
    ids = [tokenize(find_vocab(), "\n".join(_session_text(s) for s in ss)[:max_chars]) for ss in (dev, held)]
    uniq, inv = np.unique(np.concatenate(ids), return_inverse=True)
    inv_dev, inv_held = inv[:len(ids[0])], inv[len(ids[0]):]
    tok = load_tokenizer()

    def ctx(a: float) -> _Ctx:
        return _Ctx(arch="qwen3moe", shape=shp, routing=Routing(strength=a, copy_head=copy_head), seed=seed,
                    qexp=QUANTS["q8_0"], qmat=QUANTS["q8_0"], classes=np.asarray(tok["classes"], dtype=np.int8),
                    n_vocab=len(tok["tokens"]))

    x = _embedding(ctx(1.0))[uniq].astype(np.float64)
    x /= np.sqrt((x ** 2).mean(axis=1, keepdims=True))
    k, out = shp.n_expert_used, {}
    for a in strengths:
        cx, dev_c, held_c = ctx(a), {}, {}
        for il in range(shp.n_layer):
            logits = x @ _router(cx, il).T
            top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
            per_tok = np.zeros((len(uniq), shp.n_expert), dtype=np.int64)
            np.put_along_axis(per_tok, top, 1, axis=1)
            dev_c[il] = np.bincount(inv_dev, minlength=len(uniq)) @ per_tok
            held_c[il] = np.bincount(inv_held, minlength=len(uniq)) @ per_tok
        out[a] = share_on(held_c, hot_sets(dev_c, hot_frac))
    return out
