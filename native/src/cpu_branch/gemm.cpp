// Expert products of many tokens at once: the activation pack, dispatch by instruction set and the
// first-use check against ggml-cpu's tiled kernel (cpu_branch/gemm.h).
#include "cpu_branch/gemm.h"
#include "cpu_branch/check_data.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

bool ost_gemm_rows_avx512(int type, int K, const void * w, size_t rb, int nrows, const void * pack, int T,
                          float * const * out, bool amx, bool fma, int planes);

namespace {

static_assert(GGML_TYPE_Q4_K == 12 && GGML_TYPE_Q5_K == 13 && GGML_TYPE_Q6_K == 14, "ggml's type numbers");

struct kind_t {
    ggml_type t;
    size_t block_bytes;   // the layout cpu_branch/gemm_avx512.cpp reads
};
const kind_t KINDS[] = { {GGML_TYPE_Q4_K, 144}, {GGML_TYPE_Q5_K, 176}, {GGML_TYPE_Q6_K, 210} };

constexpr size_t Q8K_BYTES = 292;   // block_q8_K: float d, int8 qs[256], int16 bsums[16]

std::once_flag g_once;
bool g_avx512 = false;             // AVX-512 F/BW/VL/DQ/VNNI and F16C
bool g_amx_cpu = false;            // AMX-TILE/INT8 on the CPU and granted by the kernel
std::atomic<bool> g_amx_on{true};
std::atomic<int> g_amx_planes{0};   // ost_gemm_set_amx_planes
bool g_ok[GGML_TYPE_COUNT] = {};
int g_fma = -1;                    // the epilogue ggml-cpu was found to use: 1 fused, 0 mul-add, -1 unknown

int tiles(int T) { return (T + 15) / 16; }

bool amx_granted() {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;   // AMX-TILE, AMX-INT8
    // Linux hands out the tile state on request, per process (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
}

ost_check_rng rnd;

// ggml-cpu's result for K x nrows weights of type t and T tokens (mul_mat: its tiled kernel for
// T >= 8) against ours with AMX or not and either epilogue; *same_fma / *same_mul: bit for bit equal.
void compare(ggml_type t, int K, int nrows, int T, bool amx, bool * same_fma, bool * same_mul) {
    *same_fma = *same_mul = false;
    const size_t rb = ggml_row_size(t, K);
    std::vector<float> wf((size_t) K * nrows), xf((size_t) K * T);
    for (auto & v : wf) v = rnd();
    for (int j = 0; j < T; ++j)
        for (int i = 0; i < K; ++i) xf[(size_t) j * K + i] = rnd() * (j % 3 == 0 ? 30.0f : 1.0f);
    std::vector<uint8_t> wq(rb * nrows);
    ggml_quantize_chunk(t, wf.data(), wq.data(), 0, nrows, K, nullptr);

    ggml_init_params ip = { rb * nrows + 2 * sizeof(float) * (size_t) (K + nrows) * T + 4 * ggml_tensor_overhead() + (8 << 20) +
                                ggml_graph_overhead() + (1 << 16), nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) return;
    ggml_tensor * w = ggml_new_tensor_2d(ctx, t, K, nrows);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, T);
    memcpy(w->data, wq.data(), wq.size());
    memcpy(x->data, xf.data(), xf.size() * sizeof(float));
    ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    const bool computed = ggml_graph_compute_with_ctx(ctx, gf, 1) == GGML_STATUS_SUCCESS;

