"""Decode prefetch's automatic count: the cost model's formula (residency.cost.decode_prefetch_count)
and the setting "auto" through resolve_options into the engine's options."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from ostinatod.engine.options import DECODE_PREFETCH_DEFAULT, EngineOptions, decode_prefetch_choice, resolve_options
from ostinatod.residency.cost import DECODE_PREFETCH_CHAIN_US, decode_prefetch_count
from ostinatod.settings import EngineSettings, Settings

MB = 1e6


def test_formula_counts_the_copies_that_fit_in_one_layer():
    # floor((g - c) / (w / B)): 1 MB at 50 GB/s is 20 us a copy; 117 us - 17 us leaves 100 us: 5
    r = decode_prefetch_count(1 * MB, 50.0, 0.117)
    assert (r["experts"], r["copy_us"], r["window_us"], r["chain_us"]) == (5, pytest.approx(20.0), 117.0,
                                                                           DECODE_PREFETCH_CHAIN_US)
    assert decode_prefetch_count(1 * MB, 50.0, 0.1169)["experts"] == 4       # just short of the fifth
    assert decode_prefetch_count(1 * MB, 50.0, 0.117, chain_us=0)["experts"] == 5   # 117 / 20
    assert decode_prefetch_count(1 * MB, 50.0, 0.010)["experts"] == 0        # no room past the chain
    assert decode_prefetch_count(0.01 * MB, 50.0, 1.0)["experts"] == 16      # the setting's limit
    assert decode_prefetch_count(0.01 * MB, 50.0, 1.0, most=3)["experts"] == 3


@pytest.mark.parametrize("bw", [45.0, 50.0, 55.0])
def test_formula_on_the_measured_h100_cases(bw):
    # Qwen3.5 (2.1 MB experts, G 0.127 ms): 2 at 45-55 GB/s, the measured default;
    # GLM-4.5-Air (11.6 MB, G ~0.2 ms): one copy (211-258 us) already outlasts the layer: 0
    assert decode_prefetch_count(2.1 * MB, bw, 0.127)["experts"] == 2
    assert decode_prefetch_count(11.6 * MB, bw, 0.2)["experts"] == 0
    for g in (0.15, 0.2, 0.23):
        n = decode_prefetch_count(11.6 * MB, bw, g)["experts"]
        assert n == math.floor((g * 1e3 - DECODE_PREFETCH_CHAIN_US) / (11.6 * MB / (bw * 1e9) * 1e6))


def test_formula_refuses_meaningless_inputs():
    for bad in ((0, 50.0, 0.1), (MB, 0.0, 0.1), (MB, 50.0, -1.0), (MB, float("nan"), 0.1), (MB, 50.0, float("inf"))):
        with pytest.raises(ValueError):
            decode_prefetch_count(*bad)


def test_the_setting_takes_counts_and_auto_and_the_options_only_counts():
    assert EngineSettings().decode_prefetch_experts == 2          # the default stays the measured 2
    assert EngineSettings(decode_prefetch_experts="auto").decode_prefetch_experts == "auto"
    assert EngineSettings(decode_prefetch_experts="4").decode_prefetch_experts == 4   # env / flag text
    for bad in (17, -1, "most", True):
        with pytest.raises(ValidationError):
            EngineSettings(decode_prefetch_experts=bad)
    with pytest.raises(ValidationError):
        EngineOptions(decode_prefetch_experts="auto")             # the native side gets a count


def test_env_variable_auto(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    monkeypatch.setenv("OSTINATO_ENGINE__DECODE_PREFETCH_EXPERTS", "auto")
    assert Settings().engine.decode_prefetch_experts == "auto"


def _store(tmp_path, **cal):
    """A hardware profile with a full calibration record ``cal`` (OSTINATO_HOME = tmp_path)."""
    from ostinatod.paths import get_paths

    p = get_paths().hardware_profile
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"fingerprint": "hw", "calibration": {"format": "ostinato-calibration/1", **cal}}))


def test_auto_reaches_the_resolved_options(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    s = Settings(engine=EngineSettings(decode_prefetch_experts="auto"))
    # no calibration: today's 2, and why
    res = resolve_options(s, {"fingerprint": "fp"}, None, gpu_pool=True, expert_bytes=int(2.1 * MB))
    assert res.options.decode_prefetch_experts == DECODE_PREFETCH_DEFAULT == 2
    assert (res.decode_prefetch["setting"], res.decode_prefetch["source"]) == ("auto", "not calibrated")
    # a calibration of this model: GLM-4.5-Air's experts at 50 GB/s in a 0.2 ms layer give 0
    _store(tmp_path, gpu_branch_ms=0.2, h2d_pinned_gbps=50.0, model={"fingerprint": "fp"})
    res = resolve_options(s, {"fingerprint": "fp"}, None, gpu_pool=True, expert_bytes=int(11.6 * MB))
    assert res.options.decode_prefetch_experts == 0 and res.decode_prefetch["source"] == "calibration"
    assert res.decode_prefetch["copy_us"] == pytest.approx(232.0) and "232 us" in res.decode_prefetch["why"]
    # Qwen3.5's at 45 GB/s in 0.127 ms: 2
    _store(tmp_path, gpu_branch_ms=0.127, h2d_pinned_gbps=45.0, model={"fingerprint": "fp"})
    res = resolve_options(s, {"fingerprint": "fp"}, None, gpu_pool=True, expert_bytes=int(2.1 * MB))
    assert res.options.decode_prefetch_experts == 2 and res.decode_prefetch["gpu_layer_ms"] == 0.127
    # G depends on the model: another model's calibration, a CPU pool, no expert size keep 2
    res = resolve_options(s, {"fingerprint": "other"}, None, gpu_pool=True, expert_bytes=int(11.6 * MB))
    assert (res.options.decode_prefetch_experts, res.decode_prefetch["source"]) == (2, "calibrated on another model")
    assert decode_prefetch_choice("auto", "fp", False, int(11.6 * MB))["source"] == "no GPU pool"
    assert decode_prefetch_choice("auto", "fp", True, None)["experts"] == 2
    # an explicit count is the count, whatever the calibration says
    res = resolve_options(Settings(engine=EngineSettings(decode_prefetch_experts=4)), {"fingerprint": "fp"},
                          None, gpu_pool=True, expert_bytes=int(11.6 * MB))
    assert res.options.decode_prefetch_experts == 4 and res.decode_prefetch["source"] == "settings"


def test_the_bench_variant_asks_for_auto():
    from ostinatod.bench.bench_common import variant_settings

    assert variant_settings("ostinato-dprefetch-auto") == {"decode_prefetch_experts": "auto"}
    EngineSettings(**variant_settings("ostinato-dprefetch-auto"))
