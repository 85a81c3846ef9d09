"""Engine worker process: ``python -m ostinatod.engine.worker_main`` (started by SubprocessEngine).

Protocol: JSON lines. The parent writes to our stdin: first ``{"op": "init", "settings": {...},
"model_path": str}``, then ``{"op": "generate", "req": GenRequest-dict}``, ``{"op": "cancel",
"id"}``, ``{"op": "count_tokens" | "stats" | "flush_traces", "rid", ...}``, ``{"op":
"switch_residency", "rid", "path", "reason"}`` (answered once the loop has swapped the set, at the
next request boundary), ``{"op": "shutdown"}``. We write to the
protocol stream: ``{"op": "state", "state": "ready", "info"}`` or ``{"op": "state", "state":
"error", "code", "message", "status"}``, ``{"op": "event", "id", "type", "data"}`` and ``{"op":
"reply", "rid", "result"}`` / ``{"op": "reply", "rid", "error"}``.

The protocol stream is a private duplicate of the original stdout; fd 1 itself is pointed at stderr so
that anything native code prints cannot corrupt the protocol. stdin EOF (parent gone) stops us.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any


def _gen_request(d: dict[str, Any]):
    from .types import GenRequest
    names = {f.name for f in fields(GenRequest)}
    return GenRequest(**{k: v for k, v in d.items() if k in names})


def main() -> int:
    """Serve one worker until shutdown or stdin EOF. Returns the exit code (1: load failed)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    wlock = threading.Lock()

    def send(msg: dict[str, Any]) -> None:
        line = json.dumps(msg, default=str)
        with wlock:
            try:
                proto.write(line + "\n")
                proto.flush()
            except (BrokenPipeError, OSError):
                pass

    first = sys.stdin.readline()
    if not first:
        return 0
    init = json.loads(first)
    from ..settings import Settings
    from .types import EngineError
    from .worker import Worker

    settings = Settings(**{k: v for k, v in init["settings"].items() if v is not None})
    logging.basicConfig(level=getattr(logging, settings.log_level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s worker %(levelname)s %(name)s: %(message)s")
    worker = Worker(settings, Path(init["model_path"]))
    try:
        worker.load()
    except EngineError as e:
        send({"op": "state", "state": "error", "code": e.code, "message": e.message, "status": e.status})
        worker.close()
        return 1
    send({"op": "state", "state": "ready", "info": worker.info()})

    def reader() -> None:
        for line in sys.stdin:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            op = msg.get("op")
            if op == "generate":
                req = _gen_request(msg["req"])
                rid = req.id
                worker.submit(req, lambda ev, rid=rid: send({"op": "event", "id": rid, "type": ev.type,
                                                             "data": ev.data}))
            elif op == "cancel":
                worker.cancel(msg.get("id"))
            elif op == "switch_residency":
                rid = msg.get("rid")

                def done(info, err, rid=rid) -> None:
                    if err is None:
                        send({"op": "reply", "rid": rid, "result": info})
                    else:
                        send({"op": "reply", "rid": rid,
                              "error": {"code": err.code, "message": err.message, "status": err.status}})
                worker.switch_residency(Path(msg["path"]), done, reason=str(msg.get("reason") or "control"))
            elif op in ("count_tokens", "stats", "flush_traces"):
                try:
                    if op == "count_tokens":
                        result: Any = worker.count_tokens(_gen_request(msg["req"]))
                    elif op == "flush_traces":
                        worker.flush_traces()
                        result = True
                    else:
                        result = worker.stats()
                    send({"op": "reply", "rid": msg.get("rid"), "result": result})
                except EngineError as e:
                    send({"op": "reply", "rid": msg.get("rid"),
                          "error": {"code": e.code, "message": e.message, "status": e.status}})
                except Exception as e:
                    send({"op": "reply", "rid": msg.get("rid"),
                          "error": {"code": "internal_error", "message": str(e), "status": 500}})
            elif op == "shutdown":
                break
        worker.shutdown()

    threading.Thread(target=reader, name="ostinato-worker-stdin", daemon=True).start()
    try:
        worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
