"""The worker's prompts: tokens, rendering (chat template, raw, mixed, fill-in-the-middle), the size
and grammar-cost checks before any rendering, and the calls answered off the loop (count_tokens,
tokenize, detokenize, apply_template) on the prepare threads within ``template_timeout_s``."""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from . import limits, loading, patterns
from .types import EngineError, GenRequest


log = logging.getLogger("ostinatod.engine")


class PromptMixin:
    """Prompt methods of :class:`.worker.Worker` (they use its vocabulary, templates and settings)."""

    # ---- tokens ---------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens of ``text`` (special tokens parsed). Thread-safe (vocab is read-only)."""
        return loading.tokenize(self.vocab, text, add_special)

    def piece(self, token: int, special: bool = False) -> bytes:
        """Bytes of one token (``special``: render control tokens too)."""
        return loading.piece(self.vocab, token, special)

    def render(self, req: GenRequest) -> tuple[list[int], Any]:
        """Prompt tokens of ``req`` and the rendered chat prompt (None for raw prompts).

        Size bounds come first (:mod:`.limits`): too many schema nodes, or more text than the
        context can hold whatever its tokenization, are refused before any rendering or
        tokenizing. Raises EngineError("invalid_request" | "template_error" | "schema_too_large"
        | "context_length_exceeded").
        """
        self.check_grammar_cost(req, with_grammar=False)
        limits.check_text_fits(limits.message_text_bytes(req.messages, req.prompt), self.max_piece_bytes,
                               self.n_ctx_slot)
        if req.infill is not None:
            return self.infill_prompt(req), None
        if req.prompt_tokens is not None:
            return self.mixed_prompt(req.prompt_tokens), None
        if req.messages is not None:
            rendered = self.templates.render(req.messages, req.tools, req.tool_choice,
                                             req.parallel_tool_calls, req.enable_thinking,
                                             req.json_schema)
            text = rendered.prompt
        elif req.prompt is not None:
            text, rendered = req.prompt, None
        else:
            raise EngineError("invalid_request", "request has neither messages nor prompt")
        limits.check_text_fits(len(text.encode("utf-8", "replace")), self.max_piece_bytes, self.n_ctx_slot)
        return self.tokenize(text), rendered

    def mixed_prompt(self, pieces: list[Any]) -> list[int]:
        """Prompt tokens of token ids and texts in order (a text's special tokens parsed, the
        vocabulary's BOS only before a leading text). Raises EngineError 400 for an id outside the
        vocabulary or ``context_length_exceeded`` for text that cannot fit."""
        limits.check_text_fits(sum(len(p.encode("utf-8", "replace")) for p in pieces if isinstance(p, str)),
                               self.max_piece_bytes, self.n_ctx_slot)
        out: list[int] = []
        for i, p in enumerate(pieces):
            if isinstance(p, str):
                out += self.tokenize(p, add_special=i == 0)
            elif not 0 <= int(p) < self.n_vocab:
                raise EngineError("invalid_request", f"token id {p} is outside the vocabulary (0..{self.n_vocab - 1})")
            else:
                out.append(int(p))
        return out

    def check_grammar_cost(self, req: GenRequest, with_grammar: bool = True) -> None:
        """Refuse a request whose grammar work is too large before any of it is done: the size of
        its tool definitions and response schema (:func:`.limits.check_schema_size`) and the cost
        of its regex patterns and, ``with_grammar``, of its own GBNF ``grammar``
        (:func:`.patterns.check_request_grammar`). Raises EngineError 400 ``schema_too_large``,
        ``grammar_too_complex`` or ``invalid_request`` (a pattern llama.cpp cannot enforce)."""
        limits.check_schema_size(req.tools, req.json_schema, self.settings.max_schema_nodes,
                                 self.settings.max_schema_properties)
        patterns.check_request_grammar(req.tools, req.json_schema, req.grammar if with_grammar else None,
                                       patterns.limits_of(self.settings))

    def infill_prompt(self, req: GenRequest) -> list[int]:
        """Prompt tokens of a fill-in-the-middle request (:mod:`.infill`). Raises EngineError 400
        ``infill_not_supported`` (no FIM tokens) or ``context_length_exceeded``."""
        from . import infill
        f = req.infill or {}
        texts = [f.get("input_prefix"), f.get("input_suffix"), f.get("prompt")]
        texts += [c.get("text") for c in f.get("input_extra") or []]
        limits.check_text_fits(sum(len(t) for t in texts if isinstance(t, str)), self.max_piece_bytes,
                               self.n_ctx_slot)
        return infill.infill_tokens(infill.FimTokens.of_vocab(self.vocab),
                                    lambda text: loading.tokenize(self.vocab, text, False, parse_special=False),
                                    str(f.get("input_prefix") or ""), str(f.get("input_suffix") or ""),
                                    list(f.get("input_extra") or []), str(f.get("prompt") or ""),
                                    self.n_batch, req.max_tokens, self.n_ctx_slot)

    def tokenize_content(self, content: Any, add_special: bool = False, parse_special: bool = True,
                         with_pieces: bool = False) -> list[Any]:
        """llama-server's /tokenize: the tokens of ``content`` (a string, or a list of strings and
        token ids, the ids kept as they are); with ``with_pieces`` ``[{"id", "piece"}]`` where a
        piece that is not UTF-8 is its list of byte values. Any thread."""
        parts = content if isinstance(content, list) else [content]
        toks: list[int] = []
        for i, p in enumerate(parts):
            if isinstance(p, str):
                toks += loading.tokenize(self.vocab, p, add_special and i == 0, parse_special=parse_special)
            else:
                toks.append(int(p))
        if not with_pieces:
            return toks
        out = []
        for t in toks:
            b = self.piece(t, special=True)
            try:
                out.append({"id": t, "piece": b.decode("utf-8")})
            except UnicodeDecodeError:
                out.append({"id": t, "piece": list(b)})
        return out

    def detokenize(self, tokens: list[int]) -> str:
        """llama-server's /detokenize: the text of ``tokens`` (special tokens rendered; bytes that
        are not UTF-8 replaced). Raises EngineError 400 for an id outside the vocabulary."""
        bad = [t for t in tokens if not 0 <= int(t) < self.n_vocab]
        if bad:
            raise EngineError("invalid_request", f"token id {bad[0]} is not in the vocabulary "
                              f"(0..{self.n_vocab - 1})")
        return b"".join(self.piece(int(t), special=True) for t in tokens).decode("utf-8", "replace")

    def apply_template(self, req: GenRequest) -> str:
        """The prompt text the chat template makes of ``req`` (llama-server's /apply-template), on
        a prepare thread within ``template_timeout_s``. Raises EngineError as :meth:`render`."""
        def text() -> str:
            self.check_grammar_cost(req, with_grammar=False)
            return self.templates.render(req.messages or [], req.tools, req.tool_choice,
                                         req.parallel_tool_calls, req.enable_thinking,
                                         req.json_schema).prompt
        box: list = []
        fut = self._prep_pool.submit(self._rendering, box, text)
        try:
            return fut.result(timeout=self.settings.template_timeout_s)
        except FutureTimeout:
            raise self._timeout_error(self._loaded(box)) from None

    def chat_parser(self, req: GenRequest, rendered: Any) -> Any:
        """The output parser of a chat request (:func:`.chat.parser_for`)."""
        from . import chat
        return chat.parser_for(self.templates, req, rendered)

    def count_tokens(self, req: GenRequest) -> int:
        """Tokens of the rendered prompt of ``req`` (any thread but the loop's). Rendered on a
        prepare thread within ``template_timeout_s``; raises EngineError as :meth:`render` does,
        or ``template_timeout`` (400)."""
        box: list = []
        fut = self._prep_pool.submit(self._rendering, box, self.render, req)
        try:
            return len(fut.result(timeout=self.settings.template_timeout_s)[0])
        except FutureTimeout:
            raise self._timeout_error(self._loaded(box)) from None

    def _rendering(self, box: list, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a prepare thread, its start time in ``_render_starts`` (and appended
        to ``box``) while it runs: the load a timeout is judged by (:meth:`_loaded`)."""
        key = object()
        t0 = time.monotonic()
        box.append(t0)
        with self._lock:
            self._render_starts[key] = t0
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._render_starts.pop(key, None)

    def _loaded(self, box: list) -> bool:
        """Whether a render that timed out did so under load: it never got a prepare thread
        (``box`` empty), or another render, still within its own time limit, ran at the middle
        of its time (a render that had already timed out before is that client's, not load)."""
        if not box:
            return True
        limit = self.settings.template_timeout_s
        mid = box[0] + limit / 2
        with self._lock:
            starts = list(self._render_starts.values())
        return sum(1 for t0 in starts if t0 <= mid < t0 + limit) > 1  # itself and another

    def _timeout_error(self, loaded: bool = False) -> EngineError:
        """``template_timeout``: 400 when the request's own render is too slow, 503 (retry, the
        answer carries Retry-After) when ``loaded``: other renders ran beside it."""
        s = self.settings.template_timeout_s
        if loaded:
            return EngineError("template_timeout", f"rendering the request's chat template, grammar and "
                               f"prompt took longer than {s:g} s (limit template_timeout_s = {s:g}) while "
                               "the engine was rendering other requests; retry shortly", 503)
        return EngineError("template_timeout", f"rendering the request's chat template, grammar and "
                           f"prompt took longer than {s:g} s (limit template_timeout_s = {s:g}); send "
                           "fewer or smaller tools or a shorter prompt", 400)
