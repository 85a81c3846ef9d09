"""Routing skew as a knob: ``ostinato synth --skew`` and ``ostinato bench engines --skew-sweep``
(the sweep end to end on the tiny shape: real synthetic files, real daemons on loopback, the real
replay client; figures are printed, never asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import pytest

from ostinatod.bench import bench_engines as be
from ostinatod.bench.bench_common import BenchError
from ostinatod.bench.bench_skew import parse_skews, skew_tag, sub_argv
from ostinatod.synth import cli as synth_cli
from ostinatod.synth.shapes import Routing, SynthError
from ostinatod.synth.skew import (CALIBRATION, DEFAULT_SKEW, default_strength, router_strength, skew_floor,
                                  strength_for_skew)

SESSIONS = Path("/work/shared/sessions")


def test_strength_grows_with_skew_and_refuses_what_the_routers_cannot_make():
    for e, k in CALIBRATION:
        floor = skew_floor(e, k)
        xs = [x for x in (0.78, 0.84, 0.88, 0.92, 0.96) if x >= floor]
        a = [strength_for_skew(x, e, k) for x in xs]
        assert a == sorted(a) and len(set(a)) == len(xs) and a[0] >= 0, (e, k, a)
        assert strength_for_skew(floor, e, k) == 0.0  # the floor: no class preference
        with pytest.raises(SynthError, match="below what these routers make"):
            strength_for_skew(floor - 0.05, e, k)
    with pytest.raises(SynthError, match="skew must be in"):
        strength_for_skew(1.2, 128, 8)
    # the default: made for 0.84 where calibrated (the floor where that is higher), the old rule
    # for the test and demo shapes (their files do not change)
    assert default_strength(128, 8) == pytest.approx(strength_for_skew(DEFAULT_SKEW, 128, 8))
    assert default_strength(256, 8) == 0.0 and skew_floor(256, 8) > DEFAULT_SKEW
    assert default_strength(8, 2) == 2.5 and default_strength(32, 4) == pytest.approx(1.565, abs=1e-3)
    assert router_strength(Routing(skew=0.9, strength=2.0), 128, 8) == 2.0  # an explicit A wins
    assert router_strength(Routing(skew=0.9), 128, 8) == pytest.approx(strength_for_skew(0.9, 128, 8))


def test_synth_skew_writes_its_router_strength(tmp_path: Path, capsys):
    out = tmp_path / "m.gguf"
    assert synth_cli.main(["--shape", "tiny", "--skew", "0.9", "-o", str(out)]) == 0
    r = gguf.GGUFReader(out)
    assert r.fields["ostinato.synth.router_strength"].contents() == pytest.approx(strength_for_skew(0.9, 8, 2), rel=1e-6)
    assert json.loads(r.fields["ostinato.synth.routing"].contents())["skew"] == 0.9
    assert synth_cli.main(["--shape", "tiny", "--skew", "1.5", "-o", str(tmp_path / "bad.gguf")]) == 2
    assert "skew must be in" in capsys.readouterr().err and not (tmp_path / "bad.gguf").exists()


def test_parse_skews_and_the_command_of_one_skew():
    assert parse_skews("0.92,0.6, 0.84,0.6") == [0.6, 0.84, 0.92]
    for bad in ("0.3", "x", "1.2,0.8"):
        with pytest.raises(BenchError):
            parse_skews(bad)
    assert skew_tag(0.6) == "skew60" and skew_tag(0.925) == "skew92"
    argv = ["--shape", "tiny", "--skew-sweep", "0.6,0.9", "--name=x", "--turns", "2", "--skew", "0.7"]
    assert sub_argv(argv, 0.6, "x-skew60") == ["--shape", "tiny", "--turns", "2", "--skew", "0.6",
                                                "--name", "x-skew60"]


@pytest.mark.parametrize("extra, words", [(["--model", "m.gguf"], "cannot take --model"),
                                          (["--budget-sweep", "0.3,0.6"], "one sweep per run"),
                                          (["--skew-sweep", ","], "no skew given"),
                                          (["--skew-sweep", "0.6,0.9"], "below what these routers make")])
def test_skew_sweep_refuses_what_it_cannot_run(extra, words, capsys):
    assert be.main(["--skew-sweep", "0.8,0.9", "--no-server"] + extra) == 1
    assert words in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_skew_sweep_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    argv = ["--shape", "tiny", "--skew-sweep", "0.8,0.92", "--turns", "2", "--sessions", "1",
            "--dev-sessions", "1", "--dev-turns", "2", "--dev-max-gen", "4", "--no-server",
            "--engines", "ostinato,stock-layers", "--n-ctx", "16384", "--threads", "2",
            "--out-dir", str(out), "--work-dir", str(tmp_path / "work"), "--name", "sk",
            "--sessions-dir", str(SESSIONS), "--budget-frac", "0.3"]
    rc = be.main(argv)
    printed = capsys.readouterr().out
    sys.stdout.write(printed)
    assert rc == 0, printed
    sw = json.loads((out / "sk.json").read_text())["skew_sweep"]
    assert sw["skews"] == [0.8, 0.92] and [r["skew"] for r in sw["rows"]] == [0.8, 0.92]
    lo, hi = sw["rows"]
    # one file per skew, routers made for it
    assert lo["model_file"] != hi["model_file"] and "skew80" in lo["model_file"] and "skew92" in hi["model_file"]
    assert lo["router_strength"] < hi["router_strength"]
    models = tmp_path / "home"
    for r in sw["rows"]:
        f = next(models.rglob(r["model_file"]))
        assert gguf.GGUFReader(f).fields["ostinato.synth.router_strength"].contents() == pytest.approx(
            r["router_strength"], rel=1e-3)
        one = json.loads((out / f"{r['result']}.json").read_text())
        assert one["model"]["skew"] == r["skew"] and f"--skew {r['skew']:g}" in one["command"]
        assert "--skew-sweep" not in one["command"]
        for key in ("decode", "ttft_after_tool", "session_total"):
            assert r[key]["ostinato"] > 0 and r[key]["best_peer"] > 0, r
            assert r[key]["best_peer_engine"] == "stock-layers"
        assert r["decode"]["limit"] is None  # stock-all-gpu not asked: no limit line
        assert 0 <= r["hot_route_share_decode"] <= 1 and 0 <= r["hot_route_share_prefill"] <= 1
    md = (out / "sk.md").read_text()
    assert "| 0.80 |" in md and "| 0.92 |" in md and "(stock-layers)" in md
    svg = (out / "sk.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 4 and "best peer (stock-layers)" in svg
