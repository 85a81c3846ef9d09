"""``ostinato bench timeline`` (ostinatod/bench/bench_timeline.py): the tool end to end on the CPU
build with the tiny synthetic model (both engines, wall times, the note that no profiler ran; no
timing is asserted), the rerun without the profiler when a child fails under it, and the trace
export of the profiler wrapper with a stand-in for torch (the real torch/CUPTI path runs on the GPU
machine only: stage ``timeline`` of scripts/device-run.sh)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from ostinatod.bench import bench_timeline as bt
from ostinatod.residency.sets import make_residency, model_block, write_residency


def _residency(model: Path, path: Path) -> Path:
    """Half the experts of every layer hot (the exactness tests' set)."""
    b = model_block(model)
    hot = {layer: list(range(0, b["n_expert"], 2)) for layer in range(b["n_layer"])}
    return write_residency(make_residency(b, hot), path)


def test_timeline_end_to_end_on_the_cpu_build(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    res = _residency(tiny_model, tmp_path / "residency.json")
    out = tmp_path / "out"
    rc = bt.main(["--model", str(tiny_model), "--residency", str(res), "--context-tokens", "64",
                  "--prompt-tokens", "40", "--decode-steps", "3", "--n-ctx", "1024", "--threads", "1",
                  "--out-dir", str(out), "--work-dir", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    sys.stdout.write(printed)   # the page, for the log
    assert rc == 0, printed
    data = json.loads((out / "timeline.json").read_text())
    assert list(data["engines"]) == ["ostinato", "stock-all-gpu"]
    for name, e in data["engines"].items():
        assert "error" not in e, (name, e)
        w = e["wall"]
        assert w["prefill_ms"] > 0 and w["context_ms"] > 0 and len(w["decode_ms"]) == 3
        assert all(x > 0 for x in w["decode_ms"])
        assert e["prefill_passes"] == 1 and e["ubatch"]["ubatch"] >= 40 and e["n_layer"] == 2
        assert e["trace"] is None and "timeline" not in e
        assert any(n.startswith("no profiler") for n in e["notes"]), e["notes"]
    o, s = data["engines"]["ostinato"], data["engines"]["stock-all-gpu"]
    assert o["expert_engine"] and not s["expert_engine"] and s["native"] is None
    # the engine's own figures: one prefill pass of the 40 tokens, then the decode steps
    assert o["native"]["prefill"]["tokens"] == 40 and o["native"]["decode"]["passes"] == 3
    md = (out / "timeline.md").read_text()
    assert "| prefill ms |" in md and "no profiler" in md and "stock-all-gpu" in md
    assert (out / "timeline-ostinato.log").exists()


def test_options_are_checked(tiny_model, tmp_path, capsys):
    assert bt.main(["--model", str(tiny_model), "--out-dir", str(tmp_path)]) == 2   # no --residency
    assert "--residency is required" in capsys.readouterr().err
    assert bt.main(["--model", str(tiny_model), "--engines", "stock-layers", "--out-dir", str(tmp_path)]) == 2
    assert bt.main(["--model", str(tmp_path / "none.gguf"), "--engines", "stock-all-gpu",
                    "--out-dir", str(tmp_path)]) == 2


def test_a_child_that_fails_under_the_profiler_runs_again_without_it(tiny_model, tmp_path, monkeypatch):
    calls = []

    def spawn(name, a, out_dir, work, profile):
        calls.append((name, profile))
        if profile:
            return {"engine": name, "error": "the child exited with -11", "log_tail": ""}
        return {"engine": name, "wall": {"load_s": 1.0, "context_ms": 1.0, "prefill_ms": 2.0, "decode_ms": [1.0]},
                "ubatch": {"ubatch": 512, "reason": "x"}, "prefill_passes": 1, "n_layer": 2, "trace": None,
                "native": None, "notes": []}

    monkeypatch.setattr(bt, "_spawn", spawn)
    out = tmp_path / "out"
    rc = bt.main(["--model", str(tiny_model), "--engines", "stock-all-gpu", "--out-dir", str(out)])
    assert rc == 0 and calls == [("stock-all-gpu", True), ("stock-all-gpu", False)]
    data = json.loads((out / "timeline.json").read_text())
    assert "run again without it" in data["notes"][0]
    assert data["engines"]["stock-all-gpu"]["notes"][0].startswith("no profiler: the run with it failed")


class _FakeProfile:
    def __init__(self, activities):
        self.activities = activities

    def start(self):
        pass

    def stop(self):
        pass

    def export_chrome_trace(self, path):
        Path(path).write_text(json.dumps({"traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "timeline:prefill", "ts": 0, "dur": 10}]}))


def test_the_profiler_wrapper_writes_a_gzipped_chrome_trace(tmp_path):
    import contextlib

    prof = SimpleNamespace(profile=_FakeProfile, ProfilerActivity=SimpleNamespace(CPU="cpu", CUDA="cuda"),
                           record_function=lambda name: contextlib.nullcontext(name))
    p = bt._Profile(SimpleNamespace(profiler=prof))
    p.start()
    assert p.prof.activities == ["cpu", "cuda"]
    with p.rng("prefill") as name:
        assert name == "timeline:prefill"
    path = p.stop(tmp_path / "timeline-x.trace.json.gz")
    assert path.exists() and not (tmp_path / "timeline-x.trace.json").exists()
    with gzip.open(path, "rt") as f:
        assert json.load(f)["traceEvents"][0]["name"] == "timeline:prefill"
    assert bt._Profile(None).stop(tmp_path / "y.gz") is None
