// MXFP4 rows x many tokens with AVX-512 VNNI (cpu_branch/mxfp4.h). Built with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mavx512vnni -mavx2 -mfma -mf16c -ffp-contract=off (native/CMakeLists.txt),
// so every fused multiply-add is one written here; called only where the CPU has these.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int XB = 17;   // block_mxfp4: uint8 e, uint8 qs[16] (value i: qs[i] & 15, value 16 + i: qs[i] >> 4)
constexpr int YB = 34;   // block_q8_0: fp16 d, int8 qs[32]
constexpr int NT = 8;    // tokens per pass: 2 x 8 accumulators of 16 lanes

// ggml's kvalues_fp4 + 12 (unsigned), in each 128-bit lane
const int8_t KV12[16] = { 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0 };

// ggml_e8m0_to_fp32_half (ggml-impl.h), every value
struct e8m0_t {
    float v[256];
    e8m0_t() {
        for (int x = 0; x < 256; ++x) {
            const uint32_t bits = x < 2 ? 0x00200000u << x : (uint32_t) (x - 1) << 23;
            memcpy(&v[x], &bits, sizeof(float));
        }
    }
};
const e8m0_t E8M0;

// ggml's hsum_float_8 (ggml-cpu/arch/x86/quants.c), operation for operation
inline float hsum_float_8(__m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// Block b of rows a (low half) and c (high half): values + 12 as bytes, each half in value order
inline __m512i decode(const uint8_t * a, const uint8_t * c, __m512i tbl, __m512i m4) {
    // 128-bit lanes: a's codes, a's codes, c's codes, c's codes
    __m512i z = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) (a + 1))), 0xFF00,
                                            _mm_loadu_si128((const __m128i *) (c + 1)));
    z = _mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4);   // 128-bit lanes 1 and 3: the high nibbles
    return _mm512_shuffle_epi8(tbl, _mm512_and_si512(z, m4));
}

inline __m512 scales(const uint8_t * a, const uint8_t * c) {
    return _mm512_insertf32x8(_mm512_set1_ps(E8M0.v[a[0]]), _mm256_set1_ps(E8M0.v[c[0]]), 1);
}

struct tok_t {
    const uint8_t * y;     // the q8_0 row
    const __m256i * neg;   // per block: -12 x the 4-value sums
    const float * d;       // per block: fp16->fp32(d)
    float * out;
};

// Blocks of rows a and c decoded once for several token tiles: per block the values (+ 12) and the scales
struct dec_t {
    __m512i w;
    __m512 e;
};

// Rows a, c (c = a for a lone last row: only a's result is written when !two) x N tokens; with dc,
// the blocks as decode_all left them (more token tiles than one share them)
template <int N>
void pass(int nb, const uint8_t * a, const uint8_t * c, bool two, const tok_t * tk, bool fma_tail, const dec_t * dc) {
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) KV12));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc1[N], acc2[N];
    for (int t = 0; t < N; ++t) { acc1[t] = _mm512_setzero_ps(); acc2[t] = _mm512_setzero_ps(); }
    int ib = 0;
    for (; ib + 1 < nb; ib += 2) {
        const uint8_t * a0 = a + (size_t) ib * XB, * c0 = c + (size_t) ib * XB;
        __m512i w0, w1;
        __m512 e0, e1;
        if (dc) {
            w0 = dc[ib].w; w1 = dc[ib + 1].w; e0 = dc[ib].e; e1 = dc[ib + 1].e;
        } else {
            w0 = decode(a0, c0, tbl, m4); w1 = decode(a0 + XB, c0 + XB, tbl, m4);
            e0 = scales(a0, c0); e1 = scales(a0 + XB, c0 + XB);
        }
#pragma GCC unroll 8
        for (int t = 0; t < N; ++t) {
            const uint8_t * y = tk[t].y + (size_t) ib * YB;
            const __m512i y0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (y + 2)));
            const __m512i y1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (y + YB + 2)));
            const __m512i p0 = _mm512_dpbusd_epi32(_mm512_broadcast_i64x4(_mm256_load_si256(tk[t].neg + ib)), w0, y0);
            const __m512i p1 = _mm512_dpbusd_epi32(_mm512_broadcast_i64x4(_mm256_load_si256(tk[t].neg + ib + 1)), w1, y1);
            const __m512 s0 = _mm512_mul_ps(e0, _mm512_set1_ps(tk[t].d[ib]));
            const __m512 s1 = _mm512_mul_ps(e1, _mm512_set1_ps(tk[t].d[ib + 1]));
            acc1[t] = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(p0), acc1[t]);
            acc2[t] = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(p1), acc2[t]);
        }
    }
    __m512i wl = _mm512_setzero_si512();
    float ea = 0, ec = 0;
    if (ib < nb) {   // the odd last block: ggml's scalar tail
        wl = decode(a + (size_t) ib * XB, c + (size_t) ib * XB, tbl, m4);
        ea = E8M0.v[a[(size_t) ib * XB]];
        ec = E8M0.v[c[(size_t) ib * XB]];
    }
    for (int t = 0; t < N; ++t) {
        const __m512 v = _mm512_add_ps(acc1[t], acc2[t]);
        float ra = hsum_float_8(_mm512_castps512_ps256(v));
        float rc = hsum_float_8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        if (ib < nb) {
            const __m512i y0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (tk[t].y + (size_t) ib * YB + 2)));
            const __m512i p = _mm512_dpbusd_epi32(_mm512_broadcast_i64x4(_mm256_load_si256(tk[t].neg + ib)), wl, y0);
            const int sa = _mm512_mask_reduce_add_epi32(0x00FF, p), sc = _mm512_mask_reduce_add_epi32(0xFF00, p);
            const float da = tk[t].d[ib] * ea, dc = tk[t].d[ib] * ec;
            if (fma_tail) {
                ra = std::fma(da, (float) sa, ra);
                rc = std::fma(dc, (float) sc, rc);
            } else {
                ra = ra + da * (float) sa;
                rc = rc + dc * (float) sc;
            }
        }
        tk[t].out[0] = ra;
        if (two) tk[t].out[1] = rc;
    }
}

