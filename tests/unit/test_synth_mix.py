"""Representative cuts (a real model's layer kinds in proportion) and the
bench's checks of a file's layer mix and per-phase hot shares. Pure functions: no file is written."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ostinatod.bench import bench_breakdown
from ostinatod.synth import archs, mix
from ostinatod.synth.shapes import SHAPES, narrow_shape


def _real(shape: str, arch: str):
    return mix.shape_layer_kinds(arch, SHAPES[shape])


def test_allocate_is_largest_remainder_with_every_kind_present():
    assert mix.allocate({"hash": 3, "moe": 40}, 14) == {"hash": 1, "moe": 13}
    assert mix.allocate({"dense": 1, "moe": 45}, 12) == {"dense": 1, "moe": 11}   # 0.26 -> at least one
    assert mix.allocate({"dense": 1, "moe": 45}, 1) == {"dense": 0, "moe": 1}     # too few layers for both
    assert mix.allocate({0: 2, 4: 21, 128: 20}, 14) == {0: 1, 4: 7, 128: 6}
    assert sum(mix.allocate({0: 2, 4: 21, 128: 20}, 4).values()) == 4
    with pytest.raises(ValueError):
        mix.allocate({"a": 0}, 3)


def test_deepseek_v4_flash_cuts_keep_the_real_mix():
    """The 14-layer cut has 1 hash-routed layer (3 of 43 in the real model); the old 6-layer file
    (the first six layers: 3 hash, 2 uncompressed) is refused by the check."""
    s = mix.cut_shape("deepseek-v4-flash", 14)
    assert s.n_layer == 14 and s.hash_layers == 1
    assert s.compress_schedule == (0,) + (4, 128) * 6 + (4,)
    real = _real("deepseek-v4-flash", "deepseek4")
    assert len(real) == 43 and sum(k["ffn"] == "hash" for k in real) == 3
    assert mix.mix_problems(real, mix.shape_layer_kinds("deepseek4", s)) == []
    old = replace(SHAPES["deepseek-v4-flash"], n_layer=6)   # the bench's earlier file
    problems = mix.mix_problems(real, mix.shape_layer_kinds("deepseek4", old))
    assert any("'hash': 3 of 6 layers" in p for p in problems)
    # every cut from 1 to 43 layers is representative, and the writer lays out the same kinds
    for n in range(1, 44):
        c = mix.cut_shape("deepseek-v4-flash", n)
        assert mix.mix_problems(real, mix.shape_layer_kinds("deepseek4", c)) == [], n
        assert any(r for r in (c.compress_schedule or archs.compress_ratios(n)))   # llama.cpp needs one
    assert mix.cut_shape("deepseek-v4-flash", None) == SHAPES["deepseek-v4-flash"]


@pytest.mark.parametrize("shape,arch,n", [("glm-4.5-air", "glm4moe", 12), ("qwen3.5-35b-a3b", "qwen35moe", 12),
                                          ("qwen3.5-35b-a3b", "qwen35moe", 40), ("qwen3-30b-a3b", "qwen3moe", 24),
                                          ("minimax-m2", "minimax-m2", 4)])
def test_other_families_cuts(shape, arch, n):
    c = mix.cut_shape(shape, n)
    kinds = mix.shape_layer_kinds(arch, c)
    assert mix.mix_problems(_real(shape, arch), kinds) == []
    if arch == "glm4moe":
        assert [k["ffn"] for k in kinds].count("dense") == 1
    if arch == "qwen35moe":
        assert [k["attn"] for k in kinds].count("full") == n // 4
    # the narrow version keeps layers, kinds and expert counts
    nr = narrow_shape(c)
    assert mix.shape_layer_kinds(arch, nr) == kinds
    assert (nr.n_expert, nr.n_expert_used, nr.n_embd) == (c.n_expert, c.n_expert_used, 256)


def test_check_reads_the_files_metadata():
    """check_file_mix: the kinds from a GGUF's keys; a test shape or a real GGUF is not checked."""
    kv = {"general.architecture": "deepseek4", "ostinato.synth.shape": "deepseek-v4-flash",
          "deepseek4.block_count": 6, "deepseek4.hash_layer_count": 3,
          "deepseek4.attention.compress_ratios": [0, 0, 4, 128, 4, 128]}
    r = mix.check_file_mix(kv)
    assert r["layers"] == 6 and r["kinds"]["ffn"] == {"hash": 3, "moe": 3} and r["problems"]
    s = mix.cut_shape("deepseek-v4-flash", 14)
    kv.update({"deepseek4.block_count": 14, "deepseek4.hash_layer_count": 1,
               "deepseek4.attention.compress_ratios": list(s.compress_schedule)})
    assert mix.check_file_mix(kv)["problems"] == []
    glm = {"general.architecture": "glm4moe", "ostinato.synth.shape": "glm-4.5-air", "glm4moe.block_count": 12,
           "glm4moe.leading_dense_block_count": 0}
    assert "'dense': 0 of 12" in mix.check_file_mix(glm)["problems"][0]
    assert mix.check_file_mix({**glm, "ostinato.synth.shape": "ci"}) is None
    assert mix.check_file_mix({"general.architecture": "glm4moe"}) is None


