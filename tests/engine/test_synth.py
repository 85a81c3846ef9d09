"""Synthetic MoE GGUF writer: loads and generates in the real engine, deterministic, skewed routing."""

from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import numpy as np
import pytest

from ostinatod.synth import cli as synth_cli
from ostinatod.synth import copy_head, quants, shapes, vocab, tensors, writer


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _greedy(path: Path, prompt: bytes, n: int) -> list[int]:
    """Greedy tokens from the real llama.cpp build (low-level API, stock paths)."""
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # CPU repack/AMX buffers are irrelevant here (and AMX traps in some sandboxes)
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp could not load {path}"
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 512, 512, 2, 2
        ctx = L.llama_init_from_model(model, cp)
        assert ctx
        vocab = L.llama_model_get_vocab(model)
        buf = (L.llama_token * 384)()
        n_prompt = L.llama_tokenize(vocab, prompt, len(prompt), buf, 384, False, True)
        assert n_prompt > 0
        assert L.llama_decode(ctx, L.llama_batch_get_one(buf, n_prompt)) == 0
        n_vocab = L.llama_vocab_n_tokens(vocab)
        out = []
        one = (L.llama_token * 1)()
        for _ in range(n):
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            assert np.isfinite(logits).all()
            one[0] = int(logits.argmax())
            out.append(one[0])
            assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
        L.llama_free(ctx)
        return out
    finally:
        L.llama_model_free(model)


def test_tiny_loads_and_generates(tiny_model: Path):
    toks = _greedy(tiny_model, b"<|im_start|>user\ndef f(x):\n    return x + 1<|im_end|>\n", 100)
    assert len(toks) == 100
    assert len(set(toks)) > 1  # random weights, but not a constant output


@pytest.mark.parametrize("arch", ["deepseek2", "gpt-oss"])
def test_other_archs_load_and_generate(arch: str, tmp_path: Path):
    """deepseek2: MLA attention, a dense first layer, shared expert, exp_probs_b selection bias;
    gpt-oss: MXFP4 experts with biases, attention sinks, sliding-window layers."""
    p = writer.write_synthetic_moe(tmp_path / f"{arch}.gguf", arch=arch, shape="tiny")
    meta, _ = _meta(p)
    assert meta["general.architecture"] == arch and meta["ostinato.demo"] == "true"
    toks = _greedy(p, b"<|im_start|>user\nhello there<|im_end|>\n", 20)
    assert len(toks) == 20 and len(set(toks)) > 1


def _meta(path: Path) -> tuple[dict, dict]:
    """GGUF metadata (as llama.cpp reads it) and a few token texts, via a vocab-only load."""
    import llama_cpp as L

    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    try:
        buf = ctypes.create_string_buffer(1 << 16)
        meta = {}
        for i in range(L.llama_model_meta_count(model)):
            L.llama_model_meta_key_by_index(model, i, buf, len(buf))
            k = buf.value.decode()
            L.llama_model_meta_val_str_by_index(model, i, buf, len(buf))
            meta[k] = buf.value.decode()
        vocab = L.llama_model_get_vocab(model)
        texts = {i: L.llama_vocab_get_text(vocab, i).decode() for i in (151645, 151657, 151667)}
        return meta, texts
    finally:
        L.llama_model_free(model)


def test_metadata_marks_demo(tiny_model: Path):
    meta, texts = _meta(tiny_model)
    assert meta["general.architecture"] == "qwen3moe"
    assert meta["ostinato.demo"] == "true"
    assert "random weights" in meta["general.name"]
    assert meta["qwen3moe.expert_count"] == "8" and meta["qwen3moe.expert_used_count"] == "2"
    assert "<tool_call>" in meta["tokenizer.chat_template"]
    assert texts == {151645: "<|im_end|>", 151657: "<tool_call>", 151667: "<think>"}


def test_deterministic_from_seed(tiny_model: Path, tmp_path: Path):
    again = writer.write_synthetic_moe(tmp_path / "again.gguf", arch="qwen3moe", shape="tiny", seed=0)
    assert _sha(again) == _sha(tiny_model)
    assert not (tmp_path / "again.gguf.part").exists()
    # another seed: other router weights (checked on the builder, no second file needed)
    a = tensors._router(_ctx(0), 0)
    b = tensors._router(_ctx(1), 0)
    assert a.shape == (8, 64) and not np.allclose(a, b)


def _ctx(seed: int, shape: str = "tiny", **routing) -> "tensors._Ctx":
    tok = vocab.load_tokenizer()
    return tensors._Ctx(arch="qwen3moe", shape=shapes.SHAPES[shape], routing=shapes.Routing(**routing), seed=seed,
                      qexp=shapes.QUANTS["q8_0"], qmat=shapes.QUANTS["q8_0"],
                      classes=np.asarray(tok["classes"], dtype=np.int8), n_vocab=len(tok["tokens"]))


