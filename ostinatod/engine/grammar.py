"""Grammars a request brings itself: llama-server's ``grammar`` (GBNF) and a JSON schema on a raw
prompt.

A GBNF text is checked by llama.cpp's own grammar parser (``llama_sampler_init_grammar``: NULL when
it does not parse) before the request is served, so a bad grammar is a 400 naming llama.cpp's
reason, never a failed sampler later. The grammar then reaches the sampler the way a
``response_format`` grammar does: as the ``grammar`` of the apply result the shim's
``ostinato_sampler_new`` takes (:func:`apply_result`), not lazy, from the first output token.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from .chat import stderr_captured
from .loading import log_errors_captured
from .types import EngineError

_PARSE_ERROR = "error parsing grammar: "


def check_grammar(vocab: Any, gbnf: str) -> None:
    """Raise EngineError 400 ``invalid_grammar`` when llama.cpp's parser refuses ``gbnf`` (the
    message is llama.cpp's: e.g. ``expecting ')' at …``, ``Undefined rule identifier 'x'``,
    ``grammar does not contain a 'root' symbol``). Thread-safe."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    # llama.cpp prints a parse error on fd 2 and the other refusals through its log
    with stderr_captured() as said, log_errors_captured() as logged:
        smpl = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
    if smpl:
        llama_cpp.llama_sampler_free(smpl)
        return
    raise EngineError("invalid_grammar", f"grammar: {refusal_reason(said(), logged)}", 400)


def refusal_reason(stderr_text: str, log_lines: list[str]) -> str:
    """llama.cpp's reason for refusing a grammar, from what it printed (pure): the parse error's
    text (which names the place: ``expecting ')' at …``), else its log's error lines."""
    for line in stderr_text.splitlines():
        if _PARSE_ERROR in line:
            what = line.split(_PARSE_ERROR, 1)[1].strip() or "it does not parse"
            # llama.cpp names the place by the text that follows it: none is the grammar's end
            return what + " the end of the grammar" if what.endswith(" at") else what
    said = "; ".join(x.strip() for x in "".join(log_lines).splitlines() if x.strip())
    return said[:500] or "llama.cpp's grammar parser refused it"


def schema_grammar(schema: dict[str, Any]) -> str:
    """GBNF of a JSON schema for a raw prompt (no chat template to make it): llama.cpp's
    json-schema-to-grammar as llama-cpp-python ships it. Raises EngineError 400
    ``invalid_request`` for a schema it cannot convert."""
    # lazy: the native engine, loaded only where it runs
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad schemas
        raise EngineError("invalid_request", f"json_schema cannot be enforced: {e}", 400) from None


def apply_result(rendered_raw: Optional[str], gbnf: str) -> str:
    """The apply-result JSON the sampler takes (see module doc): the rendered prompt's with
    ``gbnf`` as its grammar, in force from the first output token (no generation prompt is fed
    to it: the client's grammar describes the output alone)."""
    base = json.loads(rendered_raw) if rendered_raw else {}
    base.update(grammar=gbnf, grammar_lazy=False, grammar_triggers=[], generation_prompt="")
    return json.dumps(base)
