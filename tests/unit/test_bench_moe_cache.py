"""``ostinato bench engines`` with upstream llama.cpp's MoE cache (``llama-server-moe-cache``): its
command line at Ostinato's pool bytes, the cache's figures read from its log, the engine as a peer,
and (only where ``OSTINATO_MOE_CACHE_SERVER`` names a built binary: the GPU machine's stage
mcbuild) a small bench end to end with it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ostinatod.bench import bench_engines as be
from ostinatod.bench import bench_moe_cache as mc
from ostinatod.bench.bench_common import CHOICES, ENGINES, MOE_CACHE, BenchError, is_peer

# the recorded sessions: the shared folder here, the carried copy on the GPU machine
SESSIONS = next((p for p in (Path("/work/shared/sessions"), Path(__file__).resolve().parents[2] / ".carry/sessions")
                 if p.is_dir()), Path("/work/shared/sessions"))
MIB = 2**20


def _opts(cmd: list[str]) -> dict[str, str]:
    flags = {"--jinja", "-cmoe"}
    return {k: cmd[i + 1] for i, k in enumerate(cmd[:-1]) if k.startswith("-") and k not in flags}


def test_command_line_keeps_every_expert_in_pinned_host_memory_with_the_pools_cache():
    cmd = mc.moe_cache_server_command(Path("/x/llama-server"), Path("/m.gguf"), 18555, 7301, 12, 32768,
                                      "--moe-cache-cpu-share  0.5", batch=["-b", "4096", "-ub", "4096"])
    assert cmd[0] == "/x/llama-server"
    opts = _opts(cmd)
    assert opts["-m"] == "/m.gguf" and opts["--host"] == "127.0.0.1" and opts["--port"] == "18555"
    assert opts["-c"] == "65536" and opts["-np"] == "2" and opts["-ngl"] == "999"
    assert opts["-t"] == "12" and opts["-tb"] == "12" and opts["-b"] == "4096" and opts["-ub"] == "4096"
    assert opts["--cache-reuse"] == "0" and "--jinja" in cmd
    # every expert in host memory (-cmoe), read into the pinned host buffer (-lm none), the cache on the GPU
    assert "-cmoe" in cmd and opts["--moe-cache-mib"] == "7301" and opts["-lm"] == "none"
    # no layer placement of its own: the cache is its only expert memory on the GPU
    assert not {"--n-cpu-moe", "-ncmoe", "-ot", "--override-tensor"} & set(cmd)
    assert cmd[-2:] == ["--moe-cache-cpu-share", "0.5"]


def test_the_cache_is_ostinatos_pool_in_whole_mib():
    assert mc.cache_mib(7301 * MIB) == 7301
    assert mc.cache_mib(7302 * MIB - 1) == 7301   # never more than the pool
    assert mc.cache_mib(MIB) == 1
    with pytest.raises(BenchError, match="under 1 MiB"):
        mc.cache_mib(MIB - 1)   # 0 would turn the cache off


def test_binary_comes_from_the_environment(tmp_path):
    with pytest.raises(BenchError, match=mc.MOE_CACHE_ENV):
        mc.moe_cache_server_binary({})
    f = tmp_path / "llama-server"
    f.write_text("#!/bin/sh\n")
    with pytest.raises(BenchError, match="not an executable"):
        mc.moe_cache_server_binary({mc.MOE_CACHE_ENV: str(f)})
    f.chmod(0o755)
    assert mc.moe_cache_server_binary({mc.MOE_CACHE_ENV: str(f)}) == f


def test_cache_figures_from_its_log():
    # the lines as upstream's src/llama-moe-cache.cpp prints them: the size at load (one per GPU),
    # hits and misses when the server stops
    log = "\n".join([
        "load_tensors: offloaded 49/49 layers to GPU",
        "impl:      CUDA0 MoE cache size =  7301.00 MiB for 16224.00 MiB of host experts",
        "impl: 48 layers, q4_0:  2920 slots (44.6%)",
        "srv  update_slots: all slots are idle",
        "llama_moe_cache: ubatch <= 8: hits = 9000, misses = 1000, hit rate = 90.00%, uploaded = 2750.50 MiB",
        "llama_moe_cache: ubatch  > 8: hits = 30, misses = 10, hit rate = 75.00%, uploaded = 27.50 MiB",
        "llama_moe_cache: large batches: 1200 experts copied from the cache, 3300.00 MiB"])
    f = mc.cache_figures(log)
    assert f["hot_route_share"] == pytest.approx(0.9)
    c = f["moe_cache"]
    assert c["size_mib"] == 7301.0 and c["host_experts_mib"] == 16224.0
    assert c["small"] == {"hits": 9000, "misses": 1000, "hit_rate": 0.9, "uploaded_mib": 2750.5}
    assert c["large"]["hit_rate"] == 0.75 and c["large"]["misses"] == 10
    # two GPUs: the cache is split among them, the figures are the sums
    two = log.replace("for 16224.00 MiB", "for 8112.00 MiB") + \
        "\nimpl:      CUDA1 MoE cache size =  3650.00 MiB for 8112.00 MiB of host experts"
    assert mc.cache_figures(two)["moe_cache"]["size_mib"] == 7301.0 + 3650.0
    # a server killed before it printed its stats, or with the cache off: no figures, no error
    none = mc.cache_figures("main: server is listening on http://127.0.0.1:18555\n")
    assert none["hot_route_share"] is None and none["moe_cache"]["small"] is None
    assert none["moe_cache"]["size_mib"] is None


def test_the_moe_cache_server_is_a_peer_named_only_on_request():
    assert MOE_CACHE in CHOICES and MOE_CACHE not in ENGINES and is_peer(MOE_CACHE)
    assert "OSTINATO_MOE_CACHE_SERVER" in " ".join(be.build_parser().format_help().split())


def test_a_missing_binary_is_a_note_not_a_failure(tmp_path, monkeypatch):
    """Named without a binary, the engine is skipped with a note (the bench's BenchError), before
    anything reads the model; the run goes on."""
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(mc.MOE_CACHE_ENV, raising=False)
    model = tmp_path / "m.gguf"
    a = be.build_parser().parse_args(["--model", str(model)])
    with pytest.raises(BenchError, match="binary not found"):
        mc.start_moe_cache_server(model, 64 * MIB, tmp_path, a)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(mc.MOE_CACHE_ENV), reason="needs upstream llama.cpp's llama-server "
                    f"with --moe-cache-mib named by {mc.MOE_CACHE_ENV} and a GPU (scripts/device-run.sh "
                    "stage mcbuild)")
def test_small_bench_with_the_moe_cache_server(tmp_path, monkeypatch, capsys):
    """The small shape (8 layers, 14 MB of experts: at a 30% pool a 4 MiB cache, ~75 slots; the tiny
    shape's pool is under 1 MiB) through the bench with the stock llama-server beside it."""
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    argv = ["--shape", "small", "--turns", "2", "--sessions", "1", "--dev-sessions", "1",
            "--dev-turns", "2", "--dev-max-gen", "4", "--n-ctx", "16384", "--threads", "2",
            "--out-dir", str(out), "--work-dir", str(tmp_path / "work"), "--name", "tiny-mc",
            "--sessions-dir", str(SESSIONS), "--budget-frac", "0.3",
            "--engines", f"ostinato,llama-server,{MOE_CACHE}"]
    monkeypatch.chdir(tmp_path)
    rc = be.main(argv)
    sys.stdout.write(capsys.readouterr().out)
    res = json.loads((out / "tiny-mc.json").read_text())
    assert rc == 0 and MOE_CACHE in res["engines"], res["notes"]
    e = res["engines"][MOE_CACHE]
    assert e["turns"] == 2 and e["errors"] == 0, e
    cmd = e["server_command"]
    assert cmd[cmd.index("--moe-cache-mib") + 1] == str(res["plan"]["pool_bytes"] // MIB)
    # its log said the cache's size at load and its hits when it stopped
    assert e["moe_cache"]["size_mib"] is not None and e["moe_cache"]["small"] is not None, e["moe_cache"]
    assert 0 <= e["hot_route_share"] <= 1
    assert res["ratios_vs_best_peer"]["decode"] is not None
