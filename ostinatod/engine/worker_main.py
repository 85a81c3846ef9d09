"""Engine worker process: ``python -m ostinatod.engine.worker_main`` (started by SubprocessEngine).

Speaks the worker pipe of :mod:`.protocol` (JSON lines): an :class:`~.protocol.Init` on stdin,
then requests, cancels and calls; we answer on the protocol stream with state messages, events and
replies.

The protocol stream is a private duplicate of the original stdout; fd 1 itself is pointed at stderr so
that anything native code prints cannot corrupt the protocol. stdin EOF (parent gone) stops us.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import protocol as P


def main() -> int:
    """Serve one worker until shutdown or stdin EOF. Returns the exit code (1: load failed)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    try:  # every logged line valid UTF-8 (a client's lone surrogate is escaped)
        sys.stderr.reconfigure(encoding="utf-8", errors="backslashreplace")  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    sys.stdout = sys.stderr
    wlock = threading.Lock()

    def send(msg: P.Message) -> None:
        line = P.encode(msg)
        with wlock:
            try:
                proto.write(line)
                proto.flush()
            except (BrokenPipeError, OSError):
                pass

    first = sys.stdin.readline()
    if not first:
        return 0
    init = P.decode(first)
    if not isinstance(init, P.Init):
        return 1
    from .stats import ModelFacts
    from .types import EngineError
    from .worker import Worker

    settings = init.settings  # validated into Settings by protocol.decode
    logging.basicConfig(level=getattr(logging, settings.log_level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s worker %(levelname)s %(name)s: %(message)s")
    from ..hardware import apply_cpu_placement

    # before the model load: the engine's threads (ggml, OpenMP, the decode graph's pool) are made
    # later and inherit this process's CPU mask
    apply_cpu_placement(settings.cpu_set)
    worker = Worker(settings, Path(init.model_path))
    try:
        worker.load()
    except EngineError as e:
        send(P.StateMsg("error", error=e))
        worker.close()
        return 1
    send(P.StateMsg("ready", info=ModelFacts.parse(worker.info())))

    # the pipe reader answers pings and only hands everything else on: request work (rendering,
    # tokens, stats, trace files) runs on these threads, so no request can delay a ping
    calls = ThreadPoolExecutor(2, thread_name_prefix="ostinato-calls")

    def call(msg: P.Call) -> None:
        if isinstance(msg, P.Ping):  # with the loop's progress: liveness is progress, not this answer
            send(P.Reply(msg.rid, worker.progress()))
            return
        if isinstance(msg, P.SwitchResidency):
            def done(info, err, rid=msg.rid) -> None:
                send(P.Reply(rid, info) if err is None else P.Reply(rid, error=err))
            worker.switch_residency(Path(msg.path), done, reason=msg.reason)
            return
        try:
            calls.submit(answer, msg)
        except RuntimeError:  # shut down: the worker is stopping
            pass

    def answer(msg: P.Call) -> None:
        try:
            send(P.Reply(msg.rid, result_of(msg)))
        except EngineError as e:
            send(P.Reply(msg.rid, error=e))
        except Exception as e:
            send(P.Reply(msg.rid, error=EngineError("internal_error", str(e), 500)))

    def result_of(msg: P.Call) -> Any:
        if isinstance(msg, P.ApplyTemplate):
            return worker.apply_template(msg.req)
        if isinstance(msg, P.CountTokens):
            return worker.count_tokens(msg.req)
        if isinstance(msg, P.Tokenize):
            return worker.tokenize_content(msg.content, msg.add_special, msg.parse_special, msg.with_pieces)
        if isinstance(msg, P.Detokenize):
            return worker.detokenize(msg.tokens)
        if isinstance(msg, P.FlushTraces):
            worker.flush_traces()
            return True
        if isinstance(msg, P.GetStats):
            return worker.stats()
        raise EngineError("internal_error", f"unknown call {msg.op.value}", 500)

    def reader() -> None:
        for line in sys.stdin:
            msg = P.decode(line)
            if isinstance(msg, P.Generate):
                rid = msg.req.id
                worker.submit(msg.req, lambda ev, rid=rid: send(P.Event(rid, ev)))
            elif isinstance(msg, P.Cancel):
                worker.cancel(msg.id)
            elif isinstance(msg, P.Call):
                call(msg)
            elif isinstance(msg, P.Shutdown):
                break
        worker.shutdown()

    threading.Thread(target=reader, name="ostinato-worker-stdin", daemon=True).start()
    try:
        worker.run()
    finally:
        calls.shutdown(wait=True, cancel_futures=True)
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
