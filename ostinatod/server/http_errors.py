"""Malformed HTTP on both of the daemon's servers (the HTTP API and the control socket): aiohttp's
own error answers (bad request line, header bytes, chunking, an undecodable body) in the server's
JSON error shape and one log line, never ``text/plain`` or a traceback.

:class:`JsonErrorsHandler` is aiohttp's protocol of one connection with two changes: the errors it
answers itself (``handle_error``, status < 500) get the body of :meth:`~JsonErrorsHandler.error_body`,
and a body it cannot decode (``Content-Encoding: gzip`` on bytes that are not gzip) is not logged
again with a traceback when aiohttp drains the rest after the handler has answered 400.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

log = logging.getLogger("ostinatod.http")


def one_line(exc: BaseException | str | None) -> str:
    """The reason of an aiohttp error on one line: an ``HttpProcessingError``'s message without
    its "400, message:" prefix (also when wrapped in a ``RequestPayloadError``), whitespace runs
    (its newlines and caret lines) collapsed."""
    if isinstance(exc, RequestPayloadError) and isinstance(exc.__cause__, HttpProcessingError):
        exc = exc.__cause__
    text = exc.message if isinstance(exc, HttpProcessingError) and exc.message else str(exc or "bad request")
    return " ".join(text.split())


def _client_caused(exc: Any) -> bool:
    """An error of the request's bytes (not of the daemon): an undecodable or cut body, a
    malformed message (aiohttp's 4xx)."""
    if isinstance(exc, RequestPayloadError):
        return True
    return isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500


class JsonErrorsHandler(RequestHandler):
    """See the module docstring. Subclasses give :meth:`error_body` (the server's error shape)."""

    __slots__ = ()

    def error_body(self, path: str, status: int, text: str) -> web.Response:
        """The answer to a malformed request to ``path`` (``text``: the reason, one line)."""
        raise NotImplementedError

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        text = one_line(exc if exc is not None else message)
        log.info("malformed HTTP request -> %d: %s", status, text)
        if request.writer.output_size > 0:  # an answer has started: the connection is broken
            raise ConnectionError("response already started, cannot send the error")
        try:
            path = request.path
        except Exception:  # noqa: BLE001 - the request line itself may be what is malformed
            path = "/"
        resp = self.error_body(path, status, text)
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if _client_caused(exc):
            # the unread rest of an undecodable body, drained after the handler answered 400 (and
            # logged it): nothing new
            log.debug("request body dropped after its error: %s", one_line(exc))
            return
        super().log_exception(*args, **kw)


class JsonErrorsUnixSite(web.UnixSite):
    """A UnixSite whose connections are served by ``handler_cls`` (a :class:`JsonErrorsHandler`)."""

    def __init__(self, runner: web.BaseRunner, path: str, handler_cls: type[JsonErrorsHandler]):
        super().__init__(runner, path)
        self.handler_cls = handler_cls

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: self.handler_cls(server, loop=server._loop, **server._kwargs), self._path,
            ssl=self._ssl_context, backlog=self._backlog)
