// Ostinato native expert engine (see ostinato.h). Paper: arXiv 2611.11533, Sections 2-3.
//
// At model load (ostinato_on_model_loaded, called by the patched loader) the hot experts named by the
// configured residency set are copied into one expert pool per device, one set of pool tensors
// [.., .., n_slots + k] per size class (same types and shapes of up/gate/down), the last k slots
// all-zero (zero slots). Per MoE layer an index table maps each expert to its pool slot (hot) or to
// the CPU (cold). The route op applies it after the router: GPU-branch ids (hot -> slot, cold -> a
// zero slot) and CPU-branch ids (cold -> expert, hot -> -1, skipped). The patched build_moe_ffn runs
// both branches over the same selected experts and sums them, which is exact because every position
// is computed by exactly one branch and is exactly zero in the other.
//
// Scheduling (ggml_backend_sched runs splits in graph order, a GPU split asynchronously): the route
// op's split brings the ids and the hidden states to the host; then the GPU branch is launched and
// the CPU branch, whose inputs are all on the host already, runs while it computes (decode overlap);
// the sum waits for both. The only GPU syncs per layer are the route op's and the sum's.
//
// This file: the engine's globals, the hooks called by the patched llama.cpp and the C API (its options:
// ostinato_experts_reconfigure).
// The pool is built in expert_pool/pool.cpp, the CPU ops of the split/upload paths and the route counts
// are in paths/split_upload_ops.cpp, the info/stats JSON in engine/stats.cpp, the decode graph in
// decode_graph/decode_graph.cpp (shared state: engine/engine.h).

#include "engine/engine.h"
#include "cpu_branch/kernel.h"
#include "cpu_branch/dot.h"
#include "paths/hybrid_split.h"

#include <condition_variable>
#include <memory>
#include <thread>

using namespace ost;

namespace ost {

std::mutex g_mu;
pinned_t g_pin;
// the placement of the model load running on this thread (ostinato_model_load), else null: the
// config travels with the load call, as tensor_buft_overrides do, not through a global
thread_local const config_t * t_load_cfg = nullptr;
// the options of that load (ostinato_model_load), likewise
thread_local const ostinato_engine_options * t_load_opts = nullptr;
engine_t * g_eng = nullptr;
std::string g_err;
bool g_graph_dirty = false;   // set by a residency switch: cached graphs reference the old pool
bool g_dgraph_broken = false; // a pass lost a wait: decode graph off until the next model load

int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

void free_engine(engine_t * e) {
    if (!e) return;
    ost_dg_free(e->dg);
    for (auto & p : e->pools) {
        // copies still in flight (a pass that failed before its upload op) land before the pool goes
        if (p.prefetch_backend) ggml_backend_synchronize(p.prefetch_backend);
        if (p.upload_backend) ggml_backend_free(p.upload_backend);
        for (auto ev : p.pf_event) if (ev) ggml_backend_event_free(ev);
        if (p.prefetch_backend) ggml_backend_free(p.prefetch_backend);
        if (p.buf) ggml_backend_buffer_free(p.buf);
        if (p.ctx) ggml_free(p.ctx);
        if (p.resident_ctx) ggml_free(p.resident_ctx);
    }
    delete e;
}


}  // namespace ost


// ---------------------------------------------------------------------------------------------
// hooks called by the patched llama.cpp

const ostinato_moe_layer * ostinato_moe_lookup(const ggml_tensor * down_exps) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng || !down_exps) return nullptr;
    auto it = g_eng->by_down.find(down_exps);
    if (it == g_eng->by_down.end()) return nullptr;
    return &g_eng->layers[it->second];
}

ggml_tensor * ostinato_moe_route(ggml_context * ctx, ggml_tensor * selected_experts, ggml_tensor * cur, int il,
                                 bool views, ggml_tensor * pred, ggml_tensor * pred2) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (g_eng) g_eng->built[ctx].n_host++;   // a host op in this graph (ctx is the graph's context)
    }
    ggml_tensor * args[4] = { selected_experts, nullptr, nullptr, nullptr };
    int n_args = 1;
    if (cur) args[n_args++] = cur;
    if (pred) args[n_args++] = pred;
    if (pred2) args[n_args++] = pred2;
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, selected_experts->ne[0], selected_experts->ne[1], 2, 1,
                                     args, n_args, route_op, 1, (void *) (intptr_t) op_ud(il, views));
    ggml_format_name(t, "ostinato_route-%d", il);
    return t;
}

ggml_tensor * ostinato_moe_mark(ggml_context * ctx, ggml_tensor * after, int il, int kind) {
    // a GPU-resident branch output is read through a one-element view (a 4-byte copy); outputs that
    // cannot be viewed that way are left untimed
    ggml_tensor * src = after;
    if (kind != 2) {
        if (after->view_src != nullptr || !ggml_is_contiguous(after) || ggml_nelements(after) == 0) {
            return after;
        }
        src = ggml_view_1d(ctx, after, 1, 0);
    }
    ggml_tensor * args[1] = { src };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, 1, mark_op, 1,
                          (void *) (intptr_t) ((il << 2) | (kind & 3)));
}

int ostinato_moe_hybrid(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return hybrid_on(opts_of(g_eng)) ? 1 : 0;
}