    const auto from_float = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float;
    std::vector<uint8_t> yq(Q8K_BYTES * (size_t) (K / 256) * T);
    std::vector<uint8_t> pack_v(ost_gemm_pack_bytes(K, T) + 64);
    uint8_t * pack = (uint8_t *) (((uintptr_t) pack_v.data() + 63) & ~(uintptr_t) 63);
    std::vector<const void *> rows((size_t) T);
    for (int j = 0; j < T; ++j) {
        uint8_t * row = yq.data() + (size_t) j * Q8K_BYTES * (K / 256);
        from_float(xf.data() + (size_t) j * K, row, K);
        rows[(size_t) j] = row;
    }
    // the second tile from two block ranges (as a run's items may split it)
    for (int tt = 0; tt < tiles(T); ++tt) {
        const void * const * rt = rows.data() + (size_t) tt * 16;
        if (tt == 1 && K / 256 > 1) {
            ost_gemm_pack_tile(pack, K, T, tt, 0, 1, rt);
            ost_gemm_pack_tile(pack, K, T, tt, 1, K / 256, rt);
        } else {
            ost_gemm_pack_tile(pack, K, T, tt, 0, K / 256, rt);
        }
    }
    std::vector<float> mine((size_t) nrows * T);
    std::vector<float *> outs((size_t) T);
    for (int j = 0; j < T; ++j) outs[(size_t) j] = mine.data() + (size_t) j * nrows;
    for (int fma = 0; fma < 2 && computed; ++fma) {
        std::fill(mine.begin(), mine.end(), -1.0f);
        if (!ost_gemm_rows_avx512((int) t, K, wq.data(), rb, nrows, pack, T, outs.data(), amx, fma, 0)) break;
        const bool same = memcmp(mine.data(), y->data, mine.size() * sizeof(float)) == 0;
        (fma ? *same_fma : *same_mul) = same;
    }
    ggml_free(ctx);
}

// Each type against ggml-cpu on this machine: two lengths, row counts that are not a multiple of
// 16, token counts that are not either, AMX and VNNI. Exactly one epilogue must match everywhere.
void check() {
    g_avx512 = ost_cpu_has_avx512_vnni();
    if (!g_avx512) return;
    g_amx_cpu = amx_granted();
    const char * tiled = getenv("GGML_CPU_TILED_MM");
    if (tiled && atoi(tiled) == 0) return;   // ggml computes these with vec_dot then: nothing to match
    ggml_cpu_init();
    bool all_fma = true, all_mul = true;
    for (const kind_t & k : KINDS) {
        if (ggml_type_size(k.t) != k.block_bytes || ggml_blck_size(k.t) != 256) continue;
        bool f = true, m = true;
        for (int amx = 0; amx <= (g_amx_cpu ? 1 : 0); ++amx) {
            for (const int K : {512, 2048}) {
                for (const int T : {8, 21, 40}) {
                    bool sf = false, sm = false;
                    compare(k.t, K, 37, T, amx, &sf, &sm);
                    f = f && sf;
                    m = m && sm;
                }
            }
        }
        g_ok[k.t] = f != m;
        if (g_ok[k.t]) { all_fma = all_fma && f; all_mul = all_mul && m; }
    }
    if (all_fma == all_mul) {   // types disagree on the epilogue (or none passed): serve none
        for (const kind_t & k : KINDS) g_ok[k.t] = false;
        return;
    }
    g_fma = all_fma ? 1 : 0;
}

void ensure() { std::call_once(g_once, check); }

}  // namespace

// The pack's parts: codes [tile][K / 64][16 kk][16 token][4] (word kk of a token: values 4 kk ..
// 4 kk + 3 of the chunk); then per block [K / 256] and token [Tp] (Tp: T padded to 16): d (float),
// bsp [4] (32-value sums of sub-blocks 2p, 2p + 1 as two 16-bit halves), bs16 [8] (16-value sums
// 2p, 2p + 1 likewise). Per block each part is Tp words, so a tile's 16 tokens fill whole 64-byte lines.
size_t ost_gemm_pack_bytes(int K, int T) {
    const size_t tp = (size_t) tiles(T) * 16, nsb = (size_t) K / 256;
    return tp * (size_t) K + nsb * tp * sizeof(int32_t) * 13;   // codes; d; bsp [4]; bs16 [8]
}

