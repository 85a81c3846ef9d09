// The CPU branch's own kernel and thread team: see cpu_branch/kernel.h.
#include "cpu_branch/kernel.h"
#include "cpu_branch/dot.h"
#include "cpu_branch/gemm.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OST_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define OST_PAUSE() __asm__ __volatile__("yield")
#else
#define OST_PAUSE() std::this_thread::yield()
#endif

// ---------------------------------------------------------------------------------------------
// graph matching

namespace {

bool host_weights(const ggml_tensor * w) {
    // not a repacked CPU tensor (its extra holds the repack traits, its rows another layout)
    const ggml_tensor * s = w && w->view_src ? w->view_src : w;
    return w && (w->op == GGML_OP_NONE || w->op == GGML_OP_VIEW) && w->data && !s->extra && w->view_offs == 0 && ggml_n_dims(w) == 3 && w->nb[0] == ggml_type_size(w->type) &&
           ggml_get_type_traits_cpu(w->type)->vec_dot != nullptr;
}

bool is_mmid(const ggml_tensor * t, const ggml_tensor * x, const ggml_tensor * ids) {
    return t && t->op == GGML_OP_MUL_MAT_ID && t->type == GGML_TYPE_F32 && t->src[1] == x && t->src[2] == ids &&
           host_weights(t->src[0]);
}

// ggml-cpu's tiled K-quant matmul takes an expert with this many rows of these types (tiled.cpp):
// not the same arithmetic as vec_dot, so such experts stay with ggml
constexpr int TILED_MIN_ROWS = 8;

bool tiled_type(ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q6_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q2_K:
        case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S:
        case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ1_M:
            return true;
        default:
            return false;
    }
}

// GGML_CPU_TILED_MM_FORCE=1 (ggml's test switch) makes ggml tile an expert whatever its row count
int tiled_min_rows() {
    const char * force = getenv("GGML_CPU_TILED_MM_FORCE");
    return force && atoi(force) == 1 ? 1 : TILED_MIN_ROWS;
}

// Routes of one expert from which ggml-cpu computes a tensor of type t with its tiled kernel
// (INT32_MAX: never; GGML_CPU_TILED_MM=0 turns that kernel off)
int32_t tiled_rows_of(ggml_type t) {
    const char * off = getenv("GGML_CPU_TILED_MM");
    if ((off && atoi(off) == 0) || !tiled_type(t)) return INT32_MAX;
    return tiled_min_rows();
}

}  // namespace

bool ost_ffn_match(const ggml_tensor * out, const ggml_tensor * ids, const ggml_tensor * cur, ost_ffn & f,
                   std::string & why) {
    f = ost_ffn{};
    if (!cur || cur->type != GGML_TYPE_F32 || !ggml_is_contiguous(cur) || cur->ne[1] != 1) {
        why = "input rows not F32 [n_embd, 1, n]";
        return false;
    }
    if (!ids || ids->type != GGML_TYPE_I32 || !ggml_is_contiguous(ids)) { why = "ids not contiguous I32"; return false; }
    if (!is_mmid(out, out ? out->src[1] : nullptr, ids)) { why = "output is not a mul_mat_id over host experts"; return false; }
    const ggml_tensor * act = out->src[1];
    const ggml_glu_op glu = act->op == GGML_OP_GLU ? ggml_get_glu_op(act) : GGML_GLU_OP_COUNT;
    if ((glu != GGML_GLU_OP_SWIGLU && glu != GGML_GLU_OP_SWIGLU_CLAMP) || !act->src[1] ||
        ((const int32_t *) act->op_params)[1] != 0 /* swapped */ || act->type != GGML_TYPE_F32 || !ggml_is_contiguous(act)) {
        why = "activation is not swiglu(gate, up) or swiglu_clamp(gate, up)";
        return false;
    }
    if (glu == GGML_GLU_OP_SWIGLU_CLAMP) {
        // the limit is the op's float parameter 3 (ggml_swiglu_clamp)
        memcpy(&f.swiglu_limit, (const char *) act->op_params + 3 * sizeof(int32_t), sizeof(float));
        if (!(f.swiglu_limit > 0.0f)) { why = "swiglu_clamp with a limit that is not positive"; return false; }
    }
    const ggml_tensor * g = act->src[0];
    const ggml_tensor * u = act->src[1];
    if (is_mmid(g, cur, ids) && is_mmid(u, cur, ids)) {
        f.gate = g->src[0];
        f.up = u->src[0];
        if (f.up->type != f.gate->type) { why = "up and gate of different types"; return false; }
    } else if (g->op == GGML_OP_VIEW && u->op == GGML_OP_VIEW && g->src[0] == u->src[0] && is_mmid(g->src[0], cur, ids)) {
        const ggml_tensor * gu = g->src[0];
        const int64_t n_ff = gu->ne[0] / 2;
        size_t og = 0, ou = 0;
        memcpy(&og, g->op_params, sizeof(og));
        memcpy(&ou, u->op_params, sizeof(ou));
        if (g->ne[0] != n_ff || u->ne[0] != n_ff || og != 0 || ou != (size_t) n_ff * sizeof(float) ||
            g->nb[1] != gu->nb[1] || u->nb[1] != gu->nb[1]) {
            why = "merged gate_up views not [gate | up]";
            return false;
        }
        f.up = gu->src[0];
        f.merged = true;
    } else {
        why = "gate and up are not mul_mat_ids of the input";
        return false;
    }
    f.down = out->src[0];
    f.n_embd = cur->ne[0];
    f.n_ff = f.merged ? f.up->ne[1] / 2 : f.up->ne[1];
    f.n_expert = f.down->ne[2];
    if (f.up->ne[0] != f.n_embd || f.down->ne[0] != f.n_ff || f.down->ne[1] != f.n_embd ||
        f.up->ne[2] != f.n_expert || (f.gate && (f.gate->ne[0] != f.n_embd || f.gate->ne[1] != f.n_ff ||
                                                 f.gate->ne[2] != f.n_expert))) {
        why = "expert tensor shapes do not agree";
        return false;
    }
    f.expert_bytes = (int64_t) (f.up->nb[1] * f.up->ne[1] + (f.gate ? f.gate->nb[1] * f.gate->ne[1] : 0) +
                                f.down->nb[1] * f.down->ne[1]);
    return true;
}