namespace {

// One per layer, for the life of the process: the CPU share's matched FFN (the model's tensors,
// rewritten at every graph build) and the number of its job on the share runner
struct cpu_share_t {
    ost_ffn f;
    uint64_t seq = 0;
    const ggml_tensor * launch = nullptr;   // its launch op in the graph built last
};
std::vector<std::unique_ptr<cpu_share_t>> g_cpu_share;   // [layer], guarded by g_mu

// The hybrid pass's CPU share beside the graph. A layer's launch op hands its job to the runner
// thread (thread 0 of a kernel team of its own) and returns: the main thread goes on with the graph
// (the join of the layer's copies, the prefetch ops that start the next layers' copies, the staged
// routes on the GPU) while the team computes. The wait op, placed after the staged routes, blocks
// only while the share still runs, and its output (the share's gather indices) feeds the add of the
// share's rows on the GPU, so the scheduler copies those rows there only after it. Layers run one
// after the other: one job at a time. (Computed on the main thread, as before, the share stopped
// the graph: no later layer's copies were issued while it ran; docs/engine.md.)
struct share_runner {
    std::mutex m;
    std::condition_variable cv;
    std::thread th;
    ost_team * team = nullptr;
    std::vector<uint8_t> ws;
    ost_ffn_job job;                 // the job posted last
    uint64_t posted = 0, taken = 0;  // jobs posted by launch ops, taken by the runner
    uint64_t done = 0;               // the last job finished
    ost_ffn_stats st;                // its stats
    int64_t t_start_us = 0, t_end_us = 0;   // its run on the team
};
share_runner * g_share = nullptr;   // made at the first launch; lives as long as the process

void share_main(share_runner * s) {
    std::unique_lock<std::mutex> lk(s->m);
    for (;;) {
        s->cv.wait(lk, [&] { return s->posted != s->taken; });
        const uint64_t seq = s->taken = s->posted;
        const ost_ffn_job job = s->job;
        lk.unlock();
        const int64_t t0 = now_us();
        ost_ffn_stats st;
        ost_ffn_run(s->team, job, s->ws, &st);   // job.force: it always computes
        const int64_t t1 = now_us();
        lk.lock();
        s->st = st;
        s->t_start_us = t0;
        s->t_end_us = t1;
        s->done = seq;
        s->cv.notify_all();
    }
}

share_runner * share_runner_get() {
    static std::once_flag once;
    std::call_once(once, [] {
        auto * s = new share_runner();
        // the decode graph's CPU-branch threads (every core but one by default): a prefill's CPU
        // share and a decode step's CPU branch never run at once
        const int n_opt = g_eng ? g_eng->opts.cpu_threads : 0;   // a pass is running: the engine is there
        int nt = n_opt > 0 ? n_opt : (int) std::thread::hardware_concurrency() - 1;
        s->team = ost_team_new(std::max(1, nt));
        s->th = std::thread(share_main, s);
        s->th.detach();
        g_share = s;
    });
    return g_share;
}

// Launch op (CPU, n_tasks = 1). Sources: cur [n_embd, 1, M], ids [k, M], then the weights (so that
// the scheduler orders and places the op). Its output [n_embd, k, M] is written by the runner after
// the op returns; the wait op reads it, and keeps the sources alive until the job is done.
void share_launch_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    auto * cs = (cpu_share_t *) ud;
    const ggml_tensor * cur = dst->src[0];
    const ggml_tensor * ids = dst->src[1];
    ost_ffn_job job;
    job.f = &cs->f;
    job.ids = (const int32_t *) ids->data;
    job.k = (int) ids->ne[0];
    job.n = (int) ids->ne[1];
    job.cur = (const float *) cur->data;
    job.cur_stride = (int64_t) (cur->nb[2] / sizeof(float));
    job.out = (float *) dst->data;
    job.zero_unrouted = true;
    // the upload op leaves to the uploads any expert whose arithmetic the kernel cannot match
    // (cpu_route_cap): what the kernel computes here is ggml's
    job.force = true;
    share_runner * s = share_runner_get();
    {
        std::lock_guard<std::mutex> lk(s->m);
        s->job = job;
        cs->seq = ++s->posted;
    }
    s->cv.notify_all();
}

// Wait op (CPU, n_tasks = 1). Sources: the launch op's output, the share's gather indices [M]
// (copied to the output), then the job's inputs (cur rows, ids: alive until here). Waits for the
// layer's job, counts it into the pass.
void share_wait_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    auto * cs = (cpu_share_t *) ud;
    share_runner * s = share_runner_get();
    const int64_t t0 = now_us();
    ost_ffn_stats st;
    int64_t ms_run = 0;
    {
        std::unique_lock<std::mutex> lk(s->m);
        s->cv.wait(lk, [&] { return s->done >= cs->seq; });
        st = s->st;
        ms_run = s->t_end_us - s->t_start_us;
    }
    const int64_t t1 = now_us();
    std::memcpy(dst->data, dst->src[1]->data, ggml_nbytes(dst));
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || !e->in_pass || st.experts == 0) return;
    e->cur.cpu_bytes += st.bytes;
    e->cur.cpu_layers++;
    e->cur.cpu_kernel_layers++;
    e->cur.cpu_ms += ms_run / 1000.0;
    e->cur.cpu_wait_ms += (t1 - t0) / 1000.0;
    if (e->opts.upload_cpu_share < 0 && t1 - t0 > ADAPT_WAITED_US) {   // the CPU was the longer part
        e->upload_cpu_share = std::max(0.0, e->upload_cpu_share - ADAPT_STEP);
    }
}

}  // namespace

ggml_tensor * ostinato_moe_cpu_share(ggml_context * ctx, ggml_tensor * out, ggml_tensor * ids, ggml_tensor * cur, int il) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng || !g_eng->opts.cpu_branch_kernel || il < 0) return out;
    ost_ffn f;
    std::string why;
    if (!ost_ffn_match(out, ids, cur, f, why)) return out;
    if ((int) g_cpu_share.size() <= il) g_cpu_share.resize((size_t) il + 1);
    auto & cs = g_cpu_share[(size_t) il];
    if (!cs) cs = std::make_unique<cpu_share_t>();
    cs->f = f;
    ggml_tensor * args[5] = { cur, ids, const_cast<ggml_tensor *>(f.down), const_cast<ggml_tensor *>(f.up),
                              const_cast<ggml_tensor *>(f.gate) };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_F32, out->ne[0], out->ne[1], out->ne[2], out->ne[3], args,
                                     f.gate ? 5 : 4, share_launch_op, 1, cs.get());
    ggml_format_name(t, "ostinato_cpu_share-%d", il);
    cs->launch = t;
    return t;
}

ggml_tensor * ostinato_moe_cpu_wait(ggml_context * ctx, ggml_tensor * out, ggml_tensor * gather, ggml_tensor * ids,
                                    ggml_tensor * cur, int il) {
    std::lock_guard<std::mutex> lock(g_mu);
    cpu_share_t * cs = il >= 0 && il < (int) g_cpu_share.size() ? g_cpu_share[(size_t) il].get() : nullptr;
    if (!cs || cs->launch != out) return gather;   // computed by ggml's graph: nothing runs beside it
    ggml_tensor * args[4] = { out, gather, cur, ids };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, gather->ne[0], 1, 1, 1, args, 4, share_wait_op, 1, cs);
    ggml_format_name(t, "ostinato_cpu_wait-%d", il);
    return t;
}

