// The CPU branch's kernel: one run's work (grouping, scratch, row chunks, activations, phases, stats).
#include "cpu_branch/run.h"
#include "cpu_branch/dot.h"
#include "cpu_branch/gemm.h"
#include "cpu_branch/mxfp4.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace ost_kernel {

namespace {

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

}  // namespace

// Routes of one expert from which ggml-cpu computes a tensor of type t with its tiled kernel
// (INT32_MAX: never; GGML_CPU_TILED_MM=0 turns that kernel off)
int32_t tiled_rows_of(ggml_type t) {
    const char * off = getenv("GGML_CPU_TILED_MM");
    if ((off && atoi(off) == 0) || !tiled_type(t)) return INT32_MAX;
    return tiled_min_rows();
}

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

namespace {

// Rows of about this many bytes make a chunk: a few microseconds of a thread's work, so that taking
// a chunk (one contended atomic add) costs little beside it.
constexpr int64_t CHUNK_BYTES = 16 * 1024;
// Blocks (256 values) of one token tile per pack item at most: 16 KiB of a pack
constexpr int PACK_BLOCKS = 4;
constexpr int64_t MXFP4_CHUNK_BYTES = 64 * 1024;

}  // namespace

std::atomic<int> g_prefetch_rows{0};

namespace {

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
    if (w->type == GGML_TYPE_MXFP4 && g.nr >= ost_mxfp4_min_tokens() && ost_mxfp4_serves()) {
        // every route of the group at once, each (row, token) bitwise ggml's vec_dot (cpu_branch/mxfp4.h)
        thread_local std::vector<float *> mo;
        thread_local std::vector<const void *> my;
        mo.resize((size_t) g.nr);
        my.resize((size_t) g.nr);
        for (int32_t q = g.r0; q < g.r0 + g.nr; ++q) {
            const route_t & rt = r.routes[(size_t) q];
            mo[(size_t) (q - g.r0)] = down ? r.job->out + ((int64_t) rt.t * r.job->k + rt.j) * f.n_embd + row0
                                           : r.gu + (size_t) q * 2 * f.n_ff + row0;
            my[(size_t) (q - g.r0)] = down ? (const void *) (r.actq + (size_t) q * r.actq_row)
                                           : (const void *) (r.xq + (size_t) r.tok_slot[(size_t) rt.t] * r.xq_row);
        }
        if (ost_mxfp4_rows((int) (down ? f.n_ff : f.n_embd), w0, w->nb[1], (int) (row1 - row0), my.data(), g.nr, mo.data())) return;
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

}  // namespace

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

namespace {

void phase_rows(run_t & r, bool down) {
    const int64_t total = phase_chunks(r, down);
    std::atomic<int64_t> & next = down ? r.next3 : r.next1;
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < total;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
        rows_item(r, c, down);
    }
}

}  // namespace

// Rows of routes the job does not compute are exact zeros (the op's output is added as x + 0):
// thread ith of nth writes every nth of them.
void zero_unrouted_rows(const ost_ffn_job & job, int ith, int nth) {
    const int64_t n_embd = job.f->n_embd, n_expert = job.f->n_expert;
    for (int64_t i = ith; i < (int64_t) job.n * job.k; i += nth) {
        const int32_t e = job.ids[i];
        if (e < 0 || e >= n_expert) memset(job.out + i * n_embd, 0, (size_t) n_embd * sizeof(float));
    }
}

namespace {

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

}  // namespace

// Token t's input row quantised once, as ggml's MUL_MAT_ID does (per src1 row, same from_float); the
// packs of its tiled groups are written afterwards, by pack items.
void quant_item(run_t & r, int32_t t) {
    if (r.tok_slot[(size_t) t] < 0) return;
    ggml_get_type_traits_cpu(r.xt)->from_float(r.job->cur + (int64_t) t * r.job->cur_stride,
                                               (void *) (r.xq + (size_t) r.tok_slot[(size_t) t] * r.xq_row), r.f->n_embd);
}

// Pack item i of the gate/up packs (!down: from the input rows) or the down packs (the activations).
void pack_item(run_t & r, size_t i, bool down) {
    const run_t::pack_item_t & it = (down ? r.pack3 : r.pack1)[i];
    const group_t & g = r.groups[(size_t) it.g];
    const int32_t q0 = g.r0 + 16 * it.tt, nt = std::min<int32_t>(16, g.nr - 16 * it.tt);
    const void * rows[16];
    for (int32_t n = 0; n < nt; ++n) {
        const int32_t q = q0 + n;
        rows[n] = down ? (const void *) (r.actq + (size_t) q * r.actq_row)
                       : (const void *) (r.xq + (size_t) r.tok_slot[(size_t) r.routes[(size_t) q].t] * r.xq_row);
    }
    ost_gemm_pack_tile(r.base + (down ? g.down_pack : g.gu_pack), (int) (down ? r.f->n_ff : r.f->n_embd), g.nr,
                       it.tt, it.sb0, it.sb1, rows);
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
}

int64_t phase_items(const run_t & r, int ph) {
    switch (ph) {
        case PH_QUANT:   return r.xq_done ? 0 : (int64_t) r.job->n;
        case PH_PACK1:   return r.xq_done ? 0 : (int64_t) r.pack1.size();
        case PH_GATE_UP: return phase_chunks(r, false);
        case PH_ACT:     return (int64_t) r.routes.size();
        case PH_PACK3:   return (int64_t) r.pack3.size();
        default:         return phase_chunks(r, true);
    }
}

void run_item(run_t & r, int ph, int64_t item) {
    switch (ph) {
        case PH_QUANT:   quant_item(r, (int32_t) item); break;
        case PH_PACK1:   pack_item(r, (size_t) item, false); break;
        case PH_GATE_UP: rows_item(r, item, false); break;
        case PH_ACT:     act_item(r, (size_t) item); break;
        case PH_PACK3:   pack_item(r, (size_t) item, true); break;
        default:         rows_item(r, item, true); break;
    }
}

