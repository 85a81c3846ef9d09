"""``ostinato tray``: a tray icon for the daemon (pystray, imported lazily), over the control API.

The icon's colour shows the daemon state (:func:`tray_state`): idle (green), busy (blue: requests
running), loading (amber: starting, loading or restarting the engine) and error (red: engine error
or no daemon answering). Menu: Open TUI, the current model and workload (read-only lines),
Pause/Resume (unloads the model to free RAM and GPU memory, and loads it back), View logs, Quit
(stops the daemon and the icon).

Without a display (SSH, CI, headless servers) :func:`display_available` is False: ``ostinato tray``
logs one line and exits 0, and :func:`spawn_for_daemon` starts nothing, so a daemon that wants a
tray runs on without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from ..control.client import ControlAPIError, DaemonNotRunning, call
from ..paths import get_paths

log = logging.getLogger("ostinatod.tray")

STATES = ("idle", "busy", "loading", "error")
COLORS = {"idle": (46, 160, 67), "busy": (33, 118, 214), "loading": (230, 160, 20), "error": (207, 34, 46)}


def display_available() -> bool:
    """True when a tray can exist: macOS/Windows, or an X11/Wayland display is set."""
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def tray_state(snap: Optional[dict[str, Any]]) -> str:
    """State of the icon from a ``/metrics`` snapshot (None: no daemon answered)."""
    if snap is None:
        return "error"
    eng = snap.get("engine_state")
    if eng == "error":
        return "error"
    if eng in ("loading", "restarting", "starting") or snap.get("phase"):
        return "loading"
    if (snap.get("requests") or {}).get("active"):
        return "busy"
    return "idle"


def draw_icon(state: str, size: int = 64):
    """The icon image (Pillow RGBA, ``size`` px square): a disc in the state colour with a white
    ring, and a white bar per state level so the states differ in shape too (colour-blind users)."""
    from PIL import Image, ImageDraw  # lazy: optional (tray)

    if state not in COLORS:
        raise ValueError(f"unknown tray state {state!r}; one of {STATES}")
    img = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    m = size // 16
    d.ellipse((m, m, size - m, size - m), fill=COLORS[state] + (255,), outline=(255, 255, 255, 255),
              width=max(1, size // 16))
    # an "o" with a note stem: a small mark for Ostinato; filled when busy
    c, r = size // 2, size // 5
    d.ellipse((c - r, c - r // 2, c + r, c + r + r // 2), outline=(255, 255, 255, 255),
              width=max(1, size // 20), fill=(255, 255, 255, 255) if state == "busy" else None)
    if state == "error":
        d.line((size // 4, size // 4, 3 * size // 4, 3 * size // 4), fill=(255, 255, 255, 255), width=size // 12)
    if state == "loading":
        d.arc((m * 3, m * 3, size - m * 3, size - m * 3), 200, 340, fill=(255, 255, 255, 255), width=size // 14)
    return img


def _terminal_command(cmd: list[str]) -> Optional[list[str]]:
    """argv that runs ``cmd`` in a new terminal window, or None when no terminal is known."""
    if sys.platform == "darwin":
        return ["osascript", "-e", f'tell application "Terminal" to do script "{shlex.join(cmd)}"']
    for term, flag in (("x-terminal-emulator", "-e"), ("gnome-terminal", "--"), ("konsole", "-e"),
                       ("xfce4-terminal", "-x"), ("kitty", ""), ("alacritty", "-e"), ("xterm", "-e")):
        if shutil.which(term):
            return [term] + ([flag] if flag else []) + cmd
    return None


def _opener() -> Optional[str]:
    return "open" if sys.platform == "darwin" else shutil.which("xdg-open")


class TrayApp:
    """The tray icon and its menu, refreshed from the control API every ``interval`` seconds.

    ``socket``: control socket (default: this user's daemon). Use :meth:`run` (blocks) or
    :meth:`start`/:meth:`stop` (a background thread; Xorg and tests). Menu actions are methods
    (:meth:`open_tui`, :meth:`toggle_pause`, :meth:`view_logs`, :meth:`quit`).
    """

    def __init__(self, socket: Optional[Path] = None, interval: float = 2.0):
        import pystray  # lazy: importing it without a display raises on Xorg

        self.pystray = pystray
        self.socket = socket
        self.interval = interval
        self.snapshot: Optional[dict[str, Any]] = None
        self.state = "loading"
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._x_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._poller: Optional[threading.Thread] = None
        self.last_spawn: Optional[list[str]] = None  # command of the last terminal/viewer started
        M = pystray.MenuItem
        self.icon = pystray.Icon("ostinato", draw_icon(self.state), "Ostinato", pystray.Menu(
            M("Open TUI", lambda *_: self.open_tui(), default=True),
            M(lambda _: f"Model: {self.model_text()}", None, enabled=False),
            M(lambda _: f"Workload: {self.workload_text()}", None, enabled=False),
            pystray.Menu.SEPARATOR,
            M(lambda _: "Resume" if self.paused else "Pause", lambda *_: self.toggle_pause()),
            M("View logs", lambda *_: self.view_logs()),
            M("Quit", lambda *_: self.quit()),
        ))

    # --- state --------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """True while the daemon's model is paused (unloaded by Pause)."""
        return bool(self.snapshot and self.snapshot.get("paused"))

    def model_text(self) -> str:
        """Menu line: served model id and engine state, or that no daemon answers."""
        if self.snapshot is None:
            return "daemon not running"
        m = self.snapshot.get("model") or {}
        return f"{m.get('id', '-')} ({self.snapshot.get('engine_state')})"

    def workload_text(self) -> str:
        """Menu line: the current workload."""
        return (self.snapshot or {}).get("workload") or "-"

    def refresh(self) -> str:
        """Fetch one snapshot, update icon image, tooltip and menu; returns the new state."""
        try:
            self.snapshot, self.error = call("GET", "/metrics", socket=self.socket), None
        except (DaemonNotRunning, ControlAPIError, OSError) as e:
            self.snapshot, self.error = None, str(e)
        state = tray_state(self.snapshot)
        # pystray's Xorg backend runs these in its loop thread and answers through one shared
        # queue: two threads updating at once can take each other's answers, so serialise them.
        with self._x_lock:
            if self._stop.is_set():
                return state
            if state != self.state:
                self.state = state
                self.icon.icon = draw_icon(state)
            # Xorg window titles are latin-1: plain ASCII only
            self.icon.title = f"Ostinato: {state}" + (f" - {self.model_text()}" if self.snapshot else "")
            try:
                self.icon.update_menu()
            except Exception:  # some backends cannot update before the icon is shown
                pass
        return state

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.interval)

    # --- menu actions -------------------------------------------------------------------------
    def _spawn(self, cmd: list[str]) -> None:
        self.last_spawn = cmd
        try:
            subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:
            log.warning("cannot start %s: %s", cmd[0], e)

    def open_tui(self) -> None:
        """Open ``ostinato tui`` in a terminal window."""
        tui = [sys.executable, "-m", "ostinatod.cli", "tui"]
        cmd = _terminal_command(tui)
        if cmd is None:
            log.warning("no terminal emulator found; run 'ostinato tui' yourself")
            self.last_spawn = None
            return
        self._spawn(cmd)

    def toggle_pause(self) -> None:
        """Pause (unload, freeing memory) or resume the daemon's model."""
        try:
            call("POST", "/resume" if self.paused else "/pause", socket=self.socket)
        except (DaemonNotRunning, ControlAPIError) as e:
            self.error = str(e)
            log.warning("pause/resume: %s", e)
        self.refresh()

    def view_logs(self) -> None:
        """Open the daemon log with the desktop's viewer (xdg-open / open), else in a terminal."""
        path = str(get_paths().log_file)
        op = _opener()
        cmd = [op, path] if op else _terminal_command(["less", "+F", path])
        if cmd:
            self._spawn(cmd)

    def quit(self) -> None:
        """Stop the daemon (SIGTERM to its pid; it shuts down cleanly) and the icon."""
        try:
            pid = call("GET", "/status", socket=self.socket).get("pid")
            if pid and pid != os.getpid():
                os.kill(int(pid), signal.SIGTERM)
        except (DaemonNotRunning, ControlAPIError, OSError) as e:
            log.info("quit: daemon not stopped: %s", e)
        self.stop()

    # --- lifecycle ----------------------------------------------------------------------------
    def _setup(self, icon) -> None:
        icon.visible = True
        self._poller = threading.Thread(target=self._poll, name="tray-poll", daemon=True)
        self._poller.start()

    def run(self) -> None:
        """Show the icon and block until :meth:`stop` (main thread; required on macOS)."""
        self.icon.run(setup=self._setup)

    def start(self) -> None:
        """Show the icon from a background thread (Xorg/GTK/AppIndicator)."""
        self._thread = threading.Thread(target=self.run, name="tray", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Hide the icon and end its loop (and the refresh thread)."""
        self._stop.set()
        # let a refresh in flight finish first: it talks to the same X connection as the loop
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(10)
        with self._x_lock:
            try:
                self.icon.stop()
            except Exception:
                pass
        # pystray's Xorg loop can miss its own DestroyNotify when stopped from another thread
        # (python-xlib queues the event without waking the reader); a round trip wakes it.
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1)
            disp = getattr(self.icon, "_display", None)
            for _ in range(10):
                if not self._thread.is_alive() or disp is None:
                    break
                try:  # a round trip on the icon's X connection wakes a loop that missed the event
                    disp.sync()
                except Exception:
                    break
                self._thread.join(0.2)

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` (or Quit) ran."""
        return self._stop.is_set()


def spawn_for_daemon() -> Optional[subprocess.Popen]:
    """For the daemon: start ``ostinato tray`` as a child process when a display exists; otherwise
    log one line and return None (the daemon runs on without a tray)."""
    if not display_available():
        log.info("no display: tray icon not started")
        return None
    return subprocess.Popen([sys.executable, "-m", "ostinatod.cli", "tray"], stdin=subprocess.DEVNULL,
                            start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    """``ostinato tray [--socket PATH] [--interval S]``."""
    ap = argparse.ArgumentParser(prog="ostinato tray", description="Tray icon for the daemon.")
    ap.add_argument("--socket", type=Path, help="control socket (default: this user's daemon)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not display_available():
        log.info("ostinato tray: no display (DISPLAY/WAYLAND_DISPLAY unset); no tray icon")
        return 0
    try:
        app = TrayApp(a.socket, a.interval)
    except Exception as e:  # pystray missing, or no usable backend on this desktop
        log.info("ostinato tray: no tray icon (%s: %s); install with: pip install 'ostinato[tray]'",
                 type(e).__name__, e)
        return 0
    try:
        if sys.platform == "darwin":
            app.run()  # AppKit wants the main thread
        else:
            app.start()
            while not app._stop.wait(0.5):
                pass
    except KeyboardInterrupt:
        app.stop()
    return 0