namespace {

// How a prediction scores a logit of a model with this gating function (ostinato_pred_score).
int pred_gating(uint32_t gating_func) {
    switch (gating_func) {
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID: return OSTINATO_PRED_SIGMOID;
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS: return OSTINATO_PRED_SQRT_SOFTPLUS;
        default: return OSTINATO_PRED_LOGIT;   // softmax keeps the logits' order
    }
}

// Layer il routes by token id (deepseek4's first layers: ffn_gate_tid2eid): no router to predict its
// routes with, for either prefetch.
bool routes_by_token(const engine_t * e, int il) {
    return e->model->layers[il].ffn_gate_tid2eid != nullptr;
}

// Layer il takes the all-resident path (see ostinato_moe_resident). Caller holds g_mu.
bool resident_layer(const engine_t * e, int il) {
    if (!e || !e->opts.resident_path || il < 0 || il >= e->n_layer) return false;
    const auto & l = e->layers[il];
    const int pi = e->layer_pool[il];
    return l.has_hot && l.n_hot == e->n_expert && l.resident[2] && pi >= 0 && e->pools[pi].counts;
}

}  // namespace

ggml_tensor * ostinato_moe_prefetch_scores(ggml_context * ctx, ggml_tensor * logits, int il_next) {
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || il_next < 0 || il_next >= (int) e->model->layers.size()) return logits;
    const auto & L = e->model->layers[il_next];
    if (L.ffn_gate_inp_b) logits = ggml_add(ctx, logits, L.ffn_gate_inp_b);
    if (!L.ffn_exp_probs_b) return logits;
    switch (pred_gating(e->model->hparams.expert_gating_func)) {
        case OSTINATO_PRED_SIGMOID: logits = ggml_sigmoid(ctx, logits); break;
        case OSTINATO_PRED_SQRT_SOFTPLUS: logits = ggml_sqrt(ctx, ggml_softplus(ctx, logits)); break;
        default: break;
    }
    return ggml_add(ctx, logits, L.ffn_exp_probs_b);
}

ggml_tensor * ostinato_moe_prefetch_gate(int il, int64_t n_tokens, int dist, int * il_next) {
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    const int nx = il + dist;
    // the last trunk layer may see only the output rows (no views): no prefetch for it (layers past
    // the trunk, e.g. MTP layers, are not in the forward pass)
    if (!e || dist < 1 || dist > e->prefetch || !e->opts.pool_views || il < 0 || nx >= (int) e->model->hparams.n_layer() - 1 ||
        n_tokens < OSTINATO_VIEW_MIN_TOKENS) {
        return nullptr;
    }
    const auto & l = e->layers[nx];
    ggml_tensor * gate = e->model->layers[nx].ffn_gate_inp;
    // an all-resident layer has nothing cold to fetch
    if (!l.has_hot || !l.views || !gate || e->layer_pool[nx] != e->layer_pool[il] || gate->ne[1] != e->n_expert ||
        resident_layer(e, nx) || routes_by_token(e, nx)) {
        return nullptr;
    }
    *il_next = nx;
    return gate;
}

ggml_tensor * ostinato_moe_prefetch(ggml_context * ctx, ggml_tensor * pred, ggml_tensor * after, int il_next) {
    ggml_tensor * args[2] = { pred, after };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, 1, 1, 1, 1, args, 2, prefetch_op, 1,
                                     (void *) (intptr_t) op_ud(il_next, true));
    ggml_format_name(t, "ostinato_prefetch-%d", il_next);
    return t;
}

ggml_tensor * ostinato_moe_upload(ggml_context * ctx, ggml_tensor * route, int il, bool views, bool hybrid) {
    ggml_tensor * args[1] = { route };
    const int64_t k = route->ne[0], n = route->ne[1];
    hybrid = views && hybrid;
    int64_t m = 0;   // the CPU branch's rows M (patch 13 reads them back from the op's size)
    if (hybrid) {
        std::lock_guard<std::mutex> lock(g_mu);
        m = std::min<int64_t>(n, opts_of(g_eng).hybrid_rows);
    }
    ggml_tensor * t = hybrid
        ? ggml_custom_4d(ctx, GGML_TYPE_I32, k * n + k * m + 2 * m, 1, 1, 1, args, 1, upload_op, 1,
                         (void *) (intptr_t) op_ud(il, true, true))
        : ggml_custom_4d(ctx, GGML_TYPE_I32, k, n, 1, 1, args, 1, upload_op, 1, (void *) (intptr_t) op_ud(il, views));
    ggml_format_name(t, "ostinato_upload-%d", il);
    return t;
}

ggml_tensor * ostinato_moe_upload_join(ggml_context * ctx, ggml_tensor * upload, ggml_tensor * cpu_out, int il,
                                       int64_t k, int64_t n_tokens) {
    ggml_tensor * args[2] = { upload, cpu_out };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, k, n_tokens, 1, 1, args, cpu_out ? 2 : 1,
                                     upload_join_op, 1, (void *) (intptr_t) op_ud(il, true));
    ggml_format_name(t, "ostinato_upload_join-%d", il);
    return t;
}

int ostinato_moe_views(int il, int64_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || il < 0 || il >= e->n_layer || !e->opts.pool_views) return 0;
    const auto & l = e->layers[il];
    return l.has_hot && l.views && n_tokens >= OSTINATO_VIEW_MIN_TOKENS ? 1 : 0;
}

void ostinato_moe_pool_views(ggml_context * ctx, const ostinato_moe_layer * l, bool hot, ggml_tensor * out[6]) {
    const int64_t s0 = hot ? l->hot0 : l->view_stage0, n = hot ? l->n_hot : l->n_stage;
    // each view gets the pool's buffer now, so that the scheduler sees weights (usage WEIGHTS) in
    // its sources and runs their products on the pool's device, as for the whole pool tensor
    auto init = [](ggml_tensor * v) {
        if (v->view_src && v->view_src->buffer && !v->buffer) ggml_backend_view_init(v);
        return v;
    };
    auto w = [&](ggml_tensor * t) -> ggml_tensor * {   // weights [.., .., slots]
        return t ? init(ggml_view_3d(ctx, t, t->ne[0], t->ne[1], n, t->nb[1], t->nb[2], (size_t) s0 * t->nb[2])) : nullptr;
    };
    auto b = [&](ggml_tensor * t) -> ggml_tensor * {   // bias rows [.., slots]
        return t ? init(ggml_view_2d(ctx, t, t->ne[0], n, t->nb[1], (size_t) s0 * t->nb[1])) : nullptr;
    };
    out[0] = w(l->up_pool); out[1] = w(l->gate_pool); out[2] = w(l->down_pool);
    out[3] = b(l->up_b_pool); out[4] = b(l->gate_b_pool); out[5] = b(l->down_b_pool);
}

