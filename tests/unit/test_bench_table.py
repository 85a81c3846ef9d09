"""``ostinato bench table``: the results page's rows come from the stored run JSONs (pure; no engine)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ostinatod.bench import bench_table

pytestmark = pytest.mark.unit
RUNS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "runs"
PEERS = RUNS / "2026-12-03-engines-h200-qwen35moe-45-peers.json"
FULL = RUNS / "2026-12-01-engines-h200-16c-L48-poll-full100.json"


def test_row_has_the_family_limit_best_peer_and_phase_shares():
    r = bench_table.row(json.loads(PEERS.read_text()), PEERS.stem)
    assert (r["family"], r["arch"], r["layers"], r["real_layers"], r["quant"]) == \
        ("Qwen3.5-35B-A3B", "qwen35moe", 40, 40, "UD-Q4_K_XL")
    assert r["pool"] == 0.45 and r["gpu"] == "H200"
    # the best peer is named per metric, and the ratios are the run's own
    assert [r["best_peer"][k + "_engine"] for k in ("decode", "ttft_after_tool", "session_total")] == \
        ["llama-server", "stock-layers", "ik-llama-server"]
    assert [r["vs_best_peer"][k] for k in ("decode", "ttft_after_tool", "session_total")] == [1.827, 4.966, 3.778]
    assert r["vs_limit"]["decode"] == 1.507 and r["limit"]["decode"] == pytest.approx(5.29, abs=0.01)
    assert r["hot_share_decode"] == pytest.approx(0.7973) and r["hot_share_after_tool"] == pytest.approx(0.8263)
    line = bench_table.markdown_row(r)
    assert line.count("|") == bench_table.HEADER.splitlines()[0].count("|")
    assert "1.83× / 4.97× / 3.78×" in line and "(llama-server / stock-layers / ik-llama-server)" in line
    assert f"(runs/{PEERS.stem}.cmd.txt)" in line


def test_run_without_peers_and_the_plot(tmp_path, capsys):
    r = bench_table.row(json.loads(FULL.read_text()))
    assert r["best_peer"] is None and r["vs_best_peer"] is None and r["pool"] == 1.0
    assert bench_table.gpu_name({"machine": {"gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}}) == "H100"
    assert "no peer in the run" in bench_table.markdown_row(r)
    out = tmp_path / "f.svg"
    assert bench_table.main([str(PEERS), str(FULL), "--svg", str(out)]) == 0
    assert ET.parse(out).getroot().tag.endswith("svg")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == bench_table.HEADER.splitlines()[0] and len(lines) == 4
    assert bench_table.main([str(tmp_path / "missing.json")]) == 2
