"""The supervised engine worker process: :class:`SubprocessEngine` (an EngineClient).

It starts ``python -m ostinatod.engine.worker_main``, speaks the worker pipe (:mod:`.protocol`)
over its stdin/stdout, watches its liveness (pings answered with the loop's progress) and
restarts it after a crash or a stall; in-flight requests end with ``engine_crashed`` /
``engine_stalled`` or, with no output yet, run again on the restarted worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from ..settings import Settings
from . import limits
from . import protocol as P
from .events import TERMINAL, DeltaEvent, EngineEvent, ErrorEvent
from .stats import EngineStats, LoopProgress, ModelFacts
from .streams import error_event, resolve_model, until_terminal
from .types import EngineError, GenRequest

log = logging.getLogger("ostinatod.engine")


STALL_S = 2.0  # a worker silent to pings this long is reported "stalled" (killed at worker_ping_timeout_s)


class SubprocessEngine:
    """Supervised worker process (see module docstring).

    ``restart_limit`` crashes within ``restart_window_s`` put the engine in state "error" instead of
    restarting again. ``pid`` is the current child's process id (None when not running).
    """

    def __init__(self, settings: Settings, model_path: Optional[Path] = None,
                 restart_limit: int = 5, restart_window_s: float = 120.0, max_backoff_s: float = 60.0):
        self.settings = settings
        self.model_path = model_path
        self.state = "stopped"
        self.error: Optional[EngineError] = None
        self.restarts = 0
        self.restart_limit = restart_limit
        self.restart_window_s = restart_window_s
        self.max_backoff_s = max_backoff_s
        self.last_exit: Optional[dict[str, Any]] = None  # {"code", "at", "reason"} of the last crash
        self.next_restart_at: Optional[float] = None  # wall time of the pending restart
        self._kill_reason: Optional[str] = None
        self.stall: Optional[dict[str, Any]] = None  # {"what", "for_s", "requests"} while stalled
        self._stalled: Optional[dict[str, Any]] = None  # the stall the worker was killed for
        self._load_failed = False  # the worker reported that the model cannot be loaded
        self._watchdog: Optional[asyncio.Task] = None
        self._crash_times: list[float] = []
        self._proc: Optional[asyncio.subprocess.Process] = None
        self._reader: Optional[asyncio.Task] = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._rid = itertools.count(1)
        self._ready: Optional[asyncio.Event] = None
        self._stopping = False
        self._info: Optional[ModelFacts] = None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def start(self) -> None:
        """Spawn the worker process; the model loads in it (see wait_ready)."""
        if self.state in ("loading", "ready", "restarting"):
            return
        self._stopping = False
        self._ready = asyncio.Event()
        self.error = None
        try:
            path = resolve_model(self.settings, self.model_path)
        except EngineError as e:
            self.state, self.error = "error", e
            self._ready.set()
            return
        self.state = "loading"
        await self._spawn(path)
        if self._watchdog is None and self.settings.worker_ping_timeout_s > 0:
            self._watchdog = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Liveness is progress. Every second (at most every ``worker_ping_timeout_s / 2``) while
        it is ready the worker is pinged; its pipe reader answers with the loop's progress
        (:meth:`.worker.Worker.progress`: the native call it is inside and for how long). A loop
        inside one call for a third of ``engine_stall_timeout_s`` (at least :data:`STALL_S`) is
        "stalled" (``status()["stall"]`` names the call
        and the request ids; /health and /metrics show them; new requests wait as for a
        restart); past ``engine_stall_timeout_s`` the worker is killed: the requests in that call
        end with ``engine_stalled`` and the others run again on the restarted worker, as after a
        crash. A worker that does not answer at all (stopped, wedged process) is "stalled" after
        :data:`STALL_S` too and killed after ``worker_ping_timeout_s``."""
        timeout = float(self.settings.worker_ping_timeout_s)
        while not self._stopping:
            await asyncio.sleep(min(1.0, timeout / 2))
            proc = self._proc
            if self.state not in ("ready", "stalled") or proc is None or proc.returncode is not None:
                continue
            try:
                progress = await self._ping(proc, timeout)
            except asyncio.TimeoutError:
                if proc is self._proc and proc.returncode is None and not self._stopping:
                    log.error("engine worker (pid %s) did not answer a ping within %.0f s (stopped or "
                              "hung); killing it", proc.pid, timeout)
                    self._kill_reason = f"did not answer a liveness ping within {timeout:.0f} s"
                    self._kill(proc)
                continue
            except EngineError:
                continue
            if proc is self._proc:
                self._judge_progress(proc, progress)

    async def _ping(self, proc: asyncio.subprocess.Process, timeout: float) -> Any:
        """The worker's answer to one ping (its progress); "stalled" meanwhile when it takes
        longer than :data:`STALL_S`. Raises asyncio.TimeoutError after ``timeout`` s."""
        ping = asyncio.ensure_future(self._call(P.Ping, force=True))
        done, _ = await asyncio.wait({ping}, timeout=min(STALL_S, timeout))
        if not done:  # this loop may have been busy itself (a huge body): read what came
            done, _ = await asyncio.wait({ping}, timeout=0.2)
        if not done and proc is self._proc and self.state == "ready":
            log.warning("engine worker (pid %s) has not answered a ping for %.0f s: stalled",
                        proc.pid, STALL_S)
            self.state = "stalled"
            self.stall = {"what": "no answer to liveness pings", "for_s": STALL_S, "requests": []}
        if not done:
            done, _ = await asyncio.wait({ping}, timeout=max(0.0, timeout - STALL_S))
            if not done:
                done, _ = await asyncio.wait({ping}, timeout=0.2)
        if not done:
            ping.cancel()
            raise asyncio.TimeoutError
        return ping.result()

    def _judge_progress(self, proc: asyncio.subprocess.Process, progress: LoopProgress) -> None:
        """Stalled or not from the worker's progress (see :meth:`_watch`); kill it past
        ``engine_stall_timeout_s``."""
        busy = progress.busy
        for_s = float(busy.for_s) if busy is not None else 0.0
        bound = float(self.settings.engine_stall_timeout_s)
        # an honest long forward pass (a deep context on a CPU) is not reported before a third
        # of the bound (5 s by default)
        if for_s < max(STALL_S, bound / 3):
            if self.state == "stalled":
                log.info("engine worker (pid %s) makes progress again", proc.pid)
                self.state = "ready"
            self.stall = None
            return
        assert busy is not None
        ids = [str(i) for i in busy.requests]
        if self.state != "stalled":
            log.warning("engine worker (pid %s) stalled: %.1f s in one %s of request(s) %s", proc.pid,
                        for_s, busy.what, ", ".join(ids) or "-")
        self.state = "stalled"
        self.stall = {"what": busy.what, "for_s": round(for_s, 1), "requests": ids}
        if bound > 0 and for_s >= bound and proc.returncode is None and not self._stopping:
            log.error("engine worker (pid %s): %.1f s in one %s of request(s) %s (limit "
                      "engine_stall_timeout_s = %g); failing them and restarting the worker", proc.pid,
                      for_s, busy.what, ", ".join(ids) or "-", bound)
            self._kill_reason = (f"stalled {for_s:.0f} s in one {busy.what} of request(s) "
                                 f"{', '.join(ids) or '-'}")
            self._stalled = {"ids": set(ids), "what": busy.what, "for_s": for_s}
            self._kill(proc)

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass

    def status(self) -> dict[str, Any]:
        """Supervision facts for /health and the control API's status."""
        out: dict[str, Any] = {"restarts": self.restarts, "last_exit": self.last_exit,
                               "error": self.error.message if self.error is not None else None}
        if self.stall is not None and self.state == "stalled":
            out["stall"] = dict(self.stall)
        if self.state == "restarting" and self.next_restart_at is not None:
            out["next_restart_in_s"] = round(max(0.0, self.next_restart_at - time.time()), 1)
        return out

    async def _spawn(self, path: Path) -> None:
        self._load_failed = False
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ostinatod.engine.worker_main",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            limit=64 * 1024 * 1024)
        await self._send(P.Init(self.settings, str(path)))
        self._reader = asyncio.create_task(self._read_loop(self._proc, path))

    async def _send(self, msg: P.Message) -> bool:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.returncode is not None:
            return False
        try:
            data = P.encode(msg).encode()
        except (TypeError, ValueError, RecursionError) as e:  # never half a line on the pipe
            raise EngineError("invalid_request", f"request cannot be sent to the engine: {e}", 400) from None
        try:
            proc.stdin.write(data)
            await proc.stdin.drain()
            return True
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            return False

    async def _read_loop(self, proc: asyncio.subprocess.Process, path: Path) -> None:
        assert proc.stdout is not None
        while True:
            try:
                line = await proc.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):
                continue
            if not line:
                break
            msg = P.decode(line)
            if isinstance(msg, P.Event):
                q = self._streams.get(msg.id)
                if q is not None:
                    q.put_nowait(msg.event)
            elif isinstance(msg, P.Reply):
                fut = self._replies.pop(msg.rid or "", None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, P.StateMsg):
                if msg.state == "ready":
                    self._info = msg.info
                    self.state = "ready"
                    self.error = None
                    assert self._ready is not None
                    self._ready.set()
                elif msg.error is not None:  # the model failed to load in this worker
                    self.error = msg.error
                    self._load_failed = True
        rc = await proc.wait()
        await self._on_exit(proc, rc, path)

    async def _on_exit(self, proc: asyncio.subprocess.Process, rc: int, path: Path) -> None:
        # every in-flight request learns that its worker is gone; the ones it was killed for
        # (a stalled call) end with engine_stalled, the others run again (generate)
        stalled, self._stalled = self._stalled, None
        self.stall = None
        for rid, q in list(self._streams.items()):
            if stalled is not None and rid in stalled["ids"]:
                bound = self.settings.engine_stall_timeout_s
                what = stalled["what"]
                cause = (" (under the request's grammar: simplify its patterns, schema or grammar)"
                         if what == "sampling" else "")
                q.put_nowait(ErrorEvent(
                    "engine_stalled",
                    f"the engine spent {stalled['for_s']:.0f} s in one {what} of this request "
                    f"(limit engine_stall_timeout_s = {bound:g}){cause}; the request was ended "
                    "and the engine worker restarted", 400 if what == "sampling" else 503))
            else:
                q.put_nowait(error_event("engine_crashed", f"the engine worker exited (code {rc}); it is "
                                          "being restarted, retry the request", 503))
        self._streams.clear()
        for fut in list(self._replies.values()):
            if not fut.done():
                fut.set_result(P.Reply(None, error=EngineError("engine_crashed", "engine worker exited", 503)))
        self._replies.clear()
        if self._stopping or proc is not self._proc:
            return
        if self.state == "loading" and not self._load_failed:
            # died before its first "ready" (llama.cpp aborts on some files): it would again
            self.error = EngineError("model_not_loaded", f"the engine worker exited with code {rc} while "
                                     "loading the model (llama.cpp aborted on the file; the engine log "
                                     "has its message)", 503)
            self._load_failed = True
        if self._load_failed and self.state in ("loading", "restarting"):
            # the model failed to load: restarting would fail the same way
            self.state = "error"
            assert self._ready is not None
            self._ready.set()
            return
        now = time.monotonic()
        self._crash_times = [t for t in self._crash_times if now - t < self.restart_window_s] + [now]
        n = len(self._crash_times)
        # the first restart_limit crashes of the window restart at once, later ones with exponential
        # backoff; it never gives up (a daemon that serves nothing helps nobody; each try is logged)
        delay = 0.2 if n <= self.restart_limit else min(self.max_backoff_s, 2.0 ** (n - self.restart_limit))
        reason, self._kill_reason = self._kill_reason, None
        self.last_exit = {"code": rc, "at": time.time(), "reason": reason or f"exited with code {rc}"}
        plural = "es" if n > 1 else ""
        self.error = EngineError("engine_crashed", f"the engine worker {self.last_exit['reason']} "
                                 f"({n} crash{plural} in {self.restart_window_s:.0f} s); restarting in "
                                 f"{delay:.1f} s", 503)
        log.error("engine worker %s (%d crash%s in %.0f s); restarting in %.1f s",
                  self.last_exit["reason"], n, plural, self.restart_window_s, delay)
        self.state = "restarting"
        self.restarts += 1
        self._ready = asyncio.Event()
        self.next_restart_at = time.time() + delay
        await asyncio.sleep(delay)
        self.next_restart_at = None
        if not self._stopping:
            await self._spawn(path)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until a worker has loaded the model. Raises EngineError on failure or timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.state == "ready":
                return
            if self.state in ("error", "stopped"):
                raise self.error or EngineError("model_not_loaded", f"the engine is {self.state}", 503)
            ev = self._ready
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise EngineError("model_not_loaded", f"model not loaded after {timeout} s", 503)
            try:
                assert ev is not None
                await asyncio.wait_for(ev.wait(), left if left is None else min(left, 1.0))
            except asyncio.TimeoutError:
                pass
            if ev is not None and ev.is_set() and self.state not in ("ready", "error", "stopped"):
                await asyncio.sleep(0.05)  # a restart replaced the event

    async def stop(self) -> None:
        """Stop the worker process (in-flight requests get an error event)."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        proc = self._proc
        if proc is not None and proc.returncode is None:
            await self._send(P.Shutdown())
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        self._proc = None
        self.state = "stopped"

    async def generate(self, req: GenRequest) -> AsyncIterator[EngineEvent]:
        """Stream the events of ``req`` from the worker process. A request the worker had given
        no output yet when it crashed is sent again, once, to the restarted worker (waiting for
        it up to ``RERUN_WAIT_S``); one with output ends with the ``engine_crashed`` error."""
        if self.state != "ready":
            yield error_event("model_not_loaded", f"the engine is {self.state}", 503)
            return
        if req.id in self._streams:
            yield error_event("invalid_request", f"request id {req.id!r} is already running", 400)
            return
        try:
            self._check_size(req)
        except EngineError as e:
            yield error_event(e.code, e.message, e.status)
            return
        finished = False
        try:
            for attempt in (0, 1):
                q: asyncio.Queue[EngineEvent] = asyncio.Queue()
                self._streams[req.id] = q
                if not await self._send(P.Generate(req)):
                    self._streams.pop(req.id, None)
                    finished = True
                    yield error_event("engine_crashed", "the engine worker is not running", 503)
                    return
                output = False
                async for ev in until_terminal(q):
                    if (attempt == 0 and not output and isinstance(ev, ErrorEvent)
                            and ev.code == "engine_crashed" and not self._stopping):
                        break  # nothing reached the client: run it again on the restarted worker
                    output = output or isinstance(ev, DeltaEvent)
                    finished = ev.type in TERMINAL
                    yield ev
                else:
                    return
                log.info("request %s: the engine worker exited before its first output; running it "
                         "again on the restarted worker", req.id)
                try:
                    await self.wait_ready(RERUN_WAIT_S)
                except EngineError as e:
                    finished = True
                    yield error_event("engine_crashed", f"the engine worker exited and did not come "
                                       f"back: {e.message}", 503)
                    return
        finally:
            self._streams.pop(req.id, None)
            if not finished:
                await self._send(P.Cancel(req.id))

    async def _call(self, kind: type[P.Call], force: bool = False, **kw: Any) -> Any:
        """Send a call of ``kind`` (fields ``kw``) and return its typed result
        (:meth:`.protocol.Call.result_of`). Raises EngineError (the worker's, or 503)."""
        if self.state != "ready" and not (force and self._proc is not None):
            raise EngineError("model_not_loaded", f"the engine is {self.state}", 503)
        rid = str(next(self._rid))
        fut = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        call = kind(rid, **kw)
        if not await self._send(call):
            self._replies.pop(rid, None)
            raise EngineError("engine_crashed", "the engine worker is not running", 503)
        reply: P.Reply = await fut
        if reply.error is not None:
            raise reply.error
        return call.result_of(reply.result)

    async def count_tokens(self, req: GenRequest) -> int:
        """Tokens of the rendered prompt of ``req``. Raises EngineError."""
        self._check_size(req)
        return await self._call(P.CountTokens, req=req)

    async def tokenize(self, content: Any, add_special: bool = False, parse_special: bool = True,
                       with_pieces: bool = False) -> list[Any]:
        """llama-server's /tokenize of ``content``, in the worker process."""
        return await self._call(P.Tokenize, content=content, add_special=add_special,
                                parse_special=parse_special, with_pieces=with_pieces)

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens``, in the worker process. Raises EngineError 400 for a bad id."""
        return await self._call(P.Detokenize, tokens=list(tokens))

    async def apply_template(self, req: GenRequest) -> str:
        """The prompt the chat template makes of ``req``, in the worker process."""
        self._check_size(req)
        return await self._call(P.ApplyTemplate, req=req)

    def _check_size(self, req: GenRequest) -> None:
        """Refuse text that cannot fit the context (:func:`.limits.check_text_fits`) before it is
        sent down the pipe: decoding tens of MiB there would keep the worker's reader from
        answering pings."""
        if self._info is None:
            return
        n_ctx, piece = self._info.n_ctx, self._info.max_piece_bytes
        if n_ctx and piece:
            limits.check_text_fits(limits.message_text_bytes(req.messages, req.prompt), piece, n_ctx)

    async def info(self) -> dict[str, Any]:
        """Loaded model facts (from the worker at load time: :class:`.stats.ModelFacts` as JSON),
        with ``state`` and ``restarts``."""
        return dict(self._info.wire if self._info is not None else {}, state=self.state,
                    restarts=self.restarts)

    async def stats(self) -> EngineStats:
        """Engine counters from the worker process, parsed (:class:`.stats.EngineStats`)."""
        if self.state != "ready":
            return EngineStats.not_ready(self.state, self.restarts)
        try:
            st: EngineStats = await self._call(P.GetStats)
        except EngineError:
            return EngineStats.not_ready(self.state, self.restarts)
        return st.with_state(self.state, self.restarts)

    async def switch_residency(self, path: Path, reason: str = "control") -> dict[str, Any]:
        """Swap the residency set in the worker process at its next request boundary; same answer
        and errors as :meth:`InProcessEngine.switch_residency` (``engine_crashed`` if the worker
        dies meanwhile)."""
        return await self._call(P.SwitchResidency, path=str(path), reason=reason)

    async def flush_traces(self) -> None:
        """Make the worker write its pending routing counts to the trace files."""
        await self._call(P.FlushTraces)


RERUN_WAIT_S = 300.0  # a re-run request waits this long for the restarted worker
