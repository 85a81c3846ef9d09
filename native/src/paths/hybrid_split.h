// The cost model's split of a prefill layer's cold experts between the CPU branch and the uploads
// (docs/engine.md "The prefill's CPU share"). Pure; unit-tested through the C API (ostinato_hybrid_split).
#pragma once

#include <cstdint>

// Layer costs of a hybrid upload pass, in microseconds. Paper Sec. 3.2: the CPU branch costs
// C(r) = alpha + beta r for r cold routes (beta = one expert's bytes / the CPU branch's bandwidth,
// each extra route of an expert as much again: the kernel is compute-bound, each route one more
// dot product per row); an upload costs one expert's bytes / the host-to-device bandwidth (copies
// overlap the CPU branch: both start at once and join before the staged routes).
struct ost_split_cost {
    double alpha_us = 0;       // the CPU branch's fixed cost per layer
    double beta_us = 0;        // per cold route on the CPU
    double upload_us = 0;      // per uploaded expert
};

// `routes[0..m)`: route counts of the experts the CPU may take, in the order it would take them
// (ascending); `n_upload`: experts to upload if the CPU takes none (>= m). Returns j in [0, m]: the
// CPU takes the first j, minimising max(alpha + beta * (routes of the j), upload_us * (n_upload - j))
// (0 for j = 0's CPU part); the smallest such j on ties. 0 when beta or upload_us is not > 0.
int ost_split_experts(const int32_t * routes, int m, int n_upload, const ost_split_cost & c);
