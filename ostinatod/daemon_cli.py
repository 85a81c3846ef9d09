"""``ostinatod``: run the daemon in the foreground, start/stop it in the background, show status,
install/uninstall the login service.

    ostinatod run    [--model PATH.gguf] [--port N] [--host ADDR] [--<any setting> VALUE]
    ostinatod start  [same flags] [--wait SECONDS]
    ostinatod stop | status [--json] | install | uninstall

Every field of :class:`ostinatod.settings.Settings` is a flag (``--n-ctx 32768``, ``--no-cors``),
generated from the settings model so that ``ostinatod run --help`` lists them with their
descriptions; flags override env ``OSTINATO_*`` and settings.toml.

The daemon itself is :class:`ostinatod.daemon.Daemon`; its log goes to ``<state>/ostinatod.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types
import typing
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal, Optional

import psutil
from pydantic import ValidationError

from . import installer
from .paths import Paths, get_paths
from .settings import ENGINE_KEYS, EngineSettings, Settings, SettingsError, load_settings

log = logging.getLogger("ostinatod")

# settings never taken from the command line (process arguments are readable by every local user)
SECRET_SETTINGS = ("api_key",)

DETACHED_ENV = "OSTINATOD_DETACHED"  # set by `start` for its child: log only to the log file
# set by `start` for its child: a pipe's write end for the child's errors (StartReport)
START_FD_ENV = "OSTINATOD_START_FD"


# --- settings as flags ------------------------------------------------------------------------
def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _flag_fields() -> list[tuple[str, Any]]:
    """(name, field) of every settings flag: the top-level settings, the [engine] table's by their own
    names (``--decode-borrow``)."""
    out = [(n, f) for n, f in Settings.model_fields.items() if n != "engine"]
    return out + list(EngineSettings.model_fields.items())


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field (``--field-name``), help text = the field description.

    Defaults are None so that only flags the user gives override env and file values."""
    group = parser.add_argument_group("settings (override env OSTINATO_* and settings.toml)")
    for name in SECRET_SETTINGS:  # accepted only to refuse them with a clear message
        group.add_argument("--" + name.replace("_", "-"), dest="secret_" + name, default=None,
                           help=argparse.SUPPRESS)
    for name, f in _flag_fields():
        if name in SECRET_SETTINGS:
            continue
        flag = "--" + name.replace("_", "-")
        ann = _unwrap(f.annotation)
        default = f.get_default(call_default_factory=True)
        default = default if default is not None else "unset"
        helptext = f"{f.description} [default: {default}]".replace("%", "%%")
        kw: dict[str, Any] = {"dest": name, "default": None, "help": helptext}
        if ann is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(ann) is Literal:
            group.add_argument(flag, choices=[str(a) for a in typing.get_args(ann)], **kw)
        elif ann in (int, float):
            group.add_argument(flag, type=ann, metavar=ann.__name__.upper(), **kw)
        elif ann is Path:
            group.add_argument(flag, type=Path, metavar="PATH", **kw)
        elif typing.get_origin(ann) is list:
            group.add_argument(flag, action="append", metavar="VALUE", **kw)
        else:
            group.add_argument(flag, metavar="VALUE", **kw)


def settings_from_args(ns: argparse.Namespace) -> Settings:
    """Settings from parsed flags > env > file > defaults. Raises SystemExit(2) on invalid values."""
    for name in SECRET_SETTINGS:
        if getattr(ns, "secret_" + name, None) is not None:
            print(f"ostinatod: --{name.replace('_', '-')} is not accepted on the command line (every "
                  f"local user can read process arguments); use OSTINATO_{name.upper()}, {name} in "
                  f"settings.toml or --{name.replace('_', '-')}-file (a chmod 600 file)", file=sys.stderr)
            raise SystemExit(2)
    overrides = {name: getattr(ns, name, None) for name, _ in _flag_fields()
                 if name not in SECRET_SETTINGS and name not in ENGINE_KEYS}
    engine = {name: getattr(ns, name) for name in ENGINE_KEYS if getattr(ns, name, None) is not None}
    if engine:   # the [engine] table's flags (--decode-borrow, ...): the file's and env's others stay
        overrides["engine"] = engine
    try:
        return load_settings(**overrides)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in e.errors())
        print(f"ostinatod: invalid settings: {msgs}", file=sys.stderr)
        raise SystemExit(2) from None
    except SettingsError as e:
        print(f"ostinatod: invalid settings: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _flags_of(ns: argparse.Namespace) -> list[str]:
    """The settings flags given on the command line, re-rendered for the `run` child of `start`."""
    out: list[str] = []
    for name, f in _flag_fields():
        v = getattr(ns, name, None)
        if v is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + name.replace("_", "-"))
        elif isinstance(v, list):
            for x in v:
                out += [flag, str(x)]
        else:
            out += [flag, str(Path(v).resolve()) if isinstance(v, Path) else str(v)]
    return out


