"""Model fingerprint and residency-set files (``ostinato-residency/1``).

A residency set names, per GPU, the (layer, expert) pairs that are *hot*: copied into that GPU's
expert pool at load and computed there in every forward pass (arXiv 2611.11533, Section 2; the
planner that writes them is :mod:`ostinatod.residency.planner`). File, under
``<data>/residency/<fingerprint>/<workload>.json``::

    {"format": "ostinato-residency/1",
     "model": {"fingerprint", "name", "arch", "n_layer", "n_expert", "n_expert_used"},
     "workload": "coding", "created": ISO8601,
     "gpus": [{"device": 0, "layers": [0, 1, ...], "budget_bytes": int,
               "hot": {"<layer>": [expert ids...]}}],
     "plan": {"source_traces": [...], "expected_hot_route_share": float, ...}}

A set whose fingerprint differs from the loaded model's is refused (:class:`ResidencyError`).
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..files import write_json_atomic
from .model import ModelFileError, describe_model, require_arch
from ..errors import MessageError

RESIDENCY_FORMAT = "ostinato-residency/1"


class ResidencyError(MessageError, ValueError):
    """A residency set that cannot be used: unreadable, malformed, or for another model."""

    code, status = "residency_refused", 400


def model_fingerprint(path: Path) -> str:
    """Hex sha256 identifying a GGUF model independently of its path (see
    :class:`~ostinatod.residency.model.ModelInfo`). Raises ResidencyError for a missing or
    unreadable file."""
    return model_block(path)["fingerprint"]


def model_block(path: Path) -> dict[str, Any]:
    """The ``model`` block of residency and trace files for a GGUF:
    ``{"fingerprint", "name", "arch", "n_layer", "n_expert", "n_expert_used"}``. Raises ResidencyError."""
    try:
        return require_arch(describe_model(path)).model_block()
    except ModelFileError as e:
        raise ResidencyError(str(e)) from e


@dataclass
class ResidencySet:
    """A validated residency set. ``hot[device][layer]`` is the sorted list of hot expert ids."""

    path: Optional[Path]
    model: dict[str, Any]
    workload: str
    hot: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def n_hot(self) -> int:
        """Number of hot (layer, expert) pairs over all GPUs."""
        return sum(len(v) for d in self.hot.values() for v in d.values())

    @property
    def devices(self) -> list[int]:
        """Sorted GPU indices of the set's ``gpus`` entries (one entry per GPU)."""
        return sorted({int(g["device"]) for g in self.raw.get("gpus", [])} | set(self.hot))

    def layer_devices(self) -> dict[int, int]:
        """{layer: GPU index} from the ``gpus`` entries' ``layers`` lists and hot-layer keys.

        Layers named by no entry are absent. Raises ResidencyError when a layer is listed on two
        GPUs (validation already refuses that for hot layers)."""
        out: dict[int, int] = {}
        for g in self.raw.get("gpus", []):
            dev = int(g["device"])
            for layer in list(g.get("layers") or []) + [int(k) for k in (g.get("hot") or {})]:
                layer = int(layer)
                if out.get(layer, dev) != dev:
                    raise ResidencyError(f"{self.path or 'residency set'}: layer {layer} is listed on "
                                         f"GPUs {out[layer]} and {dev}")
                out[layer] = dev
        return out

    def hot_all(self) -> dict[int, list[int]]:
        """{layer: hot expert ids} merged over the GPUs (each layer lives on one GPU)."""
        out: dict[int, list[int]] = {}
        for d in self.hot.values():
            for layer, ids in d.items():
                out.setdefault(layer, [])
                out[layer] = sorted(set(out[layer]) | set(ids))
        return out


MAX_DEVICES = 64  # GPU indexes a set may name (the engine checks the devices present at load)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is no index


