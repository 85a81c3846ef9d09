// Expert products of many tokens at once, AVX-512 and AMX (cpu_branch/gemm.h). Built with AVX-512
// (F, BW, VL, DQ, VNNI), AMX-TILE/INT8, F16C and -ffp-contract=off (native/CMakeLists.txt), so
// that every fused multiply-add is one the code asks for; called only where the CPU has AVX-512 (and
// AMX only where the kernel lets this process use tiles).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__F16C__)
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

// block layouts of the GGUF formats (bytes), checked against ggml_type_size by the caller
struct blk_q4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct blk_q5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct blk_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };

enum { T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };   // ggml's type numbers (checked by the caller)

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// The eight 6-bit scales (bytes 0-7) and mins (bytes 8-15) of a q4_K / q5_K block's 12 bytes
// (sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 in the nibbles of bytes 8-11
// with their top 2 bits in the top 2 bits of bytes 0-7).
inline __m128i k_scales(const uint8_t * q) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    const uint32_t low6 = 0x3f3f3f3f, nib = 0x0f0f0f0f, top2 = 0x30303030;
    return _mm_set_epi32((int) (((c >> 4) & nib) | ((b >> 2) & top2)), (int) (b & low6),
                         (int) ((c & nib) | ((a >> 2) & top2)), (int) (a & low6));
}

// How the integer sums of a row, block and token are found (VNNI, and AMX below planes_tiles()
// token tiles; from there AMX takes the two byte planes further down):
//   s1 = sum_s scale_s * dot_s(q, y)      (q6_K: less 32 * sum_s scale_s * bsum16_s)
// dot_s: one sub-block's exact sum of the raw values q (unsigned bytes: 0-15, 0-31, 0-63) times
// the activations, summed from zero for each sub-block (AMX: one tile product of K = 32 / 16 per
// sub-block; VNNI: one VPDPBUSD chain per row and token tile), then multiplied by the sub-block's
// scale in 32 bits and added up. The weights' preparation only unpacks the values into bytes.

// One block (256 values) of 16 weight rows, unpacked: per row its 256 values as bytes, q4_K / q5_K
// in the order of the nibbles (bytes 128 m + 0..63: the low nibbles of qs[64 m .. 64 m + 63],
// 128 m + 64..127 the high ones: sub-block s at 128 (s / 4) + 64 (s % 2) + 32 (s / 2 % 2)), q6_K in
// the values' order (sub-block s at 16 s). Rows are 256 bytes apart (an AMX A tile's stride).
struct alignas(64) prep_t {
    uint8_t q[16][256];
    int32_t sc[16][16];    // the sub-blocks' scales (q4_K / q5_K: 8 of 32 values; q6_K: 16 of 16)
    int32_t mp[16][8];     // pairs of 16-bit halves: q4_K / q5_K the mins of sub-blocks 2p, 2p + 1; q6_K their scales
    float d[16], dmin[16];
};

template <int TYPE> void prep_row(prep_t & p, int r, const uint8_t * row, int sb);

template <int TYPE> inline void prep_k45(prep_t & p, int r, const uint16_t * dd, const uint8_t * scales,
                                         const uint8_t * qs, const uint8_t * qh) {
    p.d[r] = h2f(dd[0]);
    p.dmin[r] = h2f(dd[1]);
    const __m128i sm = k_scales(scales);
    _mm256_store_si256((__m256i *) p.sc[r], _mm256_cvtepu8_epi32(sm));
    _mm_store_si128((__m128i *) p.mp[r], _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)));
    const __m512i m4 = _mm512_set1_epi8(0xF);
    __m512i h = _mm512_setzero_si512();
    if (TYPE == T_Q5_K) h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) qh));
    for (int m = 0; m < 2; ++m) {
        const __m512i v = _mm512_loadu_si512((const __m512i *) (qs + 64 * m));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (TYPE == T_Q5_K) {
            // value l of sub-block s has its fifth bit in bit s of qh[l]: lo holds sub-blocks 4m, 4m + 2,
            // hi 4m + 1, 4m + 3 (32 bytes each)
            const __m512i blo = _mm512_inserti64x4(_mm512_set1_epi8((char) (1 << (4 * m))),
                                                   _mm256_set1_epi8((char) (1 << (4 * m + 2))), 1);
            const __m512i k16 = _mm512_set1_epi8(16);
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(h, blo), lo, k16);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(h, _mm512_add_epi8(blo, blo)), hi, k16);
        }
        _mm512_store_si512((__m512i *) (p.q[r] + 128 * m), lo);
        _mm512_store_si512((__m512i *) (p.q[r] + 128 * m + 64), hi);
    }
}

