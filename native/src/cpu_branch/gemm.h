// Expert products of many tokens at once for the CPU branch kernel (cpu_branch/kernel.h): each weight
// row of an expert is read once for all of the expert's tokens, and the integer work runs on AMX
// tiles where the CPU has them (Intel AMX-INT8, with the kernel's permission to use them), on
// AVX-512 VNNI otherwise. Paper: arXiv 2611.11533, Sec. 3.2 (the CPU branch's cost is its expert
// bytes over the host's read bandwidth only when its arithmetic keeps up with memory).
//
// What it computes is bit for bit what ggml-cpu computes for an expert of these types with as many
// routes as its tiled K-quant kernel takes (ggml-cpu/tiled, >= 8 routes of one expert): per weight
// row, token and 256-value block the exact integer sums
//   s1 = sum_s scale_s * (sum_{e in s} q_e * y_e - bias * bsum_s),   s2 = sum_s min_s * bsum_s
// (any exact computation gives the same integers), then ggml's float operations in its order:
//   r = f(s1) * d  (minus dmin * f(s2) in one fused multiply-add for q4_K / q5_K),
//   acc = acc + r * d_y   (or one fused multiply-add, as ggml-cpu was built: see ost_gemm_epilogue)
// over the blocks in ascending order from acc = 0. How the integers are found here: the raw values
// q (unsigned bytes: 0-15, 0-31, 0-63) of each sub-block (32 values; q6_K 16) against the
// activations, summed from zero for each sub-block (AMX: one tile product of K = 32 or 16, unsigned
// weight bytes by signed activation bytes; AVX-512 VNNI: one VPDPBUSD chain per row and token tile),
// that sum times the sub-block's scale in 32 bits, added up over the sub-blocks:
//   s1 = sum_s scale_s * sum_{e in s} q_e * y_e   (q6_K: less 32 * sum_s scale_s * bsum16_s)
// The weights' preparation only unpacks the values into bytes. The scaling grows with the tokens;
// from 3 token tiles (q6_K: 2) AMX instead scales the weights once: q * scale is split into two
// bytes, a + 128 b (q6_K: scale * (q - 32) + 4096 = a + 128 b), and one tile product of each plane
// per 64 values gives s1 = dot(a, y) + 128 dot(b, y) (q6_K: less 4096 * sum y).
//
// Types: q4_K, q5_K, q6_K (the experts of the K-quant mixes: Q4_K_M, UD-Q4_K_XL). Activation rows
// are q8_K (their vec_dot_type), packed per expert by ost_gemm_pack_tile into the layout below.
#pragma once

#include "ggml.h"

#include <cstddef>
#include <cstdint>
#include <string>

// Activations of one expert's tokens (T of them, K values each, K a multiple of 256), packed once per
// expert and read by every row chunk: tokens in tiles of 16 (the last one padded with zeros), per
// 64-value chunk 16 rows (row kk: values 4 kk .. 4 kk + 3) of 16 tokens x 4 bytes, so that a
// sub-block's rows are an AMX B tile; then per block and token its scale and its 16-bit sums of 32
// and of 16 values (in pairs). Sizes in bytes:
size_t ost_gemm_pack_bytes(int K, int T);
// Packs token tile tt (tokens 16 tt .. min(T, 16 tt + 16)) for blocks [sb0, sb1) (of K / 256) from
// the tokens' q8_K rows rows[n] (n < the tile's tokens), zeros for the tile's padding tokens. Every
// byte it writes lies in 64-byte lines of the pack (the pack 64-byte aligned) that no other (tile,
// block) writes: threads may pack different (tile, block range)s at once without sharing a line.
void ost_gemm_pack_tile(void * pack, int K, int T, int tt, int sb0, int sb1, const void * const * rows);

// Rows w + i * row_bytes (i < nrows) of type t (K values each) against the packed tokens:
// out[j][i] = the row's product with token j (j < T), as ggml-cpu's tiled kernel computes it.
// False (nothing written) when t is not served (see ost_gemm_serves). Thread-safe; uses a
// thread-local scratch of ~6 KiB and 1 KiB per 16 tokens.
bool ost_gemm_rows(ggml_type t, int K, const void * w, size_t row_bytes, int nrows, const void * pack, int T,
                   float * const * out);

// Whether ost_gemm_rows serves type t on this machine: the CPU has AVX-512 (F, BW, VL, DQ, VNNI)
// and the type passed the first-use check against ggml-cpu's own tiled result, bit for bit.
bool ost_gemm_serves(ggml_type t);

// Which instruction set the integer sums run on ("amx", "avx512-vnni" or "off") and the served
// types ("q4_K,q5_K,q6_K"), for info(); the float epilogue ggml-cpu was found to use ("mul-add"
// or "fma"). AMX can be turned off (process-wide; the next rows use VNNI; returns the previous).
std::string ost_gemm_isa();
std::string ost_gemm_types();
std::string ost_gemm_epilogue();
bool ost_gemm_set_amx(bool on);
// From how many token tiles (of 16 tokens) AMX scales the weights once into two byte planes
// instead of scaling each sub-block's sums per token tile (0, the default: q6_K from 2, q4_K and
// q5_K from 3; 1: always the planes; INT_MAX: never). Process-wide, for `ostinato bench
// cpu-branch`'s A/B (--amx 2, 3); returns the previous value. Same results either way.
int ost_gemm_set_amx_planes(int tiles);
