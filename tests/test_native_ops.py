"""Op-level test of the negative-expert-id capability (native/patches/10-ggml-negative-expert-ids.patch),
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
