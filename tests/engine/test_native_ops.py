"""Op-level tests of the negative-expert-id capability (native/patches/10-ggml-negative-expert-ids.patch
on the CPU, 21-ggml-cuda-negative-expert-ids.patch on a GPU backend) and of the GPU backend's 2D copy
(22-ggml-cuda-set-2d-async.patch, last test),
in the style of llama.cpp's test-backend-ops: ``ostinato_optest_negative_ids`` in the test library
libostinato_optest (native/tests/op_tests.cpp, not exported by the product libraries) builds
ggml graphs of mul_mat_id and add_id with some ids set to -1 (F32, Q8_0 and Q4_0 experts; 1 and 2
threads; one token, several tokens, every route skipped, none skipped) and compares them with the
same ops on valid ids: skipped rows must be exact (+)zeros without bias, every other row bitwise
unchanged."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")


def _optest(name: str, argtypes: tuple = ()):
    """The op test ``name`` of libostinato_optest, returning its JSON report as bytes."""
    from ostinatod.engine import native
    f = getattr(native.side_lib("ostinato_optest"), name, None)
    if f is None:
        pytest.fail(f"libostinato_optest lacks {name}: run 'ostinato build'")
    f.argtypes, f.restype = list(argtypes), ctypes.c_char_p
    return f


def test_op_tests_and_the_cpu_branch_bench_are_not_in_the_product_libraries():
    """The op tests and the CPU-branch benchmark are libraries of their own, installed beside the
    product's (libostinato: chat shim and sampler; libllama: the expert engine), which export
    neither."""
    from llama_cpp import llama_cpp as _ll
    from ostinatod.engine import native
    assert native.has("ostinato_chat_init") and not native.has("ostinato_optest_negative_ids")
    assert hasattr(_ll._lib, "ostinato_experts_check") and not hasattr(_ll._lib, "ostinato_cpu_branch_bench")
    assert hasattr(native.side_lib("ostinato_cpubench"), "ostinato_cpu_branch_bench")
    assert hasattr(native.side_lib("ostinato_optest"), "ostinato_optest_negative_ids")


def test_negative_expert_ids_skip_rows_and_leave_the_rest_bitwise_unchanged():
    report = json.loads(_optest("ostinato_optest_negative_ids")().decode())
    bad = [c for c in report["cases"] if not c["ok"]]
    assert len(report["cases"]) == 24
    assert report["ok"] and not bad, bad
    assert any(c["skipped"] == 2 * c["tokens"] for c in report["cases"])   # a pass with no route left


def test_prediction_score_ranks_experts_as_the_selection_does():
    """Decode prefetch's score (native/src/decode_graph/decode_ops.h, ``ostinato_pred_score``) against the
    selection graph llama.cpp's build_moe_ffn builds: for the logit alone, sigmoid and sqrt(softplus)
    gating, with and without a router bias and a selection bias, each token's top k of the scores is
    the selection's top k on the same logits (docs/engine.md, "Decode prefetch", scores)."""
    report = json.loads(_optest("ostinato_optest_pred_score")().decode())
    assert len(report["cases"]) == 10   # 3 gatings x router bias x selection bias, less softmax's biased 2
    assert {c["gating"] for c in report["cases"]} == {0, 1, 2}
    assert report["ok"] and all(c["mismatches"] == 0 for c in report["cases"]), report


@pytest.mark.parametrize("device", ["CPU", None])
def test_marked_mul_mat_id_skips_negative_ids_on_a_backend(device):
    """Patch 21 through the backend API: a mul_mat_id marked in op_params[15] with more than 8 tokens
    (the GPU's MMQ kernel) and every second or third id -1, Q4_0/Q8_0/Q4_K experts: skipped rows exact
    +0 without bias, the others equal to the unmarked op on valid ids. device None: the first GPU
    (skipped where there is none; on the GPU machine it runs the CUDA kernels); "CPU": the same test
    on the CPU backend, where patch 10 gives these semantics."""
    arg = device.encode() if device else None
    report = json.loads(_optest("ostinato_optest_negative_ids_backend", (ctypes.c_char_p,))(arg).decode())
    if report["backend"] is None:
        pytest.skip("no GPU backend in this build")
    bad = [c for c in report["cases"] if not c["ok"]]
    print(f"\n[optest] {report['backend']}: {len(report['cases'])} cases, {len(bad)} bad")
    assert len(report["cases"]) == 9 and report["ok"] and not bad, bad
    assert any(c["skipped"] > 0 for c in report["cases"])


