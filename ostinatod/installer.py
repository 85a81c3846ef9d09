"""Start-at-login installers: a systemd user unit (Linux) or a launchd agent (macOS).

``ostinatod install`` renders ``installers/ostinatod.service`` (or
``installers/dev.ostinato.ostinatod.plist``) with this virtual environment's ``ostinatod run`` as
the command, writes it to the user's unit directory and enables it (``systemctl --user enable
--now`` / ``launchctl bootstrap``). Where there is no user service manager (containers, CI, SSH
sessions without a user bus) the file is still written and the commands to enable it are printed;
nothing fails. ``ostinatod uninstall`` disables and removes it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from string import Template
from typing import Callable, Optional
from xml.sax.saxutils import escape

from .paths import get_paths

UNIT_NAME = "ostinatod.service"
LAUNCHD_LABEL = "dev.ostinato.ostinatod"
TEMPLATES = Path(__file__).resolve().parent.parent / "installers"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "user-guide.md"
# Variables passed through to the service so it uses the same dirs/settings as this shell.
PASS_ENV = ("OSTINATO_HOME", "CUDA_VISIBLE_DEVICES")


def daemon_command() -> list[str]:
    """argv that runs the daemon in the foreground from this venv: ``[.../ostinatod, "run"]``, or
    ``[python, -m, ostinatod.daemon_cli, run]`` when the console script is not installed."""
    exe = Path(sys.executable).parent / "ostinatod"
    if exe.exists():
        return [str(exe), "run"]
    return [sys.executable, "-m", "ostinatod.daemon_cli", "run"]


def systemd_unit_dir() -> Path:
    """``$XDG_CONFIG_HOME/systemd/user`` (default ``~/.config/systemd/user``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def launchd_dir() -> Path:
    """``~/Library/LaunchAgents``."""
    return Path.home() / "Library" / "LaunchAgents"


def _env() -> dict[str, str]:
    return {k: os.environ[k] for k in PASS_ENV if os.environ.get(k)}


def render_systemd_unit(command: Optional[list[str]] = None, env: Optional[dict[str, str]] = None) -> str:
    """The unit file text (template ``installers/ostinatod.service``). ``command`` defaults to
    :func:`daemon_command`, ``env`` to the ``OSTINATO_HOME``/``CUDA_VISIBLE_DEVICES`` of this shell."""
    command = command or daemon_command()
    env = _env() if env is None else env
    # systemd parses ExecStart like a shell word list; quote each argument (and '%' specifiers)
    exec_start = " ".join(shlex.quote(a).replace("%", "%%") for a in command)
    lines = "".join(f'Environment="{k}={v}"\n'.replace("%", "%%") for k, v in env.items())
    return Template((TEMPLATES / UNIT_NAME).read_text()).substitute(
        exec_start=exec_start, environment=lines, docs=DOCS)


def render_launchd_plist(command: Optional[list[str]] = None, env: Optional[dict[str, str]] = None,
                         log: Optional[Path] = None) -> str:
    """The launchd agent plist text (template ``installers/dev.ostinato.ostinatod.plist``)."""
    command = command or daemon_command()
    env = _env() if env is None else env
    log = log or get_paths().state / "launchd.log"
    args = "\n".join(f"    <string>{escape(a)}</string>" for a in command)
    envs = "\n".join(f"    <key>{escape(k)}</key>\n    <string>{escape(v)}</string>" for k, v in env.items())
    return Template((TEMPLATES / f"{LAUNCHD_LABEL}.plist").read_text()).substitute(
        program_arguments=args, environment=envs, stdout_log=escape(str(log)))


def _run(cmd: list[str]) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return p.returncode == 0, (p.stderr or p.stdout).strip()


def systemd_user_available() -> bool:
    """True when ``systemctl --user`` reaches a running user manager (a login session)."""
    if not shutil.which("systemctl"):
        return False
    ok, _ = _run(["systemctl", "--user", "show-environment"])
    return ok


def install(enable: bool = True, out: Callable[[str], None] = print) -> int:
    """Write (and with ``enable`` start at login) the service for this platform. Returns 0, or 2 on
    an unsupported platform. Never raises for a missing service manager: prints how to enable."""
    if sys.platform == "darwin":
        path = launchd_dir() / f"{LAUNCHD_LABEL}.plist"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_launchd_plist())
        out(f"wrote {path}")
        cmd = ["launchctl", "bootstrap", f"gui/{os.getuid()}", str(path)]
        if enable:
            ok, msg = _run(cmd)
            out("enabled: ostinatod starts at login" if ok else f"could not enable ({msg}); run: {shlex.join(cmd)}")
        else:
            out(f"enable with: {shlex.join(cmd)}")
        return 0
    if not sys.platform.startswith("linux"):
        out(f"ostinatod install: no installer for {sys.platform}; run 'ostinatod start' instead")
        return 2
    path = systemd_unit_dir() / UNIT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_systemd_unit())
    out(f"wrote {path}")
    steps = [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", UNIT_NAME]]
    if enable and systemd_user_available():
        for cmd in steps:
            ok, msg = _run(cmd)
            if not ok:
                out(f"'{shlex.join(cmd)}' failed: {msg}")
                return 1
        out(f"enabled: ostinatod starts at login (status: systemctl --user status {UNIT_NAME})")
    else:
        if enable:
            out("no systemd user session here (container, CI or SSH without a user bus); the unit is "
                "written but not enabled.")
        out("enable it in a login session with:\n  " + "\n  ".join(shlex.join(c) for c in steps) +
            "\nto keep it running while logged out: loginctl enable-linger $USER")
    return 0


def uninstall(out: Callable[[str], None] = print) -> int:
    """Disable and remove the service written by :func:`install`. Returns 0 (also when none was
    installed)."""
    if sys.platform == "darwin":
        path = launchd_dir() / f"{LAUNCHD_LABEL}.plist"
        if path.exists():
            _run(["launchctl", "bootout", f"gui/{os.getuid()}", str(path)])
            path.unlink()
            out(f"removed {path}")
        else:
            out("nothing installed")
        return 0
    path = systemd_unit_dir() / UNIT_NAME
    if systemd_user_available():
        _run(["systemctl", "--user", "disable", "--now", UNIT_NAME])
    if path.exists():
        path.unlink()
        out(f"removed {path}")
        if systemd_user_available():
            _run(["systemctl", "--user", "daemon-reload"])
    else:
        out("nothing installed")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ostinatod.installer install|uninstall|print [--no-enable]``."""
    ap = argparse.ArgumentParser(prog="ostinatod install")
    ap.add_argument("action", choices=["install", "uninstall", "print"])
    ap.add_argument("--no-enable", action="store_true", help="write the file only")
    a = ap.parse_args(argv)
    if a.action == "print":
        print(render_launchd_plist() if sys.platform == "darwin" else render_systemd_unit(), end="")
        return 0
    return install(enable=not a.no_enable) if a.action == "install" else uninstall()


if __name__ == "__main__":
    sys.exit(main())