// ---------------------------------------------------------------------------------------------
// thread team

namespace {

// Spins a little, then yields on every try: a thread that only spins gathers CPU time and the
// scheduler then runs it last, so on a machine with more runnable threads than cores the thread a
// barrier waits for may not run for a whole time slice (measured on the 2-core CI machine under
// load: ~40 ms per kernel run with pure spinning). Yielding costs ~1 us when nothing else waits,
// but on the 16-core H200 host a yielded core goes to any other runnable thread (docs/engine.md,
// "CPU branch kernel": never yielding made the kernel 1.2-1.7x faster there, and one run 10 ms slow).
constexpr int SPINS_BEFORE_YIELD = 256;            // the default; ost_ffn_set_spins changes it
std::atomic<int> g_spins{SPINS_BEFORE_YIELD};

template <class Done> inline void spin_until(Done done) {
    for (int i = 0; !done(); ++i) {
        if (i < g_spins.load(std::memory_order_relaxed)) OST_PAUSE();
        else std::this_thread::yield();
    }
}

// Barrier of n threads that spin (then yield) while they wait; reusable at once (the last to arrive
// resets the count before it releases the others).
struct spin_barrier {
    alignas(64) std::atomic<int> arrived{0};
    alignas(64) std::atomic<uint64_t> phase{0};
    void wait(int n) {
        if (n <= 1) return;
        const uint64_t ph = phase.load(std::memory_order_acquire);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
            arrived.store(0, std::memory_order_relaxed);
            phase.fetch_add(1, std::memory_order_acq_rel);
        } else {
            spin_until([&] { return phase.load(std::memory_order_acquire) != ph; });
        }
    }
};

}  // namespace

struct ost_board;

struct ost_team {
    int n = 1;
    std::vector<std::thread> threads;
    std::mutex m;
    std::condition_variable cv;
    std::atomic<uint64_t> gen{0};          // one more per run
    std::atomic<bool> active{false};
    std::atomic<bool> quit{false};
    void (*fn)(void *, int, int) = nullptr;
    void * ctx = nullptr;
    spin_barrier barrier;
    // the kernel's work board (claims, no barriers; made at the first ost_ffn_run on this team)
    std::atomic<ost_board *> board{nullptr};
};

namespace {
// Whether the team's board has an item to claim, and working it (the kernel section below).
bool board_open(const ost_board * b);
void board_work(ost_board * b, int ith);
void board_free(ost_board * b);
}  // namespace

namespace {

bool board_has_work(const ost_team * t) {
    const ost_board * b = t->board.load(std::memory_order_acquire);
    return b && board_open(b);
}

void team_main(ost_team * t, int ith) {
    uint64_t seen = 0;
    for (;;) {
        // spin while a pass is in flight, sleep between passes
        for (int i = 0; t->gen.load(std::memory_order_acquire) == seen && !t->quit.load(std::memory_order_relaxed); ++i) {
            if (board_has_work(t)) {
                // the kernel's items: taken by whoever is here, nobody waits for a thread that is not
                board_work(t->board.load(std::memory_order_acquire), ith);
                i = 0;
                continue;
            }
            if (t->active.load(std::memory_order_relaxed)) {
                if (i < g_spins.load(std::memory_order_relaxed)) OST_PAUSE();
                else std::this_thread::yield();
                continue;
            }
            std::unique_lock<std::mutex> lk(t->m);
            t->cv.wait(lk, [&] {
                return t->gen.load(std::memory_order_acquire) != seen || t->quit.load() || t->active.load() ||
                       board_has_work(t);
            });
        }
        if (t->quit.load()) return;
        seen = t->gen.load(std::memory_order_acquire);
        t->fn(t->ctx, ith, t->n);
        ost_team_barrier(t);
    }
}

}  // namespace

ost_team * ost_team_new(int n) {
    auto * t = new ost_team();
    t->n = std::max(1, n);
    for (int i = 1; i < t->n; ++i) t->threads.emplace_back(team_main, t, i);
    return t;
}

void ost_team_free(ost_team * t) {
    if (!t) return;
    {
        std::lock_guard<std::mutex> lk(t->m);
        t->quit = true;
    }
    t->cv.notify_all();
    for (auto & th : t->threads) th.join();
    board_free(t->board.load());
    delete t;
}

int ost_team_size(const ost_team * t) { return t ? t->n : 1; }

void ost_team_set_active(ost_team * t, bool active) {
    if (!t || t->active.load() == active) return;
    {
        std::lock_guard<std::mutex> lk(t->m);
        t->active = active;
    }
    if (active) t->cv.notify_all();
}

void ost_team_barrier(ost_team * t) {
    if (t) t->barrier.wait(t->n);
}