def test_gpu_backend_2d_copy_moves_rows_at_two_pitches_and_refuses_the_rest():
    """Patch 22: the GPU backend registry offers "ggml_backend_set_2d_async", which copies rows of
    host memory at one pitch into device memory at another on the backend's stream (the upload
    path's one copy per expert): the device bytes equal the rows placed by hand, the bytes between
    rows unchanged; the CPU backend, a pitch below the width and one above the device's maximum pitch
    (2^31 bytes: the driver would split such a copy into rows) are refused with nothing written.
    Skipped in a build without a GPU backend (the CPU build offers no 2D copy)."""
    report = json.loads(_optest("ostinato_optest_set_2d")().decode())
    if report["backend"] is None:
        assert not report["offered"]
        pytest.skip("no GPU backend in this build")
    assert report["offered"], f"{report['backend']}: the GPU backend offers no 2D copy (patch 22 missing)"
    print(f"\n[optest] {report['backend']}: 2D copy, {len(report['cases'])} cases")
    assert report["ok"] and report["refusals_ok"], report
    assert len(report["cases"]) == 4 and all(c["queued"] and c["bytes_as_expected"] for c in report["cases"])


@pytest.mark.parametrize("arch,shape,quant,merged,limit", [
    ("qwen3moe", "tiny", "q8_0", False, 0.0),
    ("qwen3moe", "tiny", "q4_0", False, 0.0),
    ("qwen3moe", "tiny", "q4_0", False, 0.5),
    ("qwen35moe", "ci", "q4_0", True, 0.0),
    ("qwen3moe", "ci", "q4_k_m", False, 0.0),
    ("qwen35moe", "ci", "ud-q4_k_xl", True, 0.0),
    ("qwen35moe", "ci", "ud-q4_k_xl", True, 0.5),
    ("deepseek4", "ci", "mxfp4", False, 0.5),
])
def test_cpu_branch_kernel_is_bitwise_llama_cpps_mul_mat_id(tmp_path, arch, shape, quant, merged, limit):
    """The CPU branch's own kernel (native/src/cpu_branch/kernel.cpp, with ggml-cpu's SwiGLU row
    kernel exported by native/patches/23) on a model's expert tensors: for 1-8 experts, 1, 3 and 16
    tokens and 1-3 threads, its output rows are bitwise those of llama.cpp's CPU graph (up and gate
    mul_mat_id, swiglu, down mul_mat_id) on the same inputs; separate and merged gate_up tensors,
    Q8_0, Q4_0 and K-quant mixes; with ggml-cpu's vec_dot row by row and with the row-pair dot
    products (native/src/cpu_branch/dot.h, modes AVX2 and AVX-512; a CPU without AVX-512 runs AVX2 for
    both). With ``limit`` the activation is ggml's clamped SwiGLU (deepseek4's experts), at a limit
    that clamps part of the activation's inputs. An expert with 8 or more routes of a type that
    ggml-cpu computes with its tiled kernel is computed as that kernel computes it
    (native/src/cpu_branch/gemm.h: AMX or AVX-512 VNNI) and is bitwise too; on a CPU without AVX-512
    VNNI such rows are left to ggml (kernel false); every other row ran the kernel."""
    from ostinatod.engine import native
    from ostinatod.synth.writer import write_synthetic_moe
    from ostinatod.bench.bench_cpu import _load

    path = write_synthetic_moe(tmp_path / "m.gguf", arch=arch, shape=shape, n_layer=2, quant=quant,
                               merged_gate_up=merged)
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    avx2, avx512 = "avx2" in flags, {"avx512f", "avx512bw", "avx512vl"} <= flags
    modes = [0, 1, 2] if avx512 else [0, 1]   # without AVX-512, mode 2 runs mode 1's AVX2
    import llama_cpp
    model = _load(path)
    try:
        res = native.cpu_branch_bench(model, {"experts": [1, 2, 8], "tokens": [1, 3, 16], "row_pairs": modes,
                                              "threads": [1, 3], "reps": 1, "read_bw_bytes": 1 << 20, "flush_bytes": 1 << 20,
                                              "swiglu_limit": limit})
        with pytest.raises(native.ExpertEngineError, match="no routed experts"):
            native.cpu_branch_bench(model, {"layer": 99})
    finally:
        llama_cpp.llama_model_free(model)
    assert res["merged_gate_up"] is merged
    rows = res["rows"]
    assert len(rows) == 3 * 3 * 2 * len(modes) and all(r["matched"] for r in rows)
    for r in rows:   # the mode's instruction set, or the next lower one this CPU has
        want = {0: "off", 1: "avx2" if avx2 else "off",
                2: "avx512" if avx2 and avx512 else "avx2" if avx2 else "off"}[r["row_pairs"]]
        assert r["row_pairs_isa"] == want, r
        if want != "off":   # every type the row pairs know passed the first-use check
            assert {"q4_0", "q8_0", "q4_K", "q5_K", "q6_K"} <= set(r["row_pairs_types"].split(",")), r
    tiled = res["type_up"].startswith(("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq")) or \
        res["type_down"].startswith(("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq"))
    gemm = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags   # cpu_branch/gemm.h serves
    for r in rows:
        most = -(-r["routes"] // r["experts"])   # routes of the busiest expert
        if tiled and most >= 8 and not gemm:
            assert r["kernel"] is False, r
        else:
            assert r["kernel"] is True and r["bitwise_equal"] is True and r["max_abs_diff"] == 0.0, r
            assert (r["tiled_experts"] > 0) == (tiled and most >= 8), r
            assert r["bytes"] == r["experts"] * res["expert_bytes"]
            if limit:   # the clamp changed part of the activation's inputs, not all or none of them
                assert 0.05 < r["swiglu_clamped_share"] < 0.95, r
    assert [b["threads"] for b in res["read_bw"]] == [1, 3] and all(b["gbps"] > 0 for b in res["read_bw"])


def test_cpu_branch_mxfp4_rows_are_bitwise_ggml_vec_dot_for_every_token_count():
    """The CPU branch's MXFP4 rows x many tokens (native/src/cpu_branch/mxfp4.h: each weight block
    decoded once for all of an expert's tokens, AVX-512 VNNI) against ggml-cpu's own
    ggml_vec_dot_mxfp4_q8_0 per (row, token): block counts 1, 2, 3, 5, 8 and 65 (the odd ones end in
    ggml's scalar tail, with products large enough that a fused and an unfused tail differ), 1-17
    rows (a lone last row), 1-40 tokens (every remainder of the kernel's tiles of 8), rows at a padded
    stride, nothing written past the outputs. Skipped where the kernel is not served (a CPU without
    AVX-512 VNNI keeps vec_dot)."""
    report = json.loads(_optest("ostinato_optest_mxfp4_rows")().decode())
    if not report["served"]:
        flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
        assert not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c"} <= flags, \
            f"AVX-512 VNNI here, yet the MXFP4 rows failed their first-use check: {report}"
        pytest.skip("MXFP4 rows not served on this CPU")
    print(f"\n[optest] mxfp4 rows: {report['cases']} cases, tail {report['tail']}")
    assert report["ok"] and report["mismatches"] == 0 and report["cases"] == 6 * 5 * 40, report
