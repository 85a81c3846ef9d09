"""The stored calibration record: the ``calibration`` section of the hardware profile.

Written by ``ostinato calibrate`` (:mod:`ostinatod.engine.calibrate`), read by the engine (Np,
decode overlap and threads) and the profile code. Format ``ostinato-calibration/1``; the fields
are described in docs/calibration.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from pathlib import Path
from typing import Any, Optional

from ..files import write_json_atomic
from ..hardware import collect_profile
from ..paths import get_paths

log = logging.getLogger("ostinatod.calibrate")

CALIBRATION_FORMAT = "ostinato-calibration/1"
DEFAULT_NP = 512  # the paper's threshold on PCIe 4.0 (Section 3.3), used when nothing is calibrated
SOURCE = "arXiv 2611.11533 Sec. 3.2-3.3, Prop. 3.2, App. B"


def load_calibration(path: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """The ``calibration`` section of the hardware profile, or None (missing/unreadable)."""
    path = Path(path) if path else get_paths().hardware_profile
    try:
        return json.loads(path.read_text()).get("calibration")
    except (OSError, ValueError, AttributeError):
        return None


PROBE_KIND = "prefill probe"  # a calibration record holding only the Np measured at a model load


def _is_full(cal: Any) -> bool:
    """A usable record of ``ostinato calibrate``: not stale, not failed, not a load probe."""
    return isinstance(cal, dict) and not cal.get("stale") and not cal.get("error") \
        and cal.get("kind") != PROBE_KIND


def prefill_threshold_choice(settings: Any = None, path: Optional[Path] = None,
                             model_fingerprint: Optional[str] = None) -> tuple[int, str]:
    """Np to use and where it comes from: ``(settings.prefill_threshold, "settings")`` if set, else
    ``(np_tokens, "calibration")`` of a full calibration that is not stale (512 where it found the
    upload path never cheaper), else ``(np_tokens, "probe")`` of a load probe
    (:func:`store_prefill_probe`) of this model (``model_fingerprint``; any model when None) that is
    not stale, else ``(512, "default")`` (the paper's value on PCIe 4.0, Sec. 3.3; the engine worker
    then probes on a GPU, :func:`ostinatod.engine.np_probe.probe_np`)."""
    if settings is not None and getattr(settings, "prefill_threshold", None):
        return int(settings.prefill_threshold), "settings"
    cal = load_calibration(path)
    if _is_full(cal):
        return int(cal.get("np_tokens") or DEFAULT_NP), "calibration"
    if isinstance(cal, dict) and cal.get("kind") == PROBE_KIND and not cal.get("stale") \
            and cal.get("np_tokens"):
        fp = (cal.get("model") or {}).get("fingerprint")
        if model_fingerprint is None or fp == model_fingerprint:
            return int(cal["np_tokens"]), "probe"
    return DEFAULT_NP, "default"


def store_prefill_probe(probe: dict[str, Any], model: dict[str, Any], path: Optional[Path] = None
                        ) -> Optional[Path]:
    """Store a load probe's Np and CPU-branch bandwidth (:func:`ostinatod.engine.np_probe.probe_np`:
    ``{"np_tokens", "points", "seconds", "cpu_branch_bandwidth"}``) as the calibration record of kind :data:`PROBE_KIND` for ``model``
    (``{"fingerprint", "name"}``). A full calibration that is not stale is never replaced (it may have
    been written since the probe started): then nothing is written and None is returned."""
    if _is_full(load_calibration(path)):
        return None

    rec = {"format": CALIBRATION_FORMAT, "source": SOURCE, "kind": PROBE_KIND, "gpu_terms": True,
           "np_tokens": int(probe["np_tokens"]), "prefill": {"points": probe.get("points", [])},
           "cpu_branch_bandwidth": probe.get("cpu_branch_bandwidth") or [],
           "model": {k: model.get(k) for k in ("fingerprint", "name")},
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "seconds": probe.get("seconds"),
           "notes": ["Np measured at a model load (split and upload passes of a few sizes); "
                     "'ostinato calibrate --full' measures the whole cost model"]}
    return store_calibration(rec, path)


def store_calibration(cal: dict[str, Any], path: Optional[Path] = None) -> Path:
    """Write ``cal`` under ``"calibration"`` in the hardware profile, keeping every other key.

    Atomic (temp file + rename). When the file is missing or has no hardware fingerprint, the quick
    hardware probe (:func:`ostinatod.hardware.collect_profile` without bandwidth measurements) is
    stored with it: otherwise the daemon's start-up profile would see "changed hardware" and mark this
    fresh calibration stale.
    """
    path = Path(path) if path else get_paths().hardware_profile
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        prof = json.loads(path.read_text())
        if not isinstance(prof, dict):
            prof = {}
    except (OSError, ValueError):
        prof = {}
    if not prof.get("fingerprint"):
        try:
            prof = {**collect_profile(measure=False), **prof}
        except Exception as e:  # noqa: BLE001 - the calibration is still worth storing
            log.warning("hardware probe for the profile failed: %s", e)
    prof["calibration"] = cal
    return write_json_atomic(path, prof, indent=1)


def decode_choices(settings: Any = None) -> tuple[bool, Optional[int]]:
    """(decode overlap, decode threads or None) to serve with: the settings if given, else the
    calibration's measured choice (``decode_overlap``, ``decode_threads``), else (True, None)."""
    settings = getattr(settings, "engine", settings)   # Settings: its [engine] table
    overlap = getattr(settings, "decode_overlap", None)
    threads = getattr(settings, "decode_threads", None)
    if overlap is None or threads is None:
        cal = load_calibration() or {}
        if cal.get("stale"):
            cal = {}
        if overlap is None:
            overlap = cal.get("decode_overlap")
        if threads is None:
            threads = cal.get("decode_threads")
    return (True if overlap is None else bool(overlap)), (int(threads) if threads else None)


