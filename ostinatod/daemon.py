"""The daemon's lifecycle: HTTP front end, control API and one engine, from start to shutdown.

:class:`Daemon` binds the HTTP API (:mod:`ostinatod.server.app`) and the control socket
(:mod:`ostinatod.control.server`), prepares the model (the generated demo model when none is set),
loads it into an engine client (:mod:`ostinatod.engine.client`; reloads on the control API's
load/unload) and shuts everything down on :meth:`Daemon.request_stop`. It also owns what runs beside
serving (:meth:`Daemon.start_upkeep`): the background re-planner (:class:`ostinatod.workload.Replanner`)
and the first-start hardware profile. The ``ostinatod`` command line (run, start, stop, status,
install, uninstall) is :mod:`ostinatod.daemon_cli`.

Files (ostinatod.paths): ``<runtime>/ostinatod.pid`` (the pid), ``<runtime>/ostinatod.json``
(``{"pid", "http_url", "log_file", "control_socket"}``, written once the HTTP port is bound).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

from .control.server import start_control_server
from .demo import demo_model_path, ensure_demo_model
from .engine import client as engine_client
from .engine.types import EngineError
from .files import write_atomic, write_json_atomic
from .paths import Paths, get_paths
from .profile import ensure_profile
from .residency.model import ModelFileError, check_model_file
from .server.app import cors_refusal, open_bind_refusal, raise_fd_limit, start_http
from .server.state import DaemonState
from .settings import Settings
from .workload import Replanner

log = logging.getLogger("ostinatod")


# --- engine -----------------------------------------------------------------------------------
def make_engine(settings: Settings, model_path: Path) -> Any:
    """An EngineClient for ``model_path`` per ``settings.engine_mode`` (ostinatod/engine/client.py)."""
    return engine_client.make_engine(settings.model_copy(update={"model": model_path}), model_path)


def first_start_profile(path: Path) -> None:
    """Record the hardware profile in ``path`` when there is none or the hardware changed
    (:func:`ostinatod.profile.ensure_profile`; the calibration is left to ``ostinato calibrate``).
    Logs what it did; never raises (a profile problem must not stop the daemon)."""
    try:
        p = ensure_profile(path, recalibrate=False)
        if p.get("changed"):
            cal = p.get("calibration") or {}
            hint = "" if cal and not cal.get("error") and not cal.get("stale") else \
                "; run 'ostinato calibrate' to calibrate the engine on this hardware"
            log.info("hardware profile recorded in %s%s", path, hint)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("hardware profile not recorded: %s: %s", type(e).__name__, e)


class Daemon:
    """The running daemon: HTTP front end, control API, one engine. :meth:`serve` runs it until
    :meth:`request_stop` (SIGTERM/SIGINT)."""

    def __init__(self, settings: Settings, paths: Optional[Paths] = None):
        self.settings = settings
        self.paths = (paths or get_paths()).ensure()
        self.state = DaemonState(settings, paths=self.paths)
        self.state.reload = self.reload
        self._stop = asyncio.Event()
        self._runners: list[Any] = []
        self._lock = asyncio.Lock()
        self._control_bound = False  # the control socket file is ours to remove at shutdown
        self._profile: Optional[asyncio.Future] = None  # the first-start profile, in a worker thread

    def start_upkeep(self) -> None:
        """Start what runs beside serving, on the running event loop: the background re-planner
        (``state.replanner``; settings ``replan_idle_s``/``replan_growth``) and the first-start
        hardware profile (:func:`first_start_profile` in a worker thread). :meth:`stop_upkeep`
        stops the re-planner; the profile thread is not waited for."""
        rp = Replanner(self.state)
        self.state.replanner = rp
        rp.start()
        self._profile = asyncio.get_running_loop().run_in_executor(
            None, first_start_profile, self.paths.hardware_profile)

    async def stop_upkeep(self) -> None:
        """Stop the background re-planner (waits for its task to end; idempotent)."""
        rp = self.state.replanner
        if rp is not None:
            await rp.stop()

    def request_stop(self) -> None:
        """Ask :meth:`serve` to shut down."""
        self._stop.set()

    async def reload(self, path: Optional[Path]) -> None:
        """Replace the engine by one serving ``path`` (None: unload). Waits until loaded.

        The new file is validated first (``check_model_file``: present, GGUF, complete, not
        vocab-only); a bad file raises EngineError and the served model stays. A file that passes
        but that llama.cpp refuses raises EngineError too, with llama.cpp's reason; the model
        served before is then loaded again (without one, ``state.model_error`` says why)."""
        async with self._lock:
            st = self.state
            if path is not None:
                path = Path(path)
                # validate the new file before dropping the served one: a missing, foreign or
                # truncated file leaves the current model serving
                try:
                    await asyncio.get_running_loop().run_in_executor(None, check_model_file, path)
                except ModelFileError as e:
                    status = 404 if not path.is_file() else 400
                    code = "model_not_found" if status == 404 else "model_invalid"
                    log.error("cannot load %s: %s (the served model, if any, stays)", path, e)
                    raise EngineError(code, str(e), status) from None
            old, st.engine = st.engine, None
            previous = (getattr(old, "model_path", None) or st.settings.model) if old is not None else None
            st.model_info = {}
            if old is not None:
                await old.stop()
            if path is None:
                st.model_error = None
                log.info("model unloaded")
                return
            try:
                await self._start_engine(path)
            except Exception as e:
                st.phase = None
                st.model_error = f"{path}: {getattr(e, 'message', None) or e}"
                log.error("cannot load %s: %s", path, getattr(e, "message", None) or e)
                if previous is not None and Path(previous) != path:
                    log.info("loading the model served before again: %s", previous)
                    failed, st.engine = st.engine, None
                    if failed is not None:
                        await failed.stop()
                    try:
                        await self._start_engine(Path(previous))
                        st.phase = st.model_error = None
                    except Exception as e2:  # noqa: BLE001 - the first error is the one to report
                        log.error("the model served before did not load again: %s",
                                  getattr(e2, "message", None) or e2)
                        st.phase = None
                raise
            st.phase = None
            st.model_error = None

            st.demo = path == demo_model_path(self.settings, self.paths)
            st.settings = st.settings.model_copy(update={"model": path})
            info = st.model_info
            demo = " — DEMO MODEL WITH RANDOM WEIGHTS (output is gibberish)" if info.get("is_demo") else ""
            log.info("model ready: %s (%s, arch %s, n_ctx %s, experts %s)%s", st.model_name, path,
                     info.get("arch"), info.get("n_ctx"), info.get("experts_mode"), demo)

    async def _start_engine(self, path: Path) -> None:
        """Make, start and wait for an engine serving ``path``; it becomes ``state.engine``.
        Raises EngineError when it does not load (it is left in place, stopped or in "error")."""
        st = self.state
        st.phase = f"loading {path.name}"
        eng = make_engine(self.settings, path)
        st.engine = eng
        await eng.start()
        await eng.wait_ready()
        st.model_info = await eng.info()

    async def serve(self) -> int:
        """Bind HTTP (and the control socket), load the model, serve until stopped.
        Returns the exit code: 0 after a stop, 1 when the port cannot be bound or the demo model
        cannot be prepared. A model that fails to load leaves the daemon running without one
        (``state.model_error`` says why)."""
        st = self.state
        s = self.settings
        refusal = (open_bind_refusal(s.host, s.api_key, s.allow_open_bind)
                   or cors_refusal(s.cors, s.api_key, s.allow_cors_without_key))
        if refusal:
            log.error("%s", refusal)
            print(f"ostinatod: {refusal}", file=sys.stderr)
            return 2
        st.phase = "starting"

        log.debug("open-files limit %d", raise_fd_limit())
        try:
            runner = await start_http(st)
        except OSError as e:  # port in use, address not resolvable or not ours: one clear line
            log.error("cannot listen on %s:%s: %s", self.settings.host, self.settings.port,
                      e.strerror or e)
            return 1
        self._runners.append(runner)
        try:
            self._runners.append(await start_control_server(st, self.paths.control_socket))
            self._control_bound = True
        except OSError as e:
            log.error("control socket %s: %s", self.paths.control_socket, e)
        self.start_upkeep()
        try:
            self._write_runtime_files()
        except OSError as e:  # a full disk: one line naming the file (start reports it too)
            log.error("cannot start: %s", e)
            await self._shutdown()
            return 1
        log.info("ostinatod %s listening on %s (pid %d)%s", _version(), st.bind_address, os.getpid(),
                 "" if st.http_url.endswith(st.bind_address) else f"; local clients use {st.http_url}")
        if not self.settings.api_key and not st.http_url.endswith(st.bind_address):
            log.warning("the HTTP API is bound to %s WITHOUT an api_key (allow_open_bind)", st.bind_address)
        code = 0
        try:
            model = self.settings.model
            if model is None:
                st.phase = "generating demo model"
                model = await asyncio.get_running_loop().run_in_executor(
                    None, ensure_demo_model, self.settings, self.paths)
                st.demo = True
            st.phase = None
            load = asyncio.ensure_future(self.reload(Path(model)))
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
            if load.done():
                try:
                    load.result()
                except (EngineError, RuntimeError, OSError) as e:
                    # keep running without a model (like Ollama): /health, status and the TUI say
                    # why, and `ostinato load` can fix it
                    msg = getattr(e, "message", None) or str(e)
                    st.model_error = st.model_error or f"{model}: {msg}"
                    log.error("cannot serve model %s: %s; the daemon keeps running without a model "
                              "('ostinato load PATH' to load one)", model, msg)
                await stop
            else:
                load.cancel()
        except (EngineError, RuntimeError, OSError) as e:
            msg = getattr(e, "message", None) or str(e)
            log.error("cannot serve model %s: %s", self.settings.model or "(demo)", msg)
            code = 1
        finally:
            await self._shutdown()
        return code

    def _write_runtime_files(self) -> None:
        p = self.paths
        write_atomic(p.pid_file, f"{os.getpid()}\n")
        info = {"pid": os.getpid(), "http_url": self.state.http_url, "log_file": str(p.log_file),
                "control_socket": str(p.control_socket)}
        write_json_atomic(p.runtime / "ostinatod.json", info)

    async def _shutdown(self) -> None:
        log.info("shutting down")
        self.state.phase = "stopping"  # requests from now on: 503 engine_stopped
        await self.stop_upkeep()  # first: a re-plan must not reach for the engine being stopped
        eng, self.state.engine = self.state.engine, None
        if eng is not None:
            try:
                await asyncio.wait_for(eng.stop(), 30)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("engine stop: %r", e)
        for r in reversed(self._runners):
            await r.cleanup()
        owned = [self.paths.control_socket] if self._control_bound else []  # aiohttp leaves it
        for f in [self.paths.pid_file, self.paths.runtime / "ostinatod.json", *owned]:
            try:
                if f.name != "ostinatod.pid" or f.read_text().strip() == str(os.getpid()):
                    f.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:  # shutting down anyway: one line
                log.warning("cannot remove %s: %s", f, e.strerror or e)


def _version() -> str:
    try:
        return version("ostinato")
    except Exception:  # noqa: BLE001
        return "dev"
