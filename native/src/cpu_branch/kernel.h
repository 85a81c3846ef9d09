// The CPU branch's own kernel (internal to libllama): the expert FFN of a layer's cold routes,
// computed row by row with ggml-cpu's own dot products on a resident thread team that spins while
// a forward pass is in flight. Paper: arXiv 2611.11533, Sections 3.2 and 3.4 (the CPU branch's cost
// C(r) = alpha + beta r: beta is the bytes of one cold expert over the host's read bandwidth, alpha
// the per-layer fixed cost this kernel keeps to a few microseconds).
//
// What it computes is what ggml-cpu computes for the same graph, bit for bit: the CPU branch graph
// (built by the patched build_moe_ffn from stock's expert FFN code) is matched node by node
// (ost_ffn_match), and the kernel then does what ggml's MUL_MAT_ID, GLU(SWIGLU) and MUL_MAT_ID do:
// each token row quantized to the weights' vec_dot type with the same from_float, each output
// element one vec_dot of a weight row with that row, the activation by ggml-cpu's own
// ggml_vec_swiglu_f32 over whole rows (exported by native/patches/23; a clamped SwiGLU element by
// element in the operations of ggml-cpu's SWIGLU_CLAMP), -1 ids skipped. An expert tensor that
// ggml-cpu computes with its tiled K-quant kernel (a type it tiles, >= 8 routes of the expert) is
// computed as that kernel computes it, all the expert's tokens at once on AMX or AVX-512 VNNI
// (cpu_branch/gemm.h). Only the order of the work differs: the experts' rows are taken in chunks by
// the team's threads, every row is read once for all of its expert's tokens, and instead of ggml's
// per-op synchronisation the team takes a layer's items by claims on a board (no barriers;
// ost_ffn_set_claims), or with three barriers. Graphs it does not match (biases, scales, other
// activations, clamps other than SWIGLU_CLAMP's), and tiled experts of a type cpu_branch/gemm.h does
// not serve on this machine, keep ggml's graph compute.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <string>
#include <vector>

// A CPU-branch graph in the one shape the kernel computes.
struct ost_ffn {
    const ggml_tensor * up = nullptr;     // [n_embd, n_ff, n_expert] (merged: [n_embd, 2 n_ff, n_expert], gate rows first)
    const ggml_tensor * gate = nullptr;   // [n_embd, n_ff, n_expert]; nullptr when merged
    const ggml_tensor * down = nullptr;   // [n_ff, n_embd, n_expert]
    bool merged = false;
    // > 0: the activation is ggml's SwiGLU with a clamp (GGML_GLU_OP_SWIGLU_CLAMP, deepseek4's
    // experts): silu(min(gate, limit)) * clamp(up, -limit, limit)
    float swiglu_limit = 0.0f;
    int64_t n_embd = 0, n_ff = 0, n_expert = 0;
    // bytes of one expert (up + gate + down): what a cold route reads
    int64_t expert_bytes = 0;
};

// Recognises out = MUL_MAT_ID(down, SWIGLU(MUL_MAT_ID(gate, cur, ids), MUL_MAT_ID(up, cur, ids)), ids)
// (or the merged gate_up form: two views of one MUL_MAT_ID; or SWIGLU_CLAMP for SWIGLU) over host
// tensors. Returns false, with the reason in `why`, for any other graph.
bool ost_ffn_match(const ggml_tensor * out, const ggml_tensor * ids, const ggml_tensor * cur, ost_ffn & f,
                   std::string & why);

// Resident thread team: n - 1 threads of its own plus the caller of ost_team_run (or ost_ffn_run) as
// thread 0. Its threads also watch the team's claim board, where ost_ffn_run's runs go by default.
struct ost_team;
ost_team * ost_team_new(int n);
void       ost_team_free(ost_team * t);
int        ost_team_size(const ost_team * t);
// Spin between runs (a pass is in flight) or sleep (between passes). Cheap; call from one thread.
void       ost_team_set_active(ost_team * t, bool active);
// Runs fn(ctx, ith, nth) on every thread of the team, the caller as ith 0; returns when all are done.
void       ost_team_run(ost_team * t, void (*fn)(void * ctx, int ith, int nth), void * ctx);
// Barrier of the threads of the running fn.
void       ost_team_barrier(ost_team * t);