template <int N>
void rows(int nb, const uint8_t * w, size_t rb, int i, tok_t * tk, bool fma_tail, bool two, const dec_t * dc) {
    float * base[NT];
    for (int t = 0; t < N; ++t) { base[t] = tk[t].out; tk[t].out = base[t] + i; }
    pass<N>(nb, w + (size_t) i * rb, w + (size_t) (two ? i + 1 : i) * rb, two, tk, fma_tail, dc);
    for (int t = 0; t < N; ++t) tk[t].out = base[t];
}

}  // namespace

bool ost_mxfp4_rows_avx512(int K, const void * w, size_t rb, int nrows, const void * const * y, int T, float * const * out,
                           bool fma_tail) {
    if (K % 32 != 0 || T <= 0 || nrows <= 0) return false;
    const int nb = K / 32;
    // per token and block: -12 x the 4-value sums (32 bytes), and d as a float
    thread_local std::vector<__m256i> neg;
    thread_local std::vector<float> dv;
    neg.resize((size_t) T * nb);
    dv.resize((size_t) T * nb);
    const __m256i twelve = _mm256_set1_epi8(12);
    for (int t = 0; t < T; ++t) {
        const uint8_t * yt = (const uint8_t *) y[t];
        for (int b = 0; b < nb; ++b) {
            const uint8_t * blk = yt + (size_t) b * YB;
            const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), twelve, _mm256_loadu_si256((const __m256i *) (blk + 2)));
            neg[(size_t) t * nb + b] = _mm256_sub_epi32(_mm256_setzero_si256(), s);
            uint16_t h;
            memcpy(&h, blk, sizeof(h));
            dv[(size_t) t * nb + b] = _cvtsh_ss(h);
        }
    }
    // per row pair: its blocks decoded once when more than one token tile reads them, then each tile
    thread_local std::vector<dec_t> dec;
    const bool cache = T > NT;
    if (cache) dec.resize((size_t) nb);
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) KV12));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    tok_t tk[NT];
    const uint8_t * wb = (const uint8_t *) w;
    for (int i = 0; i < nrows; i += 2) {
        const bool two = i + 1 < nrows;
        const uint8_t * a = wb + (size_t) i * rb, * c = wb + (size_t) (two ? i + 1 : i) * rb;
        if (cache) {
            for (int b = 0; b < (nb & ~1); ++b) {   // the pairs (an odd last block: the tail decodes it)
                dec[(size_t) b].w = decode(a + (size_t) b * XB, c + (size_t) b * XB, tbl, m4);
                dec[(size_t) b].e = scales(a + (size_t) b * XB, c + (size_t) b * XB);
            }
        }
        for (int t0 = 0; t0 < T; t0 += NT) {
            const int n = T - t0 < NT ? T - t0 : NT;
            for (int t = 0; t < n; ++t) {
                tk[t] = tok_t{ (const uint8_t *) y[t0 + t], neg.data() + (size_t) (t0 + t) * nb, dv.data() + (size_t) (t0 + t) * nb,
                               out[t0 + t] };
            }
            const dec_t * dc = cache ? dec.data() : nullptr;
            switch (n) {
                case 1: rows<1>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
                case 2: rows<2>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
                case 3: rows<3>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
                case 4: rows<4>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
                case 5: rows<5>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
                case 6: rows<6>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
                case 7: rows<7>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
                default: rows<8>(nb, wb, rb, i, tk, fma_tail, two, dc); break;
            }
        }
    }
    return true;
}
#else
#include <stddef.h>
bool ost_mxfp4_rows_avx512(int, const void *, size_t, int, const void * const *, int, float * const *, bool) { return false; }
#endif