def utf8_stderr() -> None:
    """Make ``sys.stderr`` write UTF-8, escaping what cannot be encoded (lone surrogates), so
    every line the daemon or its worker logs there is valid UTF-8."""
    try:
        sys.stderr.reconfigure(encoding="utf-8", errors="backslashreplace")  # type: ignore[union-attr]
    except (AttributeError, ValueError):  # replaced by a stream without reconfigure
        pass


def setup_logging(settings: Settings, paths: Paths) -> None:
    """Log to ``<state>/ostinatod.log`` and, unless started detached by `start`, to stderr."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(settings.log_level)
    for h in list(root.handlers):
        root.removeHandler(h)
    private_file(paths.log_file)
    # UTF-8 whatever the locale; a lone surrogate from a client's text is escaped, not an
    # encoding error that loses the line and prints a traceback
    fh = logging.FileHandler(paths.log_file, encoding="utf-8", errors="backslashreplace")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    utf8_stderr()
    if not os.environ.get(DETACHED_ENV):
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        root.addHandler(sh)


class StartReport(logging.Handler):
    """The ERROR lines of a ``run`` child, also written to the pipe ``start`` reads (fd
    :data:`START_FD_ENV`): ``start`` can say why its child exited even when the log file cannot
    be written (a full disk left a truncated traceback there, "OS"). Once ``start`` has returned
    (the pipe is closed) the handler goes quiet."""

    def __init__(self, fd: int):
        super().__init__(logging.ERROR)
        self.fd: Optional[int] = fd
        self.setFormatter(logging.Formatter("%(message)s"))
        try:  # never blocks the daemon: a full pipe (start still waiting) ends the report
            os.set_blocking(fd, False)
        except OSError:
            self.fd = None

    @classmethod
    def from_env(cls) -> Optional["StartReport"]:
        """The handler of the fd ``start`` passed, or None (not started by ``start``)."""
        try:
            return cls(int(os.environ[START_FD_ENV]))
        except (KeyError, ValueError):
            return None

    def say(self, line: str) -> None:
        """Write one line to the pipe (nothing once it is closed)."""
        if self.fd is None:
            return
        try:
            os.write(self.fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
        except OSError:  # start has returned; the log file is the place from now on
            self.fd = None

    def emit(self, record: logging.LogRecord) -> None:
        self.say(self.format(record))


def _read_start_report(fd: int) -> str:
    """What the child wrote to the start pipe (non-blocking: a grandchild may hold it open)."""
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode("utf-8", "replace").strip()


def private_file(path: Path) -> None:
    """Create ``path`` if missing and make it readable by its owner only (0600): logs name models,
    clients and errors."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    os.chmod(path, 0o600)


