"""Routing traces: accumulation, file format, atomic merge from several processes, bad input."""

from __future__ import annotations

import json
import multiprocessing as mp

import numpy as np
import pytest

from ostinatod.residency.traces import (Trace, TraceError, TraceRecorder, counts_from_stats,
                                     load_traces, merge_into_file, trace_path)

MODEL = {"fingerprint": "ab" * 32, "name": "t", "arch": "qwen3moe", "n_layer": 3, "n_expert": 4,
         "n_expert_used": 2}


def _stats(seed):
    rng = np.random.default_rng(seed)
    return {"counts_prefill": rng.integers(0, 50, (3, 4)).tolist(),
            "counts_decode": rng.integers(0, 5, (3, 4)).tolist()}


def test_recorder_accumulates_into_the_shared_format(tmp_path):
    rec = TraceRecorder(MODEL, data_dir=tmp_path, flush_interval_s=0)
    rec.record("coding", _stats(1), prompt_tokens=900, new_tokens=900, generated_tokens=20, n_tools=3)
    rec.record("coding", _stats(2), prompt_tokens=1000, new_tokens=100, generated_tokens=50, n_tools=3)
    rec.record("service", _stats(3), prompt_tokens=10, new_tokens=10, generated_tokens=5)
    rec.close()
    path = trace_path(MODEL["fingerprint"], "coding", tmp_path)
    assert path == tmp_path / "traces" / MODEL["fingerprint"] / "coding.json"
    data = json.loads(path.read_text())
    assert data["format"] == "ostinato-trace/1" and data["workload"] == "coding"
    assert data["model"] == MODEL
    want_p = np.add(_stats(1)["counts_prefill"], _stats(2)["counts_prefill"])
    assert np.array_equal(data["counts_prefill"], want_p)
    assert np.array_equal(data["counts_decode"],
                          np.add(_stats(1)["counts_decode"], _stats(2)["counts_decode"]))
    assert data["max_request_tokens"] == 1050
    assert data["requests"][1] == {"prompt_tokens": 1000, "new_tokens": 100,
                                   "generated_tokens": 50, "n_tools": 3}
    # A second recorder (a later daemon run) adds to the same file.
    rec2 = TraceRecorder(MODEL, data_dir=tmp_path, flush_interval_s=3600)
    rec2.record("coding", _stats(1), prompt_tokens=5, new_tokens=5, generated_tokens=1)
    assert np.array_equal(json.loads(path.read_text())["counts_prefill"], want_p)  # not yet flushed
    rec2.close()
    t = Trace.load(path)
    assert np.array_equal(t.counts_prefill, want_p + np.array(_stats(1)["counts_prefill"]))
    assert len(t.requests) == 3 and not list(path.parent.glob("*.tmp"))


def test_counts_from_stats_accepts_the_engine_shapes():
    nested = _stats(4)
    a, b = counts_from_stats(nested, 3, 4)
    flat = {"counts": {"prefill": np.ravel(nested["counts_prefill"]).tolist(),
                       "decode": nested["counts_decode"]}}
    a2, b2 = counts_from_stats(flat, 3, 4)
    assert np.array_equal(a, a2) and np.array_equal(b, b2)
    sparse = {"counts_prefill": {"1": {"2": 7}}, "counts_decode": [[0, 3, 5], [2, 0, 1]]}
    a3, b3 = counts_from_stats(sparse, 3, 4)
    assert a3[1, 2] == 7 and a3.sum() == 7 and b3[0, 3] == 5 and b3[2, 0] == 1 and b3.sum() == 6
    z1, z2 = counts_from_stats({}, 3, 4)
    assert z1.sum() == 0 and z2.sum() == 0
    with pytest.raises(TraceError):
        counts_from_stats({"counts_prefill": [[1, 2]]}, 3, 4)


def test_bad_stats_are_logged_not_raised_and_lose_nothing(tmp_path, caplog):
    rec = TraceRecorder(MODEL, data_dir=tmp_path, flush_interval_s=0)
    rec.record("coding", {"counts_prefill": [[1]]}, prompt_tokens=1)
    assert "not recorded" in caplog.text
    rec.record("coding", _stats(5), prompt_tokens=3, generated_tokens=2)
    t = Trace.load(trace_path(MODEL["fingerprint"], "coding", tmp_path))
    assert np.array_equal(t.counts_prefill, _stats(5)["counts_prefill"])


def test_corrupt_or_foreign_files(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    with pytest.raises(TraceError, match="not JSON"):
        Trace.load(p)
    delta = Trace.empty(MODEL, "coding")
    delta.add_counts(np.ones((3, 4)), None)
    merged = merge_into_file(p, delta)  # corrupt file moved aside, counts kept
    assert merged.counts.sum() == 12 and p.with_suffix(".corrupt").exists()
    other = dict(MODEL, fingerprint="cd" * 32)
    with pytest.raises(TraceError, match="cannot be merged"):
        merge_into_file(p, Trace.empty(other, "coding"))
    with pytest.raises(TraceError, match="trace is for model abab.*not efef"):
        load_traces([p], fingerprint="ef" * 32)
    with pytest.raises(TraceError, match="workload"):
        trace_path("x", "../evil")


def _worker(args):
    path, seed = args
    for i in range(20):
        d = Trace.empty(MODEL, "coding")
        d.add_counts(np.full((3, 4), 1), None)
        merge_into_file(path, d)


def test_concurrent_writers_lose_no_counts(tmp_path):
    path = tmp_path / "c.json"
    ctx = mp.get_context("fork")
    with ctx.Pool(2) as pool:
        pool.map(_worker, [(path, 0), (path, 1)])
    assert Trace.load(path).counts_prefill.sum() == 2 * 20 * 12


def test_record_done_event(tmp_path):
    rec = TraceRecorder(MODEL, data_dir=tmp_path, flush_interval_s=0)
    done = {"usage": {"prompt_tokens": 40, "prefilled_tokens": 30, "completion_tokens": 7},
            "experts": {"active": True, **_stats(9)}}
    rec.record_done("service", done, n_tools=2)
    rec.record_done("service", {"usage": {}, "experts": {"active": False}})  # stock run: skipped
    rec.record_done("service", {"usage": {}})
    t = Trace.load(trace_path(MODEL["fingerprint"], "service", tmp_path))
    assert t.requests == [{"prompt_tokens": 40, "new_tokens": 30, "generated_tokens": 7, "n_tools": 2}]
    assert np.array_equal(t.counts_decode, _stats(9)["counts_decode"])
