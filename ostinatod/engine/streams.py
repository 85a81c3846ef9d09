"""What both engine clients share: the model file a client loads, the error event it makes itself,
and reading one request's event queue up to its end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Optional

from ..settings import Settings
from .events import TERMINAL, EngineEvent, ErrorEvent
from .types import EngineError


def resolve_model(settings: Settings, model_path: Optional[Path]) -> Path:
    """``model_path`` or the setting ``model``. Raises EngineError 503 when neither is set."""
    p = model_path or settings.model
    if p is None:
        raise EngineError("model_not_loaded", "no model configured (set 'model' or pass model_path)", 503)
    return Path(p).expanduser()


def error_event(code: str, message: str, status: int) -> ErrorEvent:
    """An error event made by a client (no worker involved)."""
    return ErrorEvent(code, message, status)


async def until_terminal(q: "asyncio.Queue[EngineEvent]") -> AsyncIterator[EngineEvent]:
    """The events of ``q`` up to and including the first "done" or "error"."""
    while True:
        ev = await q.get()
        yield ev
        if ev.type in TERMINAL:
            return