void ost_gemm_pack_tile(void * pack, int K, int T, int tt, int sb0, int sb1, const void * const * rows) {
    const int tp = tiles(T) * 16, nsb = K / 256, kc = K / 64, nt = std::min(16, T - 16 * tt);
    int8_t * codes = (int8_t *) pack;
    float * d = (float *) (codes + (size_t) tp * K);
    int32_t * bsp = (int32_t *) (d + (size_t) nsb * tp);
    int32_t * bs16 = bsp + (size_t) nsb * 4 * tp;
    for (int sb = sb0; sb < sb1; ++sb) {
        const size_t o = (size_t) sb * tp + (size_t) tt * 16;
        for (int n = 0; n < 16; ++n) {
            float dn = 0.0f;
            int16_t bs[16] = {};
            if (n < nt) {
                const uint8_t * blk = (const uint8_t *) rows[n] + (size_t) sb * Q8K_BYTES;
                memcpy(&dn, blk, sizeof(float));
                memcpy(bs, blk + 4 + 256, sizeof(bs));
            }
            d[o + n] = dn;
            for (int p = 0; p < 4; ++p) {
                // 32-value sums of sub-blocks 2p and 2p + 1 (|sum| <= 4096: two 16-bit halves)
                const uint16_t lo = (uint16_t) (bs[4 * p] + bs[4 * p + 1]), hi = (uint16_t) (bs[4 * p + 2] + bs[4 * p + 3]);
                bsp[((size_t) sb * 4 + p) * tp + (size_t) tt * 16 + n] = (int32_t) ((uint32_t) lo | (uint32_t) hi << 16);
            }
            for (int p = 0; p < 8; ++p) {
                bs16[((size_t) sb * 8 + p) * tp + (size_t) tt * 16 + n] =
                    (int32_t) ((uint32_t) (uint16_t) bs[2 * p] | (uint32_t) (uint16_t) bs[2 * p + 1] << 16);
            }
        }
        for (int c = 0; c < 4; ++c) {
            int8_t * tile = codes + ((size_t) tt * kc + (size_t) sb * 4 + c) * 1024;
            for (int kk = 0; kk < 16; ++kk) {
                const int off = 64 * c + 4 * kk;
                int8_t * line = tile + kk * 64;
                for (int n = 0; n < nt; ++n) memcpy(line + n * 4, (const uint8_t *) rows[n] + (size_t) sb * Q8K_BYTES + 4 + off, 4);
                if (nt < 16) memset(line + nt * 4, 0, (size_t) (16 - nt) * 4);
            }
        }
    }
}

bool ost_gemm_serves(ggml_type t) {
    ensure();
    return t >= 0 && t < GGML_TYPE_COUNT && g_ok[t];
}

bool ost_gemm_rows(ggml_type t, int K, const void * w, size_t row_bytes, int nrows, const void * pack, int T,
                   float * const * out) {
    if (!ost_gemm_serves(t)) return false;
    return ost_gemm_rows_avx512((int) t, K, w, row_bytes, nrows, pack, T, out,
                                g_amx_cpu && g_amx_on.load(std::memory_order_relaxed), g_fma == 1,
                                g_amx_planes.load(std::memory_order_relaxed));
}

std::string ost_gemm_isa() {
    ensure();
    if (!g_avx512 || g_fma < 0) return "off";
    return g_amx_cpu && g_amx_on.load() ? "amx" : "avx512-vnni";
}

std::string ost_gemm_types() {
    ensure();
    std::string s;
    for (const kind_t & k : KINDS) {
        if (!g_ok[k.t]) continue;
        if (!s.empty()) s += ",";
        s += ggml_type_name(k.t);
    }
    return s;
}

std::string ost_gemm_epilogue() {
    ensure();
    return g_fma == 1 ? "fma" : g_fma == 0 ? "mul-add" : "unknown";
}

bool ost_gemm_set_amx(bool on) { return g_amx_on.exchange(on); }
int ost_gemm_set_amx_planes(int tiles) { return g_amx_planes.exchange(tiles < 0 ? 0 : tiles); }
