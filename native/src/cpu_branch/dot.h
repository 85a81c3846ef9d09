// Dot products of several weight rows with one activation row for the CPU branch kernel (docs/engine.md "CPU branch"):
// bitwise what ggml-cpu's vec_dot gives for each row, two rows at a time (docs/engine.md, "CPU branch
// kernel", "Row pairs").
//
// ggml-cpu's x86 vec_dot of the types below sums each block's integer products (32 or 256 values)
// into eight 32-bit lanes and adds each block into eight float lanes with one fused multiply-add,
// then adds the lanes in a fixed order. The kernels here do the same per row, but for two rows in one pass:
// with AVX-512 one 512-bit register holds both rows' lanes (each half doing what ggml's 256-bit
// register does for one row), so the vector instructions per weight byte halve; with AVX2 two
// registers. The integer sums are exact whatever the instruction, and the float operations are
// ggml's, in its order, lane for lane: the results are bitwise ggml's. A check at first use compares
// every type against ggml-cpu's own vec_dot on this machine and turns a type off if one bit differs
// (a ggml built for another instruction set, a compiler that contracts differently).
#pragma once

#include "ggml.h"

#include <cstddef>
#include <string>

// Which row pairs (a setting: measured on the H200 host, AVX-512 pairs made the engine's CPU branch
// slower than vec_dot row by row, docs/engine.md "Row pairs"; so off by default). The CPU branch
// kernel leaves them out while its software prefetch is on (ost_ffn_set_prefetch_rows > 0).
enum { OST_DOT_OFF = 0, OST_DOT_AVX2 = 1, OST_DOT_AVX512 = 2 };

// Rows w + i * row_bytes (i < nrows) of type t, n values each, dotted with y (t's vec_dot_type, n
// values): out[i] = vec_dot(n, w_i, y). False (nothing written) when the active mode does not serve t
// (off, a CPU without that instruction set, a type that failed the check); the caller then calls
// ggml-cpu's vec_dot per row.
bool ost_dot_rows(ggml_type t, int n, const void * w, size_t row_bytes, int nrows, const void * y, float * out);

// Whether ost_dot_rows serves type t in the active mode (after the first-use check).
bool ost_dot_serves(ggml_type t);

// The mode asked for (OST_DOT_*; clamped), process-wide; returns the previous one. The active mode is
// the asked one where the CPU has its instruction set, else the next lower one it has.
int ost_dot_set_mode(int mode);
int ost_dot_mode();
int ost_dot_active();

// The active mode ("avx512", "avx2" or "off") and the types it serves ("q4_0,q8_0,..."), for info().
std::string ost_dot_isa();
std::string ost_dot_types();
