"""Engine clients: the :class:`~ostinatod.engine.types.EngineClient` protocol over a worker.

- :class:`InProcessEngine`: the :class:`~ostinatod.engine.worker.Worker` loop in a thread of this
  process (tests, tools). A native crash takes the process with it.
- :class:`SubprocessEngine` (:mod:`.supervisor`): the worker in a supervised child process
  (``python -m ostinatod.engine.worker_main``) speaking JSON lines over its stdin/stdout. If the
  child dies, every in-flight request ends with an ``error`` event of code ``engine_crashed``, the
  state goes "restarting", the child is started again and reloads the model, then "ready".

Both stop generation when the consumer of :meth:`generate` goes away (client disconnect): closing
the async iterator cancels the request in the worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from ..settings import Settings
from .events import TERMINAL, EngineEvent
from .stats import EngineStats, ModelFacts
from .streams import error_event, resolve_model, until_terminal
from .supervisor import SubprocessEngine  # noqa: F401 - one import home for both clients
from .types import EngineError, GenRequest

log = logging.getLogger("ostinatod.engine")


class InProcessEngine:
    """Worker loop in a daemon thread of this process. ``model_path`` overrides ``settings.model``."""

    def __init__(self, settings: Settings, model_path: Optional[Path] = None):
        self.settings = settings
        self.model_path = model_path
        self.state = "stopped"
        self.error: Optional[EngineError] = None
        self._worker = None
        self._thread: Optional[threading.Thread] = None
        self._loaded: Optional[asyncio.Future] = None
        self._info: Optional[ModelFacts] = None

    async def start(self) -> None:
        """Start loading the model in the worker thread (returns at once; see wait_ready)."""
        from .worker import Worker
        if self.state in ("loading", "ready"):
            return
        loop = asyncio.get_running_loop()
        self._loaded = loop.create_future()
        self.state = "loading"
        self.error = None
        try:
            path = resolve_model(self.settings, self.model_path)
        except EngineError as e:
            self._set_loaded(loop, e)
            return
        worker = Worker(self.settings, path)
        self._worker = worker

        def body() -> None:
            try:
                worker.load()
                self._info = ModelFacts.parse(worker.info())
            except EngineError as e:
                loop.call_soon_threadsafe(self._set_loaded, loop, e)
                worker.close()
                return
            except Exception as e:  # pragma: no cover - unexpected loader failure
                log.exception("model load failed")
                loop.call_soon_threadsafe(self._set_loaded, loop,
                                          EngineError("model_not_loaded", f"model load failed: {e}", 503))
                worker.close()
                return
            loop.call_soon_threadsafe(self._set_loaded, loop, None)
            try:
                worker.run()
            finally:
                worker.close()

        self._thread = threading.Thread(target=body, name="ostinato-engine", daemon=True)
        self._thread.start()

    def _set_loaded(self, loop: asyncio.AbstractEventLoop, err: Optional[EngineError]) -> None:
        if err is None:
            self.state = "ready"
        else:
            self.state = "error"
            self.error = err
            log.error("engine: %s", err.message)
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_result(err)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for the model. Raises EngineError (load failure, or "timeout" after ``timeout`` s)."""
        if self._loaded is None:
            raise EngineError("model_not_loaded", "engine not started", 503)
        try:
            err = await asyncio.wait_for(asyncio.shield(self._loaded), timeout)
        except asyncio.TimeoutError:
            raise EngineError("model_not_loaded", f"model not loaded after {timeout} s", 503) from None
        if err is not None:
            raise err

    async def stop(self) -> None:
        """Stop the worker thread and free the model."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 60)
        self._worker = None
        self._thread = None
        self.state = "stopped"

    async def generate(self, req: GenRequest) -> AsyncIterator[EngineEvent]:
        """Stream the events of ``req`` (ends after "done" or "error")."""
        if self.state != "ready" or self._worker is None:
            yield error_event("model_not_loaded", f"the engine is {self.state}", 503)
            return
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def emit(ev: EngineEvent) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        worker = self._worker
        worker.submit(req, emit)
        finished = False
        try:
            async for ev in until_terminal(q):
                finished = ev.type in TERMINAL
                yield ev
        finally:
            if not finished:
                worker.cancel(req.id)

    async def count_tokens(self, req: GenRequest) -> int:
        """Tokens of the rendered prompt. Raises EngineError for bad requests."""
        if self.state != "ready" or self._worker is None:
            raise EngineError("model_not_loaded", f"the engine is {self.state}", 503)
        return await asyncio.to_thread(self._worker.count_tokens, req)

    async def tokenize(self, content: Any, add_special: bool = False, parse_special: bool = True,
                       with_pieces: bool = False) -> list[Any]:
        """llama-server's /tokenize of ``content`` (see :meth:`.worker.Worker.tokenize_content`)."""
        return await asyncio.to_thread(self._ready_worker().tokenize_content, content, add_special,
                                       parse_special, with_pieces)

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens``. Raises EngineError 400 for an id outside the vocabulary."""
        return await asyncio.to_thread(self._ready_worker().detokenize, tokens)

    async def apply_template(self, req: GenRequest) -> str:
        """The prompt the chat template makes of ``req``. Raises EngineError as count_tokens."""
        return await asyncio.to_thread(self._ready_worker().apply_template, req)

    def _ready_worker(self) -> Any:
        if self.state != "ready" or self._worker is None:
            raise EngineError("model_not_loaded", f"the engine is {self.state}", 503)
        return self._worker

    async def info(self) -> dict[str, Any]:
        """Loaded model facts (:class:`.stats.ModelFacts` as JSON, with the ``state``; only the
        state before the model is loaded)."""
        return dict(self._info.wire if self._info is not None else {}, state=self.state)

    async def stats(self) -> EngineStats:
        """Engine counters (see Worker.stats), parsed."""
        if self._worker is None or self.state != "ready":
            return EngineStats.not_ready(self.state)
        return EngineStats.parse(self._worker.stats()).with_state(self.state)

    async def switch_residency(self, path: Path, reason: str = "control") -> dict[str, Any]:
        """Swap the residency set to the file ``path`` at the next request boundary (see
        :meth:`ostinatod.engine.worker.Worker.switch_residency`: waits until no request generates).
        Returns ``{"seconds", "workload", "path", "previous_workload", "hot_experts", "pool_bytes",
        "reason", "at"}``. Raises EngineError: ``residency_unavailable`` (409), ``residency_refused``
        (400), ``residency_switch_failed`` (500), ``model_not_loaded`` / ``engine_stopped`` (503);
        the previous set then stays active."""
        if self.state != "ready" or self._worker is None:
            raise EngineError("model_not_loaded", f"the engine is {self.state}", 503)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(info: Optional[dict[str, Any]], err: Optional[EngineError]) -> None:
            if not fut.done():
                if err is not None:
                    fut.set_exception(err)
                else:
                    fut.set_result(info)

        self._worker.switch_residency(Path(path), lambda i, e: loop.call_soon_threadsafe(settle, i, e),
                                      reason=reason)
        return await fut

    async def flush_traces(self) -> None:
        """Write pending routing counts to the trace files (before planning from them)."""
        if self._worker is not None and self.state == "ready":
            await asyncio.to_thread(self._worker.flush_traces)


def make_engine(settings: Settings, model_path: Optional[Path] = None):
    """The engine client that ``settings.engine_mode`` selects."""
    if settings.engine_mode == "inprocess":
        return InProcessEngine(settings, model_path)
    return SubprocessEngine(settings, model_path)