template <> void prep_row<T_Q4_K>(prep_t & p, int r, const uint8_t * row, int sb) {
    const blk_q4_K * x = (const blk_q4_K *) row + sb;
    prep_k45<T_Q4_K>(p, r, &x->d, x->scales, x->qs, nullptr);
}

template <> void prep_row<T_Q5_K>(prep_t & p, int r, const uint8_t * row, int sb) {
    const blk_q5_K * x = (const blk_q5_K *) row + sb;
    prep_k45<T_Q5_K>(p, r, &x->d, x->scales, x->qs, x->qh);
}

template <> void prep_row<T_Q6_K>(prep_t & p, int r, const uint8_t * row, int sb) {
    const blk_q6_K * x = (const blk_q6_K *) row + sb;
    p.d[r] = h2f(x->d);
    p.dmin[r] = 0.0f;
    const __m128i sc8 = _mm_loadu_si128((const __m128i *) x->scales);
    _mm512_store_si512((__m512i *) p.sc[r], _mm512_cvtepi8_epi32(sc8));
    _mm256_store_si256((__m256i *) p.mp[r], _mm256_cvtepi8_epi16(sc8));
    const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(3);
    // the top two bits of value l (l < 32) of chunk 2n + odd's first / second 32 values: qh[32 n + l]
    // at bits 4 odd + 0 / 4 odd + 2 (words: the same shift for both bytes, masked after)
    const __m512i sh0 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i sh1 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    for (int n = 0; n < 2; ++n) {
        // half n: values l of chunk 2n + odd from ql[64 n + l] (l < 64; low nibbles in chunk 2n, high in 2n + 1)
        const __m512i v = _mm512_loadu_si512((const __m512i *) (x->ql + 64 * n));
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (x->qh + 32 * n)));
        const __m512i t0 = _mm512_and_si512(_mm512_srlv_epi16(h, sh0), m3);
        const __m512i t1 = _mm512_and_si512(_mm512_srlv_epi16(h, sh1), m3);
        const __m512i q0 = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_slli_epi16(t0, 4));
        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_slli_epi16(t1, 4));
        _mm512_store_si512((__m512i *) (p.q[r] + 128 * n), q0);
        _mm512_store_si512((__m512i *) (p.q[r] + 128 * n + 64), q1);
    }
}

template <int TYPE> void prep_block(prep_t & p, const uint8_t * w, size_t rb, int nr, int sb) {
    for (int r = 0; r < nr; ++r) prep_row<TYPE>(p, r, w + (size_t) r * rb, sb);
    for (int r = nr; r < 16; ++r) {
        memset(p.q[r], 0, sizeof(p.q[r]));
        memset(p.sc[r], 0, sizeof(p.sc[r]));
        memset(p.mp[r], 0, sizeof(p.mp[r]));
        p.d[r] = p.dmin[r] = 0.0f;
    }
}

