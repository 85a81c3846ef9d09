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
// This file: the engine's globals and the hooks the patched llama.cpp calls at graph build and per pass.
// The C API, the options' check/apply and the model load/free hooks are in engine/api.cpp, the hybrid
// pass's CPU share in engine/cpu_share.cpp, the pool is built in expert_pool/pool.cpp, the CPU ops of
// the split/upload paths in paths/split_upload_ops.cpp, the route counts in paths/route_counts.cpp, the
// info/stats JSON in engine/stats.cpp, the decode graph in decode_graph/decode_graph.cpp (shared state:
// engine/engine.h).

#include "engine/engine.h"

using namespace ost;

namespace ost {

std::mutex g_mu;
pinned_t g_pin;
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

