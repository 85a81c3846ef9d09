// Row-pair dot products: dispatch by instruction set and the first-use check (cpu_branch/dot.h).
#include "cpu_branch/dot.h"
#include "cpu_branch/check_data.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

bool ost_dot_rows_avx2(int type, int n, const void * w, size_t rb, int nrows, const void * y, float * out, bool fused);
bool ost_dot_rows_avx512(int type, int n, const void * w, size_t rb, int nrows, const void * y, float * out, bool fused);

namespace {

enum isa_t { ISA_NONE, ISA_AVX2, ISA_AVX512 };
static_assert((int) ISA_NONE == OST_DOT_OFF && (int) ISA_AVX2 == OST_DOT_AVX2 && (int) ISA_AVX512 == OST_DOT_AVX512,
              "the modes are the instruction sets");
// cpu_branch/dot_x86.inc's dot_rows switches on these numbers
static_assert(GGML_TYPE_Q4_0 == 2 && GGML_TYPE_Q8_0 == 8 && GGML_TYPE_Q4_K == 12 && GGML_TYPE_Q5_K == 13 &&
              GGML_TYPE_Q6_K == 14, "ggml's type numbers");

struct kind_t {
    ggml_type t;
    size_t block_bytes;   // the layout cpu_branch/dot_x86.inc reads
    int64_t block_values;
};
// the served types: the quantisations of the expert tensors in the common GGUF recipes
const kind_t KINDS[] = {
    {GGML_TYPE_Q4_0, 18, 32}, {GGML_TYPE_Q8_0, 34, 32}, {GGML_TYPE_Q4_K, 144, 256},
    {GGML_TYPE_Q5_K, 176, 256}, {GGML_TYPE_Q6_K, 210, 256},
};

std::atomic<int> g_mode{OST_DOT_OFF};
std::once_flag g_once;
isa_t g_cpu = ISA_NONE;                          // the best set this CPU has
bool g_ok[3][GGML_TYPE_COUNT] = {};              // per instruction set: the types that passed the check
bool g_fused[3] = {true, true, true};            // q5_K's sum of mins as ggml's compiler built it here

isa_t detect() {
#if defined(__x86_64__)   // GCC and Clang (the engine needs them anyway)
    __builtin_cpu_init();
    const bool base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
        return ISA_AVX512;
    }
    return base ? ISA_AVX2 : ISA_NONE;
#else
    return ISA_NONE;
#endif
}

bool call(isa_t isa, ggml_type t, int n, const void * w, size_t rb, int nrows, const void * y, float * out, bool fused) {
    switch (isa) {
        case ISA_AVX512: return ost_dot_rows_avx512((int) t, n, w, rb, nrows, y, out, fused);
        case ISA_AVX2:   return ost_dot_rows_avx2((int) t, n, w, rb, nrows, y, out, fused);
        default:         return false;
    }
}

// Rows of random values (fixed seed) against ggml-cpu's vec_dot on this machine, bit for bit: an odd
// row count (the last row's pair with itself), two lengths, activations of two magnitudes.
bool same_as_ggml(isa_t isa, const kind_t & k, bool fused) {
    const auto * tr = ggml_get_type_traits_cpu(k.t);
    const auto * ty = ggml_get_type_traits_cpu(tr->vec_dot_type);
    if (!tr->vec_dot || !ty->from_float) return false;
    ost_check_rng rnd;
    for (int n : {512, 2048}) {
        const int nrows = 7;
        std::vector<float> wf((size_t) n * nrows), yf((size_t) n);
        for (auto & v : wf) v = rnd();
        const size_t rb = ggml_row_size(k.t, n);
        std::vector<uint8_t> wq(rb * nrows), yq(ggml_row_size(tr->vec_dot_type, n));
        ggml_quantize_chunk(k.t, wf.data(), wq.data(), 0, nrows, n, nullptr);
        for (float scale : {1.0f, 40.0f}) {
            for (auto & v : yf) v = rnd() * scale;
            ty->from_float(yf.data(), yq.data(), n);
            std::vector<float> mine((size_t) nrows), ref((size_t) nrows);
            if (!call(isa, k.t, n, wq.data(), rb, nrows, yq.data(), mine.data(), fused)) return false;
            for (int r = 0; r < nrows; ++r) tr->vec_dot(n, &ref[(size_t) r], 0, wq.data() + r * rb, 0, yq.data(), 0, 1);
            if (memcmp(mine.data(), ref.data(), sizeof(float) * nrows) != 0) return false;
        }
    }
    return true;
}

void check() {
    ggml_cpu_init();   // vec_dot's tables (idempotent; the backend has usually done it)
    g_cpu = detect();
    for (int isa = ISA_AVX2; isa <= (int) g_cpu; ++isa) {
        for (const kind_t & k : KINDS) {
            if (ggml_type_size(k.t) != k.block_bytes || ggml_blck_size(k.t) != k.block_values) continue;
            if (k.t == GGML_TYPE_Q5_K) {
                // exactly one of the two forms must match: data on which both do cannot tell them apart
                const bool fused = same_as_ggml((isa_t) isa, k, true), plain = same_as_ggml((isa_t) isa, k, false);
                g_ok[isa][k.t] = fused != plain;
                g_fused[isa] = fused;
                continue;
            }
            g_ok[isa][k.t] = same_as_ggml((isa_t) isa, k, true);
        }
    }
}

}  // namespace

int ost_dot_active() {
    const int mode = g_mode.load(std::memory_order_relaxed);
    if (mode == OST_DOT_OFF) return OST_DOT_OFF;   // off: the check never runs
    std::call_once(g_once, check);
    return std::min(mode, (int) g_cpu);
}

bool ost_dot_serves(ggml_type t) {
    return t >= 0 && t < GGML_TYPE_COUNT && g_ok[ost_dot_active()][t];
}

bool ost_dot_rows(ggml_type t, int n, const void * w, size_t row_bytes, int nrows, const void * y, float * out) {
    const int isa = ost_dot_active();
    if (t < 0 || t >= GGML_TYPE_COUNT || !g_ok[isa][t]) return false;
    return call((isa_t) isa, t, n, w, row_bytes, nrows, y, out, g_fused[isa]);
}

int ost_dot_set_mode(int mode) {
    mode = std::max(0, std::min(mode, (int) OST_DOT_AVX512));
    if (mode != OST_DOT_OFF) std::call_once(g_once, check);   // here, not in the first pass that uses them
    return g_mode.exchange(mode);
}
int ost_dot_mode() { return g_mode.load(); }

std::string ost_dot_isa() {
    const int isa = ost_dot_active();
    return isa == ISA_AVX512 ? "avx512" : isa == ISA_AVX2 ? "avx2" : "off";
}

std::string ost_dot_types() {
    const int isa = ost_dot_active();
    std::string s;
    for (const kind_t & k : KINDS) {
        if (!g_ok[isa][k.t]) continue;
        if (!s.empty()) s += ",";
        s += ggml_type_name(k.t);
    }
    return s;
}
