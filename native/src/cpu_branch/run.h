// One run of the CPU branch's kernel: its state and items, shared by cpu_branch/kernel.cpp and run.cpp.
#pragma once

#include "cpu_branch/kernel.h"

#include "ggml.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ost_kernel {

struct route_t { int32_t t, j; };

struct group_t {
    int32_t e = 0;
    int32_t r0 = 0, nr = 0;     // its routes: routes[r0 .. r0 + nr)
    // as many routes as ggml-cpu's tiled kernel takes for the gate/up or down tensors' type: those
    // rows go to ost_gemm_rows over the group's packed activations (offsets into the scratch)
    bool gu_tiled = false, down_tiled = false;
    size_t gu_pack = 0, down_pack = 0;
};

// Work of one run, laid out in the caller's scratch.
struct run_t {
    const ost_ffn * f;
    const ost_ffn_job * job;
    std::vector<group_t> groups;
    std::vector<route_t> routes;     // grouped by expert
    // per route r: gate and up rows (F32 [2][n_ff]), its quantised activation row
    float * gu = nullptr;
    char * actq = nullptr;
    size_t actq_row = 0;
    // per token: its quantised input row
    const char * xq = nullptr;
    size_t xq_row = 0;
    std::vector<int32_t> tok_slot;   // token -> row of xq
    char * base = nullptr;           // the scratch (packs at their groups' offsets)
    // the packs' items (tiled groups only): (group, token tile, block range), each written by one
    // thread after the rows it reads are quantised (a pack line holds 16 tokens: packing per token
    // from many threads shared every line among them)
    struct pack_item_t { int32_t g; int16_t tt, sb0, sb1; };
    std::vector<pack_item_t> pack1, pack3;   // the gate/up packs (input rows), the down packs (activations)
    ggml_type xt = GGML_TYPE_F32;    // the input rows' vec_dot type
    bool any_tiled = false;          // some group is tiled (its activations are packed)
    bool xq_done = false;            // the input rows were quantised by prepare
    int64_t n_routes = 0;
    std::vector<int32_t> count, start;   // per expert: routes, next route's place
    // rows of phase 1 (2 n_ff per group) and phase 3 (n_embd per group) in chunks that the threads
    // take from a counter: threads that run slower (a hyperthread sibling busy, an interrupt) take
    // fewer, so the phase ends when the work does (a static share waited for the slowest thread)
    int64_t chunk1 = 16, chunk3 = 16;   // rows per chunk
    int64_t per1 = 0, per3 = 0;         // chunks per group
    alignas(64) std::atomic<int64_t> next1{0};
    alignas(64) std::atomic<int64_t> next3{0};
    // phase timing (g_phase_timing): the launch, per thread its start, its arrival at the barrier
    // after each phase and its leaving of it (PH_* rows of nth)
    bool timing = false;
    int nth = 1;
    int64_t t_launch = 0;
    std::vector<int64_t> t_start, t_arrive, t_leave;
};

// The phases in order; the pack phases have items only where some group is tiled (never in a decode
// step), and the quantisation and its pack only where prepare did not do them (one token, one thread).
enum { PH_QUANT, PH_PACK1, PH_GATE_UP, PH_ACT, PH_PACK3, PH_DOWN, PH_N };

int64_t now_ns();
// software prefetch distance of the row loop (ost_ffn_set_prefetch_rows)
extern std::atomic<int> g_prefetch_rows;
int32_t tiled_rows_of(ggml_type t);

// a run's items: chunk c of phase 1 or 3, token t's input row, route q's activation, pack item i
void rows_item(run_t & r, int64_t c, bool down);
int64_t phase_chunks(const run_t & r, bool down);
void quant_item(run_t & r, int32_t t);
void act_item(run_t & r, size_t q);
void pack_item(run_t & r, size_t i, bool down);
// items of phase ph (PH_*) in the prepared run r: 0 for a phase that does not run
int64_t phase_items(const run_t & r, int ph);
// the item of phase ph
void run_item(run_t & r, int ph, int64_t item);
void zero_unrouted_rows(const ost_ffn_job & job, int ith, int nth);

// a run on ost_team_run with a barrier after each phase (ctx: a team_ctx)
struct team_ctx {
    run_t * r;
    ost_team * team;
};
void team_fn(void * ctx, int ith, int nth);

bool prepare(run_t & r, const ost_ffn_job & job, std::vector<uint8_t> & ws, int nth, bool * empty);
void fill_stats(const run_t & r, bool empty, ost_ffn_stats * st);
void fill_timing(const run_t & r, int64_t t0, int64_t t_end, ost_ffn_stats * st);
int64_t * phase_stat(ost_ffn_stats * st, int ph);

}  // namespace ost_kernel
