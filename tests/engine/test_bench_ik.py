"""``ostinato bench engines`` with ik_llama.cpp's llama-server (``ik-llama-server``): its command
line, the ``-ot`` placement against a real GGUF's tensors, the ratios to the best peer, the
replay's cached tokens from a server's timings, and (only where ``OSTINATO_IK_SERVER`` names a
built binary) the tiny bench end to end with it."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from ostinatod.bench import bench_engines as be
from ostinatod.bench import bench_ik, bench_report
from ostinatod.bench.bench_common import IK, BenchError, is_peer
from ostinatod.bench.replay import _cached_from_timings

SESSIONS = Path("/work/shared/sessions")


def _regex(ot: str) -> re.Pattern:
    """The pattern of an ``-ot`` value as ik_llama.cpp splits it (at ',', then at the first '=')."""
    items = ot.split(",")
    assert len(items) == 1
    pattern, buft = items[0].split("=", 1)
    assert buft == "CPU"
    return re.compile(pattern)   # ECMAScript and Python agree on ^ $ \. ( | )


def test_expert_override_matches_exactly_the_experts_of_the_first_layers():
    assert bench_ik.expert_override(0) is None
    rx = _regex(bench_ik.expert_override(3))
    for name in ("blk.0.ffn_up_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight",
                 "blk.2.ffn_gate_up_exps.weight"):
        assert rx.search(name), name
    for name in ("blk.3.ffn_up_exps.weight", "blk.10.ffn_up_exps.weight", "blk.12.ffn_down_exps.weight",
                 "blk.21.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight", "blk.1.attn_q.weight",
                 "blk.1.ffn_gate_inp.weight", "blk.0.ffn_up_exps.bias", "xblk.1.ffn_up_exps.weight"):
        assert not rx.search(name), name


def test_expert_override_gives_the_gpu_the_expert_bytes_of_stock_layers(tiny_model):
    """For every layer split of a real GGUF: the tensors the regex leaves on the GPU are exactly
    the expert tensors of the layers llama.cpp's ``--n-cpu-moe`` leaves there, so their bytes are
    stock-layers' GPU expert bytes ((n_layer - n_cpu_moe) layers' experts)."""
    from gguf import GGUFReader

    from ostinatod.residency.planner import read_model_shape

    shape = read_model_shape(tiny_model)
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(tiny_model)).tensors}
    stock_rx = re.compile(r"blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")   # llama.cpp's own
    experts = {n for n in tensors if stock_rx.search(n)}
    assert experts and len(experts) == 3 * len(shape.moe_layers)
    layer_bytes = shape.expert_bytes[shape.moe_layers[0]] * shape.n_expert
    for n_cpu_moe in range(1, shape.n_layer + 1):
        rx = _regex(bench_ik.expert_override(n_cpu_moe))
        on_cpu = {n for n in tensors if rx.search(n)}
        assert on_cpu == {n for n in experts if int(stock_rx.search(n).group(1)) < n_cpu_moe}
        gpu_bytes = sum(tensors[n] for n in experts - on_cpu)
        assert gpu_bytes == (shape.n_layer - n_cpu_moe) * layer_bytes, n_cpu_moe


def test_ik_command_line():
    cmd = bench_ik.ik_server_command(Path("/x/llama-server"), Path("/m.gguf"), 18555, 26, 12, 32768,
                                     "-rtr  --no-mmap")
    assert cmd[0] == "/x/llama-server"
    opts = {k: cmd[i + 1] for i, k in enumerate(cmd[:-1]) if k.startswith("-") and k != "--jinja"}
    assert opts["-m"] == "/m.gguf" and opts["--host"] == "127.0.0.1" and opts["--port"] == "18555"
    assert opts["-c"] == "65536" and opts["-np"] == "2" and opts["-ngl"] == "999"
    assert opts["-fa"] == "on" and opts["-t"] == "12" and opts["-tb"] == "12"
    assert opts["-ot"] == bench_ik.expert_override(26)
    assert "--jinja" in cmd and cmd[-2:] == ["-rtr", "--no-mmap"]
    # fused MoE is this version's default; "-fmoe" is an unknown argument of its server
    assert "-fmoe" not in cmd
    # every expert on the GPU: no override at all
    assert "-ot" not in bench_ik.ik_server_command(Path("b"), Path("m"), 1, 0, 1, 8)
    # the trace log in the run's directory, not llama.log wherever the bench was started
    cmd = bench_ik.ik_server_command(Path("b"), Path("m"), 1, 0, 1, 8, trace_log=Path("/run/ik-trace"))
    assert cmd[cmd.index("--log-file") + 1] == "/run/ik-trace"


def test_ik_binary_comes_from_the_environment(tmp_path):
    with pytest.raises(BenchError, match="OSTINATO_IK_SERVER"):
        bench_ik.ik_server_binary({})
    f = tmp_path / "llama-server"
    f.write_text("#!/bin/sh\n")
    with pytest.raises(BenchError, match="not an executable"):
        bench_ik.ik_server_binary({bench_ik.IK_ENV: str(f)})
    f.chmod(0o755)
    assert bench_ik.ik_server_binary({bench_ik.IK_ENV: str(f)}) == f


def test_ratios_vs_best_peer_take_every_engine_but_ostinatos_and_the_limit():
    def e(d, t, s):
        return {"decode_ms_per_token": d, "ttft_after_tool_median_s": t, "session_total_s": s}

    eng = {"ostinato": e(5.0, 0.14, 14.0), "ostinato-class-slots": e(1.0, 0.01, 1.0),
           "ostinato-1gpu": e(1.0, 0.01, 1.0), "stock-all-gpu": e(4.5, 0.09, 12.0),
           "stock-layers": e(18.0, 1.0, 64.0), "llama-server": e(17.0, 1.1, 66.0),
           IK: e(10.0, 0.7, 40.0)}
    assert [n for n in eng if is_peer(n)] == ["stock-layers", "llama-server", IK]
    peer = bench_report.ratios(eng, peers=True)
    assert peer["decode"] == pytest.approx(2.0) and peer["decode_best_peer"] == IK
    assert peer["ttft_after_tool"] == pytest.approx(5.0) and peer["session_total_best_peer"] == IK
    stock = bench_report.ratios(eng)
    assert stock["decode_best_stock"] == "llama-server" and stock["ttft_after_tool_best_stock"] == "stock-layers"
    assert "decode_best_peer" not in stock
    # without ik-llama-server the best peer is the best stock engine
    del eng[IK]
    assert bench_report.ratios(eng, peers=True)["decode"] == stock["decode"]


def test_cached_tokens_from_a_servers_timings():
    assert _cached_from_timings({"prompt_n": 354, "prompt_ms": 80.0}, 2500) == 2146
    assert _cached_from_timings({"prompt_n": 3000}, 2500) == 0
    assert _cached_from_timings({"prompt_n": -1}, 2500) is None
    assert _cached_from_timings(None, 2500) is None
    assert _cached_from_timings({"prompt_n": 10}, None) is None


def test_a_missing_ik_binary_is_a_note_not_a_failure(tiny_model, tmp_path, monkeypatch):
    """Named without a binary, the engine is skipped with a note; the run goes on."""
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(bench_ik.IK_ENV, raising=False)
    a = be.build_parser().parse_args(["--model", str(tiny_model)])
    with pytest.raises(BenchError, match="binary not found"):
        bench_ik.start_ik_server(tiny_model, 1, tmp_path, a)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(bench_ik.IK_ENV), reason="needs a built ik_llama.cpp llama-server "
                    f"named by {bench_ik.IK_ENV} (scripts/device-run.sh stage ikbuild)")
def test_tiny_bench_with_ik_llama_server(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    argv = ["--shape", "tiny", "--turns", "2", "--sessions", "1", "--dev-sessions", "1",
            "--dev-turns", "2", "--dev-max-gen", "4", "--n-ctx", "16384", "--threads", "2",
            "--out-dir", str(out), "--work-dir", str(tmp_path / "work"), "--name", "tiny-ik",
            "--sessions-dir", str(SESSIONS), "--model", str(tiny_model), "--budget-frac", "0.3",
            "--engines", f"ostinato,stock-layers,{IK}"]
    monkeypatch.chdir(tmp_path)
    rc = be.main(argv)
    printed = capsys.readouterr().out
    sys.stdout.write(printed)
    res = json.loads((out / "tiny-ik.json").read_text())
    assert rc == 0 and IK in res["engines"], res["notes"]
    ik = res["engines"][IK]
    assert ik["turns"] == 2 and ik["errors"] == 0, ik
    assert "-ot" in ik["server_command"] and "--jinja" in ik["server_command"]
    assert res["ratios_vs_best_peer"]["decode"] is not None
    assert "Against the best peer" in (out / "tiny-ik.md").read_text()
    # its trace log lies in the run's directory; nothing in the directory the bench was started in
    assert not (tmp_path / "llama.log").exists()
    assert list((tmp_path / "work").rglob(f"{IK}-trace*.log"))
