// Row-pair dot products with AVX-512 (one 512-bit register per pair, row 0 in its low half):
// cpu_branch/dot.h. Built with -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c -ffp-contract=off
// (native/CMakeLists.txt); called only where the CPU has them.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
#include "cpu_branch/dot_x86.inc"

namespace {

struct P512 {
    typedef __m512i vi;
    typedef __m512 vf;
    typedef __m512i q6s;   // both rows' 16 scales as words
    typedef __m512i q6i;
    static vi zero_i() { return _mm512_setzero_si512(); }
    static vf zero_f() { return _mm512_setzero_ps(); }
    static vi set1_8(char c) { return _mm512_set1_epi8(c); }
    static vi pair(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
    static vi bcast(__m256i x) { return _mm512_broadcast_i64x4(x); }
    static vi bcast_load(const void * p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) p)); }
    static vi load2(const void * p0, const void * p1) {
        return pair(_mm256_loadu_si256((const __m256i *) p0), _mm256_loadu_si256((const __m256i *) p1));
    }
    static vi and_(vi x, vi y) { return _mm512_and_si512(x, y); }
    static vi or_(vi x, vi y) { return _mm512_or_si512(x, y); }
    static vi add8(vi x, vi y) { return _mm512_add_epi8(x, y); }
    static vi sub8(vi x, vi y) { return _mm512_sub_epi8(x, y); }
    static vi add32(vi x, vi y) { return _mm512_add_epi32(x, y); }
    static vi sub32(vi x, vi y) { return _mm512_sub_epi32(x, y); }
    template <int N> static vi srli16(vi x) { return _mm512_srli_epi16(x, N); }
    template <int N> static vi slli16(vi x) { return _mm512_slli_epi16(x, N); }
    static vi srl16(vi x, int n) { return _mm512_srl_epi16(x, _mm_cvtsi32_si128(n)); }
    static vi shuffle8(vi x, vi c) { return _mm512_shuffle_epi8(x, c); }   // within each 128-bit lane, as AVX2's
    static vi maddubs(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
    static vi madd16(vi x, vi y) { return _mm512_madd_epi16(x, y); }
    // AVX-512 has no byte sign instruction: |x|, and y negated where x < 0 (where x = 0, |x| = 0)
    static vi dot_i8(vi x, vi y) {
        const vi ax = _mm512_abs_epi8(x);
        const vi sy = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(x), _mm512_setzero_si512(), y);
        return _mm512_madd_epi16(_mm512_maddubs_epi16(ax, sy), _mm512_set1_epi16(1));
    }
    static vf cvt(vi x) { return _mm512_cvtepi32_ps(x); }
    static vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
    static vf pair_f(float d0, float d1) {
        return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(d0))),
                                                   _mm256_castps_pd(_mm256_set1_ps(d1)), 1));
    }
    static __m256 lo_f(vf x) { return _mm512_castps512_ps256(x); }
    static __m256 hi_f(vf x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }
    static q6s q6_prep(__m128i s0, __m128i s1) { return pair(_mm256_cvtepi8_epi16(s0), _mm256_cvtepi8_epi16(s1)); }
    static q6i q6_idx(int m) { return _mm512_load_si512(Q6_SEL.words[m]); }
    static vi q6_scale(q6s st, q6i ix) { return _mm512_permutexvar_epi16(ix, st); }
};

}  // namespace

bool ost_dot_rows_avx512(int type, int n, const void * w, size_t rb, int nrows, const void * y, float * out, bool fused) {
    return dot_rows<P512>(type, n, w, rb, nrows, y, out, fused);
}
#else
#include <stddef.h>
bool ost_dot_rows_avx512(int, int, const void *, size_t, int, const void *, float *, bool) { return false; }
#endif