// The rows' bytes are asked for ahead of their use: all of them (into L2) when the rows are taken,
// and each block (into L1) while the one before it is computed. A block of 16 rows is 16 short
// pieces rb apart, which the hardware prefetchers do not foresee (measured here: 1.2-2.6x faster
// from L3 at one token tile).
inline void prefetch_rows(const uint8_t * w, size_t rb, int nr) {
    const uint8_t * end = w + (size_t) nr * rb;
    for (const uint8_t * line = (const uint8_t *) ((uintptr_t) w & ~(uintptr_t) 63); line < end; line += 64)
        _mm_prefetch((const char *) line, _MM_HINT_T1);
}

template <int TYPE> inline void prefetch_block(const uint8_t * w, size_t rb, int nr, int sb) {
    constexpr size_t bb = TYPE == T_Q4_K ? sizeof(blk_q4_K) : TYPE == T_Q5_K ? sizeof(blk_q5_K) : sizeof(blk_q6_K);
    for (int r = 0; r < nr; ++r) {
        const uint8_t * b = w + (size_t) r * rb + (size_t) sb * bb;
        const uint8_t * line = (const uint8_t *) ((uintptr_t) b & ~(uintptr_t) 63);
        for (; line < b + bb; line += 64) _mm_prefetch((const char *) line, _MM_HINT_T0);
    }
}

// Sub-blocks per block and 4-byte words per sub-block; word j (values 4 j .. 4 j + 3) of sub-block s
// is word kk = kbase(s) + j of the pack's chunk chunk(s) (the pack holds a chunk's 64 values in
// order: ost_gemm_pack_tile) and bytes wbase(s) + 4 j of prep_t's row.
template <int TYPE> struct subs {
    static constexpr int N = TYPE == T_Q6_K ? 16 : 8;
    static constexpr int W = TYPE == T_Q6_K ? 4 : 8;
    static int chunk(int s) { return TYPE == T_Q6_K ? s / 4 : s / 2; }
    static int kbase(int s) { return TYPE == T_Q6_K ? 4 * (s % 4) : 8 * (s % 2); }
    static int wbase(int s) { return TYPE == T_Q6_K ? 16 * s : 128 * (s / 4) + 64 * (s % 2) + 32 * (s / 2 % 2); }
};

inline __m512i bcast32(const void * p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// The pack's parts (ost_gemm_pack_bytes): codes, then d, then the 16-bit pairs of 32-value and of
// 16-value sums.
struct pack_view {
    const int8_t * codes;   // [tile][K / 64][16 kk][16 token][4]
    const float * d;        // [K / 256][Tp]
    const int32_t * bsp;    // [K / 256][4][Tp]: 32-value sums 2p, 2p + 1 as two 16-bit halves
    const int32_t * bs16;   // [K / 256][8][Tp]: 16-value sums 2p, 2p + 1 as two 16-bit halves
    int Tp, kc;             // tokens padded to 16; 64-value chunks per row
};

// The per-token sums of block sb and token tile tt the epilogue needs (q4_K / q5_K: 4 pairs of
// 32-value sums; q6_K: 8 pairs of 16-value sums)
template <int TYPE> inline void block_sums(const pack_view & pk, int sb, int tt, __m512i * bs) {
    if (TYPE == T_Q6_K) {
        for (int i = 0; i < 8; ++i) bs[i] = _mm512_loadu_si512((const __m512i *) (pk.bs16 + ((size_t) sb * 8 + i) * pk.Tp + tt * 16));
    } else {
        for (int i = 0; i < 4; ++i) bs[i] = _mm512_loadu_si512((const __m512i *) (pk.bsp + ((size_t) sb * 4 + i) * pk.Tp + tt * 16));
    }
}

// ggml-cpu's tiled epilogue (ggml-cpu/tiled/tiled-kernel.cpp) for one block, row `row` and 16 tokens,
// from tot = sum_s scale_s * dot_s: r = f(s1) d - dmin f(s2) (one fused multiply-add),
// acc = acc + r dy (fused or not, as ggml was built)
template <int TYPE, bool FMA>
inline void epilogue_row(const prep_t & p, int row, __m512i tot, const __m512i * bs, __m512 dy, float * a) {
    __m512i s1 = tot;
    if (TYPE == T_Q6_K) {
        __m512i c = _mm512_dpwssd_epi32(_mm512_setzero_si512(), bs[0], _mm512_set1_epi32(p.mp[row][0]));
        for (int i = 1; i < 8; ++i) c = _mm512_dpwssd_epi32(c, bs[i], _mm512_set1_epi32(p.mp[row][i]));
        s1 = _mm512_sub_epi32(s1, _mm512_slli_epi32(c, 5));
    }
    __m512 res = _mm512_mul_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(p.d[row]));
    if (TYPE != T_Q6_K) {
        __m512i s2 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), bs[0], _mm512_set1_epi32(p.mp[row][0]));
        for (int i = 1; i < 4; ++i) s2 = _mm512_dpwssd_epi32(s2, bs[i], _mm512_set1_epi32(p.mp[row][i]));
        res = _mm512_fnmadd_ps(_mm512_set1_ps(p.dmin[row]), _mm512_cvtepi32_ps(s2), res);
    }
    const __m512 av = _mm512_load_ps(a);
    _mm512_store_ps(a, FMA ? _mm512_fmadd_ps(res, dy, av) : _mm512_add_ps(av, _mm512_mul_ps(res, dy)));
}

