"""GGUF models already on disk: the Hugging Face cache, LM Studio's models folder, Ollama's blobs
(found through its manifests) and Ostinato's own models directory (``ostinato models``, and the
names ``ostinato load NAME`` takes).

Each file is described by :func:`ostinatod.residency.model.check_model_file` (header only, no
weights read): architecture, size, quantisation, whether the expert engine runs it, and a suggested
expert pool for the GPUs found now.

Where each source keeps its files (the first that exists of each):

* Hugging Face: ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub`` --
  ``models--ORG--REPO/snapshots/REV/*.gguf``; name ``ORG/REPO/FILE.gguf``.
* LM Studio: ``$LMSTUDIO_MODELS_DIR``, ``~/.lmstudio/models``, ``~/.cache/lm-studio/models`` --
  ``PUBLISHER/MODEL/*.gguf``; name ``PUBLISHER/MODEL/FILE.gguf``.
* Ollama: ``$OLLAMA_MODELS``, ``~/.ollama/models``, ``/usr/share/ollama/.ollama/models`` --
  ``manifests/REGISTRY/NAMESPACE/MODEL/TAG`` (JSON) names the model layer's digest, the file is
  ``blobs/sha256-HEX``; name ``MODEL:TAG`` (``NAMESPACE/MODEL:TAG`` outside ``library``).
* Ostinato: ``<data>/models/*.gguf``; name the file name.

Split GGUFs (``…-00001-of-00003.gguf``) are listed once, by their first part.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from .engine.runtime import SUPPORTED_ARCHS
from .hardware import probe_gpus
from .paths import get_paths
from .residency.gguf_header import read_header
from .residency.model import ModelFileError, check_model_file
from .residency.planner import estimate_gpu_need, staging_regions_for
from .settings import load_settings

GIB = 1024 ** 3
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
# llama.cpp's llama_ftype (general.file_type) -> the name quantisations go by
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
              23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
              29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
              38: "MXFP4_MOE"}


@dataclass
class FoundModel:
    """One model file on disk and what Ostinato makes of it (sizes in bytes)."""

    name: str
    source: str  # "huggingface" | "lmstudio" | "ollama" | "ostinato"
    path: str
    size_bytes: int = 0
    arch: Optional[str] = None
    quant: Optional[str] = None
    n_expert: int = 0
    n_expert_used: int = 0
    engine: str = ""  # "experts" (the expert engine), "stock: <why>", or "unreadable: <why>"
    expert_bytes: int = 0
    suggested_pool_bytes: Optional[int] = None  # None without a GPU
    pool_note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _first_dir(*cands: Optional[Path]) -> Optional[Path]:
    for c in cands:
        if c is not None and c.is_dir():
            return c
    return None


def _env_path(name: str) -> Optional[Path]:
    v = os.environ.get(name)
    return Path(v).expanduser() if v else None


def _ggufs(folder: Path) -> list[Path]:
    out = []
    for p in sorted(folder.glob("*.gguf")):
        m = _SPLIT.search(p.name)
        if m and int(m.group(1)) != 1:
            continue  # later parts of a split model
        if "mmproj" in p.name.lower():
            continue  # vision projectors are not models
        out.append(p)
    return out


def huggingface() -> Iterator[tuple[str, Path]]:
    """(name, path) of the GGUF files in the Hugging Face hub cache."""
    hf_home = _env_path("HF_HOME")
    root = _first_dir(_env_path("HF_HUB_CACHE"), hf_home / "hub" if hf_home else None,
                      Path.home() / ".cache" / "huggingface" / "hub")
    if root is None:
        return
    for repo in sorted(root.glob("models--*")):
        org_repo = repo.name[len("models--"):].replace("--", "/")
        seen: set[str] = set()
        snaps = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
        for snap in snaps:  # newest revision first; a file name once
            for p in _ggufs(snap) + [q for d in sorted(snap.iterdir()) if d.is_dir() for q in _ggufs(d)]:
                rel = p.relative_to(snap).as_posix()
                if rel not in seen:
                    seen.add(rel)
                    yield f"{org_repo}/{rel}", p


def lmstudio() -> Iterator[tuple[str, Path]]:
    """(name, path) of the GGUF files in LM Studio's models folder."""
    root = _first_dir(_env_path("LMSTUDIO_MODELS_DIR"), Path.home() / ".lmstudio" / "models",
                      Path.home() / ".cache" / "lm-studio" / "models")
    if root is None:
        return
    for pub in sorted(d for d in root.iterdir() if d.is_dir()):
        for model in sorted(d for d in pub.iterdir() if d.is_dir()):
            for p in _ggufs(model):
                yield f"{pub.name}/{model.name}/{p.name}", p


