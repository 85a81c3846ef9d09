"""Hardware profile: what this machine has and how fast its memory paths are (``ostinato profile``).

The profile is one JSON file at ``paths.hardware_profile`` (format ``ostinato-hardware/1``,
schema in ``profiles/hardware.schema.json``); :mod:`ostinatod.hardware` probes the machine. It
records

* GPUs through NVML (``pynvml`` from nvidia-ml-py): name, memory total/free, PCIe generation and
  width (current and maximum link);
* CPU and memory through psutil: physical/logical cores, NUMA nodes (``/sys/devices/system/node``),
  RAM total/available;
* measured bandwidths: host read bandwidth (numpy reductions on one thread per physical core) and,
  when a GPU and the CUDA runtime exist, pinned host->GPU bandwidth measured with ``cudaMemcpy``
  from ``cudaMallocHost`` memory, called through ctypes on ``libcudart`` (the same runtime the
  native engine links);
* ``calibration``: the engine's cost-model calibration (written by ``ostinatod.engine.calibrate``
  into this same file through :mod:`ostinatod.residency.calibration`). It is kept across re-profiling and never dropped here.

A *hardware fingerprint* (sha256 over the parts that change the cost model: GPU names, memory
totals and PCIe max links, CPU model, physical cores, RAM total in GiB) tells when the machine
changed; then the calibration is re-run (``ostinatod.engine.calibrate.run_calibration``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from .engine.calibrate import run_calibration
from .files import write_json_atomic
from .hardware import GIB, collect_profile
from .paths import get_paths
from .residency.calibration import PROBE_KIND

log = logging.getLogger("ostinatod.profile")

def load_profile(path: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """The stored profile, or None when there is none or it is not valid JSON (logged)."""
    path = path or get_paths().hardware_profile
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        log.warning("hardware profile %s unreadable (%s); it will be rewritten", path, e)
        return None


def _recalibrate(path: Path) -> bool:
    """Run the engine calibration (it stores its section into ``path``); True when it ran.
    ``run_calibration`` never raises."""
    log.info("hardware changed: re-running the engine calibration")
    cal = run_calibration(profile_path=path)
    if cal.get("error"):
        log.info("calibration: %s", cal["error"])
    return True


def update_profile(path: Optional[Path] = None, measure: bool = True, recalibrate: bool = True,
                   **measure_kw: Any) -> dict[str, Any]:
    """Probe, merge with the stored profile and write it (atomically).

    The stored ``calibration`` section is kept. When the hardware fingerprint differs from the
    stored one (or none was stored), the calibration is marked ``stale`` and, with
    ``recalibrate=True``, re-run through ``ostinatod.engine.calibrate.run_calibration()`` (which
    writes its section into the same file; the file is re-read afterwards).
    Returns the profile as stored, with ``"changed": bool`` telling whether the fingerprint moved.
    """
    path = path or get_paths().hardware_profile
    old = load_profile(path) or {}
    new = collect_profile(measure=measure, **measure_kw)
    changed = old.get("fingerprint") != new["fingerprint"]
    # re-read: a calibration or an engine's Np probe may have been stored while this one measured
    latest = load_profile(path) or {}
    if "calibration" in latest:
        old["calibration"] = latest["calibration"]
    if "calibration" in old:
        new["calibration"] = old["calibration"]
        if changed and isinstance(new["calibration"], dict):
            new["calibration"]["stale"] = True
    write_json_atomic(path, new, indent=2)
    if changed and recalibrate and _recalibrate(path):
        new = load_profile(path) or new
    new["changed"] = changed
    return new


def ensure_profile(path: Optional[Path] = None, recalibrate: bool = True) -> dict[str, Any]:
    """For daemon start: write a full profile if none exists; otherwise re-probe only the cheap
    parts (no bandwidth measurement) and re-measure/recalibrate only when the fingerprint moved.
    Returns the stored profile."""
    path = path or get_paths().hardware_profile
    old = load_profile(path)
    if old is None:
        return update_profile(path, measure=True, recalibrate=recalibrate)
    quick = collect_profile(measure=False)
    if quick["fingerprint"] != old.get("fingerprint"):
        return update_profile(path, measure=True, recalibrate=recalibrate)
    return old


# --- CLI ----------------------------------------------------------------------------------------

def _gb(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def format_profile(p: dict[str, Any]) -> str:
    """Human-readable summary of a profile (multi-line string)."""
    h = p.get("host", {})
    bw = p.get("bandwidth", {})
    lines = [
        f"CPU    {h.get('cpu_model')}: {h.get('physical_cores')} cores ({h.get('logical_cores')} threads), "
        f"{len(h.get('numa_nodes', []))} NUMA node(s)",
    ]
    cp = h.get("cpu_placement")
    if cp:
        lines.append(f"       engine: {cp.get('threads')} threads on CPUs {cp.get('cpulist') or '?'} "
                     f"({cp.get('reason')})")
    lines += [
        f"RAM    {_gb(h.get('ram_total_bytes'))} total, {_gb(h.get('ram_available_bytes'))} available; "
        f"read {bw.get('host_read_gbps')} GB/s on {bw.get('host_read_threads')} threads",
    ]
    h2d = {e.get("device"): e for e in bw.get("h2d_pinned", [])}
    if not p.get("gpus"):
        lines.append("GPU    none (CPU-only profile)")
    for g in p.get("gpus", []):
        e = h2d.get(g["index"], {})
        lines.append(f"GPU {g['index']}  {g['name']}: {_gb(g['memory_total_bytes'])} "
                     f"({_gb(g['memory_free_bytes'])} free), PCIe gen {g.get('pcie_gen')}/{g.get('pcie_gen_max')} "
                     f"x{g.get('pcie_width')}/{g.get('pcie_width_max')}, pinned H2D {e.get('gbps')} GB/s"
                     + (f", NUMA node {g['numa_node']}" if g.get("numa_node") is not None else ""))
    cal = p.get("calibration")
    if not cal:
        state = "none yet ('ostinato calibrate')"
    elif cal.get("error"):
        state = f"failed: {cal['error']}"
    elif cal.get("stale"):
        state = "stale (hardware changed)"
    elif cal.get("kind") == PROBE_KIND:
        state = (f"Np = {cal.get('np_tokens')} measured at a model load ({cal.get('created', '?')}); "
                 "'ostinato calibrate' for the rest")
    else:
        state = f"present ({cal.get('created', '?')})"
    lines.append("calib  " + state)
    lines.append(f"fingerprint {p.get('fingerprint', '')[:16]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``ostinato profile [--show] [--json] [--quick] [--no-recalibrate]``."""
    ap = argparse.ArgumentParser(prog="ostinato profile", description="Record (or show) the hardware profile.")
    ap.add_argument("--show", action="store_true", help="print the stored profile, measure nothing")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    ap.add_argument("--quick", action="store_true", help="skip the bandwidth measurements")
    ap.add_argument("--no-recalibrate", action="store_true", help="do not re-run the calibration on change")
    ap.add_argument("--host-read-mb", type=int, default=512, help="array size of the host read test (MiB)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = get_paths().hardware_profile
    if args.show:
        p = load_profile(path)
        if p is None:
            print(f"no hardware profile at {path}; run 'ostinato profile'", file=sys.stderr)
            return 1
    else:
        p = update_profile(path, measure=not args.quick, recalibrate=not args.no_recalibrate,
                           host_read_mb=args.host_read_mb)
    print(json.dumps(p, indent=2) if args.json else format_profile(p) + f"\nstored {path}")
    return 0
