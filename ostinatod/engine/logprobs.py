"""Log-probabilities of generated tokens (OpenAI's ``logprobs`` / ``top_logprobs``).

They are read from the model's logits of the row a token was sampled from: the log-softmax of the
raw logits, before the sampler's temperature, top-k/top-p/min-p, grammar and logit bias (what
llama-server reports by default, ``post_sampling_probs`` off). So a token forced by a grammar or a
bias can have a low log-probability, and the sampled token need not be the first alternative.

One entry per generated token, in OpenAI's chat shape
(platform.openai.com/docs/api-reference/chat/object, ``choices[].logprobs.content[]``):
``{"id": int, "token": str, "logprob": float, "bytes": [int], "top_logprobs": [{"id", "token",
"logprob", "bytes"}]}`` (``id``, the token id, as llama-server adds it).
The legacy completions shape is made from these by the encoder
(:func:`..server.encoders.openai_chat.legacy_logprobs`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

MAX_TOP_CHAT = 20  # OpenAI's bounds: top_logprobs 0..20 (chat), logprobs 0..5 (legacy completions)
MAX_TOP_LEGACY = 5


def log_softmax_pick(logits: np.ndarray, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under ``softmax(logits)`` and the ``n_top`` most likely
    tokens as ``(id, logprob)``, most likely first (ties: the lower id first).

    ``logits``: shape (n_vocab,), float32 or float64, finite or ``-inf`` (a banned token). Natural
    logarithms; float64 arithmetic (a float32 sum over 150k terms loses digits)."""
    x = logits.astype(np.float64, copy=False)
    m = float(np.max(x))
    lse = m + float(np.log(np.sum(np.exp(x - m))))
    top: list[tuple[int, float]] = []
    if n_top > 0:
        k = min(n_top, x.shape[0])
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = [(int(i), float(x[i]) - lse) for i in idx]
    return float(x[token]) - lse, top


def _one(token: int, text: bytes, logprob: float) -> dict[str, Any]:
    return {"id": token, "token": text.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(text)}


def entry(token: int, logprob: float, top: list[tuple[int, float]],
          piece: Callable[[int], bytes]) -> dict[str, Any]:
    """The chat-shaped entry of one generated token; ``piece(id)`` gives a token's bytes. A token
    that is part of a UTF-8 character has its bytes in ``bytes`` and U+FFFD in ``token``."""
    out = _one(token, piece(token), logprob)
    out["top_logprobs"] = [_one(i, piece(i), lp) for i, lp in top]
    return out
