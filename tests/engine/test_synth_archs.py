"""The synthetic writer's newer architectures (glm4moe, minimax-m2, qwen35moe,
deepseek4), its quant recipes (K-quants, IQ4_XS, MXFP4 mixed per tensor and layer) and merged
gate_up; each CI file loads in the project's llama.cpp build and generates a few greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

from ostinatod.residency.gguf_header import read_header
from ostinatod.synth import archs, quants, shapes, vocab, writer
from ostinatod.synth.tensors import _Ctx
from ostinatod.synth import cli as synth_cli

from test_synth import _greedy, _meta

PROMPT = b"<|im_start|>user\ndef f(x):\n    return x + 1<|im_end|>\n"
NEW_ARCHS = ["glm4moe", "minimax-m2", "qwen35moe", "deepseek4"]


def _types(path: Path) -> dict[str, QT]:
    # the project's own header reader (gguf.GGUFReader takes ~12 s on the 151,936-token vocabulary)
    return {t.name: QT(t.ggml_type) for t in read_header(path).tensors}


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_new_arch_tiny_loads_and_generates(arch: str, tmp_path: Path):
    """Tiny shape, q8_0 experts: the layout of each architecture loads and generates."""
    p = writer.write_synthetic_moe(tmp_path / f"{arch}.gguf", arch=arch, shape="tiny")
    meta, _ = _meta(p)
    assert meta["general.architecture"] == arch and meta["ostinato.demo"] == "true"
    toks = _greedy(p, PROMPT, 6)
    assert len(toks) == 6 and len(set(toks)) > 1


# one mixed recipe per architecture on the "ci" shape (rows of 256: K-quant blocks fit), merged
# gate_up where llama.cpp reads it
RECIPE_CASES = [
    ("qwen3moe", "q4_k_m", False),
    ("deepseek2", "ud-q4_k_xl", True),
    ("glm4moe", "q5_k_m", False),
    ("minimax-m2", "iq4_xs", False),
    ("qwen35moe", "ud-q4_k_xl", True),
    ("qwen35moe", "q6_k", False),
    ("deepseek4", "mxfp4", False),
    ("deepseek4", "q4_k_m", False),
]


@pytest.mark.parametrize("arch,quant,merged", RECIPE_CASES)
def test_ci_recipe_loads_and_generates(arch: str, quant: str, merged: bool, tmp_path: Path):
    p = writer.write_synthetic_moe(tmp_path / "m.gguf", arch=arch, shape="ci", quant=quant,
                                   merged_gate_up=merged)
    types = _types(p)
    gu = [n for n in types if n.endswith("ffn_gate_up_exps.weight")]
    assert bool(gu) == merged
    if merged:
        assert not any(n.endswith("ffn_gate_exps.weight") or n.endswith("ffn_up_exps.weight") for n in types)
    exp_types = {t for n, t in types.items() if "_exps." in n and n.endswith(".weight")}
    if quant == "mxfp4":
        assert exp_types == {QT.MXFP4}
    else:
        assert len(set(types.values()) - {QT.F32, QT.I32}) >= 2  # a mix, not one type
        assert exp_types & {QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS}
    kv = read_header(p).kv
    assert kv["ostinato.synth.quant"] == quant and kv["general.architecture"] == arch
    toks = _greedy(p, PROMPT, 4)
    assert len(toks) == 4


def test_recipe_mix_per_tensor_and_layer(tmp_path: Path):
    """ud-q4_k_xl: down_exps one step above gate/up, the edge MoE layers one more step; attention
    and shared experts Q8_0; output Q6_K; q4_k_m: down Q6_K on llama.cpp's use_more_bits layers."""
    p = writer.write_synthetic_moe(tmp_path / "ud.gguf", arch="deepseek2", shape="ci", quant="ud-q4_k_xl",
                                   n_layer=8)
    t = _types(p)
    # layer 0 dense; MoE layers 1..7: edge = 1, 2, 7
    assert t["blk.4.ffn_gate_exps.weight"] == QT.Q4_K and t["blk.4.ffn_down_exps.weight"] == QT.Q5_K
    assert t["blk.1.ffn_gate_exps.weight"] == QT.Q5_K and t["blk.1.ffn_down_exps.weight"] == QT.Q6_K
    assert t["blk.7.ffn_down_exps.weight"] == QT.Q6_K
    assert t["blk.4.ffn_down_shexp.weight"] == QT.Q8_0 and t["output.weight"] == QT.Q6_K
    R = quants.RECIPES
    downs = [quants.tensor_type(R["q4_k_m"], "exp_down", il, 16, 128, 8) for il in range(16)]
    assert downs[:2] == [QT.Q6_K, QT.Q6_K] and downs[2] == QT.Q4_K and downs[4] == QT.Q6_K
    assert downs[-2:] == [QT.Q6_K, QT.Q6_K]
    assert quants.tensor_type(R["q4_k_m"], "exp_gate", 5, 16, 128, 8) == QT.Q4_K
    assert quants.tensor_type(R["q4_k_m"], "attn_v", 5, 16, 8, 8) == QT.Q8_0  # 8-expert rule
    assert quants.tensor_type(R["iq4_xs"], "exp_down", 0, 16, 128, 8) == QT.Q5_K
    assert quants.tensor_type(R["iq4_xs"], "exp_down", 8, 16, 128, 8) == QT.IQ4_XS
    # llama.cpp's fallbacks when a block does not divide the row (GLM-4.5-Air's 1408)
    assert quants.fit(QT.Q4_K, 1408) == QT.Q5_0 and quants.fit(QT.Q6_K, 1408) == QT.Q8_0
    assert quants.fit(QT.IQ4_XS, 96) == QT.IQ4_NL and quants.fit(QT.Q8_0, 48) == QT.F16


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, QT.Q5_0, QT.Q5_1, QT.IQ4_NL])
def test_random_blocks_are_valid(qt: QT):
    from ostinatod.synth.quants import random_quant_blocks

    blocks = random_quant_blocks((4, 16, 512), qt, 0.05, np.random.default_rng(0))
    vals = gguf.quants.dequantize(blocks, qt)
    assert vals.shape == (4, 16, 512) and np.isfinite(vals).all()
    assert 0.03 < vals.std() < 0.08 and abs(vals.mean()) < 0.01


