"""EngineOptions: its C form generated from its fields, and its resolution from the settings."""

from __future__ import annotations

import ctypes

import pytest
from pydantic import ValidationError

from ostinatod.engine.options import (EngineOptions, EngineOptionsC, c_struct, from_c, resolve_options,
                                      split_fields)
from ostinatod.hardware import default_threads
from ostinatod.settings import EngineSettings, EngineTuning, Settings


def test_the_c_struct_is_generated_from_the_fields_in_order():
    names = [n for n, _ in EngineOptionsC._fields_]
    assert names == list(EngineOptions.model_fields)
    # the user's fields first, as the native struct lists them
    assert names[:len(EngineTuning.model_fields)] == list(EngineTuning.model_fields)
    kinds = dict(EngineOptionsC._fields_)
    assert kinds["prefill_threshold"] is ctypes.c_int64 and kinds["upload_cpu_share"] is ctypes.c_double
    assert kinds["decode_borrow"] is ctypes.c_int32 and kinds["decode_graph"] is ctypes.c_int32


def test_c_form_round_trips_every_kind_of_field():
    o = EngineOptions(decode_borrow=False, upload_cpu_share=-1, cpu_branch_row_pairs="avx512", force_path="upload",
                      decode_graph=None, prefill_threshold=1 << 40, cpu_threads=7,
                      **split_fields({"alpha_us": 2.0, "cpu_gbps": 3.0, "h2d_gbps": 4.0}))
    st = c_struct(o)
    assert (st.decode_borrow, st.cpu_branch_row_pairs, st.force_path, st.decode_graph) == (0, 2, 2, -1)
    assert from_c(st) == o
    assert from_c(c_struct(o.with_(decode_graph=False))).decode_graph is False
    assert o.cpu_split == {"alpha_us": 2.0, "cpu_gbps": 3.0, "h2d_gbps": 4.0}


def test_options_are_immutable_and_validated():
    o = EngineOptions()
    with pytest.raises(ValidationError):
        o.decode_borrow = False
    for bad in ({"prefetch_depth": 3}, {"decode_prefetch_experts": 17}, {"upload_cpu_share": 0.5 + 1},
                {"cpu_branch_row_pairs": "sse"}, {"cpu_split_cpu_gbps": 1.0}, {"hybrid_rows": 0}):
        with pytest.raises(ValueError):
            o.with_(**bad)
    assert o.with_(decode_borrow=False).decode_borrow is False and o.decode_borrow is True


def test_resolution_takes_the_engine_table_and_defaults(tmp_path, monkeypatch):
    # no calibration stored: Np 512 ("default"), overlap on, the graph auto; on a CPU pool the
    # context keeps its cores and the graph's pool takes all but one, no CPU split
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    s = Settings()
    res = resolve_options(s, {"fingerprint": "fp"}, None, gpu_pool=False)
    o = res.options
    assert all(getattr(o, n) == getattr(s.engine, n) for n in EngineTuning.model_fields)
    assert (o.prefill_threshold, res.np_source, o.decode_overlap, o.decode_graph) == (512, "default", True, None)
    assert (res.batch_threads, o.cpu_threads) == (None, max(1, default_threads(None) - 1))
    assert (o.prefetch_depth, res.prefetch_requested) == (2, 2)
    assert (o.cpu_split, res.cpu_split_source) == (None, "no GPU pool")
    s = Settings(prefill_threshold=96, n_threads=3,
                 engine=EngineSettings(decode_overlap=False, decode_threads=2, decode_graph=False,
                                       prefill_prefetch=False, upload_cpu_share=0.5, decode_borrow=False))
    res = resolve_options(s, {"fingerprint": "fp"}, None, gpu_pool=True)
    o = res.options
    assert (o.prefill_threshold, res.np_source, o.decode_overlap, o.decode_graph) == (96, "settings", False, False)
    assert (res.decode_threads, o.cpu_threads, res.batch_threads) == (2, 2, None)   # the graph is off
    assert (o.prefetch_depth, o.upload_cpu_share, o.decode_borrow) == (0, 0.5, False)
    assert res.cpu_split_source == "upload_cpu_share"


def test_the_native_header_lists_the_same_fields_in_the_same_order_and_types():
    """The C struct in native/include/ostinato.h against the generated ctypes Structure, by name,
    order and type: a field missing on one side, out of order or of another width would otherwise
    pass unnoticed where it lands in padding (the size check of native.library_options sees only
    the size)."""
    import re
    from pathlib import Path

    header = (Path(__file__).resolve().parents[2] / "native" / "include" / "ostinato.h").read_text()
    body = header[header.index("struct ostinato_engine_options {"):]
    body = body[:body.index("\n};")]
    c_types = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "double": ctypes.c_double}
    native = [(m.group(2), c_types[m.group(1)])
              for m in re.finditer(r"^\s*(int32_t|int64_t|double)\s+(\w+)\s*=", body, re.M)]
    assert native == list(EngineOptionsC._fields_)