def test_token_classes():
    C, P, O = shapes.CODE, shapes.PROSE, shapes.OTHER
    cases = {"    ": C, "\n": C, "){": C, "_name": C, "getValue": C, "def": C, "self": C,
             " the": P, "Hello": P, " house": P, ",": P, "42": O, "é": O}
    got = {t: vocab.coarse_class(t) for t in cases}
    assert got == cases


def test_routing_is_skewed_and_content_dependent():
    """Numpy forward of each layer's router on the token embeddings (small shape, 32 experts)."""
    cx = _ctx(0, "small")
    emb = tensors._embedding(cx)
    rng = np.random.default_rng(0)
    coarse = np.asarray(shapes.COARSE_OF)[cx.classes]
    code_ids = rng.choice(np.flatnonzero(coarse == shapes.CODE), 3000)
    prose_ids = rng.choice(np.flatnonzero(coarse == shapes.PROSE), 3000)
    for il in (0, cx.shape.n_layer - 1):
        W = tensors._router(cx, il)
        counts = []
        for ids in (code_ids, prose_ids):
            x = emb[ids] / np.sqrt((emb[ids] ** 2).mean(axis=1, keepdims=True))
            top = np.argsort(-(x @ W.T), axis=1)[:, :cx.shape.n_expert_used]
            counts.append(np.bincount(top.ravel(), minlength=cx.shape.n_expert))
        n_hot = round(0.44 * cx.shape.n_expert)
        for c in counts:
            assert np.sort(c)[::-1][:n_hot].sum() / c.sum() > 0.75  # uniform would be 0.44
        hot_code = set(np.argsort(-counts[0])[:n_hot])
        hot_prose = set(np.argsort(-counts[1])[:n_hot])
        assert hot_code != hot_prose
        # prose routes land much less on the code hot set than code routes do
        share = lambda c, hot: c[sorted(hot)].sum() / c.sum()  # noqa: E731
        assert share(counts[1], hot_code) < share(counts[0], hot_code) - 0.1


def test_copy_layer_by_architecture():
    q35 = shapes.SHAPES["qwen3.5-35b-a3b"]
    assert copy_head.copy_layer("qwen3moe", shapes.SHAPES["small"]) == 0
    assert copy_head.copy_layer("glm4moe", shapes.SHAPES["glm-4.5-air"]) == 0
    assert copy_head.copy_layer("qwen35moe", q35) == 3  # the first full-attention layer
    assert copy_head.copy_layer("qwen35moe", shapes.Shape(**{**q35.__dict__, "n_layer": 2})) is None
    assert copy_head.copy_layer("deepseek4", shapes.SHAPES["deepseek-v4-flash"]) == 0  # the first sliding-window layer
    assert copy_head.copy_layer("deepseek2", shapes.SHAPES["small"]) is None


def test_copy_head_only_on_the_real_shapes_by_default():
    # the test and demo files keep the walk their grammar-constrained answers were written for
    assert not any(shapes.copy_head_by_default(s) for s in ("tiny", "ci", "small"))
    assert all(shapes.copy_head_by_default(s) for s in shapes.ARCH_SHAPES)
    assert _ctx(0, "small").copy_at is None and _ctx(0, "small", copy_head=True).copy_at == 0


def test_copy_head_output_reads_the_copied_token():
    """The copy subspace: no embedding, class direction or router weight in it (but the anchor, the
    last dim, 1 in every embedding row); the output matrix only in it, and its argmax on the copy
    head's write of token j is j (small shape, head_dim 32: the narrowest copy of the shapes that
    write files for the bench)."""
    cx = _ctx(0, "small", copy_head=True)
    d, n = cx.shape.n_embd, cx.n_copy
    assert n == 64 and cx.copy_at == 0
    emb = tensors._embedding(cx)
    assert not emb[:, d - n:d - 1].any() and (emb[:, d - 1] == 1).all() and not cx.C[:, d - n:].any()
    assert not tensors._router(cx, 1)[:, d - n:].any()
    copies = cx._copies.copy()  # (n_vocab, n): head 0's write per token
    out = tensors._copy_output(cx)
    assert not out[:, d - 1].any()
    assert not out[:, :d - n].any()
    ids = np.random.default_rng(1).integers(0, cx.n_vocab, 400)
    assert np.mean((copies[ids] @ out[:, d - n:].T).argmax(axis=1) == ids) > 0.97
    # the copy is about as large as the embedding (copy_gain 1)
    assert np.linalg.norm(copies[ids], axis=1).mean() / np.sqrt(d) == pytest.approx(1.0, abs=0.15)


