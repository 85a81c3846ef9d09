"""Where the engine's CPU threads run: the CPU topology from sysfs (NUMA nodes, physical cores),
the NUMA node of a PCI device (a GPU), the choice of CPUs for the engine (one thread per physical
core; on a host with several NUMA nodes those of the GPUs' node, pinned) and the pinning itself.

Pure functions over a sysfs tree (``sys_root``, ``/sys`` on the machine; tests pass a fake tree)
and the process's own CPU mask. The live choice, with the GPUs' nodes from NVML, is
:func:`ostinatod.hardware.cpu_placement`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


SYS = Path("/sys")


def parse_cpulist(text: str) -> list[int]:
    """A Linux cpulist (``"0-3,8,10-11"``, as in ``/sys/devices/system/node/node0/cpulist``) ->
    sorted CPU ids; ``""`` -> []. Raises ValueError on a malformed list."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def format_cpulist(cpus: list[int]) -> str:
    """Sorted CPU ids -> the shortest cpulist (``[0, 1, 2, 5]`` -> ``"0-2,5"``)."""
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass
class CpuTopology:
    """Logical CPUs by NUMA node, and the physical core (package id, core id) of each."""

    nodes: dict[int, list[int]]
    core_of: dict[int, tuple[int, int]]


def read_cpu_topology(sys_root: Path = SYS) -> CpuTopology:
    """The CPU topology from sysfs under ``sys_root`` (``/sys``; tests pass a fake tree):
    ``devices/system/node/node*/cpulist`` (no node dirs: one node 0 with every CPU) and
    ``devices/system/cpu/cpu*/topology/{physical_package_id,core_id}`` (missing: each logical CPU
    is its own core)."""
    cpu_dir = sys_root / "devices" / "system" / "cpu"
    cpus = sorted(int(d.name[3:]) for d in cpu_dir.glob("cpu[0-9]*") if d.name[3:].isdigit())
    nodes: dict[int, list[int]] = {}
    for d in (sys_root / "devices" / "system" / "node").glob("node[0-9]*"):
        try:
            nodes[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    if not nodes:
        nodes = {0: cpus or list(range(os.cpu_count() or 1))}
    core_of: dict[int, tuple[int, int]] = {}
    for c in sorted({c for cs in nodes.values() for c in cs} | set(cpus)):
        t = cpu_dir / f"cpu{c}" / "topology"
        try:
            core_of[c] = (int((t / "physical_package_id").read_text()), int((t / "core_id").read_text()))
        except (OSError, ValueError):
            core_of[c] = (-1, c)
    return CpuTopology(nodes, core_of)


def gpu_numa_node(pci_bus_id: str, sys_root: Path = SYS) -> Optional[int]:
    """NUMA node of a PCI device from ``bus/pci/devices/<id>/numa_node``; NVML's bus id
    (``"00000000:3B:00.0"``, 8-digit domain) is turned into sysfs's (``"0000:3b:00.0"``). None when
    the file is missing or says -1 (no NUMA information, e.g. many VMs)."""
    try:
        dom, rest = pci_bus_id.strip().split(":", 1)
        sys_id = f"{int(dom, 16):04x}:{rest.lower()}"
        node = int((sys_root / "bus" / "pci" / "devices" / sys_id / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def choose_cpu_placement(topo: CpuTopology, gpu_nodes: list[Optional[int]],
                         allowed: Optional[set[int]] = None) -> dict[str, Any]:
    """Which CPUs the engine's threads use, one thread per physical core (pure).

    ``allowed``: the CPUs this process may run on (``os.sched_getaffinity``; None: all). One CPU
    per physical core (the lowest logical id of its (package, core), so no two threads share a
    core's hyper-threads). With one NUMA node (that has allowed CPUs): all of them, not pinned (the
    scheduler does well within one node). With several: the nodes of the GPUs (``gpu_nodes``, their
    sysfs NUMA nodes; None entries unknown) -- the host memory the engine touches first and the
    PCIe root of its copies are there, and thread barriers stay in one socket; when no GPU's node
    is known, the node with the most cores (the lowest id on a tie); pinned.

    Returns ``{"cpus": [ids], "cpulist": str, "threads": len(cpus), "nodes": [node ids],
    "numa_nodes": n of the host, "pin": bool, "reason": str}``."""
    ok = (lambda c: True) if allowed is None else (lambda c: c in allowed)
    phys: dict[int, list[int]] = {}
    for node, cpus in sorted(topo.nodes.items()):
        seen: set[tuple[int, int]] = set()
        for c in sorted(cpus):
            core = topo.core_of.get(c, (-1, c))
            if ok(c) and core not in seen:
                seen.add(core)
                phys.setdefault(node, []).append(c)
    if not phys:  # an affinity mask outside every node (should not happen): what we may use
        cpus = sorted(allowed or {0})
        return {"cpus": cpus, "cpulist": format_cpulist(cpus), "threads": len(cpus), "nodes": [],
                "numa_nodes": len(topo.nodes), "pin": False,
                "reason": "allowed CPUs outside the NUMA nodes: used as they are"}
    if len(phys) == 1:
        node, cpus = next(iter(phys.items()))
        return {"cpus": cpus, "cpulist": format_cpulist(cpus), "threads": len(cpus), "nodes": [node],
                "numa_nodes": len(topo.nodes), "pin": False,
                "reason": "one NUMA node: its physical cores, not pinned"}
    local = sorted({n for n in gpu_nodes if n is not None and n in phys})
    if local:
        nodes, why = local, f"NUMA node(s) {local} of the GPUs"
    else:
        best = max(sorted(phys), key=lambda n: len(phys[n]))
        nodes, why = [best], f"GPU NUMA node unknown: node {best}, the one with the most cores"
    cpus = sorted(c for n in nodes for c in phys[n])
    return {"cpus": cpus, "cpulist": format_cpulist(cpus), "threads": len(cpus), "nodes": nodes,
            "numa_nodes": len(topo.nodes), "pin": True,
            "reason": f"{len(topo.nodes)} NUMA nodes: physical cores of {why}, pinned"}


def pin_process(cpus: list[int]) -> int:
    """Restrict every thread of this process (``/proc/self/task``) to ``cpus``; threads made later
    inherit the mask (pthreads, OpenMP's, ggml's thread pools with an empty cpumask). Returns the
    number of threads pinned; 0 where the platform has no ``sched_setaffinity``. Raises OSError
    when the mask is refused (CPUs outside the cgroup)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return 0
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    n = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return n