# --- commands ---------------------------------------------------------------------------------
def _running_pid(paths: Paths) -> Optional[int]:
    """Pid of a live daemon from the pid file, else None (a stale file is ignored)."""
    try:
        pid = int(paths.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not psutil.pid_exists(pid):
        return None
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    # a recycled pid belongs to some other program: require our name or our runtime file
    return pid if "ostinatod" in cmd or _runtime_info(paths).get("pid") == pid else None


def _runtime_info(paths: Paths) -> dict[str, Any]:
    try:
        return json.loads((paths.runtime / "ostinatod.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _get_json(url: str, timeout: float = 3.0) -> tuple[int, dict[str, Any]]:
    """(status, body) of a GET; (0, {"error": ...}) when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except json.JSONDecodeError:
            return e.code, {}
    except (OSError, json.JSONDecodeError) as e:
        return 0, {"error": str(e)}


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log file)"


def cmd_run(ns: argparse.Namespace) -> int:
    """Foreground daemon."""
    settings = settings_from_args(ns)
    report = StartReport.from_env()
    try:
        paths = get_paths().ensure()
        setup_logging(settings, paths)
    except OSError as e:  # no log file yet: stderr (and start's pipe)
        msg = f"cannot set up the state and log files: {e}"
        print(f"ostinatod: {msg}", file=sys.stderr)
        if report is not None:
            report.say(msg)
        return 1
    if report is not None:
        logging.getLogger().addHandler(report)
    pid = _running_pid(paths)
    if pid is not None and pid != os.getpid():
        log.error("ostinatod is already running (pid %d); 'ostinatod stop' first", pid)
        return 1
    if settings.model is not None and not Path(settings.model).is_file():
        log.error("model file not found: %s", settings.model)
        return 1

    # lazy: only `run` serves; start, stop and status need not import the server stack
    from .daemon import Daemon

    async def main() -> int:
        d = Daemon(settings, paths)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, d.request_stop)
        return await d.serve()

    return asyncio.run(main())


def cmd_start(ns: argparse.Namespace) -> int:
    """Start `run` detached, wait until /health answers 200 (or print why not: the child's error
    lines through a pipe, :class:`StartReport`, and the log tail)."""
    settings_from_args(ns)  # validate flags before forking
    try:
        paths = get_paths().ensure()
    except OSError as e:
        print(f"ostinatod cannot start: {e}", file=sys.stderr)
        return 1
    pid = _running_pid(paths)
    if pid is not None:
        print(f"ostinatod is already running (pid {pid}) at {_runtime_info(paths).get('http_url')}")
        return 0
    log_file = paths.log_file
    r, w = os.pipe()
    try:
        (paths.runtime / "ostinatod.json").unlink(missing_ok=True)
        start_offset = log_file.stat().st_size if log_file.exists() else 0
        env = dict(os.environ, **{DETACHED_ENV: "1", START_FD_ENV: str(w)})
        private_file(log_file)
        with open(log_file, "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "ostinatod.daemon_cli", "run", *_flags_of(ns)],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                    start_new_session=True, close_fds=True, pass_fds=(w,))
    except OSError as e:
        os.close(r)
        print(f"ostinatod cannot start: {e}", file=sys.stderr)
        return 1
    finally:
        os.close(w)
    os.set_blocking(r, False)
    try:
        return _wait_started(ns, proc, paths, log_file, start_offset, r)
    finally:
        os.close(r)


def _wait_started(ns: argparse.Namespace, proc: subprocess.Popen, paths: Paths, log_file: Path,
                  start_offset: int, report_fd: int) -> int:
    deadline = time.monotonic() + ns.wait
    url = None
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            reason = _read_start_report(report_fd)
            print(f"ostinatod failed to start (exit code {rc})" + (f": {reason}" if reason else "")
                  + f"\nLog ({log_file}):", file=sys.stderr)
            print(_new_log(log_file, start_offset), file=sys.stderr)
            return 1
        url = url or _runtime_info(paths).get("http_url")
        if url:
            code, body = _get_json(url + "/health", timeout=2)
            if code == 503 and body.get("status") == "error":
                print(f"ostinatod (pid {proc.pid}) runs but its model failed to load: {body.get('error')}\n"
                      f"It keeps running without a model: 'ostinato load PATH' loads another, "
                      f"'ostinatod stop' stops it. Log ({log_file}):", file=sys.stderr)
                print(_new_log(log_file, start_offset), file=sys.stderr)
                return 1
            if code == 200:
                demo = "  [DEMO MODEL: RANDOM WEIGHTS]" if body.get("random_weights") else ""
                print(f"ostinatod running (pid {proc.pid}) at {url}  model {body.get('model')}{demo}")
                print(f"log: {log_file}")
                return 0
        time.sleep(0.3)
    print(f"ostinatod did not become ready within {ns.wait:.0f} s (pid {proc.pid} still running; "
          f"'ostinatod status' to check, 'ostinatod stop' to stop). Log ({log_file}):", file=sys.stderr)
    print(_new_log(log_file, start_offset), file=sys.stderr)
    return 1


def _new_log(path: Path, offset: int, n: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log file)"
    return "\n".join(text.splitlines()[-n:]) or _tail(path, n)


def cmd_stop(ns: argparse.Namespace) -> int:
    """SIGTERM the daemon and wait for it to exit (SIGKILL after ``--timeout``)."""
    paths = get_paths()
    pid = _running_pid(paths)
    if pid is None:
        print("ostinatod is not running")
        return 0
    p = psutil.Process(pid)
    p.terminate()
    try:
        p.wait(ns.timeout)
    except psutil.TimeoutExpired:
        print(f"ostinatod (pid {pid}) did not exit within {ns.timeout:.0f} s; killing it", file=sys.stderr)
        p.kill()
        p.wait(10)
    paths.pid_file.unlink(missing_ok=True)
    print(f"ostinatod stopped (pid {pid})")
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    """Print pid, URL, health, model (and RANDOM WEIGHTS for the demo). Exit 0 running, 3 not."""
    paths = get_paths()
    pid = _running_pid(paths)
    info = _runtime_info(paths)
    if pid is None:
        out: dict[str, Any] = {"running": False}
    else:
        url = info.get("http_url")
        code, health = _get_json(url + "/health") if url else (0, {})
        out = {"running": True, "pid": pid, "http_url": url, "health": code, "state": health.get("status"),
               "model": health.get("model"), "random_weights": health.get("random_weights", False),
               "log_file": str(paths.log_file)}
    if ns.json:
        print(json.dumps(out))
    elif not out["running"]:
        print("ostinatod is not running")
    else:
        print(f"ostinatod running (pid {out['pid']}) at {out['http_url']}")
        print(f"  state   {out['state']}  (HTTP {out['health']})")
        demo = "  — DEMO MODEL WITH RANDOM WEIGHTS" if out["random_weights"] else ""
        print(f"  model   {out['model']}{demo}")
        print(f"  log     {out['log_file']}")
    return 0 if out["running"] else 3


def cmd_install(ns: argparse.Namespace) -> int:
    """Install the login service (ostinatod/installer.py)."""
    return int(installer.install() or 0)


def cmd_uninstall(ns: argparse.Namespace) -> int:
    """Remove the login service (ostinatod/installer.py)."""
    return int(installer.uninstall() or 0)


def build_parser() -> argparse.ArgumentParser:
    """The ``ostinatod`` argument parser (subcommands run, start, stop, status, install, uninstall)."""
    p = argparse.ArgumentParser(prog="ostinatod", description="Ostinato daemon: serves a MoE GGUF model "
                                "to local agents over OpenAI- and Anthropic-compatible HTTP APIs.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run in the foreground")
    add_settings_flags(run)
    run.set_defaults(fn=cmd_run)
    start = sub.add_parser("start", help="start in the background and wait until it serves")
    start.add_argument("--wait", type=float, default=300, help="seconds to wait for /health (default 300)")
    add_settings_flags(start)
    start.set_defaults(fn=cmd_start)
    stop = sub.add_parser("stop", help="stop the background daemon")
    stop.add_argument("--timeout", type=float, default=30, help="seconds before SIGKILL (default 30)")
    stop.set_defaults(fn=cmd_stop)
    status = sub.add_parser("status", help="is it running, where, which model")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(fn=cmd_status)
    sub.add_parser("install", help="start at login (systemd user unit / launchd agent)").set_defaults(fn=cmd_install)
    sub.add_parser("uninstall", help="remove the login service").set_defaults(fn=cmd_uninstall)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``ostinatod`` console script."""
    ns = build_parser().parse_args(argv)
    return int(ns.fn(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