def _plan(arch: str, shape: str, quant: str = "q4_k_m"):
    tok = vocab.load_tokenizer()
    cx = _Ctx(arch=arch, shape=shapes.SHAPES[shape], routing=shapes.Routing(), seed=0,
              qexp=shapes.QUANTS[quant], qmat=QT.Q8_0, recipe=quants.RECIPES[quant],
              classes=np.asarray(tok["classes"], dtype=np.int8), n_vocab=len(tok["tokens"]))
    return {t.name: t for t in archs.PLANS[arch][0](cx)}


def test_real_shapes_plan():
    """Real shapes (no file written): tensor counts and per-expert sizes of the published models."""
    ds = _plan("deepseek4", "deepseek-v4-flash", "mxfp4")
    gate = ds["blk.10.ffn_gate_exps.weight"]
    assert gate.shape == (256, 2048, 4096) and gate.qtype == QT.MXFP4
    per_expert = 3 * quants.nbytes((2048, 4096), QT.MXFP4)
    assert abs(per_expert / 1e6 - 13.4) < 0.1  # docs/design.md: 13.4 MB MXFP4 experts
    assert sum(n.endswith("ffn_gate_tid2eid.weight") for n in ds) == 3
    assert archs.compress_ratios(43) == [0, 0] + [4, 128] * 20 + [4]
    q = _plan("qwen35moe", "qwen3.5-35b-a3b")
    assert sum(n.endswith("ssm_conv1d.weight") for n in q) == 30  # 3 of every 4 layers linear
    assert q["blk.3.attn_q.weight"].shape == (2 * 16 * 256, 2048)  # q + output gate
    g = _plan("glm4moe", "glm-4.5-air")
    assert "blk.0.ffn_gate.weight" in g and "blk.1.ffn_gate_exps.weight" in g
    assert g["blk.1.ffn_down_exps.weight"].qtype in (QT.Q5_0, QT.Q8_0)  # 1408 rows: fallback
    m = _plan("minimax-m2", "minimax-m2")
    assert m["blk.61.ffn_up_exps.weight"].shape == (256, 1536, 3072)


def test_bad_combinations(tmp_path: Path):
    with pytest.raises(shapes.SynthError, match="ffn_gate_up_exps"):
        writer.write_synthetic_moe(tmp_path / "x.gguf", arch="glm4moe", merged_gate_up=True)
    with pytest.raises(shapes.SynthError, match="deepseek4 shape"):
        writer.write_synthetic_moe(tmp_path / "x.gguf", arch="qwen3moe", shape="deepseek-v4-flash")
    assert synth_cli.main(["--arch", "minimax-m2", "--merged-gate-up", "-o", str(tmp_path / "y.gguf")]) == 2