void ost_team_run(ost_team * t, void (*fn)(void *, int, int), void * ctx) {
    if (!t || t->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    t->fn = fn;
    t->ctx = ctx;
    if (t->active.load(std::memory_order_relaxed)) {
        t->gen.fetch_add(1, std::memory_order_acq_rel);
    } else {
        {
            std::lock_guard<std::mutex> lk(t->m);
            t->gen.fetch_add(1, std::memory_order_acq_rel);
        }
        t->cv.notify_all();
    }
    fn(ctx, 0, t->n);
    ost_team_barrier(t);
}

// ---------------------------------------------------------------------------------------------
// kernel

namespace {

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
    std::vector<int32_t> route_of;   // [n][k]: the route of (token, j), or -1
    std::vector<int32_t> group_of;   // route -> its group
    char * base = nullptr;           // the scratch (packs at their groups' offsets)
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

enum { PH_QUANT, PH_GATE_UP, PH_ACT, PH_DOWN, PH_N };

std::atomic<bool> g_phase_timing{false};

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Rows of about this many bytes make a chunk: a few microseconds of a thread's work, so that taking
// a chunk (one contended atomic add) costs little beside it.
constexpr int64_t CHUNK_BYTES = 16 * 1024;

std::atomic<int> g_prefetch_rows{0};

// Weight row `row` of group g in phase 1 (rows [0, n_ff): gate, [n_ff, 2 n_ff): up; merged: the
// tensor's own row order, gate first) or 3 (down): its bytes, and in *w its tensor.
const char * weight_row(const ost_ffn & f, const group_t & g, int64_t row, bool down, const ggml_tensor ** w) {
    *w = down ? f.down : f.merged ? f.up : (row < f.n_ff ? f.gate : f.up);
    const int64_t wrow = down || f.merged || row < f.n_ff ? row : row - f.n_ff;
    return (const char *) (*w)->data + g.e * (*w)->nb[2] + wrow * (*w)->nb[1];
}

void prefetch_row(const ost_ffn & f, const group_t & g, int64_t row, bool down) {
    const ggml_tensor * w = nullptr;
    const char * p = weight_row(f, g, row, down, &w);
    // every cache line the row touches (rows need not start on a line)
    const char * line = (const char *) ((uintptr_t) p & ~(uintptr_t) 63);
    for (; line < p + w->nb[1]; line += 64) __builtin_prefetch(line, 0, 3);
}

// Route q's output element `row` of weight row wr (tensor w): one ggml-cpu vec_dot.
inline void vec_dot_row(run_t & r, int32_t q, int64_t row, const char * wr, const ggml_tensor * w, bool down) {
    const ost_ffn & f = *r.f;
    const route_t & rt = r.routes[(size_t) q];
    const auto vec_dot = ggml_get_type_traits_cpu(w->type)->vec_dot;
    if (down) {
        vec_dot((int) f.n_ff, r.job->out + ((int64_t) rt.t * r.job->k + rt.j) * f.n_embd + row, 0, wr, 0,
                r.actq + (size_t) q * r.actq_row, 0, 1);
    } else {
        vec_dot((int) f.n_embd, r.gu + (size_t) q * 2 * f.n_ff + row, 0, wr, 0,
                r.xq + (size_t) r.tok_slot[(size_t) rt.t] * r.xq_row, 0, 1);
    }
}

// Rows [row0, row1) of group g, one tensor, for every route of g: the row-pair dot products
// (cpu_branch/dot.h; bitwise vec_dot's, two rows per pass) where they are on, serve the type and no
// software prefetch is asked for, else vec_dot row by row (each row read once for all the group's routes).
void tensor_rows(run_t & r, const group_t & g, int64_t row0, int64_t row1, bool down, int64_t pf) {
    const ost_ffn & f = *r.f;
    const ggml_tensor * w = nullptr;
    const char * w0 = weight_row(f, g, row0, down, &w);
    if (down ? g.down_tiled : g.gu_tiled) {
        // every route of the group at once, as ggml-cpu's tiled kernel computes them
        thread_local std::vector<float *> outs;
        outs.resize((size_t) g.nr);
        for (int32_t q = g.r0; q < g.r0 + g.nr; ++q) {
            const route_t & rt = r.routes[(size_t) q];
            outs[(size_t) (q - g.r0)] = down ? r.job->out + ((int64_t) rt.t * r.job->k + rt.j) * f.n_embd + row0
                                             : r.gu + (size_t) q * 2 * f.n_ff + row0;
        }
        const bool ok = ost_gemm_rows(w->type, (int) (down ? f.n_ff : f.n_embd), w0, w->nb[1], (int) (row1 - row0),
                                      r.base + (down ? g.down_pack : g.gu_pack), g.nr, outs.data());
        GGML_ASSERT(ok);   // prepare marks a group tiled only for a type ost_gemm_serves
        return;
    }
    if (pf == 0 && ost_dot_serves(w->type)) {
        for (int32_t q = g.r0; q < g.r0 + g.nr; ++q) {
            const route_t & rt = r.routes[(size_t) q];
            float * out = down ? r.job->out + ((int64_t) rt.t * r.job->k + rt.j) * f.n_embd + row0
                               : r.gu + (size_t) q * 2 * f.n_ff + row0;
            const void * y = down ? (const void *) (r.actq + (size_t) q * r.actq_row)
                                  : (const void *) (r.xq + (size_t) r.tok_slot[(size_t) rt.t] * r.xq_row);
            if (ost_dot_rows(w->type, (int) (down ? f.n_ff : f.n_embd), w0, w->nb[1], (int) (row1 - row0), y, out)) continue;
            for (int64_t row = row0; row < row1; ++row) vec_dot_row(r, q, row, w0 + (row - row0) * w->nb[1], w, down);
        }
        return;
    }
    for (int64_t row = row0; row < std::min(row1, row0 + pf); ++row) prefetch_row(f, g, row, down);
    for (int64_t row = row0; row < row1; ++row) {
        if (pf > 0 && row + pf < row1) prefetch_row(f, g, row + pf, down);
        const char * wr = w0 + (row - row0) * w->nb[1];
        for (int32_t q = g.r0; q < g.r0 + g.nr; ++q) vec_dot_row(r, q, row, wr, w, down);
    }
}

// Chunk c of phase 1 (gate/up rows, !down) or 3 (down rows): its rows of its group, for every route of the group.
void rows_item(run_t & r, int64_t c, bool down) {
    const ost_ffn & f = *r.f;
    const int64_t n_ff = f.n_ff;
    const int64_t per = down ? f.n_embd : 2 * n_ff;           // rows per group
    const int64_t rc = down ? r.chunk3 : r.chunk1, cpg = down ? r.per3 : r.per1;
    const int64_t pf = g_prefetch_rows.load(std::memory_order_relaxed);
    const group_t & g = r.groups[(size_t) (c / cpg)];
    const int64_t row0 = (c % cpg) * rc, row1 = std::min(per, row0 + rc);
    // gate rows [0, n_ff) and up rows [n_ff, 2 n_ff) are two tensors unless merged
    if (!down && !f.merged && row0 < n_ff && row1 > n_ff) {
        tensor_rows(r, g, row0, n_ff, false, pf);
        tensor_rows(r, g, n_ff, row1, false, pf);
    } else {
        tensor_rows(r, g, row0, row1, down, pf);
    }
}

int64_t phase_chunks(const run_t & r, bool down) { return (down ? r.per3 : r.per1) * (int64_t) r.groups.size(); }

void phase_rows(run_t & r, bool down) {
    const int64_t total = phase_chunks(r, down);
    std::atomic<int64_t> & next = down ? r.next3 : r.next1;
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < total;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
        rows_item(r, c, down);
    }
}

// Rows of routes the job does not compute are exact zeros (the op's output is added as x + 0):
// thread ith of nth writes every nth of them.
void zero_unrouted_rows(const ost_ffn_job & job, int ith, int nth) {
    const int64_t n_embd = job.f->n_embd, n_expert = job.f->n_expert;
    for (int64_t i = ith; i < (int64_t) job.n * job.k; i += nth) {
        const int32_t e = job.ids[i];
        if (e < 0 || e >= n_expert) memset(job.out + i * n_embd, 0, (size_t) n_embd * sizeof(float));
    }
}

// SwiGLU with a clamp (GGML_GLU_OP_SWIGLU_CLAMP): y = silu(a) * b with a = min(gate, limit),
// b = clamp(up, -limit, limit), silu(a) = a / (1 + e^-a), in these operations and this order, which
// are ggml-cpu's for that op (scalar code there, libm's expf), so the rows are bitwise its rows.
void swiglu_clamp_row(int n, float * y, const float * g, const float * u, float limit) {
    for (int i = 0; i < n; ++i) {
        const float a = std::min(g[i], limit);
        const float b = std::clamp(u[i], -limit, limit);
        y[i] = a / (1.f + expf(-a)) * b;
    }
}

// Token t's input row quantised once, as ggml's MUL_MAT_ID does (per src1 row, same from_float).
// Token t's quantised input row into the packs of its routes' tiled groups.
void pack_item(run_t & r, int32_t t) {
    const char * row = r.xq + (size_t) r.tok_slot[(size_t) t] * r.xq_row;
    for (int j = 0; j < r.job->k; ++j) {
        const int32_t q = r.route_of[(size_t) t * r.job->k + j];
        if (q < 0) continue;
        const group_t & g = r.groups[(size_t) r.group_of[(size_t) q]];
        if (g.gu_tiled) ost_gemm_pack_token(r.base + g.gu_pack, (int) r.f->n_embd, g.nr, q - g.r0, row);
    }
}

void quant_item(run_t & r, int32_t t) {
    if (r.tok_slot[(size_t) t] < 0) return;
    ggml_get_type_traits_cpu(r.xt)->from_float(r.job->cur + (int64_t) t * r.job->cur_stride,
                                               (void *) (r.xq + (size_t) r.tok_slot[(size_t) t] * r.xq_row), r.f->n_embd);
    if (r.any_tiled) pack_item(r, t);
}

// Route q's activation over its whole row, as ggml's GLU op computes it, then its quantisation for
// the down matrix, as ggml's MUL_MAT_ID quantises each src1 row.
void act_item(run_t & r, size_t q) {
    const ost_ffn & f = *r.f;
    thread_local std::vector<float> act;
    act.resize((size_t) f.n_ff);
    const float * gq = r.gu + q * 2 * f.n_ff;
    if (f.swiglu_limit > 0.0f) {
        swiglu_clamp_row((int) f.n_ff, act.data(), gq, gq + f.n_ff, f.swiglu_limit);
    } else {
        ggml_cpu_vec_swiglu_f32((int) f.n_ff, act.data(), gq, gq + f.n_ff);
    }
    ggml_get_type_traits_cpu(ggml_get_type_traits_cpu(f.down->type)->vec_dot_type)->from_float(
        act.data(), r.actq + q * r.actq_row, f.n_ff);
    if (r.any_tiled) {
        const group_t & g = r.groups[(size_t) r.group_of[q]];
        if (g.down_tiled) ost_gemm_pack_token(r.base + g.down_pack, (int) f.n_ff, g.nr, (int) q - g.r0, r.actq + q * r.actq_row);
    }
}

// Phases of one run on nth threads (ith of them): the input rows quantised (when not done by
// prepare), the gate/up rows, the activations, the down rows; `barrier` waits for all nth.
template <class Barrier> void run_phases(run_t & r, int ith, int nth, Barrier barrier0) {
    const ost_ffn_job & job = *r.job;
    const bool timing = r.timing;   // ost_ffn_run's runs only (its team is the run's nth threads)
    if (timing) r.t_start[(size_t) ith] = now_ns();
    // the barrier after phase ph, timed when asked
    auto barrier = [&](int ph) {
        if (timing) r.t_arrive[(size_t) ph * nth + ith] = now_ns();
        barrier0();
        if (timing) r.t_leave[(size_t) ph * nth + ith] = now_ns();
    };
    if (job.zero_unrouted) zero_unrouted_rows(job, ith, nth);
    if (!r.xq_done) {
        for (int32_t t = ith; t < job.n; t += nth) quant_item(r, t);
        barrier(PH_QUANT);
    }
    phase_rows(r, false);
    barrier(PH_GATE_UP);
    for (size_t q = (size_t) ith; q < r.routes.size(); q += (size_t) nth) act_item(r, q);
    barrier(PH_ACT);
    phase_rows(r, true);
    // the run's last barrier is the caller's (ost_team_run's, or the shared state's)
    if (timing) r.t_arrive[(size_t) PH_DOWN * nth + ith] = now_ns();
}

struct team_ctx {
    run_t * r;
    ost_team * team;
};

void team_fn(void * ctx, int ith, int nth) {
    team_ctx & c = *(team_ctx *) ctx;
    run_phases(*c.r, ith, nth, [&] { ost_team_barrier(c.team); });
}

// Groups the job's routes by expert and lays out the scratch; false (nothing to compute: n_routes
// 0 sets *empty) when an expert has as many routes as ggml's tiled kernel takes and !job.force.
bool prepare(run_t & r, const ost_ffn_job & job, std::vector<uint8_t> & ws, int nth, bool * empty) {
    const ost_ffn & f = *job.f;
    r.f = &f;
    r.job = &job;
    r.groups.clear();
    r.routes.clear();
    *empty = false;
    // group the routes by expert (ascending), tokens in order within an expert
    r.count.assign((size_t) f.n_expert, 0);
    int64_t n_routes = 0;
    for (int64_t i = 0; i < (int64_t) job.n * job.k; ++i) {
        const int32_t e = job.ids[i];
        if (e >= 0 && e < f.n_expert) { r.count[(size_t) e]++; n_routes++; }
    }
    r.n_routes = n_routes;
    if (n_routes == 0) {
        *empty = true;
        return true;
    }
    // From these many routes of one expert ggml-cpu computes a tensor of the types it tiles with its
    // tiled kernel: such tensors go to ost_gemm_rows, which computes what that kernel does, where it
    // serves the type; else the caller runs ggml's graph (with job.force: vec_dot all the same)
    const int32_t gu_min = tiled_rows_of(f.up->type), dn_min = tiled_rows_of(f.down->type);
    int32_t at = 0;
    r.any_tiled = false;
    r.start.assign((size_t) f.n_expert, -1);
    for (int32_t e = 0; e < f.n_expert; ++e) {
        const int32_t n = r.count[(size_t) e];
        if (!n) continue;
        group_t g{ e, at, n };
        if (n >= gu_min) {
            g.gu_tiled = ost_gemm_serves(f.up->type);
            if (!g.gu_tiled && !job.force) return false;
        }
        if (n >= dn_min) {
            g.down_tiled = ost_gemm_serves(f.down->type);
            if (!g.down_tiled && !job.force) return false;
        }
        r.any_tiled = r.any_tiled || g.gu_tiled || g.down_tiled;
        r.groups.push_back(g);
        r.start[(size_t) e] = at;
        at += n;
    }
    r.routes.resize((size_t) n_routes);
    r.tok_slot.assign((size_t) job.n, -1);
    r.route_of.assign((size_t) job.n * job.k, -1);
    int32_t n_tok = 0;
    for (int32_t t = 0; t < job.n; ++t) {
        for (int32_t j = 0; j < job.k; ++j) {
            const int32_t e = job.ids[(int64_t) t * job.k + j];
            if (e < 0 || e >= f.n_expert) continue;
            const int32_t q = r.start[(size_t) e]++;
            r.routes[(size_t) q] = route_t{ t, j };
            r.route_of[(size_t) t * job.k + j] = q;
            if (r.tok_slot[(size_t) t] < 0) r.tok_slot[(size_t) t] = n_tok++;
        }
    }
    if (r.any_tiled) {
        r.group_of.resize((size_t) n_routes);
        for (size_t gi = 0; gi < r.groups.size(); ++gi) {
            const group_t & g = r.groups[gi];
            for (int32_t q = g.r0; q < g.r0 + g.nr; ++q) r.group_of[(size_t) q] = (int32_t) gi;
        }
    }
    // scratch: quantised input rows, gate/up rows, quantised activation rows
    r.xt = ggml_get_type_traits_cpu(f.up->type)->vec_dot_type;
    const ggml_type at_t = ggml_get_type_traits_cpu(f.down->type)->vec_dot_type;
    r.xq_row = ggml_row_size(r.xt, f.n_embd);
    r.actq_row = ggml_row_size(at_t, f.n_ff);
    auto pad = [](size_t x) { return (x + 63) & ~size_t(63); };
    const size_t o_gu = pad((size_t) n_tok * r.xq_row);
    const size_t o_act = o_gu + pad((size_t) n_routes * 2 * f.n_ff * sizeof(float));
    size_t size = o_act + pad((size_t) n_routes * r.actq_row);
    // the tiled groups' packed activations (cpu_branch/gemm.h): the input rows', the down rows'
    for (group_t & g : r.groups) {
        if (g.gu_tiled) { g.gu_pack = size; size += pad(ost_gemm_pack_bytes((int) f.n_embd, g.nr)); }
        if (g.down_tiled) { g.down_pack = size; size += pad(ost_gemm_pack_bytes((int) f.n_ff, g.nr)); }
    }
    size += 64;
    if (ws.size() < size) ws.resize(size);
    char * base = (char *) (((uintptr_t) ws.data() + 63) & ~uintptr_t(63));
    r.base = base;
    r.xq = base;
    r.gu = (float *) (base + o_gu);
    r.actq = base + o_act;
    for (const group_t & g : r.groups) {
        if (g.gu_tiled) ost_gemm_pack_pad(base + g.gu_pack, (int) f.n_embd, g.nr);
        if (g.down_tiled) ost_gemm_pack_pad(base + g.down_pack, (int) f.n_ff, g.nr);
    }
    // one token (a decode step) is quantised here; more are spread over the threads
    r.xq_done = n_tok == 1 || nth == 1;
    if (r.xq_done) {
        const auto from_float = ggml_get_type_traits_cpu(r.xt)->from_float;
        for (int32_t t = 0; t < job.n; ++t) {
            if (r.tok_slot[(size_t) t] < 0) continue;
            from_float(job.cur + (int64_t) t * job.cur_stride,
                       (void *) (r.xq + (size_t) r.tok_slot[(size_t) t] * r.xq_row), f.n_embd);
            if (r.any_tiled) pack_item(r, t);
        }
    }
    // chunks of about CHUNK_BYTES of weight rows (gate/up rows are n_embd long, down rows n_ff)
    const ggml_tensor * gw = f.merged ? f.up : f.gate;
    // an even number of rows: the row-pair dot products pair a chunk's rows
    r.chunk1 = std::max<int64_t>(2, (CHUNK_BYTES / (int64_t) gw->nb[1]) & ~(int64_t) 1);
    r.chunk3 = std::max<int64_t>(2, (CHUNK_BYTES / (int64_t) f.down->nb[1]) & ~(int64_t) 1);
    if (r.any_tiled) {   // ost_gemm_rows takes rows 16 at a time
        r.chunk1 = std::max<int64_t>(16, r.chunk1 / 16 * 16);
        r.chunk3 = std::max<int64_t>(16, r.chunk3 / 16 * 16);
    }
    r.per1 = (2 * f.n_ff + r.chunk1 - 1) / r.chunk1;
    r.per3 = (f.n_embd + r.chunk3 - 1) / r.chunk3;
    r.next1.store(0, std::memory_order_relaxed);
    r.next3.store(0, std::memory_order_relaxed);
    return true;
}

void fill_stats(const run_t & r, bool empty, ost_ffn_stats * st) {
    if (!st) return;
    *st = ost_ffn_stats{};
    if (empty) return;
    st->experts = (int64_t) r.groups.size();
    st->routes = r.n_routes;
    st->tiled_experts = std::count_if(r.groups.begin(), r.groups.end(), [](const group_t & g) { return g.gu_tiled || g.down_tiled; });
    st->bytes = (int64_t) r.groups.size() * r.f->expert_bytes;
}

// Where a timed run's time went (ost_ffn_stats' phase fields): each phase from its start (thread 0's
// start, or the first thread to leave the barrier before it: the barrier's release, whichever thread
// the scheduler runs first) to the last thread's arrival at its barrier.
void fill_timing(const run_t & r, int64_t t0, int64_t t_end, ost_ffn_stats * st) {
    if (!st || !r.timing) return;
    const int nth = r.nth;
    st->prepare_ns = r.t_launch - t0;
    st->total_ns = t_end - t0;
    int64_t wake = 0;
    for (int i = 1; i < nth; ++i) wake += r.t_start[(size_t) i] - r.t_launch;
    st->wake_ns = nth > 1 ? wake / (nth - 1) : 0;
    st->threads = nth;
    int64_t begin = r.t_start[0], idle = 0;
    int64_t * span[PH_N] = { &st->quant_ns, &st->gate_up_ns, &st->act_ns, &st->down_ns };
    for (int ph = r.xq_done ? PH_GATE_UP : PH_QUANT; ph < PH_N; ++ph) {
        const int64_t * a = r.t_arrive.data() + (size_t) ph * nth;
        const int64_t last = *std::max_element(a, a + nth);
        *span[ph] = last - begin;
        int64_t w = 0;
        for (int i = 0; i < nth; ++i) w += last - a[i];
        idle += w / nth;
        if (ph < PH_DOWN) {
            const int64_t * l = r.t_leave.data() + (size_t) ph * nth;
            begin = *std::min_element(l, l + nth);
        }
    }
    st->idle_ns = idle;
}

// ---------------------------------------------------------------------------------------------
// the work board: a run's items taken by claims, without barriers
//
// With barriers (run_phases on ost_team_run) every phase of a run waits for every thread of the team:
// one thread that the scheduler has taken off its core (it yielded while another thread was
// runnable there: the thread that launches the CUDA graph and waits for it, the HTTP server, an
// interrupt) holds the whole layer until it runs again, up to a time slice. On the board a run's
// phases are lists of items (tokens to quantise, chunks of gate/up rows, routes' activations, chunks
// of down rows) that whichever threads are on a core claim one at a time; the thread that completes
// a phase's last item opens the next phase, the one that completes the last down chunk ends the
// run. A thread that is not running holds nothing (at most the one item it claimed), so the
// layer's time is its work over the threads that are there.
//
// One word says what can be claimed: (epoch, next item), epoch = run * 8 + phase, phase 7 = closed.
// A claim is a compare-and-swap of that word, so it succeeds only while the epoch it read is still
// open; the run's state (run_t, the totals) is written only while the word is closed and read only
// by a thread holding a claim of its epoch (until that item is counted done, which the run's end
// waits for). A late thread whose claim fails touches nothing.

constexpr int PH_CLOSED = 7;
constexpr int ITEM_BITS = 24;
constexpr uint64_t ITEM_MASK = (uint64_t(1) << ITEM_BITS) - 1;

inline uint64_t board_word(uint64_t epoch, uint64_t item) { return epoch << ITEM_BITS | item; }

std::atomic<bool> g_claims{true};   // the board (ost_ffn_set_claims); false: run_phases with barriers

}  // namespace

