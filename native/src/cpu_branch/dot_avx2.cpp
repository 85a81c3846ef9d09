// Row-pair dot products with AVX2 (two 256-bit registers per pair): cpu_branch/dot.h. Built with
// -mavx2 -mfma -mf16c -ffp-contract=off (native/CMakeLists.txt); called only where the CPU has them.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "cpu_branch/dot_x86.inc"

namespace {

struct P2 {
    struct vi { __m256i a, b; };
    struct vf { __m256 a, b; };
    struct q6s { __m128i s0, s1; };
    typedef __m128i q6i;
    static vi zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
    static vf zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static vi set1_8(char c) { const __m256i x = _mm256_set1_epi8(c); return {x, x}; }
    static vi pair(__m256i a, __m256i b) { return {a, b}; }
    static vi bcast(__m256i x) { return {x, x}; }
    static vi bcast_load(const void * p) { const __m256i x = _mm256_loadu_si256((const __m256i *) p); return {x, x}; }
    static vi load2(const void * p0, const void * p1) {
        return {_mm256_loadu_si256((const __m256i *) p0), _mm256_loadu_si256((const __m256i *) p1)};
    }
    static vi and_(vi x, vi y) { return {_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)}; }
    static vi or_(vi x, vi y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
    static vi add8(vi x, vi y) { return {_mm256_add_epi8(x.a, y.a), _mm256_add_epi8(x.b, y.b)}; }
    static vi sub8(vi x, vi y) { return {_mm256_sub_epi8(x.a, y.a), _mm256_sub_epi8(x.b, y.b)}; }
    static vi add32(vi x, vi y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
    static vi sub32(vi x, vi y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
    template <int N> static vi srli16(vi x) { return {_mm256_srli_epi16(x.a, N), _mm256_srli_epi16(x.b, N)}; }
    template <int N> static vi slli16(vi x) { return {_mm256_slli_epi16(x.a, N), _mm256_slli_epi16(x.b, N)}; }
    static vi srl16(vi x, int n) {
        const __m128i c = _mm_cvtsi32_si128(n);
        return {_mm256_srl_epi16(x.a, c), _mm256_srl_epi16(x.b, c)};
    }
    static vi shuffle8(vi x, vi c) { return {_mm256_shuffle_epi8(x.a, c.a), _mm256_shuffle_epi8(x.b, c.b)}; }
    static vi maddubs(vi u, vi s) { return {_mm256_maddubs_epi16(u.a, s.a), _mm256_maddubs_epi16(u.b, s.b)}; }
    static vi madd16(vi x, vi y) { return {_mm256_madd_epi16(x.a, y.a), _mm256_madd_epi16(x.b, y.b)}; }
    // signed bytes times signed bytes, summed in fours (ggml: |x| times y with x's sign, in pairs, pairs in twos)
    static vi dot_i8(vi x, vi y) {
        const __m256i ones = _mm256_set1_epi16(1);
        return {_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x.a, x.a), _mm256_sign_epi8(y.a, x.a)), ones),
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x.b, x.b), _mm256_sign_epi8(y.b, x.b)), ones)};
    }
    static vf cvt(vi x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
    static vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
    static vf pair_f(float d0, float d1) { return {_mm256_set1_ps(d0), _mm256_set1_ps(d1)}; }
    static __m256 lo_f(vf x) { return x.a; }
    static __m256 hi_f(vf x) { return x.b; }
    static q6s q6_prep(__m128i s0, __m128i s1) { return {s0, s1}; }
    static q6i q6_idx(int m) { return _mm_load_si128((const __m128i *) Q6_SEL.bytes[m]); }
    static vi q6_scale(const q6s & st, q6i ix) {
        return {_mm256_cvtepi8_epi16(_mm_shuffle_epi8(st.s0, ix)), _mm256_cvtepi8_epi16(_mm_shuffle_epi8(st.s1, ix))};
    }
};

}  // namespace

bool ost_dot_rows_avx2(int type, int n, const void * w, size_t rb, int nrows, const void * y, float * out, bool fused) {
    return dot_rows<P2>(type, n, w, rb, nrows, y, out, fused);
}
#else
#include <stddef.h>
bool ost_dot_rows_avx2(int, int, const void *, size_t, int, const void *, float *, bool) { return false; }
#endif
