"""Control-API client (:class:`ControlClient`, :func:`call`): what the CLI commands
(:mod:`.commands`), the TUI and the tray use to talk to the daemon.

Talks JSON over HTTP on the daemon's Unix socket with aiohttp's ``UnixConnector``; see
:mod:`ostinatod.control.server` for the routes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import aiohttp

from ..errors import MessageError, OstinatoError
from ..paths import get_paths


class DaemonNotRunning(MessageError):
    """No daemon answers on the control socket (message says how to start one)."""

    code, status = "daemon_not_running", 503


class ControlAPIError(OstinatoError):
    """The daemon answered with an error: ``code`` (stable string), ``message``, ``status`` (HTTP).
    ``str()`` is ``"message (code)"``."""

    def __init__(self, code: str, message: str, status: int):
        super().__init__(code, message, status)

    def __str__(self) -> str:
        return f"{self.message} ({self.code})"


class ControlClient:
    """Async client of the control API on ``socket`` (default: this user's daemon).

    Use as ``async with ControlClient() as c: await c.get("/status")``. Raises
    :class:`DaemonNotRunning` when nothing listens and :class:`ControlAPIError` on error answers.
    ``timeout`` is the per-request total time in seconds (streams have none).
    """

    def __init__(self, socket: Optional[Path] = None, timeout: float = 600.0):
        self.socket = Path(socket or get_paths().control_socket)
        self.timeout = timeout
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "ControlClient":
        self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(self.socket)))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _not_running(self, e: Exception) -> DaemonNotRunning:
        if not Path(self.socket).exists():
            why = f"no control socket at {self.socket}"
        else:  # a socket file no process listens on (a daemon that was killed), or no permission
            why = f"no answer on {self.socket}: {getattr(e, 'os_error', None) or e}"
        return DaemonNotRunning(f"ostinatod is not running ({why}); start it with 'ostinatod start'")

    async def request(self, method: str, path: str, body: Optional[dict] = None) -> dict[str, Any]:
        """One call; returns the decoded JSON object of a 2xx answer."""
        assert self._session is not None, "use 'async with ControlClient()'"
        try:
            async with self._session.request(method, "http://ostinatod" + path, json=body,
                                             timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                try:
                    data = await r.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError):
                    data = {"error": {"code": "bad_answer", "message": (await r.text())[:200]}}
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError) as e:
            raise self._not_running(e) from None
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            raise ControlAPIError("timeout", f"ostinatod did not answer {method} {path} within "
                                  f"{self.timeout:.0f} s (it may still carry it out; see 'ostinato "
                                  "status' and 'ostinato logs')", 504) from None
        if r.status >= 400:
            err = (data or {}).get("error") or {}
            raise ControlAPIError(err.get("code", "error"), err.get("message", str(data)), r.status)
        return data

    async def get(self, path: str) -> dict[str, Any]:
        """``GET path``; see :meth:`request`."""
        return await self.request("GET", path)

    async def post(self, path: str, body: Optional[dict] = None) -> dict[str, Any]:
        """``POST path`` with a JSON body; see :meth:`request`."""
        return await self.request("POST", path, body or {})

    async def events(self, interval: float = 1.0, count: Optional[int] = None) -> AsyncIterator[dict]:
        """Yield live metrics snapshots (``GET /events``, one JSON object per line)."""
        assert self._session is not None, "use 'async with ControlClient()'"
        q = f"?interval={interval}" + (f"&count={count}" if count else "")
        try:
            async with self._session.get("http://ostinatod/events" + q,
                                         timeout=aiohttp.ClientTimeout(total=None)) as r:
                async for line in r.content:
                    if line.strip():
                        yield json.loads(line)
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError) as e:
            raise self._not_running(e) from None


def call(method: str, path: str, body: Optional[dict] = None, socket: Optional[Path] = None) -> dict:
    """Synchronous one-shot call (for the CLI and the tray's menu actions)."""
    async def go():
        async with ControlClient(socket) as c:
            return await c.request(method, path, body)
    return asyncio.run(go())