void ostinato_moe_tag_skips(ggml_tensor * t) {
    if (!t) return;
    if (t->op == GGML_OP_MUL_MAT_ID) {
        t->op_params[OSTINATO_SKIPS_PARAM] = OSTINATO_SKIPS_MAGIC;
    } else if (t->op == GGML_OP_ADD || t->op == GGML_OP_SCALE || t->op == GGML_OP_MUL) {
        // LoRA terms (add of scaled mul_mat_ids) and per-expert scales share the ids
        for (ggml_tensor * s : {t->src[0], t->src[1]}) {
            if (s && (s->op == GGML_OP_MUL_MAT_ID || s->op == GGML_OP_ADD || s->op == GGML_OP_SCALE)) ostinato_moe_tag_skips(s);
        }
    }
}

namespace {

// Decode graph wanted for this engine (auto: a pool on a GPU); creates it on first use. Holds g_mu.
ost_dgraph * dgraph_of(engine_t * e) {
    if (!e || e->opts.decode_graph == 0 || g_dgraph_broken || e->opts.timing || e->dg_failed) return nullptr;
    if (e->opts.decode_graph < 0) {
        bool gpu = false;
        for (auto & p : e->pools) gpu = gpu || ggml_backend_dev_type(p.dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
        if (!gpu) return nullptr;
    }
    if (e->dg) return e->dg;
    ost_dg_config c;
    c.n_layer = e->n_layer; c.n_expert = e->n_expert; c.k = e->k;
    c.n_embd = e->model->hparams.n_embd;
    c.max_tokens = e->opts.decode_graph_max_tokens;
    c.n_threads = e->opts.cpu_threads;
    c.ffn_kernel = e->opts.cpu_branch_kernel != 0;
    for (auto & p : e->pools) {
        if (ggml_backend_dev_type(p.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            c.host_buft = ggml_backend_dev_host_buffer_type(p.dev);   // pinned, mapped into every GPU
            break;
        }
    }
    c.layers.resize(e->n_layer);
    for (int il = 0; il < e->n_layer; ++il) {
        const int pi = e->layer_pool[il];
        if (pi < 0 || !e->pools[pi].table) continue;
        auto & l = c.layers[il];
        l.moe = true;
        l.has_hot = e->layers[il].has_hot;
        l.zero0 = e->layers[il].zero0;
        l.table = (const int32_t *) e->pools[pi].table->data + (size_t) il * e->n_expert;
        l.scratch = (int32_t *) e->pools[pi].scratch->data + (size_t) OSTINATO_SCRATCH * il;
        // decode prefetch: layers alternate between staging regions 1 and 2 (region 0 holds the
        // borrowed decode slots), so the copies for layer il + 1 never land in slots that layer il's
        // GPU branch reads while they run
        const auto & ml = e->layers[il];
        if (e->opts.decode_prefetch_experts > 0 && ml.has_hot && ml.n_stage > 0 && e->prefetch + 1 >= 3 && ml.n_hot < e->n_expert) {
            l.stage_slot0 = ml.stage0 + (1 + (il & 1)) * ml.n_stage;
        }
    }
    c.host_pool = true;
    c.copy_blocks = e->opts.decode_prefetch_copy_blocks;
    for (auto & p : e->pools) c.host_pool = c.host_pool && ggml_backend_dev_type(p.dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    // each layer's prediction of the next one (decode prefetch): where both are on one pool and the
    // next layer's experts lie in host memory (the copies read them there)
    const int n_trunk = (int) e->model->hparams.n_layer();
    for (int il = 0; il + 1 < n_trunk && il + 1 < e->n_layer && e->opts.decode_prefetch_experts > 0; ++il) {
        const int nx = il + 1;
        auto & l = c.layers[il];
        const auto & nl = c.layers[nx];
        const ggml_tensor * gate = e->model->layers[nx].ffn_gate_inp;
        if (!l.moe || !nl.moe || e->layer_pool[il] < 0 || routes_by_token(e, nx)) continue;
        // the router is read where the pool computes: its rows F32, F16 or BF16 in the pool's device memory
        const ggml_backend_dev_t pool_dev = e->pools[e->layer_pool[il]].dev;
        const bool host_pool = ggml_backend_dev_type(pool_dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
        if (nl.stage_slot0 < 0 || e->layer_pool[il] != e->layer_pool[nx] || !gate ||
            gate->ne[1] != e->n_expert || gate->ne[0] != c.n_embd || e->layer_class[nx] < 0 || !gate->buffer ||
            (host_pool ? !ggml_backend_buffer_is_host(gate->buffer)
                       : ggml_backend_buft_get_device(ggml_backend_buffer_get_type(gate->buffer)) != pool_dev) ||
            (gate->type != GGML_TYPE_F32 && gate->type != GGML_TYPE_F16 && gate->type != GGML_TYPE_BF16) ||
            gate->nb[0] != ggml_type_size(gate->type) || !e->pools[e->layer_pool[il]].pred) {
            continue;
        }
        const size_class_t & sc = e->classes[e->layer_class[nx]];
        const auto & L = e->model->layers[nx];
        auto parts = weight_parts(L, sc.up, sc.gate, sc.down);
        for (auto b : bias_parts(L, sc.b_up, sc.b_gate, sc.b_down)) parts.push_back(b);
        bool ok = parts.size() <= OSTINATO_COPY_PARTS;
        std::vector<ostinato_copy_part> cp;
        for (auto [src, dst] : parts) {
            if (!ok || !src || !dst || !src->buffer || !ggml_backend_buffer_is_host(src->buffer)) { ok = false; break; }
            const int d = ggml_n_dims(src) >= 3 ? 2 : 1;   // weight slices or bias rows
            ostinato_copy_part q{};
            q.src = (const char *) src->data;
            q.src_stride = (int64_t) src->nb[d];
            q.dst = (char *) dst->data;
            q.dst_stride = (int64_t) dst->nb[d];
            q.bytes = (int64_t) src->nb[d];
            cp.push_back(q);
        }
        if (!ok) continue;
        l.next_max = std::min({ (int) e->opts.decode_prefetch_experts, e->layers[nx].n_stage, OSTINATO_STAGE_MAX });
        l.next_slot0 = nl.stage_slot0;
        l.next_parts = cp;
        l.next_gate = gate->data;
        l.next_gate_type = gate->type;
        l.next_gate_nb1 = (int64_t) gate->nb[1];
        // the selection's biases and gating (ostinato_pred_score), each where the router is, else left out
        auto bias_at = [&](const ggml_tensor * b) -> const float * {
            return b && b->type == GGML_TYPE_F32 && ggml_nelements(b) == e->n_expert && ggml_is_contiguous(b) &&
                           b->buffer && ggml_backend_buffer_get_type(b->buffer) == ggml_backend_buffer_get_type(gate->buffer)
                       ? (const float *) b->data : nullptr;
        };
        l.next_router_b = bias_at(e->model->layers[nx].ffn_gate_inp_b);
        l.next_sel_b = bias_at(e->model->layers[nx].ffn_exp_probs_b);
        l.next_gating = pred_gating(e->model->hparams.expert_gating_func);
        l.pred_logits = (float *) e->pools[e->layer_pool[il]].pred->data;
    }
    c.count = dg_count;
    c.count_ud = e;
    std::string err;
    e->dg = ost_dg_new(c, err);
    if (!e->dg) {
        e->dg_failed = true;
        e->notes.push_back(err + ": decode graph off");
        LLAMA_LOG_ERROR("ostinato: %s: decode graph off\n", err.c_str());
    }
    return e->dg;
}

ost_dgraph * dgraph_layer(int il) {
    engine_t * e = g_eng;
    if (!e || il < 0 || il >= e->n_layer) return nullptr;
    return dgraph_of(e);
}

}  // namespace

int ostinato_moe_graph_layer(int il, const ggml_tensor * cur, int64_t n_tokens) {
    const int up = ostinato_moe_upload_path(n_tokens);
    std::lock_guard<std::mutex> lock(g_mu);
    ost_dgraph * dg = dgraph_layer(il);
    if (!dg || (n_tokens > 1 && up)) return 0;
    return cur->ne[0] == g_eng->model->hparams.n_embd && cur->ne[1] == 1 && cur->ne[2] <= ost_dg_max_tokens(dg) &&
           cur->type == GGML_TYPE_F32 && ggml_is_contiguous(cur);
}

ggml_tensor * ostinato_moe_dg_predict(ggml_context * ctx, ggml_tensor * cur, const ggml_tensor * down_exps, int il,
                                     int64_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || n_tokens != 1 || il < 0 || il + 1 >= e->n_layer) return nullptr;
    auto it = e->by_down.find(down_exps);
    if (it == e->by_down.end() || it->second != il) return nullptr;
    ost_dgraph * dg = dgraph_layer(il);
    // a decode step of a layer that takes the route op (not all-resident), whose next layer does too
    if (!dg || !e->layers[il].has_hot || resident_layer(e, il) || resident_layer(e, il + 1) ||
        cur->type != GGML_TYPE_F32 || !ggml_is_contiguous(cur) || ggml_nelements(cur) != e->model->hparams.n_embd) {
        return nullptr;
    }
    return ost_dg_predict(dg, ctx, cur, il);
}

ggml_tensor * ostinato_moe_route_dev(ggml_context * ctx, ggml_tensor * selected_experts, ggml_tensor * cur, int il) {
    std::lock_guard<std::mutex> lock(g_mu);
    return ost_dg_route(dgraph_layer(il), ctx, selected_experts, cur, il);
}

ggml_context * ostinato_moe_cpu_begin(ggml_context * graph_ctx, int il, ggml_tensor * cur, int64_t k,
                                      ggml_tensor ** ids, ggml_tensor ** cur_cpu) {
    std::lock_guard<std::mutex> lock(g_mu);
    return ost_dg_cpu_begin(dgraph_layer(il), graph_ctx, il, cur, k, ids, cur_cpu);
}

void ostinato_moe_cpu_end(ggml_context * graph_ctx, int il, ggml_tensor * out) {
    std::lock_guard<std::mutex> lock(g_mu);
    ost_dg_cpu_end(dgraph_layer(il), graph_ctx, il, out);
}

ggml_tensor * ostinato_moe_join(ggml_context * ctx, ggml_tensor * ids_gpu, ggml_tensor * out_gpu, int il) {
    std::lock_guard<std::mutex> lock(g_mu);
    return ost_dg_join(dgraph_layer(il), ctx, ids_gpu, out_gpu, il);
}

void ostinato_graph_build_begin(ggml_context * graph_ctx) {
    std::lock_guard<std::mutex> lock(g_mu);
    // entries of freed graph contexts stay until their address comes back: keep the map small (a
    // dropped live entry only loses its pass flag until that graph is built again)
    if (g_eng && g_eng->built.size() > 16) g_eng->built.clear();
    if (g_eng) g_eng->built.erase(graph_ctx);
    if (g_eng && g_eng->dg) ost_dg_build_begin(g_eng->dg, graph_ctx);
}

int ostinato_moe_resident(int il) {
    std::lock_guard<std::mutex> lock(g_mu);
    return resident_layer(g_eng, il) ? 1 : 0;
}

void ostinato_moe_count_routes(ggml_context * graph_ctx, ggml_tensor * selected_experts, int il, int64_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || il < 0 || il >= e->n_layer || e->layer_pool[il] < 0) return;
    built_t & b = e->built[graph_ctx];
    const int pi = e->layer_pool[il];
    b.plane = n_tokens == 1 ? 1 : 0;   // a decode step, as the route op has it
    b.pending[pi].push_back({il, selected_experts});
    // no host work for the layer only when its router (the dense part) runs on the pool's GPU too
    const ggml_tensor * gate = e->model->layers[il].ffn_gate_inp;
    const bool dense_on_pool = gate && gate->buffer &&
        ggml_backend_buft_get_device(ggml_backend_buffer_get_type(gate->buffer)) == e->pools[pi].dev;
    if (ggml_backend_dev_type(e->pools[pi].dev) == GGML_BACKEND_DEVICE_TYPE_CPU || !dense_on_pool) b.n_host++;
    else b.n_dev++;
}

void ostinato_graph_build_end(ggml_context * graph_ctx, ggml_cgraph * gf) {
    // userdata of every count op: the CUDA backend knows the op by it (the layers are in op_params)
    static const ostinato_op count_ud = [] {
        ostinato_op o{};
        o.magic = OSTINATO_OP_MAGIC;
        o.kind = OSTINATO_OP_COUNT;
        return o;
    }();
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e) return;
    auto it = e->built.find(graph_ctx);
    if (it == e->built.end()) return;
    built_t & b = it->second;
    for (auto & kv : b.pending) {
        ggml_tensor * table = e->pools[kv.first].counts;
        const auto & layers = kv.second;
        for (size_t i0 = 0; i0 < layers.size(); i0 += OSTINATO_COUNT_MAX) {
            const size_t m = std::min<size_t>(OSTINATO_COUNT_MAX, layers.size() - i0);
            // the plane as a view with the pool's buffer: the scheduler runs the op on the pool's device
            ggml_tensor * plane = ggml_view_2d(graph_ctx, table, table->ne[0], table->ne[1], table->nb[1],
                                               (size_t) b.plane * table->nb[2]);
            ggml_backend_view_init(plane);
            ggml_tensor * args[GGML_MAX_SRC] = { plane };
            for (size_t i = 0; i < m; ++i) args[1 + i] = layers[i0 + i].second;
            ggml_tensor * t = ggml_custom_4d(graph_ctx, GGML_TYPE_I32, 1, 1, 1, 1, args, (int) m + 1, count_op, 1,
                                             (void *) &count_ud);
            for (size_t i = 0; i < m; ++i) t->op_params[OSTINATO_COUNT_LAYERS + i] = layers[i0 + i].first;
            ggml_format_name(t, OSTINATO_OP_PREFIX "count-%d", layers[i0].first);
            ggml_build_forward_expand(gf, t);
        }
    }
    b.pending.clear();
}

int ostinato_moe_overlap(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return opts_of(g_eng).decode_overlap ? 1 : 0;
}

int ostinato_moe_timing(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return opts_of(g_eng).timing ? 1 : 0;
}

int ostinato_moe_upload_path(int64_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (n_tokens <= 1) return 0;   // decode
    const ostinato_engine_options & o = opts_of(g_eng);
    if (o.force_path == FORCE_UPLOAD) return 1;
    if (o.force_path == FORCE_SPLIT) return 0;
    return n_tokens >= o.prefill_threshold ? 1 : 0;
}

bool ostinato_graph_reusable(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    const bool ok = !g_graph_dirty;
    g_graph_dirty = false;
    return ok;
}

void ostinato_pass_begin(int64_t n_tokens, ggml_context * graph_ctx) {
    ost_dgraph * dg = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        engine_t * e = g_eng;
        if (!e) return;
        collect_dg_stats(e, true);   // the passes before this one are done on the GPU too
        e->cur = pass_t();
        e->cur.tokens = n_tokens;
        std::fill(e->cold_seen.begin(), e->cold_seen.end(), 0);
        // prefetch copies a failed pass left behind must not land in a region this pass stages or
        // lends (a decode step's borrowed slots) into
        for (int il = 0; il < e->n_layer && e->prefetch; ++il) if (e->pf_pending[il]) join_copies(e, il);
        // a pass's prefetches are its own; only passes that may take pool views prefetch or read
        // them (decode steps never do: no work there)
        if (e->prefetch && n_tokens >= OSTINATO_VIEW_MIN_TOKENS) {
            for (auto & row : e->pf_slot) std::fill(row.begin(), row.end(), -1);
            std::fill(e->pf_ran.begin(), e->pf_ran.end(), 0);
        }
        e->in_pass = true;
        e->pass_t0_us = now_us();
        e->dg_running = false;
        // a pass whose MoE layers are all-resident ones on a GPU has no host work either
        auto bi = e->built.find(graph_ctx);
        e->cur.graph = bi != e->built.end() && bi->second.n_dev > 0 && bi->second.n_host == 0;
        dg = e->dg;
        // token boundary: borrowed slots are lent for decode and handed back before the upload path
        const ostinato_engine_options & o = e->opts;
        const bool upload = n_tokens > 1 && (o.force_path == FORCE_UPLOAD ||
                                             (o.force_path != FORCE_SPLIT && n_tokens >= o.prefill_threshold));
        // a pass that may take pool views computes only the layer's own hot slots on the GPU: hand the
        // borrowed ones back first (also before every upload pass, whose staging slots they are)
        if (upload || !o.decode_borrow || (o.pool_views && n_tokens >= OSTINATO_VIEW_MIN_TOKENS)) borrow_release(e);
        else if (n_tokens == 1) borrow_step(e);
    }
    // outside g_mu: the decode graph's worker takes it to count routes
    if (dg && ost_dg_pass_begin(dg, graph_ctx)) {
        std::lock_guard<std::mutex> lock(g_mu);
        if (g_eng) g_eng->dg_running = true;
    }
}