// One layer's CPU branch: n tokens, k routes each; ids [n][k] (expert, or < 0: not this branch's),
// cur row t at cur + t * cur_stride floats, out [n][k][n_embd] F32 (rows at a negative id are not
// written). Scratch lives in `ws` (grown as needed).
struct ost_ffn_job {
    const ost_ffn * f = nullptr;
    const int32_t * ids = nullptr;
    const float * cur = nullptr;
    int64_t cur_stride = 0;
    float * out = nullptr;
    int k = 0, n = 0;
    bool zero_unrouted = false;   // also write 0 into the rows at a negative id
    bool force = false;           // tiled experts of a type cpu_branch/gemm.h does not serve: vec_dot (not ggml's arithmetic)
};

struct ost_ffn_stats {
    int64_t experts = 0;     // distinct experts computed
    int64_t routes = 0;      // routes computed
    int64_t bytes = 0;       // weight bytes read (each distinct expert once)
    int64_t tiled_experts = 0;   // experts computed as ggml's tiled kernel does (cpu_branch/gemm.h)
    // where a run's time went (ns; filled only while ost_ffn_set_phase_timing(true), ost_ffn_run):
    // the caller's grouping and scratch layout; the team's start (mean over its other threads of
    // their first step after the launch; on the claim board over those that took an item); the input
    // rows' quantisation (with the tiled experts' packs of them), the gate/up rows, the activations
    // (with their packs), the down rows (each from its start to
    // the last thread's arrival at its barrier; on the board to the completion of its last item);
    // the mean time a thread waited at those barriers (on the board: the handoffs between phases);
    // the whole run
    int64_t prepare_ns = 0, wake_ns = 0, quant_ns = 0, gate_up_ns = 0, act_ns = 0, down_ns = 0, idle_ns = 0,
            total_ns = 0;
    int threads = 0;   // threads that took part (the team's size with barriers; those that claimed an item)
};
// How a team computes ost_ffn_run's runs (process-wide; default true): on a claim board, where the
// threads that are on a core take the run's items (chunks of rows, routes' activations) one at a
// time and nobody waits for a thread that is not running; false: every thread of the team takes
// part in every phase, with a barrier after each (the form before 2026-12-03, for `ostinato bench
// engines`' A/B). The same arithmetic either way. Returns the previous value.
bool ost_ffn_set_claims(bool on);
// The team's current mode (ost_ffn_set_claims).
bool ost_ffn_claims();

// Phase timing of ost_ffn_run (off by default; for `ostinato bench cpu-branch`): a few clock reads
// per thread and phase. Returns the previous value.
bool ost_ffn_set_phase_timing(bool on);
// Pauses a waiting thread of a team spins before it yields on every further try (its start, the
// barriers; default 256, INT_MAX: never yields): process-wide, for `ostinato bench cpu-branch`'s
// A/B. Returns the previous value.
int ost_ffn_set_spins(int spins);
int ost_ffn_spins();

// False (nothing computed) when an expert of the job has as many routes as ggml-cpu's tiled kernel
// takes for a weight type that cpu_branch/gemm.h does not serve here (bitwise equality could not be
// promised): the caller then runs ggml's graph. `team` may be null (the caller alone).
bool ost_ffn_run(ost_team * team, const ost_ffn_job & job, std::vector<uint8_t> & ws, ost_ffn_stats * st);

// Software prefetch in the kernel's row loop (process-wide, read once per phase of a run): while a thread
// computes weight row r of its chunk it prefetches row r + rows (and the chunk's first rows when it
// takes the chunk), so that its reads do not wait for the hardware prefetcher, which starts again at
// every 4 KiB page and every chunk (chunks of one expert go to different threads). 0 = off. Changes
// which bytes are fetched when, never what is computed. Returns the previous value.
constexpr int OST_PREFETCH_ROWS_MAX = 64;   // the largest distance (the C API and the bench refuse more)
int ost_ffn_set_prefetch_rows(int rows);
int ost_ffn_prefetch_rows();
// Routes of one expert from which the kernel cannot compute these expert types as ggml-cpu does:
// ggml-cpu computes the types it tiles with its tiled kernel from 8 routes (1 with
// GGML_CPU_TILED_MM_FORCE=1); the kernel computes that arithmetic too for the types cpu_branch/gemm.h
// serves (INT32_MAX then), and for types ggml does not tile or with GGML_CPU_TILED_MM=0.
int32_t          ost_ffn_tiled_rows(ggml_type up, ggml_type gate, ggml_type down);
