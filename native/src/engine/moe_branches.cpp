// The branches of a MoE layer (patch 13's hook, include/ostinato/engine_hooks.h): which path this
// layer takes in this pass and the graph of each of its branches, built with stock's expert FFN
// (build_moe_ffn's moe_experts, passed in as a.experts) over the expert pool and the host tensors.
// Paper: arXiv 2611.11533, Section 3; the paths: docs/engine.md.
//
// The text below is the body that native/patches/13 used to hold inside build_moe_ffn, with the
// graph context's members read from `a` under their llama.cpp names (ctx0, gf, cb, sched, ...): the
// graph built is the same, node for node and in the same order. Keep it so: the GPU backend fuses
// node patterns, the scheduler splits by node order, and the exactness tests compare bitwise.
#include "ostinato/engine_hooks.h"

#include "ggml.h"
#include "ggml-backend.h"

ggml_tensor * ostinato_moe_build_branches(const ostinato_moe_build & a) {
    // build_moe_ffn's names for what the body reads
    ggml_context * ctx0 = a.ctx;
    ggml_cgraph * gf = a.gf;
    ggml_backend_sched_t sched = a.sched;
    ggml_backend_t backend_cpu = a.backend_cpu;
    const int il = a.il;
    const int64_t n_expert = a.n_expert;
    const int64_t n_expert_used = a.n_expert_used;
    const int64_t n_tokens_pass = a.n_tokens;   // ubatch.n_tokens
    const bool weight_before_ffn = a.weight_before_ffn;
    ggml_tensor * cur = a.cur;
    ggml_tensor * selected_experts = a.selected_experts;
    // the host expert tensors; a merged gate_up layer passes gate_up (and its bias) as up
    ggml_tensor * up_or_gu = a.up;
    ggml_tensor * gate_exps = a.gate;
    ggml_tensor * down_exps = a.down;
    ggml_tensor * up_or_gu_b = a.up_b;
    ggml_tensor * gate_exps_b = a.gate_b;
    ggml_tensor * down_exps_b = a.down_b;
    auto cb = [&](ggml_tensor * t, const char * name, int l) { a.cb(t, name, l); };
    // stock's expert FFN in the graph's context
    auto moe_experts = [&](ggml_tensor * up_e, ggml_tensor * gate_e, ggml_tensor * down_e,
                           ggml_tensor * up_b, ggml_tensor * gate_b, ggml_tensor * down_b,
                           ggml_tensor * ids, ggml_tensor * x, bool on_cpu = false,
                           bool skips = false) -> ggml_tensor * {
        return a.experts(ctx0, up_e, gate_e, down_e, up_b, gate_b, down_b, ids, x, on_cpu, skips);
    };

    const ostinato_moe_layer * ost = ostinato_moe_lookup(down_exps);
    if (ost == nullptr) {
        return nullptr;   // the engine does not run this layer: stock's expert FFN (the caller's)
    }
    ggml_tensor * experts = nullptr;
    if (ostinato_moe_resident(il)) {
        // every expert of the layer is resident, its hot slots in expert order: the stock computation
        // over the layer's resident tensors (leaves over the pool) with the router's ids as they are,
        // on any path and pass size. No route op, no host round trip; a count op at the end of the
        // graph counts the routes
        const auto & v = ost->resident;
        experts = moe_experts(v[0], v[1], v[2], v[3], v[4], v[5], selected_experts, cur);
        cb(experts, "ostinato_out_resident", il);
        ostinato_moe_count_routes(ctx0, selected_experts, il, n_tokens_pass);
    } else if (!weight_before_ffn && ostinato_moe_graph_layer(il, cur, n_tokens_pass)) {
        // decode graph (Sec. 3.4): the route op runs on the GPU and writes the cold routes and their
        // hidden rows to mapped host memory; the CPU branch is a graph of its own over host tensors,
        // run by the engine's resident thread pool; the join op waits for it only where a position is
        // cold. The forward pass needs no host round trip, so the whole of it can be one CUDA graph.
        ggml_tensor * ids_gpu = ostinato_moe_route_dev(ctx0, selected_experts, cur, il);
        ggml_tensor * out_gpu = nullptr;
        if (ost->has_hot) {
            out_gpu = moe_experts(ost->up_pool, ost->gate_pool, ost->down_pool,
                                  ost->up_b_pool, ost->gate_b_pool, ost->down_b_pool, ids_gpu, cur);
            cb(out_gpu, "ostinato_out_gpu", il);
        }
        ggml_tensor * cpu_ids = nullptr;
        ggml_tensor * cpu_cur = nullptr;
        ggml_context * cpu_ctx = ostinato_moe_cpu_begin(ctx0, il, cur, n_expert_used, &cpu_ids, &cpu_cur);
        if (cpu_ctx != nullptr) {
            // the same expert FFN code builds the CPU branch's graph in the engine's context
            ggml_tensor * out_cpu = a.experts(cpu_ctx, up_or_gu, gate_exps, down_exps, up_or_gu_b, gate_exps_b, down_exps_b,
                                              cpu_ids, cpu_cur, false, false);
            ostinato_moe_cpu_end(ctx0, il, out_cpu);
        }
        // a layer whose experts are all resident has no cold route: its GPU branch is the output (the
        // join would add 0); its CPU-branch job stays, it only counts the routes
        experts = out_gpu && ost->n_hot == n_expert ? out_gpu : ostinato_moe_join(ctx0, ids_gpu, out_gpu, il);
    } else if (!ost->has_hot) {
        // no hot expert in this layer: stock computation, the route op only counts the routes
        ggml_tensor * route = ostinato_moe_route(ctx0, selected_experts, nullptr, il);
        ggml_tensor * ids = ggml_view_2d(ctx0, route, route->ne[0], route->ne[1], route->nb[1], 0);
        experts = moe_experts(up_or_gu, gate_exps, down_exps, up_or_gu_b, gate_exps_b, down_exps_b, ids, cur);
    } else if (ostinato_moe_upload_path(n_tokens_pass)) {
        // upload path (n >= Np; the path is chosen per forward pass, the last layer may see only the
        // output rows): each distinct cold expert of the pass is copied once into the pool's staging
        // slots, then every route of the layer runs on the GPU
        const bool views = ostinato_moe_views(il, selected_experts->ne[1]);
        const bool cold = views && ost->n_stage > 0 && ost->n_hot < n_expert;   // a cold route can occur
        // the hybrid pass and the prefetch read cur as [n_embd, n] (not so with weight_before_ffn)
        const bool flat = cur->ne[1] == 1;
        const bool hybrid = cold && flat && ostinato_moe_hybrid();
        // prefetch: the routers of the next layers (one or two) applied to this layer's input predict
        // their routes; the predictions reach the host with this layer's ids, and prefetch ops after
        // this layer's upload start the copies of their predicted cold experts
        static_assert(OSTINATO_PREFETCH_MAX_DEPTH == 2, "the route op takes two predictions");
        int il_next[OSTINATO_PREFETCH_MAX_DEPTH] = { -1, -1 };
        ggml_tensor * gate_next[OSTINATO_PREFETCH_MAX_DEPTH] = { nullptr, nullptr };
        for (int d = 0; d < OSTINATO_PREFETCH_MAX_DEPTH && cold && flat; ++d) {
            gate_next[d] = ostinato_moe_prefetch_gate(il, selected_experts->ne[1], d + 1, &il_next[d]);
        }
        // one 2-D view of cur serves the route op (which brings it to the host), the CPU branch's
        // gather and the predictions: one tensor, so the scheduler copies it to the host once
        ggml_tensor * cur2d = hybrid || gate_next[0] || gate_next[1] ? ggml_reshape_2d(ctx0, cur, cur->ne[0], selected_experts->ne[1]) : nullptr;
        ggml_tensor * pred[OSTINATO_PREFETCH_MAX_DEPTH] = { nullptr, nullptr };
        for (int d = 0; d < OSTINATO_PREFETCH_MAX_DEPTH; ++d) {
            if (!gate_next[d]) continue;
            ggml_tensor * logits = ggml_mul_mat(ctx0, gate_next[d], cur2d);
            pred[d] = ggml_argsort_top_k(ctx0, ostinato_moe_prefetch_scores(ctx0, logits, il_next[d]), selected_experts->ne[0]);   // [k, n]
            cb(pred[d], "ostinato_prefetch_pred", il);
        }
        // the prefetch ops, in graph order after `after`: the next layer's first
        auto prefetch = [&](ggml_tensor * after) {
            for (int d = 0; d < OSTINATO_PREFETCH_MAX_DEPTH; ++d) {
                if (!pred[d]) continue;
                after = ostinato_moe_prefetch(ctx0, pred[d], after, il_next[d]);
                ggml_build_forward_expand(gf, after);
            }
        };
        // a hybrid pass's CPU branch needs cur on the host: the route op's split brings it there
        ggml_tensor * route = ostinato_moe_route(ctx0, selected_experts, hybrid ? cur2d : nullptr, il, views, pred[0], pred[1]);
        if (views) {
            // in graph order (= run order): the hot routes over a view of the layer's own slots (GPU,
            // launched asynchronously); the upload op, which copies the cold experts on the upload
            // stream meanwhile (in a hybrid pass it only starts them, a CPU branch computes the cold
            // experts with the fewest routes, and a join op waits for the copies); the staged routes
            // over a view of the staging slots. Every route is computed in exactly one part and is
            // exactly 0 in the others: x + 0 (+ 0) == x
            ggml_tensor * v[6];
            ostinato_moe_pool_views(ctx0, ost, true, v);
            ggml_tensor * ids_hot = ggml_view_2d(ctx0, route, route->ne[0], route->ne[1], route->nb[1], 0);
            experts = moe_experts(v[0], v[1], v[2], v[3], v[4], v[5], ids_hot, cur, false, true);
            cb(experts, "ostinato_out_hot", il);
            if (cold && !hybrid) {
                // the upload op joins its copies itself; they overlap the hot routes
                ggml_build_forward_expand(gf, experts);
                ggml_tensor * ids_stage = ostinato_moe_upload(ctx0, route, il, true, false);
                prefetch(ids_stage);
                ostinato_moe_pool_views(ctx0, ost, false, v);
                ggml_tensor * out_stage = moe_experts(v[0], v[1], v[2], v[3], v[4], v[5], ids_stage, cur, false, true);
                cb(out_stage, "ostinato_out_upload", il);
                experts = ggml_add(ctx0, experts, out_stage);
            } else if (cold) {
                // hybrid: the CPU branch runs over the M tokens that have its routes only (gathered
                // from cur on the host), and its rows are added onto the GPU's sum of the two other
                // parts by a gather, an add and a scatter of those rows
                ggml_build_forward_expand(gf, experts);
                const int64_t n_tok = selected_experts->ne[1], k_used = selected_experts->ne[0];
                const size_t i32 = sizeof(int32_t);
                ggml_tensor * up_ids = ostinato_moe_upload(ctx0, route, il, true, true);
                const int64_t m_rows = (up_ids->ne[0] - k_used * n_tok) / (k_used + 2);   // as the op was sized
                ggml_tensor * ids_cpu = ggml_view_2d(ctx0, up_ids, k_used, m_rows, k_used * i32, k_used * n_tok * i32);
                ggml_tensor * gather  = ggml_view_1d(ctx0, up_ids, m_rows, (k_used * n_tok + k_used * m_rows) * i32);
                ggml_tensor * scatter = ggml_view_1d(ctx0, up_ids, m_rows, (k_used * n_tok + k_used * m_rows + m_rows) * i32);
                ggml_tensor * cur_rows = ggml_get_rows(ctx0, cur2d, gather);
                if (sched && backend_cpu) {
                    ggml_backend_sched_set_tensor_backend(sched, cur_rows, backend_cpu);
                }
                cur_rows = ggml_reshape_3d(ctx0, cur_rows, cur->ne[0], 1, m_rows);
                ggml_tensor * out_cpu = moe_experts(up_or_gu, gate_exps, down_exps, up_or_gu_b, gate_exps_b, down_exps_b,
                                                    ids_cpu, cur_rows, true);   // [n_embd, k, M]
                // computed by the CPU branch's own kernel beside the graph where it matches: started
                // here, waited for only before its rows are added (the join, the next layers'
                // prefetch copies and the staged routes go on meanwhile)
                out_cpu = ostinato_moe_cpu_share(ctx0, out_cpu, ids_cpu, cur_rows, il);
                if (sched && backend_cpu) {
                    ggml_backend_sched_set_tensor_backend(sched, out_cpu, backend_cpu);
                }
                cb(out_cpu, "ostinato_out_cpu", il);
                ggml_build_forward_expand(gf, out_cpu);
                ggml_tensor * ids_stage = ostinato_moe_upload_join(ctx0, up_ids, out_cpu, il, k_used, n_tok);
                prefetch(ids_stage);   // after the join, which would otherwise wait for these copies too
                ostinato_moe_pool_views(ctx0, ost, false, v);
                ggml_tensor * out_stage = moe_experts(v[0], v[1], v[2], v[3], v[4], v[5], ids_stage, cur, false, true);
                cb(out_stage, "ostinato_out_upload", il);
                ggml_tensor * sum = ggml_add(ctx0, experts, out_stage);   // [n_embd, k, n]
                ggml_build_forward_expand(gf, sum);
                gather = ostinato_moe_cpu_wait(ctx0, out_cpu, gather, ids_cpu, cur_rows, il);
                const int64_t row = sum->ne[0] * sum->ne[1];
                ggml_tensor * sum2 = ggml_reshape_2d(ctx0, sum, row, n_tok);
                ggml_tensor * rows = ggml_add(ctx0, ggml_get_rows(ctx0, sum2, gather), ggml_reshape_2d(ctx0, out_cpu, row, m_rows));
                experts = ggml_reshape_3d(ctx0, ggml_set_rows(ctx0, sum2, rows, scatter), sum->ne[0], sum->ne[1], n_tok);
            }
        } else {
            ggml_tensor * ids_up = ostinato_moe_upload(ctx0, route, il);
            experts = moe_experts(ost->up_pool, ost->gate_pool, ost->down_pool,
                                  ost->up_b_pool, ost->gate_b_pool, ost->down_b_pool, ids_up, cur);
            cb(experts, "ostinato_out_upload", il);
        }
    } else {
        // split path / decode. The route op also brings cur to the host, so that the CPU branch
        // starts while the GPU branch runs (decode overlap)
        // with pool views the GPU branch runs over the layer's own slots (cold positions -1)
        const bool views = ostinato_moe_views(il, selected_experts->ne[1]);
        ggml_tensor * route = ostinato_moe_route(ctx0, selected_experts, cur, il, views);
        ggml_tensor * ids_gpu  = ggml_view_2d(ctx0, route, route->ne[0], route->ne[1], route->nb[1], 0);
        ggml_tensor * ids_cold = ggml_view_2d(ctx0, route, route->ne[0], route->ne[1], route->nb[1], route->nb[2]);
        // GPU branch: hot routes from the pool, cold positions hit zero slots (exact zeros).
        // CPU branch: cold routes from host memory; hot positions are -1, skipped and written as 0.
        // Graph order = run order: with overlap the GPU branch is launched first and the CPU branch
        // (all inputs on the host already) runs meanwhile; without, the CPU branch runs in the route
        // op's split and both branches' results go to the GPU together.
        auto gpu_branch = [&]() {
            ggml_tensor * v[6] = { ost->up_pool, ost->gate_pool, ost->down_pool,
                                   ost->up_b_pool, ost->gate_b_pool, ost->down_b_pool };
            if (views) {
                ostinato_moe_pool_views(ctx0, ost, true, v);
            }
            ggml_tensor * out = moe_experts(v[0], v[1], v[2], v[3], v[4], v[5], ids_gpu, cur, false, views);
            cb(out, "ostinato_out_gpu", il);
            ggml_build_forward_expand(gf, out);
            if (ostinato_moe_timing() && n_tokens_pass == 1) {
                ggml_build_forward_expand(gf, ostinato_moe_mark(ctx0, out, il, 1));
            }
            return out;
        };
        auto cpu_branch = [&]() {
            ggml_tensor * out = moe_experts(up_or_gu, gate_exps, down_exps, up_or_gu_b, gate_exps_b, down_exps_b,
                                            ids_cold, cur, true);
            cb(out, "ostinato_out_cpu", il);
            ggml_build_forward_expand(gf, out);
            ggml_build_forward_expand(gf, ostinato_moe_mark(ctx0, out, il, 2));
            return out;
        };
        ggml_tensor * out_gpu  = nullptr;
        ggml_tensor * out_cold = nullptr;
        if (ostinato_moe_overlap()) {
            out_gpu  = gpu_branch();
            out_cold = cpu_branch();
        } else {
            out_cold = cpu_branch();
            out_gpu  = gpu_branch();
        }
        // each position is exact in one branch and exactly 0 in the other: x + 0 == x
        experts = ggml_add(ctx0, out_gpu, out_cold);
    }
    return experts;
}
