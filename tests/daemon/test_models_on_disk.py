"""``ostinato models`` finds GGUF models already on disk (Hugging Face cache, LM Studio, Ollama by
manifest, Ostinato's models directory) and ``ostinato load NAME`` serves one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import child_pythonpath


def _disk(tmp: Path, tiny_model: Path) -> dict[str, str]:
    """A home with the tiny model in each source's layout; returns the env."""
    home = tmp / "home"
    hf = tmp / "hf"
    snap = hf / "models--acme--Tiny-MoE-GGUF" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "tiny-moe-Q8_0.gguf").symlink_to(tiny_model)
    (snap / "tiny-moe-Q8_0-00002-of-00002.gguf").symlink_to(tiny_model)  # a later split part: not listed
    lms = home / ".lmstudio" / "models" / "acme" / "tiny-moe"
    lms.mkdir(parents=True)
    (lms / "tiny-moe.gguf").symlink_to(tiny_model)
    (lms / "notes.txt").write_text("not a model")
    ol = tmp / "ollama"
    (ol / "blobs").mkdir(parents=True)
    digest = "ab" * 32
    shutil.copyfile(tiny_model, ol / "blobs" / f"sha256-{digest}")  # Ollama's blobs are files
    man = ol / "manifests" / "registry.ollama.ai" / "library" / "tinymoe" / "latest"
    man.parent.mkdir(parents=True)
    man.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1}]}))
    (tmp / "ost" / "data" / "models").mkdir(parents=True)
    (tmp / "ost" / "data" / "models" / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    return dict(os.environ, HOME=str(home), HF_HUB_CACHE=str(hf), OLLAMA_MODELS=str(ol),
                OSTINATO_HOME=str(tmp / "ost"), PYTHONPATH=child_pythonpath())


def test_models_found_on_disk(tmp_path, tiny_model):
    env = _disk(tmp_path, tiny_model)
    r = subprocess.run([sys.executable, "-m", "ostinatod.cli", "models", "--json"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    found = {m["name"]: m for m in json.loads(r.stdout)}
    assert set(found) == {"acme/Tiny-MoE-GGUF/tiny-moe-Q8_0.gguf", "acme/tiny-moe/tiny-moe.gguf",
                          "tinymoe:latest", "broken.gguf"}
    assert {n: m["source"] for n, m in found.items()} == {
        "acme/Tiny-MoE-GGUF/tiny-moe-Q8_0.gguf": "huggingface", "acme/tiny-moe/tiny-moe.gguf": "lmstudio",
        "tinymoe:latest": "ollama", "broken.gguf": "ostinato"}
    ol = found["tinymoe:latest"]
    assert ol["path"].endswith("sha256-" + "ab" * 32)
    assert (ol["arch"], ol["engine"], ol["size_bytes"]) == ("qwen3moe", "experts", tiny_model.stat().st_size)
    assert ol["quant"] and ol["n_expert"] > 0 and ol["expert_bytes"] > 0
    assert ol["suggested_pool_bytes"] is None and "no GPU" in ol["pool_note"]  # this machine has none
    assert found["broken.gguf"]["engine"].startswith("unreadable")
    table = subprocess.run([sys.executable, "-m", "ostinatod.cli", "models"], env=env,
                           capture_output=True, text=True, timeout=120).stdout
    assert "tinymoe:latest" in table and "qwen3moe" in table and "unreadable" in table


def test_pool_suggestion_with_a_gpu(tiny_model):
    from ostinatod.discover import describe
    m = describe("x", "ostinato", tiny_model, [{"memory_free_bytes": 80 * 1024 ** 3}], 4096)
    assert m.suggested_pool_bytes == m.expert_bytes and m.pool_note == "all experts fit on the GPUs"
    m = describe("x", "ostinato", tiny_model, [{"memory_free_bytes": 1}], 4096)
    assert m.suggested_pool_bytes == 0


def test_load_by_name(tmp_path, tiny_model, start_daemon):
    env = _disk(tmp_path, tiny_model)
    d = start_daemon("--model", str(tiny_model), "--n-ctx", "512", "--n-slots", "1", "--n-threads", "1")
    env["OSTINATO_HOME"] = str(d.home)
    r = subprocess.run([sys.executable, "-m", "ostinatod.cli", "load", "tinymoe:latest"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sha256-" + "ab" * 32 in r.stdout
    st = json.loads(subprocess.run([sys.executable, "-m", "ostinatod.cli", "status", "--json"], env=env,
                                   capture_output=True, text=True, timeout=60).stdout)
    assert st["model"]["path"].endswith("sha256-" + "ab" * 32)
    r = subprocess.run([sys.executable, "-m", "ostinatod.cli", "load", "tiny-moe"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "matches 2 models" in r.stderr