void ostinato_pass_end(int64_t n_tokens) {
    const int up = ostinato_moe_upload_path(n_tokens);
    ost_dgraph * dg = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (g_eng && g_eng->dg_running) dg = g_eng->dg;
    }
    std::string dg_err;
    const bool dg_ok = !dg || ost_dg_pass_end(dg, dg_err);   // the CPU branches of this pass are done
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!dg_ok) {
        LLAMA_LOG_ERROR("ostinato: %s; the decode graph is off until the model is loaded again\n", dg_err.c_str());
        g_dgraph_broken = true;
        g_graph_dirty = true;
        if (e) e->notes.push_back(dg_err);
    }
    if (!e || !e->in_pass) return;
    e->in_pass = false;
    e->cur.total_ms = (now_us() - e->pass_t0_us) / 1000.0;
    e->cur.path = n_tokens <= 1 ? "decode" : (up ? "upload" : "split");
    e->cur.graph = e->cur.graph || e->dg_running;
    e->dg_running = false;
    e->total.add(e->cur);
    e->request.add(e->cur);
    e->last.push_back(e->cur);
    while (e->last.size() > 32) e->last.pop_front();
}

namespace {

// The CPU branch's thread team (process-wide: one kernel, one team per pool) takes the options'
// spins, claims, prefetch distance and row pairs.
void set_team(const ostinato_engine_options & o) {
    ost_ffn_set_spins(o.cpu_branch_spins);
    ost_ffn_set_claims(o.cpu_branch_claims != 0);
    ost_ffn_set_prefetch_rows(o.cpu_branch_prefetch_rows);
    ost_dot_set_mode(o.cpu_branch_row_pairs);
}

// Builds the engine for `model` with `cfg` and `opts` (a load or a switch); false with g_err set on refusal.
bool adopt(llama_model * model, const config_t & cfg, const ostinato_engine_options & opts) {
    std::string err;
    const int64_t t0 = now_us();
    bool ok;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_dgraph_broken = false;
        ok = build_engine(model, cfg, opts, err);
        if (!ok) g_err = err;
        else set_team(opts);
    }
    if (!ok) {
        LLAMA_LOG_ERROR("ostinato: %s\n", err.c_str());
        return false;
    }
    LLAMA_LOG_INFO("ostinato: expert pool on %s: %lld hot experts, %zu size classes, %.1f MiB, %.1f ms; "
                   "cold experts in %s\n",
                   g_eng->pool_device.c_str(), (long long) g_eng->n_hot, g_eng->classes.size(),
                   g_eng->pool_bytes / 1048576.0, (now_us() - t0) / 1000.0, g_eng->host_buffer.c_str());
    if (g_eng->pools.size() > 1) {
        for (const auto & p : g_eng->pools) {
            LLAMA_LOG_INFO("ostinato:   pool of GPU %d on %s: %zu MoE layers, %lld hot experts, %d size classes, "
                           "%.1f MiB\n", p.gpu, p.name.c_str(), p.layers.size(), (long long) p.n_hot,
                           p.n_classes, p.bytes / 1048576.0);
        }
    }
    return true;
}

