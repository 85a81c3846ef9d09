"""Exactness on every path for the other model layouts: merged gate/up expert tensors and the newer
architectures (glm4moe, minimax-m2, qwen35moe, deepseek4) (harness: exact_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ostinatod.engine import native
from ostinatod.residency.sets import model_block
from exact_helpers import (_opt, N_NEW, PROMPT_LEN, Runner, _every_path_matches, _moe_layers, _prompt, drop_ost,
                           half_hot, moe)
from exact_helpers import _daemon_pool_layout, _free_shared_runner  # noqa: F401 (fixtures)


def merge_gate_up(src, dst):
    """Rewrites a GGUF with separate ffn_gate_exps / ffn_up_exps as one merged ffn_gate_up_exps per
    layer (gate rows first, then up rows, per expert), as recent converters write them."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    by_name = {t.name: t for t in r.tensors}
    out = []
    for t in r.tensors:
        if t.name.endswith("ffn_up_exps.weight"):
            continue
        if t.name.endswith("ffn_gate_exps.weight"):
            up = by_name[t.name.replace("ffn_gate_exps", "ffn_up_exps")]
            out.append((t.name.replace("ffn_gate_exps", "ffn_gate_up_exps"),
                        np.concatenate([t.data, up.data], axis=1), t.tensor_type))
        else:
            out.append((t.name, t.data, t.tensor_type))
    for name, data, qt in out:
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data, _ in out:
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    return dst


def test_merged_gate_up_layers_take_the_expert_engine(tmp_path):
    """A deepseek2 file with merged ffn_gate_up_exps: the engine puts the merged rows in the
    pool (a size class marked merged_gate_up) instead of serving the layers stock, and every path,
    the decode graph too, gives stock's greedy tokens for the same file."""
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    drop_ost()
    src = synthetic_model(CACHE, arch="deepseek2", shape="tiny")
    path = merge_gate_up(src, tmp_path / "merged.gguf")
    m = model_block(path)
    moe = (path, m, _moe_layers("deepseek2", m["n_layer"]))
    ref = Runner(path)
    try:
        ref_toks, _ = ref.generate(_prompt(PROMPT_LEN), N_NEW)
    finally:
        ref.close()
    r = Runner(path, hot=half_hot(moe), prefill_threshold=512)
    try:
        info = native.experts_json("ostinato_experts_info")
        assert info["size_classes"] and all(c["merged_gate_up"] for c in info["size_classes"])
        assert not any("not supported" in n for n in info["notes"])
        _every_path_matches(r, ref_toks)
    finally:
        r.close()


NEW_ARCHS = ("glm4moe", "minimax-m2", "qwen35moe", "deepseek4")


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_newer_architectures_through_the_engine(arch):
    """On the CPU: each newer architecture's tiny file (synthetic, q8_0 experts) with
    half of every MoE layer's experts hot gives stock's greedy tokens on the split path, the upload
    path and the decode graph, the latter also with decode prefetch (the daemon's default; on the
    GPU deepseek4's decode graph runs in several scheduler splits, and a prefetch chain crossing one
    once aborted the CUDA graph's capture), and the pool holds its hot experts (not the stock
    fallback); the decode graph's CPU branch runs on its own kernel in every layer."""
    from ostinatod.residency.gguf_header import read_header
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    drop_ost()
    path = synthetic_model(CACHE, arch=arch, shape="tiny")
    m = model_block(path)
    layers = sorted({int(t.name.split(".")[1]) for t in read_header(path).tensors
                     if t.name.endswith("ffn_down_exps.weight")})
    hot = half_hot((path, m, layers), seed=7)
    ref = Runner(path)
    try:
        ref_toks, _ = ref.generate(_prompt(PROMPT_LEN), N_NEW)
    finally:
        ref.close()
    _opt(prefetch_depth=2)   # three staging regions: the decode prefetch stages in two of them
    r = Runner(path, hot=hot, prefill_threshold=512)
    try:
        info = native.experts_json("ostinato_experts_info")
        assert info["hot_experts"] == sum(len(v) for v in hot.values()), info["notes"]
        st = _every_path_matches(r, ref_toks, decode_prefetch=16)
        print(f"\n[exactness] {arch} decode prefetch: staged {st['decode_prefetch_staged']}, "
              f"{st['decode_prefetch_routes']} of {st['cold_routes']} cold routes in the GPU branch; "
              f"CPU branch layers {st['cpu_branch_layers']}, of them on its own kernel {st['cpu_kernel_layers']}")
        # every one of these architectures' expert FFNs is the CPU branch kernel's shape (deepseek4's
        # clamped SwiGLU included), so no decode-graph layer fell back to ggml's graph compute
        assert st["cpu_kernel_layers"] == st["cpu_branch_layers"] > 0, st
        if len(layers) > 1:   # a next layer to predict: the prefetch staged and its routes ran
            assert st["decode_prefetch_staged"] > 0 and st["decode_prefetch_routes"] > 0
    finally:
        r.close()
        _opt(prefetch_depth=0)