struct ost_board {
    run_t r;
    alignas(64) std::atomic<uint64_t> claim{board_word(PH_CLOSED, 0)};
    alignas(64) std::atomic<uint64_t> finished{0};   // the last run whose items are all done
    std::atomic<int64_t> total[PH_N] = {};
    struct alignas(64) counter { std::atomic<int64_t> v{0}; };
    counter done[PH_N];
    // phase timing: when each phase opened and closed, when each thread first took an item
    std::atomic<int64_t> t_open[PH_N] = {}, t_close[PH_N] = {};
    uint64_t run = 0;   // the worker's count of runs
    ost_team * team = nullptr;
};

namespace {

bool board_open(const ost_board * b) {
    const uint64_t c = b->claim.load(std::memory_order_acquire);
    const int ph = (int) ((c >> ITEM_BITS) & 7);
    return ph < PH_N && (int64_t) (c & ITEM_MASK) < b->total[ph].load(std::memory_order_relaxed);
}

// Opens a phase (stores the word); threads of an inactive team sleep on its condition variable, so
// they are woken (under its mutex: none of them misses the word between its check and its wait).
void board_publish(ost_board * b, uint64_t word) {
    ost_team * t = b->team;
    if (t->active.load(std::memory_order_relaxed)) {
        b->claim.store(word, std::memory_order_release);
        return;
    }
    {
        std::lock_guard<std::mutex> lk(t->m);
        b->claim.store(word, std::memory_order_release);
    }
    t->cv.notify_all();
}

// Takes the next item of the open phase: false when there is none (the phase's items are all taken,
// or the board is closed).
bool board_claim(ost_board * b, uint64_t & epoch, int64_t & item) {
    uint64_t c = b->claim.load(std::memory_order_acquire);
    for (;;) {
        const int ph = (int) ((c >> ITEM_BITS) & 7);
        // a total read after the word changed is another run's: the exchange below then fails
        if (ph >= PH_N || (int64_t) (c & ITEM_MASK) >= b->total[ph].load(std::memory_order_relaxed)) return false;
        if (b->claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
            epoch = c >> ITEM_BITS;
            item = (int64_t) (c & ITEM_MASK);
            return true;
        }
    }
}

void board_work(ost_board * b, int ith) {
    uint64_t epoch = 0;
    int64_t item = 0;
    while (board_claim(b, epoch, item)) {
        run_t & r = b->r;   // this run's state until the item is counted done
        const int ph = (int) (epoch & 7);
        if (r.timing && r.t_start[(size_t) ith] == 0) r.t_start[(size_t) ith] = now_ns();
        switch (ph) {
            case PH_QUANT:   quant_item(r, (int32_t) item); break;
            case PH_GATE_UP: rows_item(r, item, false); break;
            case PH_ACT:     act_item(r, (size_t) item); break;
            default:         rows_item(r, item, true); break;
        }
        const int64_t total = b->total[ph].load(std::memory_order_relaxed);
        if (b->done[ph].v.fetch_add(1, std::memory_order_acq_rel) + 1 != total) continue;
        // the phase's last item: open the next phase (they follow in order; only the first may be
        // empty), or end the run
        if (r.timing) b->t_close[ph].store(now_ns(), std::memory_order_relaxed);
        if (ph == PH_DOWN) {
            b->finished.store(epoch >> 3, std::memory_order_release);
        } else {
            if (r.timing) b->t_open[ph + 1].store(now_ns(), std::memory_order_relaxed);
            board_publish(b, board_word(epoch + 1, 0));
        }
    }
}

void board_free(ost_board * b) { delete b; }

// The run prepared in b->r on the board of b->team: the caller (thread 0) publishes it, works on it, and waits
// until its last item is done. False (the caller runs the barrier path) for a run of more items per
// phase than the word holds.
bool board_run(ost_board * b) {
    run_t & r = b->r;
    const int64_t totals[PH_N] = { r.xq_done ? 0 : (int64_t) r.job->n, phase_chunks(r, false),
                                   (int64_t) r.routes.size(), phase_chunks(r, true) };
    for (int64_t x : totals) if (x > (int64_t) ITEM_MASK) return false;
    const uint64_t run = ++b->run;
    for (int ph = 0; ph < PH_N; ++ph) {
        b->total[ph].store(totals[ph], std::memory_order_relaxed);
        b->done[ph].v.store(0, std::memory_order_relaxed);
    }
    const int first = r.xq_done ? PH_GATE_UP : PH_QUANT;
    if (r.timing) {
        for (int ph = 0; ph < PH_N; ++ph) { b->t_open[ph] = 0; b->t_close[ph] = 0; }
        b->t_open[first] = r.t_launch;
    }
    board_publish(b, board_word(run * 8 + first, 0));
    for (int i = 0; b->finished.load(std::memory_order_acquire) != run; ++i) {
        if (board_open(b)) { board_work(b, 0); i = 0; continue; }
        if (i < g_spins.load(std::memory_order_relaxed)) OST_PAUSE();
        else std::this_thread::yield();
    }
    // closed before the next run's state is written: a claim of this run read earlier now fails
    b->claim.exchange(board_word(run * 8 + PH_CLOSED, 0), std::memory_order_acq_rel);
    return true;
}

// A board run's phase timing in ost_ffn_stats' fields: each phase from its opening to the completion
// of its last item, the handoffs between phases as idle, the team's start as the mean delay to the
// first item of the other threads that took one.
void fill_board_timing(const ost_board * b, int64_t t0, int64_t t_end, ost_ffn_stats * st) {
    const run_t & r = b->r;
    if (!st || !r.timing) return;
    st->prepare_ns = r.t_launch - t0;
    st->total_ns = t_end - t0;
    int64_t wake = 0;
    int took = 0;
    for (int i = 1; i < r.nth; ++i) {
        if (!r.t_start[(size_t) i]) continue;
        wake += r.t_start[(size_t) i] - r.t_launch;
        took++;
    }
    st->wake_ns = took ? wake / took : 0;
    st->threads = took + 1;
    int64_t * span[PH_N] = { &st->quant_ns, &st->gate_up_ns, &st->act_ns, &st->down_ns };
    int64_t idle = 0;
    for (int ph = r.xq_done ? PH_GATE_UP : PH_QUANT; ph < PH_N; ++ph) {
        *span[ph] = b->t_close[ph] - b->t_open[ph];
        if (ph + 1 < PH_N) idle += b->t_open[ph + 1] - b->t_close[ph];
    }
    st->idle_ns = idle;
}

}  // namespace