def test_hot_shares_warn_outside_the_papers_skew_and_on_a_phase_gap():
    def b(pre, dec, after=None):
        out = {"prefill": {"hot_route_share": pre}, "decode_step": {"hot_route_share": dec}}
        if after is not None:
            out["prefill_after_tool"] = {"hot_route_share": after}
        return out

    ok = bench_breakdown.hot_shares(b(0.85, 0.83), 0.45)
    assert ok["checked"] and ok["warnings"] == [] and ok["decode_minus_prefill"] == pytest.approx(-0.02)
    assert ok["target"] == [0.81, 0.87]
    # the 6-layer DeepSeek-V4-Flash file measured first: both phases below, decode 8 points colder
    w = bench_breakdown.hot_shares(b(0.69, 0.61), 0.45)["warnings"]
    assert len(w) == 3 and "prefill hot-route share 0.690" in w[0] and "points below" in w[2]
    # outside the 42-47% pools the range is not checked; the phase gap is
    far = bench_breakdown.hot_shares(b(0.95, 0.97), 0.85)
    assert not far["checked"] and far["warnings"] == []
    assert len(bench_breakdown.hot_shares(b(0.95, 0.80), 0.85)["warnings"]) == 1
    # the gap is taken against the prefills after tool outputs when there are some
    assert bench_breakdown.hot_shares(b(0.84, 0.84, after=0.90), 0.44)["warnings"][0].startswith(
        "ostinato: decode hot-route share 0.840 is 6.0 points below the prefill after tool")
    assert bench_breakdown.hot_shares(None, 0.45)["warnings"] == []


def test_written_narrow_cut_has_the_representative_keys(tmp_path):
    """The writer lays out the cut it plans: a narrow 4-layer DeepSeek-V4-Flash file has 1 hash layer
    and ratios 0, 4, 128, 4 in its keys, and the bench's check passes it."""
    from ostinatod.bench import bench_prepare
    from ostinatod.residency.gguf_header import read_header
    from ostinatod.synth.writer import planned_bytes, write_synthetic_moe

    p = write_synthetic_moe(tmp_path / "v4n.gguf", arch="deepseek4", shape="deepseek-v4-flash", n_layer=4,
                            narrow=True)
    kv = read_header(p).kv
    assert kv["deepseek4.hash_layer_count"] == 1 and list(kv["deepseek4.attention.compress_ratios"]) == [0, 4, 128, 4]
    assert kv["ostinato.synth.narrow"] and kv["deepseek4.embedding_length"] == 256
    assert mix.check_file_mix(kv)["problems"] == []
    assert bench_prepare.layer_mix(p, type("A", (), {"no_mix_check": False})())["layers"] == 4
    assert 0 < planned_bytes("deepseek4", "deepseek-v4-flash", "q8_0", 4, narrow=True) < p.stat().st_size