def ollama() -> Iterator[tuple[str, Path]]:
    """(name, path) of Ollama's models: each manifest's model layer, a blob named by its digest."""
    root = _first_dir(_env_path("OLLAMA_MODELS"), Path.home() / ".ollama" / "models",
                      Path("/usr/share/ollama/.ollama/models"))
    if root is None or not (root / "manifests").is_dir():
        return
    for man in sorted(p for p in (root / "manifests").rglob("*") if p.is_file()):
        parts = man.relative_to(root / "manifests").parts  # registry, namespace, model, tag
        if len(parts) != 4:
            continue
        try:
            layers = json.loads(man.read_text()).get("layers") or []
        except (OSError, ValueError, AttributeError):
            continue
        digest = next((l.get("digest") for l in layers if isinstance(l, dict)
                       and l.get("mediaType") == OLLAMA_MODEL_LAYER), None)
        if not isinstance(digest, str) or not digest.startswith("sha256:"):
            continue
        blob = root / "blobs" / digest.replace(":", "-")
        if blob.is_file():
            registry, ns, model, tag = parts
            name = f"{model}:{tag}" if ns == "library" else f"{ns}/{model}:{tag}"
            yield (name if registry == "registry.ollama.ai" else f"{registry}/{name}"), blob


def ostinato(models_dir: Optional[Path] = None) -> Iterator[tuple[str, Path]]:
    """(name, path) of the GGUF files in Ostinato's own models directory."""
    if models_dir is None:
        models_dir = get_paths().models_dir
    if models_dir.is_dir():
        for p in _ggufs(models_dir):
            yield p.name, p


SOURCES = {"huggingface": huggingface, "lmstudio": lmstudio, "ollama": ollama, "ostinato": ostinato}


def quant_of(path: Path) -> Optional[str]:
    """The quantisation of a GGUF (``general.file_type``; else the type holding most bytes)."""
    hdr = read_header(path)
    ft = hdr.kv.get("general.file_type")
    if isinstance(ft, int) and ft in FILE_TYPES:
        return FILE_TYPES[ft]
    by_type: dict[str, int] = {}
    for t in hdr.tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + int(t.n_bytes)
    return max(by_type, key=by_type.get) if by_type else None


def suggested_pool(info: Any, gpus: list[dict[str, Any]], n_ctx: int,
                   staging_regions: int = 1) -> tuple[Optional[int], str]:
    """(pool bytes, note): what the GPUs' free memory leaves for hot experts after what a request
    of ``n_ctx`` tokens needs besides (the planner's estimate with ``staging_regions`` staging
    buffers, :func:`.residency.planner.staging_regions_for`; 10% kept free)."""
    if not gpus:
        return None, "no GPU: experts run on the CPU"
    free = sum(int(g.get("memory_free_bytes") or 0) for g in gpus)
    need = estimate_gpu_need(info, range(info.n_layer), n_ctx, last=True,
                             staging_regions=staging_regions)["total"]
    pool = max(0, int(free * 0.9) - need)
    total = info.total_expert_bytes
    if total and pool >= total:
        return total, "all experts fit on the GPUs"
    return pool, (f"{pool / total:.0%} of the expert bytes" if total else "")


