"""Tray icon under Xvfb: pystray's real Xorg backend docks into a minimal system-tray manager
(python-xlib, the _NET_SYSTEM_TRAY protocol) and follows a real control API.

Needs the Xvfb binary (Debian package ``xvfb``): installed here with apt-get when missing and
running as root; the X tests skip with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from ostinatod.ui import tray as traymod


def _ensure_xvfb() -> str | None:
    if shutil.which("Xvfb"):
        return None
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "xvfb"], capture_output=True, timeout=600)
        if shutil.which("Xvfb"):
            return None
    return "Xvfb is not installed and could not be installed (apt-get install xvfb)"


class TrayManager:
    """The manager side of the freedesktop system-tray protocol, just enough to accept docks:
    owns ``_NET_SYSTEM_TRAY_S<screen>`` and records SYSTEM_TRAY_REQUEST_DOCK window ids."""

    def __init__(self, display: str):
        from Xlib import X, display as xdisplay
        self.X = X
        self.d = xdisplay.Display(display)
        scr = self.d.screen()
        self.win = scr.root.create_window(0, 0, 1, 1, 0, scr.root_depth)
        self.opcode = self.d.intern_atom("_NET_SYSTEM_TRAY_OPCODE")
        self.win.set_selection_owner(self.d.intern_atom(f"_NET_SYSTEM_TRAY_S{self.d.get_default_screen()}"),
                                     X.CurrentTime)
        self.d.flush()
        self.docked: list[int] = []
        self._stop = False
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self):
        while not self._stop:
            while self.d.pending_events():
                ev = self.d.next_event()
                if ev.type == self.X.ClientMessage and ev.client_type == self.opcode and ev.data[1][1] == 0:
                    self.docked.append(ev.data[1][2])
            time.sleep(0.02)

    def close(self):
        self._stop = True
        self.t.join(2)
        self.d.close()


@pytest.fixture(scope="module")
def xdisplay():
    reason = _ensure_xvfb()
    if reason:
        pytest.skip(reason)
    r, w = os.pipe()
    proc = subprocess.Popen(["Xvfb", "-displayfd", str(w), "-screen", "0", "640x480x24", "-nolisten", "tcp"],
                            pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    num = b""
    while not num.endswith(b"\n"):
        chunk = os.read(r, 16)
        if not chunk:
            break
        num += chunk
    os.close(r)
    if not num.strip():
        proc.kill()
        pytest.skip("Xvfb did not start")
    name = f":{num.decode().strip()}"
    mgr = TrayManager(name)
    yield name, mgr
    import gc
    gc.collect()  # pystray icons close their X connections in __del__: before the server goes
    mgr.close()
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def server(tmp_path, monkeypatch):
    import tempfile
    from helpers import recording_control_server
    monkeypatch.setenv("OSTINATO_HOME", tempfile.mkdtemp(prefix="ost-", dir="/tmp"))
    t = recording_control_server()
    yield t
    t.stop()


def test_icon_states_are_distinct_images():
    imgs = {s: traymod.draw_icon(s) for s in traymod.STATES}
    assert all(i.size == (64, 64) and i.mode == "RGBA" for i in imgs.values())
    assert len({i.tobytes() for i in imgs.values()}) == 4
    assert imgs["error"].getpixel((10, 32))[:3] == traymod.COLORS["error"]
    with pytest.raises(ValueError):
        traymod.draw_icon("sleeping")


def test_state_from_snapshot():
    assert traymod.tray_state(None) == "error"
    assert traymod.tray_state({"engine_state": "ready", "requests": {"active": 0}}) == "idle"
    assert traymod.tray_state({"engine_state": "ready", "requests": {"active": 2}}) == "busy"
    assert traymod.tray_state({"engine_state": "loading"}) == "loading"
    assert traymod.tray_state({"engine_state": "stopped", "phase": "generating demo model"}) == "loading"
    assert traymod.tray_state({"engine_state": "error"}) == "error"


def test_no_display_logs_one_line_and_returns(monkeypatch, caplog):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if not traymod.display_available():
        with caplog.at_level("INFO", logger="ostinatod.tray"):
            assert traymod.main([]) == 0
            assert traymod.spawn_for_daemon() is None
        assert len(caplog.records) == 2 and all("no display" in r.getMessage() for r in caplog.records)


def test_tray_docks_and_follows_the_daemon(xdisplay, server, monkeypatch, tmp_path):
    name, mgr = xdisplay
    monkeypatch.setenv("DISPLAY", name)
    monkeypatch.setenv("PATH", str(tmp_path))  # no terminal / xdg-open: actions must not crash
    app = traymod.TrayApp(socket=server.socket, interval=0.1)
    assert type(app.icon).__module__ == "pystray._xorg"
    n0 = len(mgr.docked)
    app.start()
    try:
        deadline = time.monotonic() + 20
        while len(mgr.docked) == n0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(mgr.docked) > n0, "icon never asked the tray manager to dock"
        assert app.refresh() == "idle"
        labels = [str(i) for i in app.icon.menu.items]
        assert "Open TUI" in labels and "Model: ostinato-demo-random-weights (stopped)" in labels
        assert "Workload: coding" in labels and "Pause" in labels

        server.state.begin_request("r1", "anthropic", "m", "claude-code", "coding")
        assert app.refresh() == "busy"
        assert app.icon.title.startswith("Ostinato: busy")

        # Pause/Resume through the menu item (as a click would): unload, then load back
        from helpers import write_tiny_gguf
        g = write_tiny_gguf(tmp_path / "m.gguf")
        from ostinatod.control.client import call
        call("POST", "/models/load", {"path": str(g)}, socket=server.socket)

        class Loaded:
            state = "ready"

            async def stats(self):
                return {}
        server.state.engine = Loaded()
        pause = next(i for i in app.icon.menu.items if str(i) == "Pause")
        pause(app.icon)
        assert server.loads[-1] is None and app.paused
        assert "Resume" in [str(i) for i in app.icon.menu.items]
        next(i for i in app.icon.menu.items if str(i) == "Resume")(app.icon)
        assert server.loads[-1] == g and not app.paused

        app.open_tui()  # no terminal on PATH: logged, no exception
        assert app.last_spawn is None
    finally:
        app.quit()  # the daemon here is this process: only the icon stops
    assert app.stopped and not app.icon._running
    assert not app._poller.is_alive() and not app._thread.is_alive()


def test_daemon_away_means_error_state(xdisplay, monkeypatch, tmp_path):
    monkeypatch.setenv("DISPLAY", xdisplay[0])
    app = traymod.TrayApp(socket=tmp_path / "nothing.sock")
    assert app.refresh() == "error"
    assert "not running" in app.error
    assert "Model: daemon not running" in [str(i) for i in app.icon.menu.items]
    del app  # its X connection closes in __del__, while the X server still runs
    import gc
    gc.collect()
