// See paths/hybrid_split.h.
#include "paths/hybrid_split.h"

#include <algorithm>

int ost_split_experts(const int32_t * routes, int m, int n_upload, const ost_split_cost & c) {
    if (!(c.beta_us > 0) || !(c.upload_us > 0) || m <= 0) return 0;
    n_upload = std::max(n_upload, m);
    int best = 0;
    double best_t = c.upload_us * n_upload, cpu = c.alpha_us;
    for (int j = 1; j <= m; ++j) {
        cpu += c.beta_us * std::max<int32_t>(routes[j - 1], 0);
        const double t = std::max(cpu, c.upload_us * (n_upload - j));
        if (t < best_t) { best_t = t; best = j; }
        if (cpu >= best_t) break;   // the CPU part only grows from here
    }
    return best;
}
