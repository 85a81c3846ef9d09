// MXFP4 expert rows against several tokens at once for the CPU branch kernel (cpu_branch/kernel.h):
// each weight block is read and decoded once for all of an expert's tokens, and every (row, token)
// is bit for bit ggml-cpu's ggml_vec_dot_mxfp4_q8_0 of that row with that token's q8_0 row.
// ggml does not tile MXFP4 (docs/engine.md "Tiled experts"), so its result for an expert of any
// route count is one vec_dot per (row, token); this computes the same numbers.
//
// ggml's x86 vec_dot (its AVX2 branch, also the one built for AVX-512 CPUs) per pair of 32-value
// blocks (2i, 2i + 1): eight 32-bit lanes per block, lane j the exact sum of the products of values
// 4j .. 4j + 3 (kvalues_fp4[code] x y); scale_b = fp16->fp32(y_b.d) * e8m0_half(x_b.e) (one float
// multiply); accum1 = fma(scale_2i, float(lanes_2i), accum1), accum2 = fma(scale_2i+1, ...,
// accum2); then hsum_float_8(accum1 + accum2) and an odd last block as sumf += d * sumi (a fused
// multiply-add or not, as ggml-cpu's compiler contracted it: the first-use check finds out).
// Here: one 512-bit register holds the lanes of two weight rows for one token and one block parity;
// the integer lanes are one VPDPBUSD of (code value + 12, unsigned) by the token's bytes, started
// from -12 x the token's 4-value sums (precomputed once per call and token): exact, so the same
// integers; the float operations are ggml's, in its order, per lane.
#pragma once

#include <cstddef>
#include <string>

// Rows w + i * row_bytes (i < nrows) of MXFP4 (K values, K a multiple of 32) against T tokens' q8_0
// rows y[j] (K values): out[j][i] = ggml_vec_dot_mxfp4_q8_0(K, row i, y[j]). False (nothing
// written) where not served (see ost_mxfp4_serves). Thread-safe; a thread-local scratch of
// ~68 bytes per token and 32 values.
bool ost_mxfp4_rows(int K, const void * w, size_t row_bytes, int nrows, const void * const * y, int T,
                    float * const * out);

// Whether ost_mxfp4_rows is served on this machine: AVX-512 (F, BW, VL, DQ, VNNI) and F16C, and the
// first-use check against ggml-cpu's own vec_dot passed bit for bit (odd and even block counts, row
// and token counts that fill no tile). Off process-wide with ost_mxfp4_set_enabled(false).
bool ost_mxfp4_serves();
// From how many routes of one expert the CPU branch uses ost_mxfp4_rows (default 2; the environment's
// OST_MXFP4_MIN_TOKENS, read once, for measurements: at 1 route both forms run near the read bandwidth).
int ost_mxfp4_min_tokens();
// Process-wide switch (for `ostinato bench cpu-branch` A/B and tests); returns the previous value.
bool ost_mxfp4_set_enabled(bool on);
// "avx512-vnni" or "off" (info()); the odd last block's form found ("fma", "mul-add", "unknown").
std::string ost_mxfp4_isa();
std::string ost_mxfp4_tail();