def validate_residency(doc: Any, model: Optional[dict[str, Any]] = None,
                       path: Optional[Path] = None) -> ResidencySet:
    """Check a residency document's structure and, if ``model`` (a :func:`model_block`) is given,
    that it belongs to that model: same fingerprint, layers < n_layer, expert ids < n_expert, no
    layer on two GPUs. Returns a ResidencySet; raises ResidencyError naming the first problem."""
    where = f"{path}: " if path else ""
    if not isinstance(doc, dict) or doc.get("format") != RESIDENCY_FORMAT:
        raise ResidencyError(f"{where}not an {RESIDENCY_FORMAT} file "
                             f"(format={doc.get('format') if isinstance(doc, dict) else None!r})")
    m = doc.get("model")
    if not isinstance(m, dict) or not isinstance(m.get("fingerprint"), str):
        raise ResidencyError(f"{where}missing model.fingerprint")
    if model is not None and m["fingerprint"] != model["fingerprint"]:
        raise ResidencyError(
            f"{where}residency set is for model {m.get('name')!r} (fingerprint "
            f"{m['fingerprint'][:12]}), but the loaded model is {model.get('name')!r} (fingerprint "
            f"{model['fingerprint'][:12]}); plan a set for this model with 'ostinato plan'")
    n_layer = int((model or m).get("n_layer") or 0)
    n_expert = int((model or m).get("n_expert") or 0)
    gpus = doc.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        raise ResidencyError(f"{where}'gpus' must be a non-empty list")
    hot: dict[int, dict[int, list[int]]] = {}
    owner: dict[int, int] = {}
    for g in gpus:
        if not isinstance(g, dict) or not _is_int(g.get("device")):
            raise ResidencyError(f"{where}each gpus entry needs an integer 'device'")
        dev = g["device"]
        if not 0 <= dev < MAX_DEVICES:
            raise ResidencyError(f"{where}device {dev} is not a GPU index (0..{MAX_DEVICES - 1})")
        if dev in hot:
            raise ResidencyError(f"{where}device {dev} is listed twice")
        budget = g.get("budget_bytes")
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise ResidencyError(f"{where}gpus[device={dev}].budget_bytes must be a byte count >= 0")
        h = g.get("hot", {})
        if not isinstance(h, dict):
            raise ResidencyError(f"{where}gpus[device={dev}].hot must be an object")
        per: dict[int, list[int]] = {}
        for k, ids in h.items():
            try:
                layer = int(k)
            except (TypeError, ValueError):
                raise ResidencyError(f"{where}hot layer key {k!r} is not an integer") from None
            if n_layer and not 0 <= layer < n_layer:
                raise ResidencyError(f"{where}layer {layer} out of range (model has {n_layer})")
            if layer in owner and owner[layer] != dev:
                raise ResidencyError(f"{where}layer {layer} is on GPUs {owner[layer]} and {dev}")
            owner[layer] = dev
            if not isinstance(ids, list) or not all(_is_int(x) for x in ids):
                raise ResidencyError(f"{where}hot[{k}] must be a list of expert ids")
            if n_expert and any(not 0 <= x < n_expert for x in ids):
                raise ResidencyError(f"{where}hot[{k}] has an expert id outside 0..{n_expert - 1}")
            if any(x < 0 for x in ids):
                raise ResidencyError(f"{where}hot[{k}] has a negative expert id")
            per[layer] = sorted(set(ids))
            if len(per[layer]) != len(ids):
                raise ResidencyError(f"{where}hot[{k}] lists an expert id more than once")
        hot[dev] = per
    return ResidencySet(path=path, model=m, workload=str(doc.get("workload", "")), hot=hot, raw=doc)


def read_residency(path: Path, model: Optional[dict[str, Any]] = None) -> ResidencySet:
    """Read and validate a residency file (see :func:`validate_residency`). Raises ResidencyError."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ResidencyError(f"cannot read residency set {path}: {e}") from e
    except ValueError as e:
        raise ResidencyError(f"{path}: not JSON ({e})") from e
    return validate_residency(doc, model, path)


def make_residency(model: dict[str, Any], hot: dict[int, list[int]], *, workload: str = "coding",
                   device: int = 0, budget_bytes: int = 0,
                   plan: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A one-GPU residency document holding ``hot`` ({layer: expert ids}) for ``model``."""
    return {"format": RESIDENCY_FORMAT, "model": dict(model), "workload": workload,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "gpus": [{"device": device, "layers": list(range(int(model.get("n_layer", 0)))),
                      "budget_bytes": int(budget_bytes),
                      "hot": {str(k): sorted(v) for k, v in sorted(hot.items())}}],
            "plan": plan or {}}


def write_residency(doc: dict[str, Any], path: Path) -> Path:
    """Validate (structure only) and write a residency document atomically; returns the path.
    Raises ResidencyError (invalid) or :class:`ostinatod.files.WriteFailed` (disk full, ...: the
    earlier set stays, no temp file is left)."""
    validate_residency(doc)
    return write_json_atomic(path, doc, indent=1)
