"""Hardware profile: real probes of this machine (psutil, NVML if present), schema, merge rules."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from ostinatod import hardware
from ostinatod import profile as prof

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "profiles" / "hardware.schema.json").read_text())


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    return tmp_path


def test_collect_matches_schema_and_machine(home):
    p = prof.update_profile(measure=True, recalibrate=False, host_read_mb=16)
    jsonschema.validate(p, SCHEMA)
    assert p["host"]["physical_cores"] >= 1
    assert p["host"]["ram_total_bytes"] > p["host"]["ram_available_bytes"] > 0
    assert p["bandwidth"]["host_read_gbps"] > 0
    assert p["cpu_only"] == (not p["gpus"])
    assert len(p["bandwidth"]["h2d_pinned"]) == len(p["gpus"])
    stored = json.loads((home / "data" / "hardware.json").read_text())
    assert stored["fingerprint"] == p["fingerprint"]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "profiles").glob("example-*.json")))
def test_shipped_examples_match_schema(name):
    jsonschema.validate(json.loads((ROOT / "profiles" / name).read_text()), SCHEMA)


def test_calibration_kept_and_marked_stale_on_hardware_change(home):
    path = home / "data" / "hardware.json"
    first = prof.update_profile(measure=False, recalibrate=False)
    assert first["changed"] is True
    data = json.loads(path.read_text())
    data["calibration"] = {"alpha_ms": 0.14, "beta_ms": 0.184, "np": 512}
    path.write_text(json.dumps(data))
    # same machine: calibration kept untouched
    again = prof.update_profile(measure=False, recalibrate=False)
    assert again["changed"] is False
    assert again["calibration"] == {"alpha_ms": 0.14, "beta_ms": 0.184, "np": 512}
    # pretend the stored profile came from other hardware: kept, but marked stale
    data = json.loads(path.read_text())
    data["fingerprint"] = "0" * 64
    path.write_text(json.dumps(data))
    moved = prof.update_profile(measure=False, recalibrate=False)
    assert moved["changed"] is True
    assert moved["calibration"]["alpha_ms"] == 0.14 and moved["calibration"]["stale"] is True


def test_fingerprint_ignores_free_memory_but_not_gpus():
    base = {"host": {"cpu_model": "x", "physical_cores": 8, "ram_total_bytes": 64 << 30,
                     "ram_available_bytes": 10}, "gpus": []}
    fp = hardware.hardware_fingerprint(base)
    noisy = json.loads(json.dumps(base))
    noisy["host"]["ram_available_bytes"] = 999
    assert hardware.hardware_fingerprint(noisy) == fp
    gpu = json.loads(json.dumps(base))
    gpu["gpus"] = [{"name": "NVIDIA RTX 4090", "memory_total_bytes": 24 << 30, "pcie_gen_max": 4,
                    "pcie_width_max": 16, "memory_free_bytes": 1}]
    assert hardware.hardware_fingerprint(gpu) != fp


def test_ensure_profile_reuses_stored(home):
    p1 = prof.ensure_profile(recalibrate=False)
    p2 = prof.ensure_profile(recalibrate=False)
    assert p2["created"] == p1["created"]  # not re-measured: same machine


def test_corrupt_profile_is_rewritten(home):
    path = home / "data" / "hardware.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    p = prof.update_profile(measure=False, recalibrate=False)
    assert json.loads(path.read_text())["fingerprint"] == p["fingerprint"]


def test_cli_show_and_json(home, capsys):
    assert prof.main(["--show"]) == 1  # nothing stored yet: clear message, no traceback
    assert "no hardware profile" in capsys.readouterr().err
    assert prof.main(["--quick", "--no-recalibrate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "ostinato-hardware/1"
    assert prof.main(["--show"]) == 0
    assert "fingerprint" in capsys.readouterr().out


def test_no_cuda_runtime_means_no_h2d_figure_not_a_crash(monkeypatch):
    monkeypatch.setattr(hardware, "_find_cudart", lambda: None)
    assert hardware.measure_pinned_h2d_bandwidth() is None
