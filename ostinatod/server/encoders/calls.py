"""What all encoders do with the final message of a generation: settled tool calls, the text not
streamed yet.

Tool calls are sent whole, from the final message, when the generation ends (not as the engine
streams their deltas): a call cut by the length limit or with arguments that do not parse goes
back as text (:func:`ostinatod.engine.text.settle_tool_calls`), which a call already streamed
could not.
"""

from __future__ import annotations

from typing import Any, Optional

from ...engine.text import settle_tool_calls

# while call deltas are held back, a keep-alive goes out every this many of them
TOOL_DELTAS_PER_PING = 32


def final_message(done: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The final assistant message and finish reason of a ``done`` event, tool calls settled
    (valid calls stay calls; the rest is text: :func:`ostinatod.engine.text.settle_tool_calls`)."""
    msg, finish = settle_tool_calls(dict(done.get("message") or {}), done.get("finish_reason") or "stop")
    return msg, finish or "stop"


def unsent_text(final: Optional[str], sent: str) -> str:
    """What of the final content was not streamed yet (a settled call's text, a held-back tail)."""
    final = final or ""
    return final[len(sent):] if final.startswith(sent) else ""
