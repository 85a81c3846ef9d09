"""The demo model: a synthetic MoE GGUF with RANDOM WEIGHTS, generated on first start when no model
is configured, so that a fresh install answers requests (with gibberish) right away.

Written by ``ostinatod.synth.writer.write_synthetic_moe`` (qwen3moe, ``settings.demo_shape``) into
``<data>/models/ostinato-demo-<shape>.gguf``; written to a temporary name and renamed, so a crash
while writing never leaves a truncated file that would be reused.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .paths import Paths
from .settings import Settings
from .synth.writer import write_synthetic_moe

log = logging.getLogger("ostinatod.demo")


def demo_model_path(settings: Settings, paths: Paths) -> Path:
    """Where the demo model of ``settings.demo_shape`` lives (it may not exist yet)."""
    return paths.models_dir / f"ostinato-demo-{settings.demo_shape}.gguf"


def ensure_demo_model(settings: Settings, paths: Paths) -> Path:
    """Return the demo model's path, generating it first if it is missing (blocking; seconds to
    under a minute on 2 cores). Raises RuntimeError when the synthetic-model writer is missing."""
    path = demo_model_path(settings, paths)
    if path.exists() and path.stat().st_size > 0:
        log.warning("serving the DEMO model %s: it has RANDOM WEIGHTS (output is gibberish); "
                    "set --model PATH.gguf or 'model' in settings.toml to serve a real model", path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    log.warning("no model configured: generating the DEMO model (qwen3moe, shape %r) with RANDOM "
                "WEIGHTS at %s", settings.demo_shape, path)
    t0 = time.monotonic()
    try:
        write_synthetic_moe(tmp, arch="qwen3moe", shape=settings.demo_shape)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    log.warning("demo model written in %.1f s; it has RANDOM WEIGHTS (output is gibberish)",
                time.monotonic() - t0)
    return path
