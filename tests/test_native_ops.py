"""Op-level tests of the negative-expert-id capability (native/patches/10-ggml-negative-expert-ids.patch
on the CPU, 21-ggml-cuda-negative-expert-ids.patch on a GPU backend) and of the GPU backend's 2D copy
(22-ggml-cuda-set-2d-async.patch, last test),
in the style of llama.cpp's test-backend-ops: ``ostinato_optest_negative_ids`` in libostinato builds
ggml graphs of mul_mat_id and add_id with some ids set to -1 (F32, Q8_0 and Q4_0 experts; 1 and 2
threads; one token, several tokens, every route skipped, none skipped) and compares them with the
same ops on valid ids: skipped rows must be exact (+)zeros without bias, every other row bitwise
unchanged."""

from __future__ import annotations

import ctypes
import json

import pytest

pytest.importorskip("llama_cpp")


def test_negative_expert_ids_skip_rows_and_leave_the_rest_bitwise_unchanged():
    from ostinatod.engine import native
    if not native.has("ostinato_optest_negative_ids"):
        pytest.fail("libostinato lacks ostinato_optest_negative_ids: run 'ostinato build'")
    native.declare("ostinato_optest_negative_ids", [], ctypes.c_char_p)
    report = json.loads(native.fn("ostinato_optest_negative_ids")().decode())
    bad = [c for c in report["cases"] if not c["ok"]]
    assert len(report["cases"]) == 24
    assert report["ok"] and not bad, bad
    assert any(c["skipped"] == 2 * c["tokens"] for c in report["cases"])   # a pass with no route left


@pytest.mark.parametrize("device", ["CPU", None])
def test_marked_mul_mat_id_skips_negative_ids_on_a_backend(device):
    """Patch 21 through the backend API: a mul_mat_id marked in op_params[15] with more than 8 tokens
    (the GPU's MMQ kernel) and every second or third id -1, Q4_0/Q8_0/Q4_K experts: skipped rows exact
    +0 without bias, the others equal to the unmarked op on valid ids. device None: the first GPU
    (skipped where there is none; on the GPU machine it runs the CUDA kernels); "CPU": the same test
    on the CPU backend, where patch 10 gives these semantics."""
    from ostinatod.engine import native
    if not native.has("ostinato_optest_negative_ids_backend"):
        pytest.fail("libostinato lacks ostinato_optest_negative_ids_backend: run 'ostinato build'")
    native.declare("ostinato_optest_negative_ids_backend", [ctypes.c_char_p], ctypes.c_char_p)
    arg = device.encode() if device else None
    report = json.loads(native.fn("ostinato_optest_negative_ids_backend")(arg).decode())
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
    from ostinatod.engine import native
    if not native.has("ostinato_optest_set_2d"):
        pytest.fail("libostinato lacks ostinato_optest_set_2d: run 'ostinato build'")
    native.declare("ostinato_optest_set_2d", [], ctypes.c_char_p)
    report = json.loads(native.fn("ostinato_optest_set_2d")().decode())
    if report["backend"] is None:
        assert not report["offered"]
        pytest.skip("no GPU backend in this build")
    assert report["offered"], f"{report['backend']}: the GPU backend offers no 2D copy (patch 22 missing)"
    print(f"\n[optest] {report['backend']}: 2D copy, {len(report['cases'])} cases")
    assert report["ok"] and report["refusals_ok"], report
    assert len(report["cases"]) == 4 and all(c["queued"] and c["bytes_as_expected"] for c in report["cases"])
