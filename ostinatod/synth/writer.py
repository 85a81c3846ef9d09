"""Synthetic MoE GGUF writer: real llama.cpp architectures, a real tokenizer, random weights and
content-dependent, skewed expert routing (docs/design.md "Testing and measuring").

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

Public API: :func:`write_synthetic_moe`, :data:`SHAPES`, :func:`find_vocab`, CLI ``ostinato synth``."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from .quants import RECIPES, _BLOCK, _rng, quant_nbytes
from .mix import cut_shape
from .shapes import (ARCH_SHAPES, MERGED_GATE_UP_ARCHS, QUANTS, Routing, SHAPES, SYNTH_FORMAT, SynthError,
                     TOKEN_ENDOFTEXT, TOKEN_IM_END, copy_head_by_default, narrow_shape)
from .vocab import load_tokenizer, named_tokens
from .skew import router_strength
from .archs import PLANS as _PLANS
from .tensors import _Ctx


def chat_template() -> str:
    """Our ChatML/Hermes-style chat template (tools in <tools>, <tool_call> JSON, <think>)."""
    return (Path(__file__).with_name("chat_template.jinja")).read_text()


def write_synthetic_moe(path: str | os.PathLike, arch: str = "qwen3moe", shape: str = "tiny",
                        n_layer: int | None = None, quant: str = "q8_0", seed: int = 0,
                        routing: Routing | None = None, vocab: Path | None = None,
                        progress: bool = False, merged_gate_up: bool = False, narrow: bool = False) -> Path:
    """Write a synthetic MoE GGUF and return its path.

    ``arch``: one of :data:`ARCHS`; ``shape``: a key of :data:`SHAPES`; ``n_layer`` cuts (or
    extends) the depth; ``quant``: a recipe of :data:`.quants.RECIPES`: "f16" | "q8_0" | "q4_0" |
    "mxfp4" set the type of the routed and shared experts (attention, embedding and output q8_0, f16
    when quant="f16"; gpt-oss turns the default q8_0 into mxfp4); "q4_k_m" | "q5_k_m" | "q6_k" |
    "iq4_xs" | "ud-q4_k_xl" mix types per tensor and layer like the published files (norms and
    routers f32 always); ``merged_gate_up``: one ``ffn_gate_up_exps`` tensor per layer instead of
    gate and up (archs in :data:`MERGED_GATE_UP_ARCHS`); ``seed``: all weights are a
    deterministic function of it; ``routing``: the routing knobs (default :class:`Routing`; its
    ``skew`` sets the router strength, :mod:`.skew`). The file is written to
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
    if shape in ARCH_SHAPES and ARCH_SHAPES[shape] != arch:
        raise SynthError(f"shape {shape!r} is a {ARCH_SHAPES[shape]} shape, not {arch}")
    if merged_gate_up and arch not in MERGED_GATE_UP_ARCHS:
        raise SynthError(f"--merged-gate-up: llama.cpp reads ffn_gate_up_exps only for "
                         f"{', '.join(MERGED_GATE_UP_ARCHS)}, not {arch}")
    if n_layer is not None and int(n_layer) < 1:
        raise SynthError("n_layer must be >= 1")
    shp = cut_shape(shape, n_layer)
    if narrow:
        if shape not in ARCH_SHAPES:
            raise SynthError(f"--narrow: {shape!r} is not a real model's shape (have: {', '.join(ARCH_SHAPES)})")
        shp = narrow_shape(shp)
    routing = routing or Routing()
    if routing.copy_head is None:
        routing = replace(routing, copy_head=copy_head_by_default(shape))
    strength = router_strength(routing, shp.n_expert, shp.n_expert_used)  # SynthError for a skew out of range, before writing
    path = Path(path)
    t0 = time.time()
    tok = load_tokenizer(vocab)
    tokens, types = named_tokens(tok)
    cx = _Ctx(arch=arch, shape=shp, routing=routing, seed=seed, qexp=QUANTS[quant],
              qmat=QT.F16 if quant == "f16" else QT.Q8_0, recipe=RECIPES[quant], merged=merged_gate_up,
              classes=np.asarray(tok["classes"], dtype=np.int8), n_vocab=len(tokens))
    plan_fn, kv_fn = _PLANS[arch]
    plan = plan_fn(cx)
    biggest = max((quant_nbytes(t.shape, t.qtype) for t in plan if t.qtype in _BLOCK and "exps" in t.name),
                  default=0)
    if biggest > (64 << 20):
        # big experts: draw random bytes once, cut each tensor from it (memcpy speed)
        cx.pool = _rng(seed, "pool").integers(0, 256, size=biggest + (1 << 20), dtype=np.uint8)

    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(part, arch)
    tag = (f"{'' if n_layer is None else f' {shp.n_layer}L'}{' merged-gate-up' if merged_gate_up else ''}"
           f"{' narrow' if narrow else ''}")
    name = f"ostinato-demo {arch} {shape}{tag} {quant} (random weights)"
    w.add_name(name)
    w.add_type("model")
    w.add_description("Synthetic MoE model written by 'ostinato synth': random weights, real "
                      "architecture and tokenizer, content-dependent skewed routing. Its text is "
                      "meaningless; use it for tests and benchmarks only.")
    w.add_file_type(RECIPES[quant].ftype)
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
    if merged_gate_up:
        w.add_bool("ostinato.synth.merged_gate_up", True)
    if narrow:
        w.add_bool("ostinato.synth.narrow", True)
    w.add_string("ostinato.synth.routing", json.dumps(asdict(routing), sort_keys=True))
    w.add_float32("ostinato.synth.router_strength", strength)

    for t in plan:
        nb = quant_nbytes(t.shape, t.qtype)
        if t.qtype in _BLOCK:
            bshape = t.shape[:-1] + (t.shape[-1] // _BLOCK[t.qtype][0] * _BLOCK[t.qtype][1],)
            w.add_tensor_info(t.name, bshape, np.dtype(np.uint8), nb, raw_dtype=t.qtype)
        else:
            dt = {QT.F32: np.float32, QT.F16: np.float16, QT.I32: np.int32}[t.qtype]
            w.add_tensor_info(t.name, t.shape, np.dtype(dt), nb, raw_dtype=t.qtype)
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


def planned_bytes(arch: str, shape: str, quant: str, n_layer: int | None = None, narrow: bool = False) -> int:
    """Bytes of the tensor data :func:`write_synthetic_moe` would write for these arguments (the file
    is this plus its metadata, a few MB for the vocabulary); nothing is written. Raises SynthError
    as the writer does for bad arguments."""
    if arch not in _PLANS or shape not in SHAPES or quant not in QUANTS:
        raise SynthError(f"unknown arch, shape or quant: {arch!r}, {shape!r}, {quant!r}")
    shp = cut_shape(shape, n_layer)
    shp = narrow_shape(shp) if narrow else shp
    tok = load_tokenizer(None)
    cx = _Ctx(arch=arch, shape=shp, routing=Routing(copy_head=copy_head_by_default(shape)), seed=0,
              qexp=QUANTS[quant], qmat=QT.F16 if quant == "f16" else QT.Q8_0, recipe=RECIPES[quant],
              merged=False, classes=np.asarray(tok["classes"], dtype=np.int8), n_vocab=len(tok["tokens"]))
    return sum(quant_nbytes(t.shape, t.qtype) for t in _PLANS[arch][0](cx))


def synthetic_model(directory: str | os.PathLike, arch: str = "qwen3moe", shape: str = "tiny",
                    n_layer: int | None = None, quant: str = "q8_0", seed: int = 0,
                    merged_gate_up: bool = False) -> Path:
    """A cached synthetic model: ``<directory>/ostinato-<arch>-<shape>[-<n>L]-<quant>-s<seed>.gguf``,
    written by :func:`write_synthetic_moe` if missing (the name carries the writer's format
    version, so a format change writes a new file). For test fixtures and the demo model."""
    tag = (f"-{n_layer}L" if n_layer is not None else "") + ("-gu" if merged_gate_up else "")
    version = SYNTH_FORMAT.rsplit("/", 1)[-1]
    p = Path(directory) / f"ostinato-{arch}-{shape}{tag}-{quant}-s{seed}-v{version}.gguf"
    if not p.is_file():
        write_synthetic_moe(p, arch=arch, shape=shape, n_layer=n_layer, quant=quant, seed=seed,
                            merged_gate_up=merged_gate_up)
    return p
