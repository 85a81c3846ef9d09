"""The served context per slot: what is asked where the KV cache of every
slot fits in the memory left after the model and its pool, else the largest that fits, said why."""

from __future__ import annotations

from ostinatod.engine.context_fit import CONTEXT_STEP, MIN_FIT_CONTEXT, fit_context
from ostinatod.settings import Settings

MiB = 1 << 20
KV = 98304  # bytes per token: 48 layers x 4 KV heads x (128 + 128) x f16 (a Qwen3-30B-A3B-like model)


def test_default_asks_what_agents_assume():
    assert Settings().n_ctx >= 131072  # Claude Code's compact window needs >= 100K; agents assume 128K-131K


def test_enough_memory_serves_what_was_asked():
    need = 131072 * 2 * KV
    f = fit_context(131072, 262144, 2, KV, free_bytes=need + 2048 * MiB, reserve_bytes=1024 * MiB)
    assert (f.n_ctx, f.reason) == (131072, None)
    # the training context clamps; that is no memory reason
    f = fit_context(131072, 32768, 2, KV, free_bytes=None)
    assert (f.n_ctx, f.reason) == (32768, None)


def test_too_little_memory_serves_the_largest_fit_and_says_why():
    free = 16384 * MiB
    f = fit_context(131072, 262144, 2, KV, free_bytes=free, reserve_bytes=1024 * MiB, where="GPU memory")
    room = free - 1024 * MiB
    assert f.n_ctx % CONTEXT_STEP == 0 and f.n_ctx * 2 * KV <= room < (f.n_ctx + CONTEXT_STEP) * 2 * KV
    assert f.n_ctx < 131072 and f.asked == 131072
    assert "GPU memory" in f.reason and "24576 MiB" in f.reason and "15360 MiB" in f.reason
    # nothing free: the floor, context creation reports what does not fit
    f = fit_context(131072, 262144, 2, KV, free_bytes=0, reserve_bytes=1024 * MiB)
    assert f.n_ctx == MIN_FIT_CONTEXT and f.reason


def test_unknown_memory_or_sizes_are_served_as_asked():
    assert fit_context(65536, 0, 2, KV, free_bytes=None).n_ctx == 65536
    assert fit_context(65536, 0, 2, 0, free_bytes=0).n_ctx == 65536
