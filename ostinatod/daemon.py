"""The daemon's lifecycle: HTTP front end, control API and one engine, from start to shutdown.

:class:`Daemon` binds the HTTP API (:mod:`ostinatod.server.app`) and the control socket
(:mod:`ostinatod.control.server`), prepares the model (the generated demo model when none is set),
loads it into an engine client (:mod:`ostinatod.engine.client`; reloads on the control API's
load/unload) and shuts everything down on :meth:`Daemon.request_stop`. The ``ostinatod`` command
line (run, start, stop, status, install, uninstall) is :mod:`ostinatod.daemon_cli`.

Files (ostinatod.paths): ``<runtime>/ostinatod.pid`` (the pid), ``<runtime>/ostinatod.json``
(``{"pid", "http_url", "log_file", "control_socket"}``, written once the HTTP port is bound).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from .paths import Paths, get_paths
from .settings import Settings

log = logging.getLogger("ostinatod")


# --- engine -----------------------------------------------------------------------------------
def make_engine(settings: Settings, model_path: Path) -> Any:
    """An EngineClient for ``model_path`` per ``settings.engine_mode`` (ostinatod/engine/client.py)."""
    from .engine import client as engine_client

    return engine_client.make_engine(settings.model_copy(update={"model": model_path}), model_path)


class Daemon:
    """The running daemon: HTTP front end, control API, one engine. :meth:`serve` runs it until
    :meth:`request_stop` (SIGTERM/SIGINT)."""

    def __init__(self, settings: Settings, paths: Optional[Paths] = None):
        from .server.state import DaemonState

        self.settings = settings
        self.paths = (paths or get_paths()).ensure()
        self.state = DaemonState(settings, paths=self.paths)
        self.state.reload = self.reload
        self._stop = asyncio.Event()
        self._runners: list[Any] = []
        self._lock = asyncio.Lock()

    def request_stop(self) -> None:
        """Ask :meth:`serve` to shut down."""
        self._stop.set()

    async def reload(self, path: Optional[Path]) -> None:
        """Replace the engine by one serving ``path`` (None: unload). Waits until loaded.
        Raises EngineError when the model cannot be loaded (the daemon keeps running, no model)."""
        from .engine.types import EngineError

        async with self._lock:
            st = self.state
            old, st.engine = st.engine, None
            st.model_info = {}
            if old is not None:
                await old.stop()
            if path is None:
                log.info("model unloaded")
                return
            path = Path(path)
            if not path.is_file():
                raise EngineError("model_not_found", f"model file not found: {path}", 404)
            st.phase = f"loading {path.name}"
            eng = make_engine(self.settings, path)
            st.engine = eng
            try:
                await eng.start()
                await eng.wait_ready()
                st.model_info = await eng.info()
            except Exception:
                st.phase = None
                raise
            st.phase = None
            from .demo import demo_model_path

            st.demo = path == demo_model_path(self.settings, self.paths)
            st.settings = st.settings.model_copy(update={"model": path})
            info = st.model_info
            demo = " — DEMO MODEL WITH RANDOM WEIGHTS (output is gibberish)" if info.get("is_demo") else ""
            log.info("model ready: %s (%s, arch %s, n_ctx %s, experts %s)%s", st.model_name, path,
                     info.get("arch"), info.get("n_ctx"), info.get("experts_mode"), demo)

    async def serve(self) -> int:
        """Bind HTTP (and the control socket), load the model, serve until stopped.
        Returns the exit code: 0 after a stop, 1 when the model cannot be prepared or loaded."""
        from .engine.types import EngineError
        from .server.app import open_bind_refusal, start_http

        st = self.state
        refusal = open_bind_refusal(self.settings.host, self.settings.api_key, self.settings.allow_open_bind)
        if refusal:
            log.error("%s", refusal)
            print(f"ostinatod: {refusal}", file=sys.stderr)
            return 2
        st.phase = "starting"
        runner = await start_http(st)
        self._runners.append(runner)
        from .control.server import start_control_server
        try:
            self._runners.append(await start_control_server(st, self.paths.control_socket))
        except OSError as e:
            log.error("control socket %s: %s", self.paths.control_socket, e)
        self._write_runtime_files()
        log.info("ostinatod %s listening on %s (pid %d)%s", _version(), st.bind_address, os.getpid(),
                 "" if st.http_url.endswith(st.bind_address) else f"; local clients use {st.http_url}")
        if not self.settings.api_key and not st.http_url.endswith(st.bind_address):
            log.warning("the HTTP API is bound to %s WITHOUT an api_key (allow_open_bind)", st.bind_address)
        code = 0
        try:
            model = self.settings.model
            if model is None:
                from .demo import ensure_demo_model

                st.phase = "generating demo model"
                model = await asyncio.get_running_loop().run_in_executor(
                    None, ensure_demo_model, self.settings, self.paths)
                st.demo = True
            st.phase = None
            load = asyncio.ensure_future(self.reload(Path(model)))
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
            if load.done():
                load.result()
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
        p.pid_file.write_text(f"{os.getpid()}\n")
        info = {"pid": os.getpid(), "http_url": self.state.http_url, "log_file": str(p.log_file),
                "control_socket": str(p.control_socket)}
        tmp = p.runtime / "ostinatod.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, p.runtime / "ostinatod.json")

    async def _shutdown(self) -> None:
        log.info("shutting down")
        eng, self.state.engine = self.state.engine, None
        if eng is not None:
            try:
                await asyncio.wait_for(eng.stop(), 30)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("engine stop: %r", e)
        for r in reversed(self._runners):
            await r.cleanup()
        for f in (self.paths.pid_file, self.paths.runtime / "ostinatod.json"):
            try:
                if f.name != "ostinatod.pid" or f.read_text().strip() == str(os.getpid()):
                    f.unlink()
            except FileNotFoundError:
                pass


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ostinato")
    except Exception:  # noqa: BLE001
        return "dev"
