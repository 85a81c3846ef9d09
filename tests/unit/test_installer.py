"""Installers: the rendered systemd unit (checked by systemd-analyze verify where it exists), the
launchd plist (parsed with plistlib), and install/uninstall without a systemd user session."""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ostinatod import installer


@pytest.fixture()
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    # no user bus reachable: install must write the unit and explain, never enable a real service
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent/bus")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "norun"))
    return tmp_path


def test_unit_runs_this_venv_and_restarts_on_failure(xdg):
    text = installer.render_systemd_unit()
    cmd = installer.daemon_command()
    assert Path(cmd[0]).exists() and cmd[-1] == "run"
    assert f"ExecStart={cmd[0]}" in text
    assert "Restart=on-failure" in text and "WantedBy=default.target" in text
    assert f'Environment="OSTINATO_HOME={xdg / "home"}"' in text


def test_unit_quotes_paths_with_spaces_and_percent(xdg):
    text = installer.render_systemd_unit(["/opt/my venv/bin/ostinatod", "run"], {"OSTINATO_HOME": "/a%b"})
    assert "ExecStart='/opt/my venv/bin/ostinatod' run" in text
    assert 'Environment="OSTINATO_HOME=/a%%b"' in text


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_unit(xdg):
    d = xdg / "verify"
    d.mkdir()
    unit = d / installer.UNIT_NAME
    unit.write_text(installer.render_systemd_unit())
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    # and the check is real: a unit whose command does not exist is refused
    unit.write_text(installer.render_systemd_unit(["/nonexistent/ostinatod", "run"]))
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert p.returncode != 0 and "nonexistent" in p.stderr


def test_launchd_plist_is_valid(xdg):
    data = plistlib.loads(installer.render_launchd_plist(["/x/<ostinatod>", "run"],
                                                         {"OSTINATO_HOME": "/h&"}).encode())
    assert data["Label"] == "dev.ostinato.ostinatod"
    assert data["ProgramArguments"] == ["/x/<ostinatod>", "run"]
    assert data["EnvironmentVariables"]["OSTINATO_HOME"] == "/h&"
    assert data["RunAtLoad"] is True and data["KeepAlive"] == {"SuccessfulExit": False}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd installer is Linux-only")
def test_install_without_user_session_writes_and_explains(xdg):
    lines: list[str] = []
    assert installer.install(out=lines.append) == 0
    unit = xdg / "cfg" / "systemd" / "user" / "ostinatod.service"
    assert unit.read_text() == installer.render_systemd_unit()
    text = "\n".join(lines)
    assert "not enabled" in text and "systemctl --user enable --now ostinatod.service" in text
    lines.clear()
    assert installer.uninstall(out=lines.append) == 0
    assert not unit.exists() and "removed" in lines[0]
    lines.clear()
    assert installer.uninstall(out=lines.append) == 0
    assert lines == ["nothing installed"]


def test_demo_model_vocabulary_is_kept_with_the_installed_package(tmp_path):
    """After ``ostinato build``'s vocabulary step in an environment, a user with
    another HOME and OSTINATO_HOME (a service, sudo) writes the demo model from the copy kept in
    ``<sys.prefix>/share/ostinato``. The environment is a fresh venv (its own sys.prefix) that sees
    this one's packages through PYTHONPATH."""
    import os
    import site

    from conftest import child_pythonpath
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    pp = os.pathsep.join([child_pythonpath(), *site.getsitepackages()])
    keep = {k: v for k, v in os.environ.items() if k not in ("OSTINATO_VOCAB", "XDG_DATA_HOME")}
    # the install step, as this user (whose data dir has the vocabulary from the lead's build)
    r = subprocess.run([py, "-c", "from ostinatod.build import install_vocab; print(install_vocab())"],
                       env=dict(keep, PYTHONPATH=pp), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().startswith(str(venv)), (r.stdout, r.stderr)
    other = tmp_path / "other-user"
    other.mkdir()
    env = dict(keep, PYTHONPATH=pp, HOME=str(other), OSTINATO_HOME=str(other / "ostinato"))
    code = ("from ostinatod.demo import ensure_demo_model; from ostinatod.paths import get_paths; "
            "from ostinatod.settings import load_settings; "
            "print(ensure_demo_model(load_settings(demo_shape='tiny'), get_paths()))")
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=str(other))
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()).is_file() and r.stdout.strip().startswith(str(other))


def test_native_tree_sync_rewrites_changed_files_with_the_sync_time(tmp_path):
    # an edit made while an earlier build compiled the old text is older than that object: the
    # build tree's copy must be newer than the object, or ninja keeps the stale one
    import os
    import time

    from ostinatod.build import sync_tree
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.cpp").write_text("old")
    (src / "y.cpp").write_text("same")
    (src / "link").symlink_to("y.cpp")
    assert sync_tree(src, dst) == 3
    assert (dst / "link").is_symlink() and os.readlink(dst / "link") == "y.cpp"
    edited = time.time() - 100
    (src / "a" / "x.cpp").write_text("new")
    os.utime(src / "a" / "x.cpp", (edited, edited))   # edited before the object below
    obj = time.time() - 50
    os.utime(dst / "y.cpp", (obj - 10, obj - 10))
    before = time.time()
    assert sync_tree(src, dst) == 1
    assert (dst / "a" / "x.cpp").read_text() == "new"
    assert (dst / "a" / "x.cpp").stat().st_mtime >= before - 1 > obj   # newer than the object
    assert (dst / "y.cpp").stat().st_mtime == pytest.approx(obj - 10)   # unchanged: mtime kept
    (src / "y.cpp").unlink()
    sync_tree(src, dst)
    assert not (dst / "y.cpp").exists()