// Parses the JSON placement config (see ostinato.h); false with `err` on bad input.
bool parse_config(const char * js, config_t & c, std::string & err) {
    try {
        json j = json::parse(js);
        c = config_t();
        c.set = true;
        if (j.contains("hot")) {
            for (auto & kv : j["hot"].items()) {
                c.hot[std::stoi(kv.key())] = kv.value().get<std::vector<int>>();
            }
        }
        c.device = j.value("device", -1);
        if (j.contains("layer_device") && !j["layer_device"].is_null()) {
            for (auto & kv : j["layer_device"].items()) {
                const int d = kv.value().get<int>();
                if (d < -1) throw std::runtime_error("layer_device values must be GPU indices (>= 0) or -1");
                c.layer_device[std::stoi(kv.key())] = d;
            }
        }
        c.np = j.value("prefill_threshold", (int64_t) -1);   // absent: the options'
        if (j.contains("prefill_threshold") && c.np < 1) throw std::runtime_error("prefill_threshold must be >= 1");
        const std::string f = j.value("force_path", std::string());
        if (f.empty()) c.force = -1;
        else if (f == "auto") c.force = FORCE_AUTO;
        else if (f == "split") c.force = FORCE_SPLIT;
        else if (f == "upload") c.force = FORCE_UPLOAD;
        else throw std::runtime_error("force_path must be auto, split or upload");
        return true;
    } catch (const std::exception & ex) {
        err = std::string("bad expert config: ") + ex.what();
        return false;
    }
}

