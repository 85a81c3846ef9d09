"""The GPU timeline's summary (ostinatod/bench/timeline_trace.py) on hand-made chrome traces in
Kineto's format: phases by annotation, attribution by correlation id, busy time, compute-stream
gaps, memcpy, kernel names, the per-layer marker heuristic and its failure note; the markdown page."""

from __future__ import annotations

import pytest

from ostinatod.bench import timeline_md
from ostinatod.bench.timeline_trace import per_layer, phase_summary, short_name, split_by_phase, summarize_trace


def _k(name, ts, dur, stream=7, corr=None):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"stream": stream, **({"correlation": corr} if corr is not None else {})}}


def _call(ts, corr, name="cudaLaunchKernel"):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": corr}}


def _phase(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"timeline:{name}", "ts": ts, "dur": dur}


NORM = "void rms_norm_f32<1024, true, false>(float const*, float*, int)"
MM = "void mul_mat_q<(ggml_type)12, 64, false>(char const*, int const*, float*, int)"


def test_short_names():
    assert short_name(NORM) == "rms_norm_f32<1024,true,false>"
    assert short_name(MM) == "mul_mat_q<12,64,false>"
    assert short_name("sm90_xmma_gemm_f16f16") == "sm90_xmma_gemm_f16f16"
    assert len(short_name("k" * 200)) == 72


def test_phase_summary_busy_gaps_memcpy_and_kernels():
    evs = [_k(NORM, 110, 10), _k(MM, 120, 30), _k(MM, 170, 20),      # a 20 us gap at 150-170
           _k("void k_copy(int)", 130, 5, stream=9),
           {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 200, "dur": 10,
            "args": {"stream": 9, "bytes": 1_000_000}}]
    s = phase_summary((100.0, 220.0), evs)
    assert s["kernels"] == 4 and s["kernel_us"] == 65
    assert s["gpu_busy_us"] == 70   # 110-150, 170-190, 200-210
    cs = s["compute_stream"]
    assert cs["stream"] == "7" and cs["busy_us"] == 60 and cs["span_us"] == 80 and cs["idle_us"] == 20
    assert cs["gaps"] == 1 and cs["lead_in_us"] == 10 and cs["tail_us"] == 30
    assert cs["largest_gaps"][0] == {"us": 20, "at_us": 50, "after": "mul_mat_q<12,64,false>",
                                     "before": "mul_mat_q<12,64,false>"}
    assert s["memcpy"]["H2D"] == {"count": 1, "bytes": 1_000_000, "us": 10}
    assert s["by_kernel"]["mul_mat_q<12,64,false>"] == {"count": 2, "us": 50}


def test_kernels_go_to_the_phase_of_their_launch_call():
    # the prefill's last kernel runs after its range (no sync in a hand-made trace): its launch call
    # in the range decides; a kernel without a recorded call goes by its own start
    trace = {"traceEvents": [_phase("prefill", 0, 100), _phase("decode:0", 200, 50),
                             _call(90, 1), _k(MM, 150, 10, corr=1), _k(MM, 210, 5), _k(MM, 400, 5)]}
    ranges, per, outside = split_by_phase(trace)
    assert set(ranges) == {"prefill", "decode:0"}
    assert [e["ts"] for e in per["prefill"]] == [150] and [e["ts"] for e in per["decode:0"]] == [210]
    assert outside == 1


def _layers_trace(n_layer, m, out_norm, t0=0.0, ts_step=10.0):
    """One pass: get_rows, then per layer m norms each followed by a matmul, then the output norm."""
    evs, t = [_k("void k_get_rows(int)", t0, 2)], t0 + 5
    for _ in range(n_layer):
        for _ in range(m):
            evs += [_k(NORM, t, 1), _k(MM, t + 2, 5)]
            t += ts_step
    if out_norm:
        evs += [_k(NORM, t, 1), _k("void lm_head(int)", t + 2, 4)]
    return evs


@pytest.mark.parametrize("m,out_norm", [(1, False), (2, True)])
def test_per_layer_by_the_marker(m, out_norm):
    evs = _layers_trace(3, m, out_norm)
    r = per_layer(evs, 3)
    assert r["marker"] == "rms_norm_f32<1024,true,false>" and r["per_layer_marker_count"] == m
    assert [x["kernels"] for x in r["layers"]] == [2 * m] * 3
    assert [x["kernel_us"] for x in r["layers"]] == [6.0 * m] * 3
    assert r["pre_us"] == 2 and r["post_us"] == (5 if out_norm else 0)


def test_per_layer_over_two_passes_and_its_failure_note():
    evs = _layers_trace(2, 1, True) + _layers_trace(2, 1, True, t0=1000)
    r = per_layer(evs, 2, passes=2)
    # the second pass's inputs run after the first's output norm: counted in post_us
    assert [x["kernels"] for x in r["layers"]] == [4, 4] and r["pre_us"] == 2 and r["post_us"] == 12
    bad = per_layer(_layers_trace(3, 1, False)[:-2], 3)   # a layer's norm missing
    assert bad["layers"] is None and "counts" in bad["note"]


def test_summarize_trace_and_page():
    evs = [_phase("context", 0, 100), _phase("prefill", 1000, 500)]
    evs += _layers_trace(2, 1, True, t0=1010)
    for i in range(3):
        evs += [_phase(f"decode:{i}", 2000 + 100 * i, 80)] + _layers_trace(2, 1, True, t0=2005 + 100 * i)
    s = summarize_trace({"traceEvents": evs}, n_layer=2, prefill_passes=1)
    assert s["prefill"]["kernels"] == 7 and s["prefill"]["per_layer"]["layers"][1]["kernels"] == 2
    assert len(s["decode_steps"]) == 3 and s["decode"]["steps"] == 2 and s["decode"]["first_step_skipped"]
    assert s["decode"]["by_kernel"]["mul_mat_q<12,64,false>"]["count"] == 2
    assert s["decode"]["per_layer"]["layers"][0]["kernel_us"] == 6 and s["notes"] == []
    eng = {"wall": {"load_s": 1, "context_ms": 1.0, "prefill_ms": 2.0, "decode_ms": [1.0, 0.5]},
           "ubatch": {"ubatch": 512}, "prefill_passes": 1, "native": None, "timeline": s, "notes": []}
    page = timeline_md.markdown({"model": "m.gguf", "context_tokens": 1, "prompt_tokens": 2, "decode_steps": 2,
                                 "engines": {"ostinato": eng, "stock-all-gpu": dict(eng)}, "notes": []})
    assert "## The prefill pass (us)" in page and "| `mul_mat_q<12,64,false>` |" in page
    assert "Per layer, decode" in page and "| decode ms/step (after the first) | 0.50 | 0.50 |" in page
    empty = summarize_trace({"traceEvents": [_phase("prefill", 0, 10), _phase("decode:0", 20, 5)]}, 2, 1)
    assert any("CUDA graphs" in n for n in empty["notes"]) and any("prefill range" in n for n in empty["notes"])
