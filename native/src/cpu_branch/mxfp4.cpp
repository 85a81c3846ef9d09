// MXFP4 rows x many tokens: dispatch and the first-use check against ggml-cpu's vec_dot (cpu_branch/mxfp4.h).
#include "cpu_branch/mxfp4.h"
#include "cpu_branch/check_data.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

bool ost_mxfp4_rows_avx512(int K, const void * w, size_t rb, int nrows, const void * const * y, int T, float * const * out,
                           bool fma_tail);

namespace {

std::once_flag g_once;
bool g_avx512 = false;
bool g_ok = false;
int g_fma = -1;   // the odd last block's form in ggml-cpu's build: 1 fused, 0 multiply then add, -1 unknown
std::atomic<bool> g_on{true};

// K x nrows random MXFP4 weights and T tokens (some of large magnitude) against ggml-cpu's
// vec_dot per (row, token), with either form of the odd last block; *same_fma / *same_mul: bit for bit
void compare(int K, int nrows, int T, uint64_t seed, bool * same_fma, bool * same_mul) {
    *same_fma = *same_mul = false;
    ost_check_rng rnd{seed};
    const auto * tr = ggml_get_type_traits_cpu(GGML_TYPE_MXFP4);
    const auto * ty = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    if (!tr->vec_dot || tr->vec_dot_type != GGML_TYPE_Q8_0 || !ty->from_float) return;
    const size_t rb = ggml_row_size(GGML_TYPE_MXFP4, K), yb = ggml_row_size(GGML_TYPE_Q8_0, K);
    std::vector<float> wf((size_t) K * nrows), yf((size_t) K);
    // an odd last block (ggml's scalar tail) of large same-signed products, so that d * sumi is
    // inexact and its rounding tells a fused multiply-add from a multiply and an add
    const bool odd = (K / 32) % 2 == 1;
    for (size_t i = 0; i < wf.size(); ++i) {
        wf[i] = rnd() * (i % 97 == 0 ? 50.0f : 1.0f);
        if (odd && (int) (i % (size_t) K) >= K - 32) wf[i] = 3.0f + std::fabs(wf[i]);
    }
    std::vector<uint8_t> wq(rb * nrows), yq(yb * T);
    ggml_quantize_chunk(GGML_TYPE_MXFP4, wf.data(), wq.data(), 0, nrows, K, nullptr);
    std::vector<const void *> ys((size_t) T);
    for (int j = 0; j < T; ++j) {
        for (auto & v : yf) v = rnd() * (j % 3 == 0 ? 30.0f : 1.0f);
        if (odd) for (int i = K - 32; i < K; ++i) yf[(size_t) i] = 100.0f + 10.0f * rnd();
        ty->from_float(yf.data(), yq.data() + (size_t) j * yb, K);
        ys[(size_t) j] = yq.data() + (size_t) j * yb;
    }
    std::vector<float> ref((size_t) nrows * T), mine((size_t) nrows * T);
    std::vector<float *> outs((size_t) T);
    for (int j = 0; j < T; ++j) {
        outs[(size_t) j] = mine.data() + (size_t) j * nrows;
        for (int i = 0; i < nrows; ++i) tr->vec_dot(K, &ref[(size_t) j * nrows + i], 0, wq.data() + i * rb, 0, ys[(size_t) j], 0, 1);
    }
    for (int fma = 0; fma < 2; ++fma) {
        std::fill(mine.begin(), mine.end(), -1.0f);
        if (!ost_mxfp4_rows_avx512(K, wq.data(), rb, nrows, ys.data(), T, outs.data(), fma == 1)) return;
        (fma ? *same_fma : *same_mul) = memcmp(mine.data(), ref.data(), ref.size() * sizeof(float)) == 0;
    }
}

void check() {
    g_avx512 = ost_cpu_has_avx512_vnni();
    if (!g_avx512) return;
    ggml_cpu_init();
    bool f = true, m = true, f_odd = true, m_odd = true;
    uint64_t seed = 0x9e3779b97f4a7c15ULL;
    for (const int K : {64, 96, 512, 2080, 4096}) {
        for (const int T : {1, 2, 7, 8, 9, 19}) {
            bool sf = false, sm = false;
            compare(K, 5, T, seed++, &sf, &sm);
            if (getenv("OST_MXFP4_DEBUG")) fprintf(stderr, "mxfp4 check K=%d T=%d fma=%d mul=%d\n", K, T, sf, sm);
            if ((K / 32) % 2) { f_odd = f_odd && sf; m_odd = m_odd && sm; }
            else { f = f && sf; m = m && sm; }
        }
    }
    // even block counts never reach the odd block's form: both must match there; on odd counts
    // exactly one form must match everywhere
    if (!f || !m || f_odd == m_odd) return;
    g_fma = f_odd ? 1 : 0;
    g_ok = true;
}

void ensure() { std::call_once(g_once, check); }

}  // namespace

bool ost_mxfp4_serves() {
    if (!g_on.load(std::memory_order_relaxed)) return false;
    ensure();
    return g_ok;
}

int ost_mxfp4_min_tokens() {
    static const int n = [] { const char * e = getenv("OST_MXFP4_MIN_TOKENS"); return e && atoi(e) > 0 ? atoi(e) : 2; }();
    return n;
}

bool ost_mxfp4_set_enabled(bool on) { return g_on.exchange(on); }

bool ost_mxfp4_rows(int K, const void * w, size_t row_bytes, int nrows, const void * const * y, int T, float * const * out) {
    if (!ost_mxfp4_serves()) return false;
    return ost_mxfp4_rows_avx512(K, w, row_bytes, nrows, y, T, out, g_fma == 1);
}

std::string ost_mxfp4_isa() {
    ensure();
    return g_ok ? "avx512-vnni" : "off";
}

std::string ost_mxfp4_tail() {
    ensure();
    return g_fma == 1 ? "fma" : g_fma == 0 ? "mul-add" : "unknown";
}