namespace {

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
        if (!r.pack1.empty()) {
            for (size_t i = (size_t) ith; i < r.pack1.size(); i += (size_t) nth) pack_item(r, i, false);
            barrier(PH_PACK1);
        }
    }
    phase_rows(r, false);
    barrier(PH_GATE_UP);
    for (size_t q = (size_t) ith; q < r.routes.size(); q += (size_t) nth) act_item(r, q);
    barrier(PH_ACT);
    if (!r.pack3.empty()) {
        for (size_t i = (size_t) ith; i < r.pack3.size(); i += (size_t) nth) pack_item(r, i, true);
        barrier(PH_PACK3);
    }
    phase_rows(r, true);
    // the run's last barrier is the caller's (ost_team_run's, or the shared state's)
    if (timing) r.t_arrive[(size_t) PH_DOWN * nth + ith] = now_ns();
}

}  // namespace

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
    int32_t n_tok = 0;
    for (int32_t t = 0; t < job.n; ++t) {
        for (int32_t j = 0; j < job.k; ++j) {
            const int32_t e = job.ids[(int64_t) t * job.k + j];
            if (e < 0 || e >= f.n_expert) continue;
            const int32_t q = r.start[(size_t) e]++;
            r.routes[(size_t) q] = route_t{ t, j };
            if (r.tok_slot[(size_t) t] < 0) r.tok_slot[(size_t) t] = n_tok++;
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
    // the packs' items: each (group, token tile) in ranges of at most PACK_BLOCKS blocks
    r.pack1.clear();
    r.pack3.clear();
    if (r.any_tiled) {
        auto items = [](std::vector<run_t::pack_item_t> & v, int32_t gi, int32_t nr, int64_t K) {
            const int nsb = (int) (K / 256), nrange = (nsb + PACK_BLOCKS - 1) / PACK_BLOCKS, per = (nsb + nrange - 1) / nrange;
            for (int tt = 0; tt < (nr + 15) / 16; ++tt)
                for (int sb = 0; sb < nsb; sb += per)
                    v.push_back({ gi, (int16_t) tt, (int16_t) sb, (int16_t) std::min(nsb, sb + per) });
        };
        for (size_t gi = 0; gi < r.groups.size(); ++gi) {
            const group_t & g = r.groups[gi];
            if (g.gu_tiled) items(r.pack1, (int32_t) gi, g.nr, f.n_embd);
            if (g.down_tiled) items(r.pack3, (int32_t) gi, g.nr, f.n_ff);
        }
    }
    // one token (a decode step) is quantised here; more are spread over the threads
    r.xq_done = n_tok == 1 || nth == 1;
    if (r.xq_done) {
        const auto from_float = ggml_get_type_traits_cpu(r.xt)->from_float;
        for (int32_t t = 0; t < job.n; ++t) {
            if (r.tok_slot[(size_t) t] < 0) continue;
            from_float(job.cur + (int64_t) t * job.cur_stride,
                       (void *) (r.xq + (size_t) r.tok_slot[(size_t) t] * r.xq_row), f.n_embd);
        }
        for (size_t i = 0; i < r.pack1.size(); ++i) pack_item(r, i, false);
    }
    // chunks of about CHUNK_BYTES of weight rows (gate/up rows are n_embd long, down rows n_ff)
    const ggml_tensor * gw = f.merged ? f.up : f.gate;
    // an even number of rows: the row-pair dot products pair a chunk's rows
    r.chunk1 = std::max<int64_t>(2, (CHUNK_BYTES / (int64_t) gw->nb[1]) & ~(int64_t) 1);
    r.chunk3 = std::max<int64_t>(2, (CHUNK_BYTES / (int64_t) f.down->nb[1]) & ~(int64_t) 1);
    // MXFP4 groups of several routes (cpu_branch/mxfp4.h) prepare each token's sums per chunk: chunks
    // of about MXFP4_CHUNK_BYTES keep that small beside the rows' work
    const bool mx_gu = gw->type == GGML_TYPE_MXFP4, mx_dn = f.down->type == GGML_TYPE_MXFP4;
    if ((mx_gu || mx_dn) && ost_mxfp4_serves() &&
        std::any_of(r.groups.begin(), r.groups.end(), [](const group_t & g) { return g.nr >= ost_mxfp4_min_tokens(); })) {
        if (mx_gu) r.chunk1 = std::max<int64_t>(r.chunk1, (MXFP4_CHUNK_BYTES / (int64_t) gw->nb[1]) & ~(int64_t) 1);
        if (mx_dn) r.chunk3 = std::max<int64_t>(r.chunk3, (MXFP4_CHUNK_BYTES / (int64_t) f.down->nb[1]) & ~(int64_t) 1);
    }
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
// The stats field phase ph's time goes to (a pack phase's to the phase whose rows it packs)
int64_t * phase_stat(ost_ffn_stats * st, int ph) {
    switch (ph) {
        case PH_QUANT: case PH_PACK1: return &st->quant_ns;
        case PH_GATE_UP:              return &st->gate_up_ns;
        case PH_ACT: case PH_PACK3:   return &st->act_ns;
        default:                      return &st->down_ns;
    }
}

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
    for (int ph = 0; ph < PH_N; ++ph) {
        if (phase_items(r, ph) == 0 && ph != PH_DOWN) continue;   // not run (no barrier)
        const int64_t * a = r.t_arrive.data() + (size_t) ph * nth;
        const int64_t last = *std::max_element(a, a + nth);
        *phase_stat(st, ph) += last - begin;
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

}  // namespace ost_kernel