// Options `o` with the Np and forced path a config names.
ostinato_engine_options with_config(ostinato_engine_options o, const config_t & c) {
    if (c.np > 0) o.prefill_threshold = c.np;
    if (c.force >= 0) o.force_path = c.force;
    return o;
}

// Empty when `o` is valid, else what is wrong with it (the field's name first).
std::string check_options(const ostinato_engine_options & o) {
    auto bad = [](const char * f, const char * want) { return std::string(f) + " must be " + want; };
    if (o.prefill_threshold < 1) return bad("prefill_threshold", ">= 1");
    if (o.force_path < FORCE_AUTO || o.force_path > FORCE_UPLOAD) return bad("force_path", "0 (auto), 1 (split) or 2 (upload)");
    if (o.decode_graph < -1 || o.decode_graph > 1) return bad("decode_graph", "-1 (auto), 0 or 1");
    if (o.decode_graph_max_tokens < 1 || o.decode_graph_max_tokens > 4096) return bad("decode_graph_max_tokens", "1..4096");
    if (o.cpu_threads < 0) return bad("cpu_threads", ">= 0");
    if (o.hybrid_rows < 1 || o.hybrid_rows > 4096) return bad("hybrid_rows", "1..4096");
    if (!(o.upload_cpu_share >= 0 && o.upload_cpu_share <= 1) && o.upload_cpu_share != -1) {
        return bad("upload_cpu_share", "0..1 or -1 (adapted)");
    }
    if (!std::isfinite(o.cpu_split_alpha_us) || !std::isfinite(o.cpu_split_cpu_gbps) || !std::isfinite(o.cpu_split_h2d_gbps) ||
        o.cpu_split_alpha_us < 0 || o.cpu_split_cpu_gbps < 0 || o.cpu_split_h2d_gbps < 0 ||
        (o.cpu_split_cpu_gbps > 0) != (o.cpu_split_h2d_gbps > 0)) {
        return bad("cpu_split_*", "finite, >= 0, both bandwidths > 0 or both 0");
    }
    if (o.prefetch_depth < 0 || o.prefetch_depth > OSTINATO_PREFETCH_MAX_DEPTH) return bad("prefetch_depth", "0..2");
    if (o.decode_prefetch_experts < 0 || o.decode_prefetch_experts > OSTINATO_STAGE_MAX) return bad("decode_prefetch_experts", "0..16");
    if (o.decode_prefetch_copy_blocks < 1 || o.decode_prefetch_copy_blocks > OST_COPY_BLOCKS_MAX) {
        return bad("decode_prefetch_copy_blocks", "1..1024");
    }
    if (o.cpu_branch_prefetch_rows < 0 || o.cpu_branch_prefetch_rows > OST_PREFETCH_ROWS_MAX) return bad("cpu_branch_prefetch_rows", "0..64");
    if (o.cpu_branch_row_pairs < OST_DOT_OFF || o.cpu_branch_row_pairs > OST_DOT_AVX512) return bad("cpu_branch_row_pairs", "0, 1 or 2");
    if (o.cpu_branch_spins < 0) return bad("cpu_branch_spins", ">= 0");
    return "";
}

