"""Hardware profile: real probes of this machine (psutil, NVML if present), schema, merge rules."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from ostinatod import cpus, hardware
from ostinatod import profile as prof

ROOT = Path(__file__).resolve().parents[2]
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


# --- CPU placement on hosts with several NUMA nodes (fake sysfs trees) ----------------------------

def _fake_sys(root: Path, nodes: dict[int, str], smt: int = 2, cores_per_pkg: int = 0,
              gpus: dict[str, int] | None = None) -> Path:
    """A sysfs tree: ``nodes`` {node: cpulist}; logical CPU c is core c % n_phys with ``smt``
    hyper-threads (the Linux numbering: siblings are n_phys apart), package = node; ``gpus``
    {sysfs PCI id: numa_node}."""
    all_cpus = sorted(c for cl in nodes.values() for c in cpus.parse_cpulist(cl))
    n_phys = len(all_cpus) // smt
    for n, cl in nodes.items():
        d = root / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cl + "\n")
        for c in cpus.parse_cpulist(cl):
            t = root / "devices/system/cpu" / f"cpu{c}" / "topology"
            t.mkdir(parents=True)
            (t / "physical_package_id").write_text(f"{n}\n")
            (t / "core_id").write_text(f"{c % n_phys}\n")
    for bus, node in (gpus or {}).items():
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


def test_cpu_placement_two_sockets_follows_the_gpus_node(tmp_path):
    """2 sockets x 16 cores x 2 threads (node 0: CPUs 0-15,32-47; node 1: 16-31,48-63): the GPUs'
    node's 16 physical cores, pinned; GPUs on both nodes: all 32 physical cores; no GPU node known:
    the largest node; one node: its physical cores, unpinned."""
    root = _fake_sys(tmp_path / "a", {0: "0-15,32-47", 1: "16-31,48-63"},
                     gpus={"0000:3b:00.0": 1, "0000:86:00.0": 1, "0000:af:00.0": 0, "0000:d8:00.0": -1})
    topo = cpus.read_cpu_topology(root)
    assert topo.nodes[1] == list(range(16, 32)) + list(range(48, 64))
    assert topo.core_of[16] == topo.core_of[48] == (1, 16)  # hyper-thread siblings share a core
    n1 = cpus.gpu_numa_node("00000000:3B:00.0", root)   # NVML's 8-digit, upper-case form
    assert n1 == 1 and cpus.gpu_numa_node("00000000:86:00.0", root) == 1
    assert cpus.gpu_numa_node("00000000:D8:00.0", root) is None   # -1: no NUMA information
    assert cpus.gpu_numa_node("00000000:01:00.0", root) is None   # no such device
    p = cpus.choose_cpu_placement(topo, [n1, 1])
    assert p["cpus"] == list(range(16, 32)) and p["threads"] == 16 and p["pin"]
    assert p["nodes"] == [1] and p["cpulist"] == "16-31" and "NUMA node(s) [1]" in p["reason"]
    both = cpus.choose_cpu_placement(topo, [0, 1])
    assert both["cpus"] == list(range(32)) and both["threads"] == 32 and both["nodes"] == [0, 1]
    unknown = cpus.choose_cpu_placement(topo, [None])
    assert unknown["nodes"] == [0] and unknown["threads"] == 16 and "unknown" in unknown["reason"]
    # a process limited (taskset, cgroup) to part of node 1 and the siblings of node 0
    lim = cpus.choose_cpu_placement(topo, [1], allowed=set(range(20, 24)) | set(range(32, 48)))
    assert lim["cpus"] == [20, 21, 22, 23] and lim["nodes"] == [1]
    one = cpus.choose_cpu_placement(topo, [1], allowed=set(range(32, 40)))  # only node 0's HTs
    assert one["cpus"] == list(range(32, 40)) and not one["pin"] and one["nodes"] == [0]
    # one node, 8 cores x 2 threads: 8 threads, not pinned, whatever the GPU says
    single = cpus.read_cpu_topology(_fake_sys(tmp_path / "b", {0: "0-15"}))
    s = cpus.choose_cpu_placement(single, [0])
    assert s["cpus"] == list(range(8)) and s["threads"] == 8 and not s["pin"]


def test_cpu_topology_without_node_or_topology_files(tmp_path):
    """No node dirs: one node with every CPU; no topology files: each logical CPU its own core."""
    for c in range(4):
        (tmp_path / "devices/system/cpu" / f"cpu{c}").mkdir(parents=True)
    topo = cpus.read_cpu_topology(tmp_path)
    assert topo.nodes == {0: [0, 1, 2, 3]}
    p = cpus.choose_cpu_placement(topo, [])
    assert p["threads"] == 4 and not p["pin"]
    assert cpus.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpus.format_cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError):
        cpus.parse_cpulist("0-x")


def test_placement_of_this_machine_and_the_pin(monkeypatch):
    """On this machine: a placement within the process's CPUs; a cpu_set setting is used as given;
    pin_process restricts every thread and a new thread inherits the mask."""
    import os
    import threading

    allowed = os.sched_getaffinity(0)
    p = hardware.cpu_placement()
    assert p["threads"] >= 1 and set(p["cpus"]) <= allowed
    assert hardware.default_threads() == p["threads"]
    first = min(allowed)
    assert hardware.cpu_placement(str(first))["cpus"] == [first]
    seen = {}
    try:
        assert cpus.pin_process([first]) >= 1
        th = threading.Thread(target=lambda: seen.update(mask=os.sched_getaffinity(0)))
        th.start()
        th.join()
        assert seen["mask"] == {first} and os.sched_getaffinity(0) == {first}
    finally:
        cpus.pin_process(sorted(allowed))
    assert os.sched_getaffinity(0) == allowed


def test_expert_engine_threads_leave_the_pool_its_cores(monkeypatch):
    """Unset, with the CPU branch's own kernel (plain threads that sleep between decode passes) the
    context gets every core for prefill and the CPU branch every core but one; with ggml's graph
    compute (two OpenMP teams) the pool gets a quarter of the cores and the context the rest (no more
    OpenMP threads than cores: the 16-core H200 run in docs/benchmarks/runs/2026-12-01-engines-h200-16c-L48-threads.md);
    set counts are kept as given."""
    for cores, want, want_kernel in ((16, (12, 4), (16, 15)), (32, (24, 8), (32, 31)), (2, (2, 1), (2, 1)),
                                     (1, (1, 1), (1, 1))):
        monkeypatch.setattr(hardware, "default_threads", lambda cpu_set=None, c=cores: c)
        assert hardware.expert_engine_threads(None, None, kernel=False) == want
        assert hardware.expert_engine_threads(None, None) == want_kernel
    monkeypatch.setattr(hardware, "default_threads", lambda cpu_set=None: 16)
    assert hardware.expert_engine_threads(8, None) == (8, 7)       # n_threads set: pool as before
    assert hardware.expert_engine_threads(None, 6, kernel=False) == (12, 6)   # calibrated pool, context capped
    assert hardware.expert_engine_threads(None, 6) == (16, 6)
    assert hardware.expert_engine_threads(10, 3) == (10, 3)