def describe(name: str, source: str, path: Path, gpus: list[dict[str, Any]], n_ctx: int,
             staging_regions: int = 1) -> FoundModel:
    """One :class:`FoundModel` (never raises: an unreadable file says why in ``engine``);
    ``staging_regions`` as :func:`suggested_pool` takes it."""
    fm = FoundModel(name=name, source=source, path=str(path))
    try:
        fm.size_bytes = path.stat().st_size
        info = check_model_file(path)
        fm.quant = quant_of(path)
    except (ModelFileError, OSError, ValueError) as e:
        fm.engine = f"unreadable: {e}"
        return fm
    fm.arch, fm.n_expert, fm.n_expert_used = info.arch or None, info.n_expert, info.n_expert_used
    fm.expert_bytes = info.total_expert_bytes
    if not info.moe_layers:
        fm.engine = "stock: dense model"
    elif info.arch not in SUPPORTED_ARCHS:
        fm.engine = f"stock: {info.arch} not yet in the expert engine"
    else:
        fm.engine = "experts"
    if info.moe_layers:
        fm.suggested_pool_bytes, fm.pool_note = suggested_pool(info, gpus, n_ctx, staging_regions)
    return fm


def find_models(sources: Optional[list[str]] = None, n_ctx: Optional[int] = None,
                gpus: Optional[list[dict[str, Any]]] = None) -> list[FoundModel]:
    """Every model found on disk (see module doc), described; ``gpus`` default: those found now."""
    if gpus is None:
        try:
            gpus = probe_gpus()
        except Exception:  # no NVML: no GPU
            gpus = []
    settings = load_settings()   # once for every file
    if n_ctx is None:
        n_ctx = settings.n_ctx
    regions = staging_regions_for(settings)
    out = []
    for src in sources or list(SOURCES):
        for name, path in SOURCES[src]():
            out.append(describe(name, src, path, gpus, n_ctx, regions))
    return out


def resolve_name(name: str, found: list[FoundModel]) -> FoundModel:
    """The model a name given to ``ostinato load`` means: an exact name, else the one name that
    contains it (case-insensitive). Raises LookupError saying what matched."""
    exact = [m for m in found if m.name == name]
    if exact:
        return exact[0]
    low = name.lower()
    some = [m for m in found if low in m.name.lower()]
    if len(some) == 1:
        return some[0]
    if not some:
        raise LookupError(f"no model named {name!r} on disk (see `ostinato models`)")
    raise LookupError(f"{name!r} matches {len(some)} models: " + ", ".join(m.name for m in some[:8]))


def format_table(found: list[FoundModel]) -> str:
    """The table ``ostinato models`` prints."""
    if not found:
        return ("no GGUF models found (Hugging Face cache, LM Studio, Ollama, Ostinato's models "
                "directory); load one by path: ostinato load /path/model.gguf")
    w = max(20, min(48, max(len(m.name) for m in found)))
    rows = [f"{'NAME':<{w}} {'SOURCE':<11} {'ARCH':<10} {'SIZE':>9} {'QUANT':<9} {'ENGINE':<10} POOL"]
    for m in found:
        pool = ("-" if not m.n_expert else m.pool_note if m.suggested_pool_bytes is None
                else f"{m.suggested_pool_bytes / GIB:.1f} GiB ({m.pool_note})")
        eng = m.engine if m.engine in ("experts",) else m.engine.split(":")[0]
        rows.append(f"{m.name[:w]:<{w}} {m.source:<11} {(m.arch or '-')[:10]:<10} "
                    f"{m.size_bytes / GIB:>7.2f}Gi {(m.quant or '-')[:9]:<9} {eng:<10} {pool}")
        if m.engine not in ("experts",) and ":" in m.engine:
            rows.append(f"{'':<{w}}   ({m.engine})")
    return "\n".join(rows)