SESSIONS = Path("/work/shared/sessions")


def test_hot_sets_and_shares():
    from ostinatod.synth.routing import hot_sets, share_on

    dev = {0: np.array([9, 1, 5, 0]), 3: np.array([0, 0, 2, 7])}
    hot = hot_sets(dev, 0.5)
    assert [h.tolist() for h in hot.values()] == [[0, 2], [2, 3]]
    held = {0: np.array([1, 1, 1, 1]), 3: np.array([0, 4, 0, 0])}
    assert share_on(held, hot) == pytest.approx((0.5 + 0.0) / 2)
    assert share_on({}, hot) is None


def test_designed_shares_grow_with_the_router_strength():
    """The numpy forward the skew table is made with (no file written): the class preference
    adds skew on top of what the tokens alone give (A = 0)."""
    from ostinatod.synth.routing import designed_shares

    got = designed_shares("small", [0.0, 1.0, 2.5], SESSIONS / "swe.jsonl", n_layer=4, max_chars=20000,
                          copy_head=False)
    assert 0.44 < got[0.0] < got[1.0] < got[2.5] < 1.0, got


@pytest.mark.slow
def test_decode_steps_route_like_prompt_tokens_through_the_engine(tmp_path: Path):
    """Through the real engine (native route counters, CPU): greedy tokens after a prompt are
    mostly copies of the prompt's tokens (without the copy head a random model repeats a fixed
    walk of tokens), and held-out decode steps route to the development hot set within a few
    points of held-out prefill tokens (docs/design.md "Testing and measuring")."""
    from ostinatod.engine import native
    from ostinatod.synth import routing

    if not native.experts_available():
        pytest.skip("native expert engine not built")
    path = writer.write_synthetic_moe(tmp_path / "ci.gguf", arch="qwen3moe", shape="ci",
                                      routing=shapes.Routing(copy_head=True))
    # longer than copy_lag (96 tokens): the copy head copies the token that far back
    prompt = b"def load(path):\n    with open(path) as f:\n        return json.load(f)\n" \
             b"The file holds the user's orders, one per line. Each order names a customer, " \
             b"a date and the items bought, with their prices in euros.\n" \
             b"def total(orders):\n    return sum(o['price'] * o['count'] for o in orders)\n" \
             b"class Store:\n    def __init__(self, path):\n        self.orders = load(path)\n" \
             b"    def report(self):\n        print(f'{len(self.orders)} orders, {total(self.orders):.2f} EUR')\n" \
             b"Write a test for report() that reads a small file of three orders.<|im_end|>\n" \
             b"<|im_start|>assistant\n"
    prompt_ids = set(routing.tokenize(path, prompt.decode()).tolist())
    out = _greedy(path, prompt, 24)
    assert np.mean([t in prompt_ids for t in out]) > 0.6 and len(set(out)) >= 6, out
    rep = routing.routing_report(path, [SESSIONS / "swe.jsonl"], engine=True, decode=16, window=512,
                                 max_chars=12000)
    ph = rep["files"]["swe"]["per_phase"]
    assert rep["files"]["swe"]["decode_routes"]["held_out"] > 0
    # the bench's bound: decode no more than 5 points hotter than prefill (else it hides the CPU branch); and not
    # far colder (the copies are of context tokens). The last layer is not counted (llama.cpp
    # computes it for the logits rows only), so 3 of the ci shape's 4 layers with 8 experts each
    assert ph["prefill"] - 0.10 < ph["decode"] < ph["prefill"] + 0.05, ph


def test_quant_blocks_are_valid():
    import gguf

    rng = np.random.default_rng(0)
    for qt in (shapes.QUANTS["q4_0"], shapes.QUANTS["q8_0"]):
        blocks = quants.random_quant_blocks((4, 64, 128), qt, 0.05, rng)
        vals = gguf.quants.dequantize(blocks, qt)
        assert vals.shape == (4, 64, 128)
        assert np.isfinite(vals).all()
        assert 0.02 < vals.std() < 0.1


def test_bad_arguments(tmp_path: Path):
    with pytest.raises(shapes.SynthError):
        writer.write_synthetic_moe(tmp_path / "x.gguf", arch="llama")
    with pytest.raises(shapes.SynthError):
        writer.write_synthetic_moe(tmp_path / "x.gguf", shape="huge")
    with pytest.raises(SystemExit):
        synth_cli.main(["--quant", "q3", "-o", str(tmp_path / "y.gguf")])
