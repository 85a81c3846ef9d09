"""The prefill's ubatch and passes (ostinatod/engine/prefill_plan.py): pure."""

from __future__ import annotations

from ostinatod.engine.prefill_plan import SMALL_UBATCH, UBATCH_STEPS, choose_ubatch, passes

MiB = 1 << 20


def compute(u: int) -> int:   # compute buffers growing with the ubatch, as the planner's estimate does
    return 100 * MiB + u * 256 * 1024


def test_a_setting_is_served_as_set_within_n_batch():
    assert choose_ubatch(256, 2048, True, 0, compute).ubatch == 256
    c = choose_ubatch(8192, 2048, True, None, compute)
    assert (c.ubatch, c.reason) == (2048, "set")


def test_without_uploads_the_small_ubatch_keeps_other_slots_going():
    c = choose_ubatch(0, 2048, False, 10**12, compute)
    assert c.ubatch == SMALL_UBATCH and "no uploads" in c.reason
    assert choose_ubatch(0, 128, False, None, compute).ubatch == 128   # never above n_batch


def test_with_uploads_the_largest_ubatch_whose_compute_fits():
    # room for the compute of 2048 but not of 4096 beside the 512 the context fit kept
    room = compute(2048) - compute(512)
    assert choose_ubatch(0, 4096, True, room, compute).ubatch == 2048
    assert choose_ubatch(0, 4096, True, room - 1, compute).ubatch == 1024
    assert choose_ubatch(0, 4096, True, 0, compute).ubatch == 512
    assert choose_ubatch(0, 4096, True, None, compute).ubatch == UBATCH_STEPS[-1]   # unknown memory
    assert choose_ubatch(0, 2048, True, 10**12, compute).ubatch == 2048             # n_batch caps it
    assert choose_ubatch(0, 3000, True, 10**12, compute).ubatch == 3000             # n_batch between steps


def test_passes_of_a_prefill():
    assert [passes(n, 512) for n in (0, 1, 512, 513, 863)] == [0, 1, 1, 2, 2]
    assert passes(863, 2048) == 1
