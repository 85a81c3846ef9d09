"""Routing skew as a knob: the router strength A that gives a held-out share S.

S is the share of held-out routes that land on the development top 44% of each layer's experts
(the Ostinato paper's Sec. 2 statistic, 0.84 on its real model). A is the weight of the class
preference in the router logit (:class:`ostinatod.synth.shapes.Routing`). S grows with A from a
floor at A = 0, where a route depends on the token alone (its fixed per-token noise): frequent
tokens then route to the same experts in development and held-out text. The curve depends on the
expert count and k, so the table is per (n_expert, n_expert_used) of the real shapes, measured with
:func:`ostinatod.synth.routing.designed_shares` at full depth on ``swe.jsonl`` (100,000 characters
per side) and checked against the engine's own counts on cut files (docs/synthetic-models.md,
"Skew as a knob", gives the runs and the error).
"""

from __future__ import annotations

import math

from .shapes import Routing, SynthError

# the paper's real model: the 44% of experts that development sessions route to most get 84% of
# held-out routes
DEFAULT_SKEW = 0.84
SKEW_RANGE = (0.5, 0.99)

_A = (0.0, 0.25, 0.5, 0.6, 0.73, 0.85, 1.0, 1.25, 1.5, 2.0)
# (n_expert, n_expert_used) -> S at each A of _A (designed_shares: qwen3-30b-a3b 48 layers,
# qwen3.5-35b-a3b 40 layers, deepseek-v4-flash 43 layers)
CALIBRATION: dict[tuple[int, int], tuple[float, ...]] = {
    (128, 8): (0.7708, 0.7798, 0.8095, 0.8243, 0.8456, 0.865, 0.8894, 0.9221, 0.9455, 0.9752),
    (256, 8): (0.8457, 0.8564, 0.8866, 0.9044, 0.9255, 0.9442, 0.9641, 0.9837, 0.9937, 0.9993),
    (256, 6): (0.8697, 0.8805, 0.9141, 0.9309, 0.95, 0.9651, 0.9796, 0.9934, 0.998, 0.9998),
}


def _curve(n_expert: int, n_expert_used: int) -> tuple[tuple[int, int], list[tuple[float, float]]]:
    """The calibrated curve [(A, S)] of (n_expert, k), or of the nearest calibrated pair (log
    distance in n_expert first, then k) with its key."""
    key = min(CALIBRATION, key=lambda c: (abs(math.log(c[0] / max(n_expert, 1))), abs(c[1] - n_expert_used)))
    return key, list(zip(_A, CALIBRATION[key]))


def skew_floor(n_expert: int, n_expert_used: int) -> float:
    """The lowest S the routers make (A = 0: routes by token alone) for (n_expert, k)."""
    return _curve(n_expert, n_expert_used)[1][0][1]


def strength_for_skew(skew: float, n_expert: int, n_expert_used: int) -> float:
    """Router strength A for held-out share ``skew`` with ``n_expert`` experts, ``n_expert_used``
    per token: linear interpolation of the calibrated (A, S) points of that pair (the nearest
    calibrated pair for other counts, e.g. the test shapes', whose S it does not predict). Raises
    SynthError when ``skew`` is outside :data:`SKEW_RANGE` or below :func:`skew_floor` / above the
    table's top."""
    lo, hi = SKEW_RANGE
    if not lo <= skew <= hi:
        raise SynthError(f"skew must be in [{lo}, {hi}] (held-out share of the dev top-44% experts), got {skew}")
    key, pts = _curve(n_expert, n_expert_used)
    if skew < pts[0][1]:
        raise SynthError(f"skew {skew} is below what these routers make with {key[0]} experts, k = {key[1]}: "
                         f"{pts[0][1]:.3f} with no class preference, routes by token alone "
                         "(docs/synthetic-models.md, 'Skew as a knob')")
    if skew > pts[-1][1]:
        raise SynthError(f"skew {skew} is above the calibrated {pts[-1][1]:.3f} for {key[0]} experts, k = {key[1]}")
    for (a0, s0), (a1, s1) in zip(pts, pts[1:]):
        if s0 <= skew <= s1:
            return a0 + (a1 - a0) * (skew - s0) / (s1 - s0)
    return pts[-1][0]


def default_strength(n_expert: int, n_expert_used: int) -> float:
    """A when no skew or strength is asked: the calibrated A for :data:`DEFAULT_SKEW` (at least 0:
    the floor where that is above 0.84) on a calibrated (n_expert, k); otherwise (the test and demo
    shapes, 8 and 32 experts) ``min(2.5, 0.73 (128 / n_expert)^0.55)``, the rule their files were
    made with (1.56 at 32 experts)."""
    if (n_expert, n_expert_used) in CALIBRATION:
        return strength_for_skew(max(DEFAULT_SKEW, skew_floor(n_expert, n_expert_used)), n_expert, n_expert_used)
    return min(2.5, 0.73 * (128.0 / max(n_expert, 2)) ** 0.55)


def router_strength(routing: Routing, n_expert: int, n_expert_used: int) -> float:
    """A of ``routing`` for a model of ``n_expert`` experts, ``n_expert_used`` per token: its
    ``strength``, else the calibrated A of its ``skew``, else :func:`default_strength`. Raises
    SynthError for a skew the routers cannot make."""
    if routing.strength is not None:
        return routing.strength
    if routing.skew is not None:
        return strength_for_skew(routing.skew, n_expert, n_expert_used)
    return default_strength(n_expert, n_expert_used)
