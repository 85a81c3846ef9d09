"""The prefill's CPU/upload split rule (native/src/paths/hybrid_split.h): of a layer's
cold experts in ascending route count, the CPU branch takes the first j that minimise
max(alpha + beta * their routes, upload_us * (experts left to upload)). Through the C API."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
from ostinatod.engine import native  # noqa: E402


@pytest.mark.parametrize("routes, n_upload, alpha, beta, up, want", [
    ([1, 1, 1, 1], 4, 0.0, 1.0, 1.0, 2),      # equal costs: half each, both end at 2
    ([1, 1, 1, 1], 4, 10.0, 1.0, 1.0, 0),     # the CPU's fixed cost exceeds every upload: none
    ([1, 5, 9], 3, 0.0, 1.0, 3.0, 1),         # max(1, 6) = 6 = max(6, 3): the smaller j on a tie
    ([1, 1], 5, 0.0, 1.0, 1.0, 2),            # experts the CPU may not take still cost their upload
    ([1, 1, 1], 3, 0.0, 0.001, 1.0, 3),       # a CPU much faster than PCIe takes all it may
    ([2, 2, 2], 3, 0.0, 1000.0, 1.0, 0),      # a CPU much slower takes none
    ([1, 1, 1], 3, 0.0, 0.0, 1.0, 0),         # not calibrated (beta 0): no split
    ([], 4, 0.0, 1.0, 1.0, 0),
])
def test_split_minimises_the_later_of_cpu_and_uploads(routes, n_upload, alpha, beta, up, want):
    assert native.hybrid_split(routes, n_upload, alpha, beta, up) == want


def test_split_is_the_brute_force_optimum():
    import random
    rng = random.Random(7)
    for _ in range(300):
        m = rng.randint(0, 9)
        routes = sorted(rng.randint(1, 12) for _ in range(m))
        n_up = m + rng.randint(0, 4)
        alpha, beta, up = rng.uniform(0, 20), rng.uniform(0.1, 5), rng.uniform(0.1, 8)
        cost = [max(alpha + beta * sum(routes[:j]) if j else 0.0, up * (n_up - j)) for j in range(m + 1)]
        best = min(cost)
        j = native.hybrid_split(routes, n_up, alpha, beta, up)
        assert cost[j] == pytest.approx(best)
        assert all(c > best + 1e-9 for c in cost[:j])   # the smallest optimal j (ties to fewer CPU experts)


def test_cpu_split_options_refuse_bad_values():
    # EngineOptions refuses them, and so does the native engine given the struct directly
    import ctypes

    from ostinatod.engine.options import EngineOptions, EngineOptionsC, split_fields

    for bad in ({"alpha_us": -1, "cpu_gbps": 10, "h2d_gbps": 10}, {"alpha_us": 0, "cpu_gbps": 10, "h2d_gbps": 0},
                {"alpha_us": float("nan"), "cpu_gbps": 10, "h2d_gbps": 10}):
        with pytest.raises(ValueError):
            EngineOptions().with_(**split_fields(bad))
        st = EngineOptionsC()
        native.llama_fn("ostinato_engine_options_default")(ctypes.byref(st))
        st.cpu_split_alpha_us, st.cpu_split_cpu_gbps, st.cpu_split_h2d_gbps = (bad["alpha_us"], bad["cpu_gbps"],
                                                                               bad["h2d_gbps"])
        assert native.llama_fn("ostinato_experts_reconfigure")(ctypes.byref(st)) == -1
        assert "cpu_split" in native.experts_error()