bool ost_ffn_run(ost_team * team, const ost_ffn_job & job, std::vector<uint8_t> & ws, ost_ffn_stats * st) {
    static thread_local run_t own;
    const int64_t t0 = g_phase_timing.load(std::memory_order_relaxed) ? now_ns() : 0;
    const int nth = ost_team_size(team);
    // a team's runs go on its board (made here, by its one caller) unless barriers are asked for
    ost_board * b = nullptr;
    if (nth > 1 && g_claims.load(std::memory_order_relaxed)) {
        b = team->board.load(std::memory_order_relaxed);
        if (!b) {
            b = new ost_board();
            b->team = team;
            team->board.store(b, std::memory_order_release);
        }
    }
    run_t & r = b ? b->r : own;
    bool empty = false;
    r.timing = false;
    if (!prepare(r, job, ws, nth, &empty)) return false;
    bool on_board = false;
    if (!empty) {
        r.nth = nth;
        r.timing = t0 != 0;
        if (r.timing) {
            r.t_start.assign((size_t) r.nth, 0);
            r.t_arrive.assign((size_t) PH_N * r.nth, 0);
            r.t_leave.assign((size_t) PH_N * r.nth, 0);
            r.t_launch = now_ns();
        }
        // (the barrier path below, where the board refuses the run, writes the same zeros again)
        if (b && job.zero_unrouted) zero_unrouted_rows(job, 0, 1);
        on_board = b && board_run(b);
        if (!on_board) {
            team_ctx c{ &r, team };
            ost_team_run(team, team_fn, &c);
        }
    } else if (job.zero_unrouted) {
        zero_unrouted_rows(job, 0, 1);
    }
    fill_stats(r, empty, st);
    if (!empty) {
        const int64_t t_end = r.timing ? now_ns() : 0;
        if (on_board) fill_board_timing(b, t0, t_end, st);
        else fill_timing(r, t0, t_end, st);
    }
    return true;
}

bool ost_ffn_set_claims(bool on) { return g_claims.exchange(on); }
int ost_ffn_set_prefetch_rows(int rows) { return g_prefetch_rows.exchange(std::max(0, rows)); }
bool ost_ffn_set_phase_timing(bool on) { return g_phase_timing.exchange(on); }
int ost_ffn_set_spins(int spins) { return g_spins.exchange(std::max(0, spins)); }
int ost_ffn_spins() { return g_spins.load(); }
bool ost_ffn_claims() { return g_claims.load(); }
int ost_ffn_prefetch_rows() { return g_prefetch_rows.load(); }

int32_t ost_ffn_tiled_rows(ggml_type up, ggml_type gate, ggml_type down) {
    // a type ost_gemm_rows serves is computed as ggml's tiled kernel computes it, from any count
    int32_t cap = INT32_MAX;
    for (ggml_type t : {up, gate, down}) {
        if (!ost_gemm_serves(t)) cap = std::min(cap, tiled_rows_of(t));
    }
    return cap;
}
