"""What this machine is: GPUs (NVML), CPU cores, host memory, measured bandwidths.

The one place that probes the hardware (the hardware profile, the planner's free GPU memory, the
live snapshots' GPU memory, thread counts of the engine):

* GPUs through NVML (``pynvml`` from nvidia-ml-py): name, memory total/free/used, PCIe generation
  and width (current and maximum link) -- :func:`probe_gpus`, :func:`detect_gpus`,
  :func:`gpu_memory`;
* CPU and memory through psutil: physical/logical cores (:func:`physical_cores`), NUMA nodes
  (``/sys/devices/system/node``), RAM total/available;
* measured bandwidths: host read bandwidth (numpy reductions on one thread per physical core) and,
  when a GPU and the CUDA runtime exist, pinned host->GPU bandwidth measured with ``cudaMemcpy``
  from ``cudaMallocHost`` memory, called through ctypes on ``libcudart``;
* :func:`collect_profile`: all of it as the ``ostinato-hardware/1`` dict that
  :mod:`ostinatod.profile` stores, with its :func:`hardware_fingerprint`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime as _dt
import hashlib
import importlib.util
import json
import logging
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import psutil

from .cpus import (CpuTopology, choose_cpu_placement, format_cpulist, gpu_numa_node, parse_cpulist,
                   pin_process, read_cpu_topology)

log = logging.getLogger("ostinatod.hardware")

FORMAT = "ostinato-hardware/1"
GIB = 1 << 30


# --- GPUs (NVML) -----------------------------------------------------------------------------

def probe_gpus() -> list[dict[str, Any]]:
    """NVIDIA GPUs seen by NVML, in NVML index order.

    Returns a list of ``{"index", "name", "uuid", "memory_total_bytes", "memory_free_bytes",
    "pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max", "pci_bus_id", "numa_node"}`` (PCIe
    fields None when NVML cannot tell; ``numa_node`` from sysfs, None when the platform does not
    say). No NVML library or no driver: ``[]`` (a CPU-only machine), never an exception.
    """
    try:
        import pynvml  # lazy: optional (NVIDIA driver)
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ImportError
        log.debug("no NVML: %s", e)
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)

            def q(fn, h=h):
                try:
                    return int(fn(h))
                except Exception:
                    return None

            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            try:
                bus = _name(pynvml.nvmlDeviceGetPciInfo(h).busId)
            except Exception:
                bus = None
            out.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                "memory_total_bytes": int(mem.total),
                "memory_free_bytes": int(mem.free),
                "pcie_gen": q(pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                "pcie_width": q(pynvml.nvmlDeviceGetCurrPcieLinkWidth),
                "pcie_gen_max": q(pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                "pcie_width_max": q(pynvml.nvmlDeviceGetMaxPcieLinkWidth),
                "pci_bus_id": bus,
                "numa_node": gpu_numa_node(bus) if bus else None,
            })
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


# --- CPU and memory (psutil, /sys) --------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _numa_nodes() -> list[dict[str, Any]]:
    """NUMA nodes from ``/sys/devices/system/node`` (Linux); elsewhere one node with all CPUs."""
    base = Path("/sys/devices/system/node")
    nodes = []
    if base.is_dir():
        for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            try:
                cpus = (d / "cpulist").read_text().strip()
            except OSError:
                cpus = ""
            mem_total = None
            try:
                for line in (d / "meminfo").read_text().splitlines():
                    if "MemTotal:" in line:  # "Node 0 MemTotal:  24000000 kB"
                        mem_total = int(line.split()[-2]) * 1024
            except (OSError, ValueError):
                pass
            nodes.append({"node": int(d.name[4:]), "cpus": cpus, "memory_total_bytes": mem_total})
    if not nodes:
        nodes = [{"node": 0, "cpus": f"0-{(psutil.cpu_count() or 1) - 1}", "memory_total_bytes": None}]
    return nodes


def probe_host() -> dict[str, Any]:
    """CPU and memory: ``{"os", "machine", "cpu_model", "physical_cores", "logical_cores",
    "numa_nodes": [{"node", "cpus", "memory_total_bytes"}], "cpu_placement" (the engine's CPUs and
    thread count: :func:`cpu_placement`), "ram_total_bytes", "ram_available_bytes"}``."""
    vm = psutil.virtual_memory()
    return {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False) or psutil.cpu_count() or 1,
        "logical_cores": psutil.cpu_count() or 1,
        "numa_nodes": _numa_nodes(),
        "cpu_placement": cpu_placement(),
        "ram_total_bytes": int(vm.total),
        "ram_available_bytes": int(vm.available),
    }


# --- bandwidths ---------------------------------------------------------------------------------

def measure_host_read_bandwidth(size_mb: int = 512, threads: Optional[int] = None,
                                repeats: int = 3) -> dict[str, Any]:
    """Host memory read bandwidth in GB/s (1e9 bytes/s), best of ``repeats``.

    One float64 array of ``size_mb`` MiB is split in ``threads`` contiguous chunks (default:
    physical cores) and each thread sums its chunk (numpy releases the GIL in reductions), so the
    figure is what the CPU branch can stream from RAM, not a single-core figure. Use an array well
    above the last-level cache (the default 512 MiB) for a meaningful number.
    Returns ``{"gbps", "size_bytes", "threads"}``.
    """
    threads = threads or psutil.cpu_count(logical=False) or 1
    n = max(threads, size_mb * (1 << 20) // 8)
    a = np.ones(n, dtype=np.float64)  # touch every page before timing
    chunks = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, chunks))  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    return {"gbps": round(a.nbytes / best / 1e9, 2), "size_bytes": int(a.nbytes), "threads": threads}


def _find_cudart() -> Optional[str]:
    """Path or soname of the CUDA runtime: next to our native engine, the nvidia pip wheel, or the
    system library search path."""
    cands: list[str] = []
    try:
        spec = importlib.util.find_spec("llama_cpp")
        if spec and spec.origin:
            cands += sorted(str(p) for p in (Path(spec.origin).parent / "lib").glob("libcudart.so*"))
    except Exception:
        pass
    for p in sys.path:
        for pat in ("nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*"):
            cands += sorted(str(x) for x in Path(p).glob(pat))
    found = ctypes.util.find_library("cudart")
    if found:
        cands.append(found)
    cands += ["libcudart.so", "libcudart.so.12", "libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so"]
    for c in cands:
        try:
            ctypes.CDLL(c)
            return c
        except OSError:
            continue
    return None


def measure_pinned_h2d_bandwidth(device: int = 0, size_mb: int = 256,
                                 repeats: int = 5) -> Optional[dict[str, Any]]:
    """Pinned host->GPU copy bandwidth of ``device`` in GB/s (1e9 bytes/s), best of ``repeats``.

    This is the bandwidth the upload path pays per cold expert (paper Sec. 3, the Np switch point).
    Uses the CUDA runtime through ctypes: ``cudaMallocHost`` + ``cudaMalloc`` + synchronous
    ``cudaMemcpy`` (kind 1 = host-to-device). Returns ``{"gbps", "size_bytes", "method"}`` or None
    when no CUDA runtime or no device is usable (the reason is logged).
    """
    lib_name = _find_cudart()
    if lib_name is None:
        log.info("pinned H2D bandwidth: no CUDA runtime (libcudart) found; skipped")
        return None
    rt = ctypes.CDLL(lib_name)
    size = size_mb << 20
    host, dev = ctypes.c_void_p(), ctypes.c_void_p()

    def ck(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed with cudaError {err}")

    try:
        ck(rt.cudaSetDevice(ctypes.c_int(device)), "cudaSetDevice")
        ck(rt.cudaMallocHost(ctypes.byref(host), ctypes.c_size_t(size)), "cudaMallocHost")
        ck(rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(size)), "cudaMalloc")
        ctypes.memset(host, 1, size)
        best = float("inf")
        for i in range(repeats + 1):
            ck(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            t0 = time.perf_counter()
            ck(rt.cudaMemcpy(dev, host, ctypes.c_size_t(size), ctypes.c_int(1)), "cudaMemcpy")
            ck(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            if i:  # first copy is a warm-up
                best = min(best, time.perf_counter() - t0)
        return {"gbps": round(size / best / 1e9, 2), "size_bytes": size, "method": f"ctypes:{Path(lib_name).name}"}
    except (RuntimeError, AttributeError) as e:
        log.info("pinned H2D bandwidth on GPU %d not measured: %s", device, e)
        return None
    finally:
        if dev.value:
            rt.cudaFree(dev)
        if host.value:
            rt.cudaFreeHost(host)


# --- fingerprint, storage -----------------------------------------------------------------------

def hardware_fingerprint(profile: dict[str, Any]) -> str:
    """Hex sha256 over what changes the cost model: per GPU (name, memory total, max PCIe link),
    CPU model, physical cores and RAM total rounded to GiB (so free-memory noise never counts)."""
    host = profile.get("host", {})
    key = {
        "gpus": [[g.get("name"), g.get("memory_total_bytes"), g.get("pcie_gen_max"), g.get("pcie_width_max")]
                 for g in profile.get("gpus", [])],
        "cpu": host.get("cpu_model"),
        "cores": host.get("physical_cores"),
        "ram_gib": round((host.get("ram_total_bytes") or 0) / GIB),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def collect_profile(measure: bool = True, host_read_mb: int = 512, h2d_mb: int = 256) -> dict[str, Any]:
    """Probe the machine now (no file I/O). ``measure=False`` skips the bandwidth measurements
    (their fields are then None). Returns the profile dict without ``calibration``."""
    gpus = probe_gpus()
    host = probe_host()
    bw: dict[str, Any] = {"host_read_gbps": None, "host_read_threads": None, "h2d_pinned": []}
    if measure:
        hr = measure_host_read_bandwidth(size_mb=host_read_mb)
        bw["host_read_gbps"], bw["host_read_threads"] = hr["gbps"], hr["threads"]
        for g in gpus:
            r = measure_pinned_h2d_bandwidth(g["index"], size_mb=h2d_mb)
            bw["h2d_pinned"].append({"device": g["index"], **(r or {"gbps": None, "method": None})})
    prof = {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_only": not gpus,
        "host": host,
        "gpus": gpus,
        "bandwidth": bw,
    }
    prof["fingerprint"] = hardware_fingerprint(prof)
    return prof


# --- GPUs for planning and live snapshots -----------------------------------------------------

@dataclass
class GpuSpec:
    """One GPU for planning. ``free_bytes`` None = unknown (emulated GPU: budget alone decides)."""

    device: int
    free_bytes: Optional[int] = None
    name: str = ""


def _name(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def detect_gpus() -> list[GpuSpec]:
    """NVIDIA GPUs with their free memory, via nvidia-ml-py; [] when there is none or no driver."""
    return [GpuSpec(g["index"], g["memory_free_bytes"], g["name"]) for g in probe_gpus()]


_nvml_ok: Optional[bool] = None


def gpu_memory() -> list[dict[str, Any]]:
    """Per NVIDIA GPU ``{"index", "name", "total_bytes", "used_bytes"}`` (NVML kept initialised
    for repeated live snapshots); [] without one."""
    global _nvml_ok
    if _nvml_ok is False:
        return []
    try:
        import pynvml  # lazy: optional (NVIDIA driver)
        if not _nvml_ok:
            pynvml.nvmlInit()
            _nvml_ok = True
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            m = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append({"index": i, "name": _name(pynvml.nvmlDeviceGetName(h)),
                        "total_bytes": int(m.total), "used_bytes": int(m.used)})
        return out
    except Exception:
        _nvml_ok = False
        return []


def physical_cores() -> int:
    """Physical CPU cores (psutil), else logical ones, else 2."""
    try:
        return psutil.cpu_count(logical=False) or os.cpu_count() or 2
    except Exception:
        return os.cpu_count() or 2


_placement: dict[str, Any] = {}


def cpu_placement(cpu_set: Optional[str] = None) -> dict[str, Any]:
    """The engine's CPUs on this machine (:func:`choose_cpu_placement` over sysfs, the GPUs' NUMA
    nodes from NVML bus ids and this process's affinity; cached per ``cpu_set``). ``cpu_set`` (the
    setting of that name): None or "auto" chooses; "all" keeps every allowed CPU's physical core,
    unpinned; a cpulist ("0-15,32-47") is used as given, pinned. The GPUs are those of
    CUDA_VISIBLE_DEVICES when it lists indices, else all. Never raises: on a failure, the physical
    core count, unpinned."""
    key = cpu_set or "auto"
    if key in _placement:
        return _placement[key]
    try:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        if key not in ("auto", "all"):
            cpus = sorted(set(parse_cpulist(key)) & (allowed or set(parse_cpulist(key))))
            if not cpus:
                raise ValueError(f"cpu_set {key!r} names no CPU this process may use")
            out = {"cpus": cpus, "cpulist": format_cpulist(cpus), "threads": len(cpus), "nodes": [],
                   "numa_nodes": None, "pin": True, "reason": f"setting cpu_set = {key}"}
        elif key == "all":
            topo = read_cpu_topology()
            merged = CpuTopology({0: sorted({c for cs in topo.nodes.values() for c in cs})}, topo.core_of)
            out = {**choose_cpu_placement(merged, [], allowed), "nodes": sorted(topo.nodes),
                   "numa_nodes": len(topo.nodes),
                   "reason": "setting cpu_set = all: every physical core, not pinned"}
        else:
            gpus = probe_gpus()
            vis = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            if vis and all(v.strip().isdigit() for v in vis.split(",")):
                want = {int(v) for v in vis.split(",")}
                gpus = [g for g in gpus if g["index"] in want]
            out = choose_cpu_placement(read_cpu_topology(), [g.get("numa_node") for g in gpus], allowed)
    except Exception as e:  # noqa: BLE001 - a probe problem must not stop the engine
        n = physical_cores()
        out = {"cpus": [], "cpulist": "", "threads": n, "nodes": [], "numa_nodes": None, "pin": False,
               "reason": f"placement not chosen ({type(e).__name__}: {e}): {n} physical cores, not pinned"}
    _placement[key] = out
    return out


def default_threads(cpu_set: Optional[str] = None) -> int:
    """CPU threads of the engine when the setting n_threads is unset: one per physical core of
    :func:`cpu_placement` (at least 1)."""
    return max(1, int(cpu_placement(cpu_set)["threads"]))


def expert_engine_threads(n_threads: Optional[int], decode_threads: Optional[int],
                          cpu_set: Optional[str] = None, kernel: bool = True) -> tuple[int, int]:
    """(context threads for prefill, decode-graph CPU-branch threads) of the expert engine.

    With the CPU branch's own kernel (``kernel``, setting ``cpu_branch_kernel``) its team is plain
    threads that sleep outside decode-graph passes, so neither team waits on the other: unset, the
    context gets every core of :func:`default_threads` for prefill and the CPU branch every core
    but one (the context's own thread, which launches the decode graph and waits for it, keeps
    one). With ggml's graph compute (``kernel`` false) both teams are OpenMP teams, and libgomp cuts
    every wait short once the process holds more OpenMP threads than CPUs: the pool then gets a
    quarter of the cores and the context the rest (measured on the 16-core H200 machine,
    docs/benchmarks/runs/2026-12-01-engines-h200-16c-L48-threads.md: context 16 with pool 15 cost every prefill
    ~1.8 s more at a 100% pool). A set ``n_threads`` is kept for the context and ``decode_threads``
    (setting or calibration) for the pool; the pool then defaults to ``n_threads - 1``. Never raises."""
    p = default_threads(cpu_set)
    if n_threads:
        return int(n_threads), int(decode_threads or max(1, int(n_threads) - 1))
    if kernel:
        return p, int(decode_threads or max(1, p - 1))
    pool = int(decode_threads or max(1, p // 4))
    return max(1, p - min(pool, p // 4)), pool


def apply_cpu_placement(cpu_set: Optional[str] = None) -> dict[str, Any]:
    """Pin this process (a process of its own for the engine: the worker, ``ostinato calibrate``)
    to :func:`cpu_placement`'s CPUs when it says ``pin``, with :func:`pin_process`, and log the
    choice. The engine's thread pools are ggml's and the decode graph's, made with an empty cpumask:
    their threads inherit this mask, so they stay on those CPUs (not one thread per core: that needs
    the pools' cpumask, see docs/engine.md). Returns the placement with ``pinned_threads`` (0:
    not pinned) and, when the mask was refused, ``pin_error``; never raises."""
    place = dict(cpu_placement(cpu_set))
    place["pinned_threads"] = 0
    if place["pin"]:
        try:
            place["pinned_threads"] = pin_process(place["cpus"])
        except OSError as e:
            place["pin_error"] = str(e)
            log.warning("CPU placement: could not pin to %s: %s", place["cpulist"], e)
    log.info("CPU placement: %d threads on CPUs %s (%s)%s", place["threads"], place["cpulist"] or "?",
             place["reason"], f"; {place['pinned_threads']} threads pinned" if place["pinned_threads"] else "")
    return place
