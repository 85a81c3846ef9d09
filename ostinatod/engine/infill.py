"""Fill-in-the-middle prompts (llama-server's ``/infill``, used by llama.vscode and llama.vim).

The prompt is made of tokens, as llama-server makes it (its ``format_prompt_infill``): the
repository-level FIM pattern, where the vocabulary has the tokens for it::

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra chunk 0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

The prefix and suffix texts are tokenized without parsing special tokens (code may contain their
text), the prefix keeps its end and the suffix its start so that both fit one batch (3:1), and the
extra chunks fill what is left of the context before them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .types import EngineError

NULL = -1  # LLAMA_TOKEN_NULL


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's FIM token ids (``NULL`` where it has none)."""

    pre: int
    suf: int
    mid: int
    rep: int = NULL
    sep: int = NULL
    bos: Optional[int] = None  # the BOS token when the vocabulary adds one

    @classmethod
    def of_vocab(cls, vocab: Any) -> "FimTokens":
        import llama_cpp  # lazy: the native engine, loaded only where it runs
        bos = llama_cpp.llama_vocab_bos(vocab) if llama_cpp.llama_vocab_get_add_bos(vocab) else None
        return cls(llama_cpp.llama_vocab_fim_pre(vocab), llama_cpp.llama_vocab_fim_suf(vocab),
                   llama_cpp.llama_vocab_fim_mid(vocab), llama_cpp.llama_vocab_fim_rep(vocab),
                   llama_cpp.llama_vocab_fim_sep(vocab), bos)

    def missing(self) -> list[str]:
        """The tokens /infill needs that the vocabulary lacks, in llama-server's words."""
        return [f"{name} token is missing" for name, tok in
                (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if tok == NULL]


def check_supported(fim: FimTokens) -> None:
    """Raise EngineError 400 ``infill_not_supported`` naming the missing FIM tokens."""
    missing = fim.missing()
    if missing:
        raise EngineError("infill_not_supported", "Infill is not supported by this model: "
                          + "; ".join(missing) + " (its vocabulary has no fill-in-the-middle tokens)", 400)


# llama-server's separator of extra chunks in a vocabulary without FIM_SEP
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


def infill_tokens(fim: FimTokens, tokenize: Callable[[str], list[int]], input_prefix: str,
                  input_suffix: str, input_extra: list[dict[str, Any]], prompt: str, n_batch: int,
                  n_predict: int, n_ctx: int) -> list[int]:
    """The prompt tokens of an infill request (see the module doc; pure given ``tokenize``, which
    tokenizes text without parsing special tokens). ``n_batch``: the logical batch (the prefix and
    suffix fit one), ``n_predict``: the output budget kept free of extra chunks, ``n_ctx``: the
    slot's context. Raises EngineError 400 when the vocabulary lacks the FIM tokens."""
    check_supported(fim)
    extra: list[int] = []
    if fim.rep != NULL:
        extra += [fim.rep] + tokenize("myproject\n")
    for chunk in input_extra:
        if fim.sep != NULL:
            extra += [fim.sep] + tokenize(str(chunk.get("filename") or "tmp") + "\n")
        else:
            extra += tokenize(_CHUNK_SEPARATOR)
        extra += tokenize(str(chunk.get("text") or ""))
    if fim.sep != NULL:
        extra += [fim.sep] + tokenize("filename\n")
    prefix, suffix, prompt_toks = tokenize(input_prefix), tokenize(input_suffix), tokenize(prompt)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt_toks))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [fim.pre] + prefix[len(prefix) - n_prefix:] + prompt_toks
    if fim.bos is not None:
        head = [fim.bos] + head
    return extra[len(extra) - n_extra:] + head + [fim.suf] + suffix[:n_suffix] + [fim.mid]
