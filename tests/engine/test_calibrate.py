"""Calibration math (paper Sec. 3.2-3.3, Prop. 3.2, App. B) on synthetic measurements, and the
profile read-modify-write."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ostinatod.engine import calibrate as cal
from ostinatod.residency import calibration, cost
from ostinatod.residency.cost import PrefillPoint


def _decode_rows(g0=0.12, a=0.14, b=0.184, L=24, k=8, steps=200, seed=0, noise=0.01):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(steps):
        p_cold = rng.uniform(0.05, 0.6)
        r = rng.binomial(k, p_cold, size=L)
        ms = cost.cpu_branch_cost(r, g0, a, b).sum() + rng.normal(0, noise)
        rows.append((int((r == 0).sum()), int((r > 0).sum()), int(r.sum()), float(ms)))
    return rows


def test_fit_cpu_branch_recovers_the_paper_constants():
    f = cost.fit_cpu_branch(_decode_rows())
    assert f["gamma0_ms"] == pytest.approx(0.12, abs=0.005)
    assert f["alpha_ms"] == pytest.approx(0.14, abs=0.005)
    assert f["beta_ms"] == pytest.approx(0.184, abs=0.002)
    assert f["samples"] == 200 and f["rmse_ms"] < 0.05


def test_fit_cpu_branch_drops_disturbed_steps():
    rows = _decode_rows(steps=100, noise=0.002)
    for i in range(0, 100, 10):  # 10% of the steps hit by other work on the machine
        n0, n1, r, ms = rows[i]
        rows[i] = (n0, n1, r, ms + 25.0)
    f = cost.fit_cpu_branch(rows)
    assert f["outliers_dropped"] >= 10
    assert f["beta_ms"] == pytest.approx(0.184, abs=0.003)
    assert f["alpha_ms"] == pytest.approx(0.14, abs=0.01)


def test_fit_cpu_branch_per_layer_samples_and_missing_terms():
    rows = [(0, 1, r, 0.2 + 0.1 * r) for r in (1, 2, 3, 4)]  # no r = 0 layer: gamma0 unknown
    f = cost.fit_cpu_branch(rows)
    assert f["gamma0_ms"] is None
    assert f["alpha_ms"] == pytest.approx(0.2) and f["beta_ms"] == pytest.approx(0.1)
    with pytest.raises(cost.CalibrationError):
        cost.fit_cpu_branch([(1, 0, 0, 0.1), (1, 0, 0, 0.1)])
    with pytest.raises(cost.CalibrationError):
        cost.fit_cpu_branch([(1, 0, 0, 0.1)])


def _prefill_points(ph0=-5.0, c_s=0.2, c_u=0.02, a_u=6.0, up_ms=0.5, n_cold=400, p=0.01):
    pts = []
    for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
        u = n_cold * (1 - (1 - p) ** n)  # concave ū(n), bounded by the cold experts (Lemma B.3)
        pts.append(PrefillPoint(n, "split", a_u + ph0 + c_s * n, u, n * 2.0))
        pts.append(PrefillPoint(n, "upload", a_u + c_u * n + up_ms * u, u, n * 2.0))
    return pts


def test_np_is_the_single_switch_point_of_prop_3_2():
    pts = _prefill_points()
    fit = cost.fit_prefill_paths(pts)
    assert fit["phi0_ms"] == pytest.approx(-5.0, abs=1e-6)
    assert fit["phi1_ms_per_token"] == pytest.approx(0.18, abs=1e-6)
    assert fit["phi2_ms_per_expert"] == pytest.approx(0.5, abs=1e-6)
    ns, us = cost.ubar_curve([p for p in pts if p.path == "upload"])
    np_ = cost.switch_point(fit["phi0_ms"], fit["phi1_ms_per_token"], fit["phi2_ms_per_expert"], ns, us)
    # Brute force on the true cost curves: upload cheaper exactly from np_ on (one switch).
    n = np.arange(1, 4096)
    u = np.interp(n, ns, us)
    phi = -5.0 + 0.18 * n - 0.5 * u
    assert phi[np_ - 1] >= 0 > phi[np_ - 2]
    assert (phi[np_ - 1:] >= 0).all()
    crossing = cost.measured_crossing(pts)
    assert crossing is not None and crossing >= np_ / 2


def test_np_is_the_measured_crossing_when_the_linear_model_misleads():
    # median costs measured on the H200 (16-layer Qwen3-30B-A3B-shape model, pageable host experts):
    # the split path is cheaper up to 64 tokens, the upload path from 128 on; a straight line through
    # the split points has a large intercept, so the cost model alone would put Np at 1
    med = {16: (31.7, 73.8), 64: (97.8, 120.5), 128: (167.6, 145.4), 256: (315.0, 165.3),
           512: (612.1, 220.2), 1024: (1256.9, 274.3), 2048: (2451.6, 361.7)}
    ubar = {16: 197, 64: 314, 128: 373, 256: 415, 512: 438, 1024: 461, 2048: 471}
    pts = [PrefillPoint(n, path, ms, ubar[n], 0) for n, (s_, u) in med.items()
           for path, ms in (("split", s_), ("upload", u))]
    # split - upload: -22.7 at 64, +22.2 at 128 -> zero at 64 + 64 * 22.7 / 44.9 = 96.4
    assert cost.measured_switch_point(pts) == 97
    c = cost.solve_calibration(_decode_rows(steps=50), [0.06] * 8, pts, gpu=True)
    assert c["np_tokens"] == 97 and c["np_measured_crossing"] == 128
    assert c["np_model"] is not None and c["np_model"] < 97 / 4
    assert any("far from the measured" in n for n in c["notes"])
    assert cost.measured_switch_point([p for p in pts if p.n >= 256]) == 256  # upload wins from the start
    assert cost.measured_switch_point([p for p in pts if p.n <= 64]) is None


def test_np_none_when_upload_never_pays_and_phi2_from_bandwidth():
    pts = [PrefillPoint(n, path, 1.0 + 0.1 * n + (5.0 if path == "upload" else 0), 10, 0)
           for n in (32, 128) for path in ("split", "upload")]
    fit = cost.fit_prefill_paths(pts, expert_upload_ms=0.3)  # 2 sizes: phi2 from bytes / bandwidth
    assert fit["phi2_ms_per_expert"] == pytest.approx(0.3)
    assert cost.switch_point(fit["phi0_ms"], fit["phi1_ms_per_token"], fit["phi2_ms_per_expert"],
                            [0, 32, 128], [0, 10, 10]) is None
    with pytest.raises(cost.CalibrationError):
        cost.fit_prefill_paths(pts[:2])


def test_solve_cpu_only_says_gpu_terms_absent():
    c = cost.solve_calibration(_decode_rows(steps=50), [], [], gpu=False)
    assert c["gpu_terms"] is False and c["gpu_branch_ms"] is None and c["np_tokens"] is None
    assert any("no GPU" in n for n in c["notes"])
    assert c["cpu_branch"]["beta_ms"] == pytest.approx(0.184, abs=0.005)


def test_solve_with_gpu_gives_np_and_residual():
    c = cost.solve_calibration(_decode_rows(steps=80), [0.137] * 10, _prefill_points(), gpu=True,
                              expert_bytes=13_400_000, h2d_gbps=25.0)
    assert c["gpu_branch_ms"] == pytest.approx(0.137)
    assert c["expert_upload_ms"] == pytest.approx(13.4e6 / 25e9 * 1e3)
    assert 16 <= c["np_tokens"] <= 2048
    assert c["residual_alpha_minus_g_ms"] == pytest.approx(0.14 - 0.137, abs=0.006)


def test_store_keeps_other_profile_keys_and_threshold_lookup(tmp_path):
    prof = tmp_path / "hardware.json"
    prof.write_text(json.dumps({"format": "ostinato-hardware/1", "gpus": [{"index": 0}],
                                "calibration": {"old": True}}))
    assert calibration.prefill_threshold_choice(None, prof)[0] == calibration.DEFAULT_NP
    calibration.store_calibration({"np_tokens": 700, "format": calibration.CALIBRATION_FORMAT}, prof)
    data = json.loads(prof.read_text())
    assert data["gpus"] == [{"index": 0}] and data["format"] == "ostinato-hardware/1"
    assert data["calibration"] == {"np_tokens": 700, "format": calibration.CALIBRATION_FORMAT}
    assert calibration.prefill_threshold_choice(None, prof)[0] == 700

    class S:
        prefill_threshold = 64

    assert calibration.prefill_threshold_choice(S(), prof)[0] == 64
    data["calibration"]["stale"] = True
    prof.write_text(json.dumps(data))
    assert calibration.prefill_threshold_choice(None, prof)[0] == calibration.DEFAULT_NP


def test_calibration_on_a_machine_without_profile_survives_the_daemon_start(tmp_path):
    # `ostinato calibrate` before any daemon start: the stored file gets the hardware fingerprint,
    # so the start-up profile (ensure_profile) keeps the calibration instead of marking it stale
    from ostinatod.profile import ensure_profile
    prof = tmp_path / "hw.json"
    calibration.store_calibration({"np_tokens": 16, "format": calibration.CALIBRATION_FORMAT}, prof)
    assert json.loads(prof.read_text())["fingerprint"]
    p = ensure_profile(prof, recalibrate=False)
    assert not p["calibration"].get("stale")
    assert calibration.prefill_threshold_choice(None, prof)[0] == 16


def test_decode_graph_choice_setting_then_calibration_then_auto(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))

    class On:
        decode_graph = True

    assert calibration.decode_graph_choice(None) is None   # no calibration: auto
    calibration.store_calibration({"format": calibration.CALIBRATION_FORMAT, "decode_graph": False})
    assert calibration.decode_graph_choice(None) is False  # the sweep found the graph slower here
    assert calibration.decode_graph_choice(On()) is True   # the setting wins
    calibration.store_calibration({"format": calibration.CALIBRATION_FORMAT, "decode_graph": None})
    assert calibration.decode_graph_choice(None) is None   # not measured (CPU build): auto


BW_ROWS = [{"threads": 1, "alpha_us": 9.0, "bw_gbps": 5.0}, {"threads": 4, "alpha_us": 21.0, "bw_gbps": 30.0},
           {"threads": 15, "alpha_us": 25.7, "bw_gbps": 38.7}, {"threads": 16, "alpha_us": 27.0, "bw_gbps": 39.0}]


def test_cpu_split_params_take_the_prefill_thread_count_row():
    # the row of the prefill's threads, else the most threads below, else the fewest above
    p = cost.cpu_split_params(BW_ROWS, 16, 55.0)
    assert p == {"alpha_us": 27.0, "cpu_gbps": 39.0, "h2d_gbps": 55.0, "threads": 16}
    assert cost.cpu_split_params(BW_ROWS, 8, 55.0)["threads"] == 4
    assert cost.cpu_split_params(BW_ROWS[2:], 2, 55.0)["threads"] == 15
    # nothing to split with: no pinned bandwidth, no usable row (bw inf from a flat fit, missing)
    assert cost.cpu_split_params(BW_ROWS, 16, None) is None
    assert cost.cpu_split_params(BW_ROWS, 16, 0.0) is None
    assert cost.cpu_split_params([{"threads": 4, "alpha_us": 3.0, "bw_gbps": float("inf")}], 4, 55.0) is None
    assert cost.cpu_split_params([{"threads": 4, "bw_gbps": 30.0}], 4, 55.0) is None
    assert cost.cpu_split_params([], 4, 55.0) is None
    # a negative fitted alpha (noise) is a zero fixed cost, not a CPU branch that saves time
    assert cost.cpu_split_params([{"threads": 4, "alpha_us": -3.0, "bw_gbps": 30.0}], 4, 55.0)["alpha_us"] == 0.0


def test_cpu_split_inputs_setting_then_calibration_then_probe(tmp_path):
    prof = tmp_path / "hw.json"

    class Off:
        prefill_cpu_split = False

    assert calibration.cpu_split_inputs(None, prof) == ([], None, "not calibrated")
    calibration.store_calibration({"format": calibration.CALIBRATION_FORMAT, "np_tokens": 128,
                                   "h2d_pinned_gbps": 55.0, "cpu_branch_bandwidth": BW_ROWS}, prof)
    assert calibration.cpu_split_inputs(None, prof) == (BW_ROWS, 55.0, "calibration")
    assert cost.cpu_split_params(BW_ROWS, 16, 55.0)["cpu_gbps"] == 39.0
    assert calibration.cpu_split_inputs(Off(), prof) == ([], None, "settings")
    data = json.loads(prof.read_text())
    data["calibration"]["stale"] = True
    prof.write_text(json.dumps(data))
    assert calibration.cpu_split_inputs(None, prof) == ([], None, "not calibrated")
    # a load probe of this model that measured the CPU branch (no pinned figure of its own: the
    # profile's measured bandwidth)
    data["bandwidth"] = {"h2d_pinned": [{"device": 0, "gbps": 52.0}]}
    data["calibration"] = {"format": calibration.CALIBRATION_FORMAT, "kind": calibration.PROBE_KIND,
                           "np_tokens": 16, "model": {"fingerprint": "abc"}, "cpu_branch_bandwidth": BW_ROWS[:1]}
    prof.write_text(json.dumps(data))
    assert calibration.cpu_split_inputs(None, prof, "abc") == (BW_ROWS[:1], 52.0, "probe")
    assert calibration.cpu_split_inputs(None, prof, "other") == ([], None, "not calibrated")


def test_load_probe_record_keeps_the_cpu_branch_rows(tmp_path):
    prof = tmp_path / "hw.json"
    calibration.store_prefill_probe({"np_tokens": 16, "points": [], "seconds": 1.0, "cpu_branch_bandwidth": BW_ROWS},
                                    {"fingerprint": "abc", "name": "m"}, prof)
    rec = json.loads(prof.read_text())["calibration"]
    assert rec["kind"] == calibration.PROBE_KIND and rec["cpu_branch_bandwidth"] == BW_ROWS


def test_run_calibration_without_model_never_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    monkeypatch.delenv("OSTINATO_MODEL", raising=False)
    c = cal.run_calibration(profile_path=tmp_path / "p.json")
    assert "no model" in c["error"]


def test_run_calibration_on_the_engine_cpu(tiny_model, tmp_path, monkeypatch):
    """The real engine (CPU build): forced-path passes run, the fit is stored, GPU terms absent."""
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    prof = tmp_path / "hw.json"
    prof.write_text(json.dumps({"format": "ostinato-hardware/1", "host": {"x": 1}}))
    c = cal.run_calibration(tiny_model, profile_path=prof)
    assert "error" not in c, c
    stored = json.loads(prof.read_text())
    assert stored["host"] == {"x": 1} and stored["calibration"]["created"] == c["created"]
    assert c["measurements"]["decode_steps"] == 48 and c["measurements"]["prefill_passes"] == 6
    assert {p["path"] for p in c["measurements"]["prefill"]} == {"split", "upload"}
    assert c["cpu_branch"]["samples"] == 48
    # decode overlap on/off x thread counts measured, the fastest kept for serving
    assert len(c["decode_sweep"]) >= 2 and isinstance(c["decode_overlap"], bool)
    # a CPU build sweeps no decode-graph setting (the graph is for a pool on a GPU)
    assert c["decode_graph"] is None and not any(r["graph"] for r in c["decode_sweep"])
    assert c["decode_threads"] >= 1 and c["decode_step_ms"] > 0
    if not c["gpu_terms"]:
        assert c["gpu_branch_ms"] is None and c["np_tokens"] is None
    print(cal.format_calibration(c))


def test_np_choice_order_and_the_load_probe_record(tmp_path):
    """settings > full calibration > a probe of this model > 512; a probe never replaces a full
    calibration that is not stale; a probe of another model is not used."""
    prof = tmp_path / "hw.json"
    prof.write_text(json.dumps({"format": "ostinato-hardware/1", "fingerprint": "f"}))
    choice = calibration.prefill_threshold_choice
    assert choice(None, prof, "m1") == (calibration.DEFAULT_NP, "default")
    probe = {"np_tokens": 40, "points": [{"n": 16, "path": "split", "total_ms": 3.0}], "seconds": 0.5}
    assert calibration.store_prefill_probe(probe, {"fingerprint": "m1", "name": "one"}, prof) == prof
    rec = json.loads(prof.read_text())["calibration"]
    assert rec["kind"] == calibration.PROBE_KIND and rec["np_tokens"] == 40 and rec["model"]["fingerprint"] == "m1"
    assert choice(None, prof, "m1") == (40, "probe")
    assert choice(None, prof, "m2") == (calibration.DEFAULT_NP, "default")   # another model: probe again
    assert calibration.prefill_threshold_choice(None, prof)[0] == 40

    class S:
        prefill_threshold = 64

    assert choice(S(), prof, "m1") == (64, "settings")
    # a full calibration wins and is never replaced by a later probe
    calibration.store_calibration({"np_tokens": 700, "format": calibration.CALIBRATION_FORMAT}, prof)
    assert choice(None, prof, "m1") == (700, "calibration")
    assert calibration.store_prefill_probe(probe, {"fingerprint": "m1"}, prof) is None
    assert json.loads(prof.read_text())["calibration"]["np_tokens"] == 700
    # ... unless it is stale (the hardware changed)
    data = json.loads(prof.read_text())
    data["calibration"]["stale"] = True
    prof.write_text(json.dumps(data))
    assert choice(None, prof, "m1") == (calibration.DEFAULT_NP, "default")
    assert calibration.store_prefill_probe(probe, {"fingerprint": "m1"}, prof) == prof
    assert choice(None, prof, "m1") == (40, "probe")
    # a full calibration that found the upload path never cheaper (np_tokens None) is kept: 512
    calibration.store_calibration({"np_tokens": None, "decode_threads": 4,
                                   "format": calibration.CALIBRATION_FORMAT}, prof)
    assert choice(None, prof, "m1") == (calibration.DEFAULT_NP, "calibration")
    assert calibration.store_prefill_probe(probe, {"fingerprint": "m1"}, prof) is None
    assert json.loads(prof.read_text())["calibration"]["decode_threads"] == 4


def test_profile_show_names_a_probe(tmp_path):
    from ostinatod.profile import format_profile
    p = {"calibration": {"kind": calibration.PROBE_KIND, "np_tokens": 24, "created": "today"}}
    assert "Np = 24 measured at a model load" in format_profile(p)


def test_np_probe_on_the_engine_cpu(tiny_model, tmp_path, monkeypatch):
    """The load probe through the real engine (CPU build: both paths run, the pool is a CPU buffer):
    one split and one upload pass per size, Np among the sizes or 512, and afterwards the counters
    are empty (the probe's routes reach neither traces nor /metrics) and the path is back on auto."""
    from ostinatod.engine import native
    from ostinatod.engine.worker import Worker
    from ostinatod.residency.sets import make_residency, model_block, write_residency
    from ostinatod.settings import load_settings

    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    block = model_block(tiny_model)
    half = {il: list(range(block["n_expert"] // 2)) for il in range(block["n_layer"])}
    res = write_residency(make_residency(block, half), tmp_path / "half.json")
    s = load_settings(model=tiny_model, experts="ostinato", residency=res, n_slots=1, n_ctx=512,
                      engine_mode="inprocess")
    w = Worker(s, tiny_model)
    w.load()
    try:
        assert w.rt is not None
        # a CPU build has no GPU pool: the load did not probe (the two paths are one computation here)
        assert native.has_gpu() or not w.rt.wants_np_probe()
        assert native.has_gpu() or calibration.load_calibration() is None
        from ostinatod.engine.np_probe import probe_np
        r = probe_np(w, sizes=(8, 32, 128))
        assert [(p["path"], p["n"]) for p in r["points"]] == [
            ("split", 8), ("split", 32), ("split", 128), ("upload", 8), ("upload", 32), ("upload", 128)]
        assert all(p["total_ms"] > 0 for p in r["points"])
        assert r["np_tokens"] in (8, 32, 128, calibration.DEFAULT_NP) or 8 < r["np_tokens"] < 128
        st = w.rt.stats()
        assert st["routes"] == 0 and st["passes"] == 0
        assert w.rt.forced == "auto"
        # through the worker: served with and stored for the next loads of this model
        assert w.probe_np() == w.rt.prefill_threshold and w.rt.prefill_threshold_source == "probe"
        stored = calibration.load_calibration()
        assert stored["kind"] == calibration.PROBE_KIND and stored["model"]["fingerprint"] == block["fingerprint"]
    finally:
        w.close()


def test_runtime_serves_the_split_of_the_probe_on_a_gpu_pool_only(tmp_path, monkeypatch):
    # the runtime's choice at load: the probe's CPU-branch row at the prefill's thread count, set in
    # the engine's options (reaching the native engine once the model is loaded: info()["prefill"]
    # ["cpu_split"] needs one). has_gpu is forced only to reach the GPU-pool branch on this CPU machine.
    from ostinatod.engine import native
    from ostinatod.engine.options import EngineOptions
    from ostinatod.engine.runtime import ExpertRuntime
    from ostinatod.settings import Settings

    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    calibration.store_prefill_probe({"np_tokens": 16, "points": [], "cpu_branch_bandwidth": BW_ROWS},
                                    {"fingerprint": "fp1", "name": "m"})
    data = json.loads(calibration.get_paths().hardware_profile.read_text())
    data["bandwidth"] = {"h2d_pinned": [{"device": 0, "gbps": 55.0}]}
    calibration.get_paths().hardware_profile.write_text(json.dumps(data))
    rt = ExpertRuntime(tmp_path / "m.gguf", {"fingerprint": "fp1"}, None, EngineOptions(prefill_threshold=16), 0)
    rt.batch_threads = 8   # no row of 8: the row of the most threads below (4)
    monkeypatch.setattr(native, "has_gpu", lambda: True)
    # off by default (slower on the H200, docs/engine.md): the probe's row is not used
    rt.apply_cpu_split(Settings())
    assert (rt.cpu_split, rt.cpu_split_source) == (None, "settings")
    rt.apply_cpu_split(Settings(engine={"prefill_cpu_split": True}))
    assert rt.cpu_split_source == "probe"
    assert rt.cpu_split == {"alpha_us": 21.0, "cpu_gbps": 30.0, "h2d_gbps": 55.0, "threads": 4}
    assert rt.options.cpu_split == {"alpha_us": 21.0, "cpu_gbps": 30.0, "h2d_gbps": 55.0}
    rt.apply_cpu_split(Settings(engine={"prefill_cpu_split": False}))
    assert rt.options.cpu_split is None
    assert (rt.cpu_split, rt.cpu_split_source) == (None, "settings")
    rt.apply_cpu_split(Settings(engine={"prefill_cpu_split": True, "upload_cpu_share": 0.5}))
    assert (rt.cpu_split, rt.cpu_split_source) == (None, "upload_cpu_share")
    monkeypatch.setattr(native, "has_gpu", lambda: False)
    rt.apply_cpu_split(Settings(engine={"prefill_cpu_split": True}))
    assert (rt.cpu_split, rt.cpu_split_source) == (None, "no GPU pool")