// ---- AVX-512 VNNI ----

// Rows 8 h .. 8 h + 7 of block sb against token tile tt: the integer sums and the epilogue into
// acc [16 rows][16 tokens].
template <int TYPE, bool FMA>
inline void vnni_rows8(const prep_t & p, const pack_view & pk, int sb, int tt, int h, float * acc) {
    using S = subs<TYPE>;
    const int8_t * bt = pk.codes + ((size_t) tt * pk.kc + (size_t) sb * 4) * 1024;
    __m512i tot[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) tot[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int s = 0; s < S::N; ++s) {
        const int8_t * yb = bt + S::chunk(s) * 1024 + S::kbase(s) * 64;
        const uint8_t * qb = p.q[8 * h] + S::wbase(s);
        const int32_t * sc = &p.sc[8 * h][s];
        __m512i a[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < S::W; ++j) {
            const __m512i y = _mm512_load_si512((const __m512i *) (yb + j * 64));
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) a[r] = _mm512_dpbusd_epi32(a[r], bcast32(qb + r * 256 + 4 * j), y);
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(a[r], bcast32(sc + r * 16)));
    }
    const __m512 dy = _mm512_loadu_ps(pk.d + (size_t) sb * pk.Tp + (size_t) tt * 16);
    __m512i bs[8];
    block_sums<TYPE>(pk, sb, tt, bs);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) epilogue_row<TYPE, FMA>(p, 8 * h + r, tot[r], bs, dy, acc + (size_t) (8 * h + r) * 16);
}

// ---- AMX ----

struct alignas(64) tilecfg_t {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
// Tiles 0, 1: a sub-block's sums (16 rows x 16 tokens, int32; two sub-blocks in flight), 2, 3: its
// weights (16 rows x K bytes), 4, 5: its activations (K / 4 rows x 16 tokens x 4 bytes); K = 32
// (q4_K / q5_K) or 16 (q6_K). Constant data, not a local: GCC 12 drops stores into a local config
// that only ldtilecfg reads (the instruction then faults on the garbage).
alignas(64) const tilecfg_t TILES_K32 = { 1, 0, {}, {64, 64, 32, 32, 64, 64}, {16, 16, 16, 16, 8, 8} };
alignas(64) const tilecfg_t TILES_K16 = { 1, 0, {}, {64, 64, 16, 16, 64, 64}, {16, 16, 16, 16, 4, 4} };

// Sub-block s's sums into tile C from weights in tile A and activations in tile B (GCC's tile
// intrinsics take tile numbers as literal tokens: a macro)
#define OST_AMX_SUB(C, A, B, s)                                                  \
    do {                                                                         \
        _tile_zero(C);                                                           \
        _tile_loadd(A, p.q[0] + S::wbase(s), 256);                               \
        _tile_loadd(B, bt + S::chunk(s) * 1024 + S::kbase(s) * 64, 64);          \
        _tile_dpbusd(C, A, B);                                                   \
    } while (0)

// tot[r] += scale of (row r, sub-block s) * sums of row r (c: a stored tile)
template <int TYPE> inline void amx_scale(const prep_t & p, const int32_t (*c)[16], int s, __m512i * tot) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
        tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(_mm512_load_si512((const __m512i *) c[r]), bcast32(&p.sc[r][s])));
}