def decode_graph_choice(settings: Any = None) -> Optional[bool]:
    """Decode graph to serve with: the ``decode_graph`` setting if set, else the calibration's
    measured choice (``decode_graph``: whether a graph setting won the decode sweep; absent when the
    sweep could not run one, e.g. on a CPU build), else None (on when the pool is on a GPU)."""
    choice = getattr(getattr(settings, "engine", settings), "decode_graph", None)
    if choice is None:
        cal = load_calibration() or {}
        if not cal.get("stale") and cal.get("decode_graph") is not None:
            choice = bool(cal["decode_graph"])
    return choice


def cpu_split_inputs(settings: Any, path: Optional[Path] = None, model_fingerprint: Optional[str] = None
                     ) -> tuple[list[dict[str, Any]], Optional[float], str]:
    """What the prefill's CPU/upload split is made from
    (:func:`ostinatod.residency.cost.cpu_split_params`) and where it came from: ``(rows, h2d_gbps,
    source)`` with the record's ``cpu_branch_bandwidth`` rows and its ``h2d_pinned_gbps`` (else the
    profile's measured pinned bandwidth), from a full calibration that is not stale
    (``"calibration"``) or a load probe of this model (``"probe"``; any model when
    ``model_fingerprint`` is None); ``([], None, "settings")`` when ``prefill_cpu_split`` is false,
    ``([], None, "not calibrated")`` without such a record."""
    if settings is not None and not getattr(settings, "engine", settings).prefill_cpu_split:
        return [], None, "settings"
    cal = load_calibration(path)
    if _is_full(cal):
        source = "calibration"
    elif isinstance(cal, dict) and cal.get("kind") == PROBE_KIND and not cal.get("stale") and \
            (model_fingerprint is None or (cal.get("model") or {}).get("fingerprint") == model_fingerprint):
        source = "probe"
    else:
        return [], None, "not calibrated"
    return list(cal.get("cpu_branch_bandwidth") or []), cal.get("h2d_pinned_gbps") or h2d_from_profile(path), source


def h2d_from_profile(path: Optional[Path] = None) -> Optional[float]:
    """The best measured pinned host->GPU bandwidth (GB/s) of the stored profile, or None."""
    try:
        prof = json.loads((Path(path) if path else get_paths().hardware_profile).read_text())
        vals = [e.get("gbps") for e in prof.get("bandwidth", {}).get("h2d_pinned", []) if e.get("gbps")]
        return float(max(vals)) if vals else None
    except (OSError, ValueError, AttributeError):
        return None


def decode_prefetch_inputs(path: Optional[Path] = None, model_fingerprint: Optional[str] = None
                           ) -> tuple[Optional[float], Optional[float], str]:
    """What the automatic decode prefetch count is made from
    (:func:`ostinatod.residency.cost.decode_prefetch_count`): ``(g_ms, h2d_gbps, source)`` with the
    GPU-branch time per MoE layer of decode steps (``gpu_branch_ms``, G of the cost model; it depends
    on the model, so the record must be of ``model_fingerprint`` where both are known) and the pinned
    host->GPU bandwidth (``h2d_pinned_gbps``, else the profile's measured one) of a full calibration
    that is not stale: source ``"calibration"``; else ``(None, None, why)``."""
    cal = load_calibration(path)
    if not _is_full(cal):
        return None, None, "not calibrated"
    fp = (cal.get("model") or {}).get("fingerprint")
    if model_fingerprint and fp and fp != model_fingerprint:
        return None, None, "calibrated on another model"
    g, h2d = cal.get("gpu_branch_ms"), cal.get("h2d_pinned_gbps") or h2d_from_profile(path)
    if not g or not h2d:
        return None, None, "calibration without GPU terms"
    return float(g), float(h2d), "calibration"