// The one place that decides what a change of engine e's options from e->opts to `n` needs (between
// passes; caller holds g_mu). Cached graphs hold the path choice, timing markers, the branch order,
// pool views, the all-resident path, the CPU-branch jobs (matched at graph build) and the hybrid
// pass's CPU branch and shape: those rebuild. The decode graph captures its max tokens (mailbox), CPU
// threads (pool), decode prefetch (staging, predictions) and copy blocks (a CUDA graph's launch shape):
// freed, made anew at the next pass. The team takes its settings now. The pool's layout
// (prefetch_depth, pool_whole_expert_slots) is read at its next build (load or residency switch);
// borrow, copy_2d and the split's costs are read at each pass or copy.
void apply_options(engine_t * e, const ostinato_engine_options & n) {
    const ostinato_engine_options & w = e->opts;
    const bool graphs = n.prefill_threshold != w.prefill_threshold || n.force_path != w.force_path ||
                        n.timing != w.timing || n.decode_overlap != w.decode_overlap ||
                        n.decode_graph != w.decode_graph || n.pool_views != w.pool_views ||
                        n.resident_path != w.resident_path || n.cpu_branch_kernel != w.cpu_branch_kernel ||
                        hybrid_on(n) != hybrid_on(w) || n.hybrid_rows != w.hybrid_rows;
    const bool dgraph = n.decode_graph_max_tokens != w.decode_graph_max_tokens || n.cpu_threads != w.cpu_threads ||
                        n.decode_prefetch_experts != w.decode_prefetch_experts ||
                        n.decode_prefetch_copy_blocks != w.decode_prefetch_copy_blocks;
    if (dgraph && e->dg) {
        ost_dg_free(e->dg);
        e->dg = nullptr;
        g_graph_dirty = true;   // its ops point into the old mailbox
    }
    if (graphs) g_graph_dirty = true;
    e->opts = n;
    ost_dg_set_ffn_kernel(e->dg, n.cpu_branch_kernel != 0);
    set_team(n);
}

}  // namespace

bool ostinato_on_model_loaded(llama_model * model) {
    if (!t_load_cfg) return true;   // a stock load
    return adopt(model, *t_load_cfg, t_load_opts ? *t_load_opts : ostinato_engine_options{});
}

bool ostinato_keep_on_host(const char * name) {
    if (!name || std::strncmp(name, "blk.", 4) != 0 || !std::strstr(name, "_exps.")) return false;
    return t_load_cfg != nullptr;
}

void ostinato_on_model_free(llama_model * model) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_eng && g_eng->model == model) {
        free_engine(g_eng);
        g_eng = nullptr;
    }
    if (g_pin.model == model) unpin(g_pin);
}

// ---------------------------------------------------------------------------------------------
// C API (ctypes)

extern "C" {

int ostinato_experts_check(const char * js) {
    config_t c;
    std::string err;
    const bool ok = parse_config(js ? js : "", c, err);
    std::lock_guard<std::mutex> lock(g_mu);
    g_err = ok ? "" : err;
    return ok ? 0 : -1;
}

struct llama_model * ostinato_model_load(const char * path, struct llama_model_params params, const char * js,
                                         const struct ostinato_engine_options * opts) {
    if (!js || !*js) return llama_model_load_from_file(path, params);
    config_t c;
    std::string err;
    const ostinato_engine_options base = opts ? *opts : ostinato_engine_options{};
    if (parse_config(js, c, err)) err = check_options(base);
    if (!err.empty()) {
        std::lock_guard<std::mutex> lock(g_mu);
        g_err = err;
        return nullptr;
    }
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_err.clear();
    }
    const ostinato_engine_options o = with_config(base, c);
    t_load_cfg = &c;   // read by the loader hooks of this load (this thread) only
    t_load_opts = &o;
    llama_model * model = llama_model_load_from_file(path, params);
    t_load_cfg = nullptr;
    t_load_opts = nullptr;
    return model;
}

int ostinato_experts_switch(const char * js, const struct ostinato_engine_options * opts) {
    llama_model * model;
    ostinato_engine_options base;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_eng) { g_err = "no model with an active expert engine"; return -1; }
        model = g_eng->model;
        base = opts ? *opts : g_eng->opts;
    }
    config_t c;
    std::string err;
    if (parse_config(js ? js : "", c, err)) err = check_options(base);
    if (!err.empty()) {
        std::lock_guard<std::mutex> lock(g_mu);
        g_err = err;
        return -1;
    }
    return adopt(model, c, with_config(base, c)) ? 0 : -1;
}

int ostinato_experts_active(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_eng != nullptr ? 1 : 0;
}

const char * ostinato_experts_last_error(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_err.c_str();
}

void ostinato_engine_options_default(struct ostinato_engine_options * out) {
    if (out) *out = ostinato_engine_options{};
}

int ostinato_engine_options_size(void) { return (int) sizeof(ostinato_engine_options); }

int ostinato_experts_options(struct ostinato_engine_options * out) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) { g_err = "no model with an active expert engine"; return -1; }
    if (out) *out = g_eng->opts;
    return 0;
}

int ostinato_experts_reconfigure(const struct ostinato_engine_options * o) {
    const std::string err = o ? check_options(*o) : "no options";
    std::lock_guard<std::mutex> lock(g_mu);
    if (!err.empty()) { g_err = "bad engine options: " + err; return -1; }
    if (!g_eng) { g_err = "no model with an active expert engine"; return -1; }
    apply_options(g_eng, *o);
    return 0;
}

int ostinato_hybrid_split(const int32_t * routes, int m, int n_upload, double alpha_us, double beta_us,
                          double upload_us) {
    if (!routes || m < 0) return 0;
    ost_split_cost c;
    c.alpha_us = alpha_us;
    c.beta_us = beta_us;
    c.upload_us = upload_us;
    return ost_split_experts(routes, m, n_upload, c);
}

}  // extern "C"