// All 16 rows of block sb against token tile tt on the tiles (configured: TILES_K32 / K16): each
// sub-block's tile product runs while the previous one's sums are scaled on the vector units.
template <int TYPE, bool FMA>
inline void amx_rows16(const prep_t & p, const pack_view & pk, int sb, int tt, float * acc) {
    using S = subs<TYPE>;
    const int8_t * bt = pk.codes + ((size_t) tt * pk.kc + (size_t) sb * 4) * 1024;
    alignas(64) int32_t c[2][16][16];
    __m512i tot[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) tot[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int s = 0; s < S::N; s += 2) {
        OST_AMX_SUB(0, 2, 4, s);
        if (s > 0) {
            _tile_stored(1, c[1], 64);
            amx_scale<TYPE>(p, c[1], s - 1, tot);
        }
        OST_AMX_SUB(1, 3, 5, s + 1);
        _tile_stored(0, c[0], 64);
        amx_scale<TYPE>(p, c[0], s, tot);
    }
    _tile_stored(1, c[1], 64);
    amx_scale<TYPE>(p, c[1], S::N - 1, tot);
    const __m512 dy = _mm512_loadu_ps(pk.d + (size_t) sb * pk.Tp + (size_t) tt * 16);
    __m512i bs[8];
    block_sums<TYPE>(pk, sb, tt, bs);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) epilogue_row<TYPE, FMA>(p, r, tot[r], bs, dy, acc + (size_t) r * 16);
}
#undef OST_AMX_SUB

#include "cpu_branch/gemm_amx_planes.inc"

// From this many token tiles AMX takes the two planes (where the scaling per sub-block and token
// tile costs more than the planes' preparation: measured on a VM of an AVX-512/AMX Xeon, q6_K's 16
// sub-blocks reach it sooner); ost_gemm_set_amx_planes overrides it
template <int TYPE> constexpr int planes_tiles() { return TYPE == T_Q6_K ? 2 : 3; }

// 16 rows (nr of them real) of type TYPE against every token of the pack. acc: [tiles][16 rows][16 tokens].
template <int TYPE, bool AMX, bool FMA>
void rows16(int K, const uint8_t * w, size_t rb, int nr, const pack_view & pk, int T, float * const * out,
            int row0, prep_t & p, float * acc) {
    const int nsb = K / 256, ntt = pk.Tp / 16;
    memset(acc, 0, sizeof(float) * 256 * (size_t) ntt);
    prefetch_rows(w, rb, nr);
    for (int sb = 0; sb < nsb; ++sb) {
        if (sb + 1 < nsb) prefetch_block<TYPE>(w, rb, nr, sb + 1);
        prep_block<TYPE>(p, w, rb, nr, sb);
        for (int tt = 0; tt < ntt; ++tt) {
            if (AMX) {
                amx_rows16<TYPE, FMA>(p, pk, sb, tt, acc + (size_t) tt * 256);
            } else {
                vnni_rows8<TYPE, FMA>(p, pk, sb, tt, 0, acc + (size_t) tt * 256);
                if (nr > 8) vnni_rows8<TYPE, FMA>(p, pk, sb, tt, 1, acc + (size_t) tt * 256);
            }
        }
    }
    for (int tt = 0; tt < ntt; ++tt) {
        for (int n = 0; n < 16 && tt * 16 + n < T; ++n) {
            float * o = out[tt * 16 + n] + row0;
            for (int r = 0; r < nr; ++r) o[r] = acc[(size_t) tt * 256 + (size_t) r * 16 + n];
        }
    }
}

template <int TYPE, bool AMX, bool FMA>
void rows_all(int K, const uint8_t * w, size_t rb, int nrows, const pack_view & pk, int T, float * const * out,
              int planes) {
    static thread_local float * acc = nullptr;
    static thread_local int acc_tiles = 0;
    const int ntt = pk.Tp / 16;
    if (acc_tiles < ntt) {
        free(acc);
        acc = (float *) aligned_alloc(64, sizeof(float) * 256 * (size_t) ntt);
        acc_tiles = ntt;
    }
    if (AMX && ntt >= (planes > 0 ? planes : planes_tiles<TYPE>())) {
        static thread_local prep2_t pr[2];
        _tile_loadconfig(&TILES_PLANES);
        for (int r0 = 0; r0 < nrows; r0 += 16) {
            rows16_planes<TYPE, FMA>(K, w + (size_t) r0 * rb, rb, nrows - r0 < 16 ? nrows - r0 : 16, pk, T, out, r0, pr, acc);
        }
        _tile_release();
        return;
    }
    static thread_local prep_t p;
    if (AMX) _tile_loadconfig(TYPE == T_Q6_K ? &TILES_K16 : &TILES_K32);
    for (int r0 = 0; r0 < nrows; r0 += 16) {
        rows16<TYPE, AMX, FMA>(K, w + (size_t) r0 * rb, rb, nrows - r0 < 16 ? nrows - r0 : 16, pk, T, out, r0, p, acc);
    }
    if (AMX) _tile_release();
}

template <int TYPE> bool rows_t(int K, const uint8_t * w, size_t rb, int nrows, const pack_view & pk, int T,
                               float * const * out, bool amx, bool fma, int planes) {
    if (amx) {
        if (fma) rows_all<TYPE, true, true>(K, w, rb, nrows, pk, T, out, planes);
        else rows_all<TYPE, true, false>(K, w, rb, nrows, pk, T, out, planes);
    } else {
        if (fma) rows_all<TYPE, false, true>(K, w, rb, nrows, pk, T, out, 0);
        else rows_all<TYPE, false, false>(K, w, rb, nrows, pk, T, out, 0);
    }
    return true;
}

}  // namespace

bool ost_gemm_rows_avx512(int type, int K, const void * w, size_t rb, int nrows, const void * pack, int T,
                          float * const * out, bool amx, bool fma, int planes) {
    if (K % 256 != 0 || T <= 0) return false;
    pack_view pk;
    pk.Tp = (T + 15) / 16 * 16;
    pk.kc = K / 64;
    const int nsb = K / 256;
    pk.codes = (const int8_t *) pack;
    pk.d = (const float *) (pk.codes + (size_t) pk.Tp * K);
    pk.bsp = (const int32_t *) (pk.d + (size_t) nsb * pk.Tp);
    pk.bs16 = pk.bsp + (size_t) nsb * 4 * pk.Tp;
    const uint8_t * wr = (const uint8_t *) w;
    switch (type) {
        case T_Q4_K: return rows_t<T_Q4_K>(K, wr, rb, nrows, pk, T, out, amx, fma, planes);
        case T_Q5_K: return rows_t<T_Q5_K>(K, wr, rb, nrows, pk, T, out, amx, fma, planes);
        case T_Q6_K: return rows_t<T_Q6_K>(K, wr, rb, nrows, pk, T, out, amx, fma, planes);
        default:     return false;
    }
}
#else
#include <stddef.h>
bool ost_gemm_rows_avx512(int, int, const void *, size_t, int, const void *, int, float * const *, bool, bool, int) {
    return false;
}
#endif
