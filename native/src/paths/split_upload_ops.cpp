// Expert engine: the CPU custom ops of the split and upload paths (route, upload, prefetch, join,
// timing marker) and the expert copies they make. See engine/engine.h.
#include "engine/engine.h"
#include "cpu_branch/kernel.h"
#include "paths/hybrid_split.h"

namespace ost {

// Route op (custom CPU op, n_tasks = 1): reads selected_experts [k, n_tokens] (possibly a strided
// view), counts the routes into the current pass and writes the two planes of ids (see the header).
// With pool views plane 0 indexes the layer's hot view (hot -> slot - hot0, else -1).
void route_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ggml_tensor * a = dst->src[0];
    const int il = op_ud_layer(ud);
    const bool views = op_ud_views(ud);
    const int64_t k = a->ne[0], n = a->ne[1];
    int32_t * g = (int32_t *) dst->data;
    int32_t * c = g + k * n;
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    const bool ok = e && il >= 0 && il < e->n_layer;
    const bool split = ok && e->layers[il].has_hot;
    const int zero0 = split ? e->layers[il].zero0 : 0;
    const int hot0 = split ? e->layers[il].hot0 : 0, hot1 = split ? hot0 + e->layers[il].n_hot : 0;
    // a decode pass by its token count, as the decode graph's counter has it (the last layer of a
    // prefill sees only the output rows, often one)
    const bool decode = ok && e->cur.tokens == 1;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t x = *(const int32_t *) ((const char *) a->data + t * a->nb[1] + j * a->nb[0]);
            const int64_t i = t * k + j;
            if (!ok || x < 0 || x >= e->n_expert) { g[i] = x; c[i] = x; continue; }
            const int32_t s = count_route(e, il, x, decode);
            if (views) {
                // a slot outside the layer's hot range (a borrowed one; they are handed back before
                // such passes) is computed by the CPU branch
                const bool in = s >= hot0 && s < hot1;
                g[i] = in ? s - hot0 : -1;
                c[i] = in ? -1 : x;
            } else if (s >= 0) {
                g[i] = s; c[i] = -1;
            } else {
                g[i] = split ? zero0 + (int32_t) j : x;   // a zero slot per position: exact zeros
                c[i] = x;
            }
        }
    }
    if (ok) e->mark_us[il] = now_us();
    if (ok && views && split) e->cur.views = true;
}

// The weight matrices (up or gate_up, gate, down) of layer il's expert 0 and pool slot 0 as the rows
// of one 2D copy: each the same bytes per expert, the host tensors in host memory, one positive pitch
// between consecutive rows (by host address) in host memory and one in the pool, the rows in the same
// order in both, one slot stride for all parts. Height 0 when they are not. Computed once per layer at
// the pool build (the addresses do not change until the next one).
rows_2d_t layout_2d(const engine_t * e, int il) {
    const auto & L = e->model->layers[il];
    const auto & ol = e->layers[il];
    struct row_t { const char * src; char * dst; };
    const auto w = weight_parts(L, ol.up_pool, ol.gate_pool, ol.down_pool);
    const ggml_tensor * src0 = w[0].first;
    const ggml_tensor * dst0 = w[0].second;
    if (!src0 || !dst0) return {};
    const size_t nb = src0->nb[2], stride = dst0->nb[2];
    std::vector<row_t> rows;
    for (auto [src, dst] : w) {
        if (!src || !dst || src->nb[2] != nb || dst->nb[2] != stride || stride < nb || !src->buffer ||
            !ggml_backend_buffer_is_host(src->buffer)) return {};
        rows.push_back({(const char *) src->data, (char *) dst->data});
    }
    std::sort(rows.begin(), rows.end(), [](const row_t & a, const row_t & b) { return a.src < b.src; });
    const ptrdiff_t sp = rows[1].src - rows[0].src, dp = rows[1].dst - rows[0].dst;
    if (sp < (ptrdiff_t) nb || dp < (ptrdiff_t) nb) return {};
    for (size_t i = 2; i < rows.size(); ++i) {
        if (rows[i].src - rows[i - 1].src != sp || rows[i].dst - rows[i - 1].dst != dp) return {};
    }
    rows_2d_t r;
    r.src = rows[0].src; r.dst = rows[0].dst;
    r.spitch = (size_t) sp; r.dpitch = (size_t) dp; r.width = nb; r.height = rows.size();
    r.src_stride = nb; r.dst_stride = stride;
    return r;
}

// Experts x0 .. x0+m-1 of layer il into slots s0 .. s0+m-1 as one 2D copy (layer il's layout_2d moved
// to them, m matrices wide): a run is one 2D copy where its slices are contiguous in the pool too, so
// with whole-expert slots (pool tensors strided by a slot) only one expert's. False (r unchanged) when
// it is not one 2D copy.
bool copy_rows_2d(const engine_t * e, int il, int x0, int s0, int m, rows_2d_t & r) {
    const rows_2d_t & b = e->rows_2d[il];
    const size_t width = (size_t) m * b.width;
    if (b.height == 0 || (m > 1 && b.dst_stride != b.src_stride) || width > b.spitch || width > b.dpitch) return false;
    // the checks ggml_backend_tensor_set would make: within the host and pool tensors
    GGML_ASSERT(x0 >= 0 && s0 >= 0 && x0 + m <= e->n_expert && s0 + m <= e->layers[il].down_pool->ne[2]);
    r = b;
    r.src += (size_t) x0 * b.src_stride;
    r.dst += (size_t) s0 * b.dst_stride;
    r.width = width;
    return true;
}

bool set_2d_host(ggml_backend_t, void * dst, size_t dpitch, const void * src, size_t spitch, size_t width,
                 size_t height) {
    for (size_t i = 0; i < height; ++i) std::memcpy((char *) dst + i * dpitch, (const char *) src + i * spitch, width);
    return true;
}

// Copies the experts x with copy[x] set into slot[x] of layer il's pool tensors (weights and
// biases; one expert = one ne[2] slice of a weight tensor, one row of a bias tensor), asynchronously on
// `stream` (a GPU pool's upload or prefetch backend), else (null: a CPU pool) synchronously; runs of
// consecutive experts in consecutive slots go in one copy. With the pool's 2D copy (pool_t::set_2d: the
// GPU backend's, or row by row into a CPU pool; the options' upload_copy_2d) a run's weight matrices go in one 2D copy
// when they sit at one pitch in host memory and in the pool, as llama.cpp's files and build_engine's
// pool layout put them: the copy
// engine moves 2.65 MB per transfer instead of 0.88 MB on the 48-layer Qwen3-30B-A3B shape at Q4_0,
// 108.7 against 120.0 ms for one prefill's 5.6 GB (docs/benchmarks/h2d-h200.json). The GPU backend
// refuses a pitch above the device's maximum (2^31 - 1 bytes: a 45% pool of that shape has 2.45 GB
// class tensors), and such runs go matrix by matrix. Counts the bytes and copy calls into the pass.
// Caller holds g_mu.
void stage_experts(engine_t * e, int il, const std::vector<int32_t> & slot, const std::vector<uint8_t> & copy,
                   ggml_backend_t stream) {
    const auto & L = e->model->layers[il];
    const auto & ol = e->layers[il];
    const pool_t & pool = e->pools[e->layer_pool[il]];
    // a run of m experts whose slices are contiguous in the pool tensor too (not so with whole-expert
    // slots, whose runs are one expert long)
    auto put = [&](const ggml_tensor * src, ggml_tensor * dst, int x0, int s0, int m) {
        const int d = ggml_n_dims(src) >= 3 ? 2 : 1;
        const size_t nb = src->nb[d];
        const size_t sz = (size_t) m * nb;
        GGML_ASSERT(m == 1 || dst->nb[d] == nb);
        const size_t at = (size_t) s0 * dst->nb[d];
        if (src->buffer && ggml_backend_buffer_is_host(src->buffer)) {
            const char * p = (const char *) src->data + (size_t) x0 * nb;
            if (stream) ggml_backend_tensor_set_async(stream, dst, p, at, sz);
            else                   ggml_backend_tensor_set(dst, p, at, sz);
        } else {
            std::vector<uint8_t> tmp(sz);
            ggml_backend_tensor_get(src, tmp.data(), (size_t) x0 * nb, sz);
            ggml_backend_tensor_set(dst, tmp.data(), at, sz);
        }
        e->cur.upload_bytes += (int64_t) sz;
        e->cur.upload_copies++;
    };
    size_class_t & cls = e->classes[e->layer_class[il]];
    auto put_2d = [&](int x0, int s0, int m) {
        if (!pool.set_2d || !e->opts.upload_copy_2d || cls.copy_2d_refused) return false;
        rows_2d_t r;
        if (!copy_rows_2d(e, il, x0, s0, m, r)) return false;
        if (!pool.set_2d(stream, r.dst, r.dpitch, r.src, r.spitch, r.width, r.height)) {
            cls.copy_2d_refused = true;   // the class's pitch: not worth asking again per copy
            return false;
        }
        e->cur.upload_bytes += (int64_t) (r.width * r.height);
        e->cur.upload_copies++;
        return true;
    };
    const bool whole = cls.whole_slots;
    for (int x = 0; x < e->n_expert;) {
        if (!copy[x]) { ++x; continue; }
        int m = 1;
        while (!whole && x + m < e->n_expert && copy[x + m] && slot[x + m] == slot[x] + m) ++m;
        if (!put_2d(x, slot[x], m)) {
            for (auto [src, dst] : weight_parts(L, ol.up_pool, ol.gate_pool, ol.down_pool)) put(src, dst, x, slot[x], m);
        }
        for (auto [src, dst] : bias_parts(L, ol.up_b_pool, ol.gate_b_pool, ol.down_b_pool)) put(src, dst, x, slot[x], m);
        x += m;
    }
}

// Routes of one expert from which ggml-cpu would compute layer il's experts with its tiled kernel
// (INT32_MAX: never); the CPU branch's own kernel takes fewer, so that its result is ggml's.
int32_t cpu_route_cap(const engine_t * e, int il) {
    const auto & ml = e->model->layers[il];
    const ggml_tensor * up = ml.ffn_gate_up_exps ? ml.ffn_gate_up_exps : ml.ffn_up_exps;
    const ggml_tensor * gate = ml.ffn_gate_exps ? ml.ffn_gate_exps : up;
    const ggml_tensor * down = ml.ffn_down_exps;
    if (!up || !gate || !down) return INT32_MAX;
    return ost_ffn_tiled_rows(up->type, gate->type, down->type);
}

// The cost model's split of layer il (paths/hybrid_split.h) over `cand` (the experts the CPU may take,
// in the order it takes them) with `routes` per expert and n_upload experts to copy without a CPU
// share: how many of cand the CPU takes. Caller holds g_mu.
size_t split_take(const engine_t * e, int il, const std::vector<int> & cand, const std::vector<int32_t> & routes,
                  int n_upload) {
    std::vector<int32_t> r(cand.size());
    for (size_t i = 0; i < cand.size(); ++i) r[i] = routes[(size_t) cand[i]];
    const double bytes = (double) e->expert_bytes[il];
    ost_split_cost sc;
    sc.alpha_us = e->opts.cpu_split_alpha_us;
    sc.beta_us = bytes / (e->opts.cpu_split_cpu_gbps * 1e3);
    sc.upload_us = bytes / (e->opts.cpu_split_h2d_gbps * 1e3);
    return (size_t) ost_split_experts(r.data(), (int) r.size(), n_upload, sc);
}

// The cold experts the CPU branch may take, in the order it takes them: ascending routes, those
// `eligible` says may go to the CPU, fewer routes than `cap` (ggml-cpu's tiled kernel, see
// cpu_route_cap), at most `limit`, each only if its tokens (`toks_of`) still fit the M = m_rows rows
// of the CPU part together with those taken before it.
template <class Eligible>
std::vector<int> cpu_candidates(const std::vector<int32_t> & routes, const std::vector<std::vector<int32_t>> & toks_of,
                                int64_t n_tok, int64_t m_rows, int32_t cap, size_t limit, Eligible eligible) {
    std::vector<int> order;
    for (int x = 0; x < (int) routes.size(); ++x) {
        if (routes[(size_t) x] > 0 && routes[(size_t) x] < cap && eligible(x)) order.push_back(x);
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return routes[(size_t) a] < routes[(size_t) b]; });
    std::vector<uint8_t> tok_in((size_t) n_tok, 0);
    std::vector<int> cand;
    int64_t m = 0;
    for (int x : order) {
        if (cand.size() >= limit) break;
        int64_t add = 0;
        for (int32_t t : toks_of[(size_t) x]) add += !tok_in[(size_t) t];
        if (m + add > m_rows) continue;
        for (int32_t t : toks_of[(size_t) x]) tok_in[(size_t) t] = 1;
        m += add;
        cand.push_back(x);
    }
    return cand;
}

// Cold experts of a pass (routes > 0): with a prefetch, the layer's copies whoever makes them.
int count_cold(const std::vector<int32_t> & routes) {
    return (int) std::count_if(routes.begin(), routes.end(), [](int32_t r) { return r > 0; });
}

// A prefetch for a layer whose upload pass gives the CPU a share by the cost model: the predicted
// experts the split would leave to the CPU branch (the fewest predicted routes first, within its M
// rows by predicted tokens and the tiled-kernel cap) are not copied (`want` cleared), so that the
// copies the layers share the link for carry only what the GPU computes. The upload op decides
// again with the real routes, counting this layer's prefetched experts as its uploads. Caller
// holds g_mu.
void leave_to_cpu(const engine_t * e, int il, const ggml_tensor * pred, const std::vector<int32_t> & routes,
                  std::vector<uint8_t> & want) {
    std::vector<std::vector<int32_t>> toks_of((size_t) e->n_expert);   // predicted tokens per wanted expert
    for (int64_t t = 0; t < pred->ne[1]; ++t) {
        for (int64_t j = 0; j < pred->ne[0]; ++j) {
            const int32_t x = *(const int32_t *) ((const char *) pred->data + t * pred->nb[1] + j * pred->nb[0]);
            if (x >= 0 && x < e->n_expert && want[(size_t) x]) toks_of[(size_t) x].push_back((int32_t) t);
        }
    }
    const std::vector<int> cand = cpu_candidates(routes, toks_of, pred->ne[1], std::min<int64_t>(pred->ne[1], e->opts.hybrid_rows),
                                                 e->opts.cpu_branch_kernel ? cpu_route_cap(e, il) : INT32_MAX, SIZE_MAX,
                                                 [&](int x) { return want[(size_t) x] != 0; });
    const size_t take = split_take(e, il, cand, routes, count_cold(routes));
    for (size_t i = 0; i < take; ++i) want[(size_t) cand[i]] = 0;
}

// Prefetch op (CPU, n_tasks = 1; see ostinato_moe_prefetch): reads a prediction for layer il (pred
// [k, n], possibly a strided view), starts the copies of its cold experts that no earlier prediction
// of this pass brought into the next free slots of il's staging region (ascending expert ids), on the
// pool's prefetch stream, records them for il's upload op and an event after them; does not wait. The
// prediction only moves copies earlier: il's upload op stages what was not predicted and never reads a
// slot it did not account for.
void prefetch_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    std::memset(dst->data, 0, ggml_nbytes(dst));
    const ggml_tensor * pred = dst->src[0];
    const int il = op_ud_layer(ud);
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || !e->prefetch || il < 0 || il >= e->n_layer || !e->layers[il].has_hot) return;
    const int64_t t0 = now_us();
    const auto & ol = e->layers[il];
    auto & pf = e->pf_slot[il];
    std::vector<uint8_t> want(e->n_expert, 0);
    std::vector<int32_t> routes(e->n_expert, 0);   // predicted routes per cold expert
    for (int64_t t = 0; t < pred->ne[1]; ++t) {
        for (int64_t j = 0; j < pred->ne[0]; ++j) {
            const int32_t x = *(const int32_t *) ((const char *) pred->data + t * pred->nb[1] + j * pred->nb[0]);
            if (x >= 0 && x < e->n_expert && e->slot[il][x] < 0) {
                routes[x]++;
                if (pf[x] < 0) want[x] = 1;
            }
        }
    }
    if (split_on(e->opts) && e->opts.upload_cpu_share == 0) leave_to_cpu(e, il, pred, routes, want);
    int used = 0;   // slots of the region taken by earlier predictions for il
    for (int x = 0; x < e->n_expert; ++x) if (pf[x] >= 0) used = std::max(used, pf[x] - ol.view_stage0 + 1);
    std::vector<int32_t> slot(e->n_expert, -1);
    bool any = false;
    for (int x = 0; x < e->n_expert; ++x) {
        if (!want[x]) continue;
        slot[x] = pf[x] = ol.view_stage0 + used++;
        any = true;
    }
    GGML_ASSERT(used <= ol.n_stage);   // at most the layer's cold experts, which the region holds
    e->pf_ran[il] = 1;
    if (any) {
        pool_t & p = e->pools[e->layer_pool[il]];
        stage_experts(e, il, slot, want, p.prefetch_backend ? p.prefetch_backend : p.upload_backend);
        if (p.prefetch_backend) {   // it exists only with an event per layer
            ggml_backend_event_record(p.pf_event[il], p.prefetch_backend);
            e->pf_pending[il] = 1;
        }
    }
    e->cur.upload_ms += (now_us() - t0) / 1000.0;
}

// Waits for layer il's copies: its pool's upload stream (the upload op's own copies) and the
// prefetch copies recorded for il (an event on the prefetch stream, which may already run copies for
// later layers). Caller holds g_mu.
void join_copies(engine_t * e, int il) {
    pool_t & p = e->pools[e->layer_pool[il]];
    if (p.upload_backend) ggml_backend_synchronize(p.upload_backend);
    if (e->pf_pending[il]) {
        if (p.pf_event[il]) ggml_backend_event_synchronize(p.pf_event[il]);
        e->pf_pending[il] = 0;
    }
}

// Custom CPU op of the upload path (Section 3.3, n_tasks = 1): for layer il, copies each distinct
// cold expert of the pass once from host memory into the staging slots of the pool (ascending expert
// ids into ascending slots, so runs of consecutive cold experts go in one copy; asynchronous on the
// engine's own stream) and writes pool ids: hot -> its slot, cold -> its staging slot. Hot experts
// are never uploaded. Unless hybrid the copies are joined here and the output is [k, n]; with pool
// views it indexes the staging view (cold -> slot - stage0, hot -> -1), and the hot routes, launched
// before this op in graph order, compute while the copies run.
//
// A hybrid upload op (dst I32 [k*n + k*M + 2*M], layout in ostinato.h) leaves distinct cold
// experts with the fewest routes (as many as the cost model's split gives, or a share, see
// upload_share; touching at most M tokens) to a CPU branch over those M tokens only and uploads the
// others. The copies are not joined here: the CPU
// branch runs while they do, and upload_join_op joins them before the staged routes run. The hot
// routes run over the hot view, launched before this op in graph order, so the GPU computes them
// meanwhile.
void upload_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ggml_tensor * route = dst->src[0];
    const int il = op_ud_layer(ud);
    const bool views = op_ud_views(ud);
    const bool hybrid = op_ud_hybrid(ud);
    const int64_t k = route->ne[0], n = route->ne[1];
    const int32_t * g = (const int32_t *) route->data;   // plane 0: hot -> slot
    const int32_t * c = g + k * n;                        // plane 1: cold -> expert, hot -> -1
    int32_t * out = (int32_t *) dst->data;
    // hybrid: the CPU branch's ids [k, M], then the tokens it gathers [M] and the rows it scatters to [M]
    const int64_t m_rows = hybrid ? (ggml_nelements(dst) - k * n) / (k + 2) : 0;
    int32_t * out_cpu = hybrid ? out + k * n : nullptr;
    int32_t * gather = hybrid ? out_cpu + k * m_rows : nullptr;
    int32_t * scatter = hybrid ? gather + m_rows : nullptr;
    std::vector<uint8_t> tok_in(hybrid ? n : 0, 0);   // token in the CPU branch's rows
    // fills the CPU branch's rows from on_cpu: its tokens in order, then distinct other tokens with
    // all ids -1 (outputs 0, scattered onto rows that get + 0)
    auto cpu_rows = [&](const std::vector<uint8_t> & on_cpu) {
        int64_t r = 0;
        for (int64_t t = 0; t < n && r < m_rows; ++t) {
            if (!tok_in[t]) continue;
            gather[r] = scatter[r] = (int32_t) t;
            for (int64_t j = 0; j < k; ++j) {
                const int32_t x = c[t * k + j];
                out_cpu[r * k + j] = x >= 0 && x < (int32_t) on_cpu.size() && on_cpu[x] ? x : -1;
            }
            r++;
        }
        for (int64_t t = 0; t < n && r < m_rows; ++t) {
            if (tok_in[t]) continue;
            gather[r] = scatter[r] = (int32_t) t;
            for (int64_t j = 0; j < k; ++j) out_cpu[r * k + j] = -1;
            r++;
        }
    };
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || il < 0 || il >= e->n_layer || !e->layers[il].has_hot) {
        for (int64_t i = 0; i < k * n; ++i) out[i] = views ? -1 : g[i];
        if (hybrid) cpu_rows({});
        return;
    }
    const int64_t t0 = now_us();
    const auto & ol = e->layers[il];
    ggml_backend_t upload_backend = e->pools[e->layer_pool[il]].upload_backend;   // the layer's device
    std::vector<int32_t> tokens(e->n_expert, 0);   // routes per cold expert in this pass
    for (int64_t i = 0; i < k * n; ++i) if (c[i] >= 0 && c[i] < e->n_expert) tokens[c[i]]++;
    std::vector<uint8_t> on_cpu(e->n_expert, 0);
    if (hybrid) {
        // the CPU takes cold experts with the fewest routes (cheap there, while each upload costs a
        // whole expert's bytes): a share of them (fixed or adapted, for measurements) or as many as
        // the cost model says end no later than the uploads of the rest (paths/hybrid_split.h); not one
        // a prefetch is bringing over already, only ones whose tokens fit its M rows, and, where the
        // CPU branch's own kernel computes them, fewer routes than ggml-cpu would tile (its arithmetic)
        const bool by_share = e->opts.upload_cpu_share != 0;
        const int n_cold = count_cold(tokens);   // the layer's copies: a prefetch's count as much as the upload op's own
        const size_t limit = by_share ? (size_t) std::lround(upload_share(e, upload_backend != nullptr) * (double) n_cold)
                                      : SIZE_MAX;
        std::vector<std::vector<int32_t>> toks_of(e->n_expert);   // tokens routed to each cold expert
        for (int64_t i = 0; i < k * n; ++i) if (c[i] >= 0 && c[i] < e->n_expert) toks_of[c[i]].push_back((int32_t) (i / k));
        // not one a prefetch is bringing over already
        const std::vector<int> cand = cpu_candidates(tokens, toks_of, n, m_rows, e->opts.cpu_branch_kernel ? cpu_route_cap(e, il) : INT32_MAX,
                                                     limit, [&](int x) { return e->pf_slot[il][x] < 0; });
        const size_t take = by_share ? cand.size() : split_take(e, il, cand, tokens, n_cold);
        for (size_t i = 0; i < take; ++i) {
            for (int32_t t : toks_of[cand[i]]) tok_in[t] = 1;
            on_cpu[cand[i]] = 1;
        }
        cpu_rows(on_cpu);
    }
    // staging slots: pool-view passes stage in the layer's region (view_stage0), where a prefetch may
    // have put some of the experts already (they take its first slots)
    const int base = views ? ol.view_stage0 : ol.stage0;
    auto & pf = e->pf_slot[il];
    int used = 0;
    if (views) for (int x = 0; x < e->n_expert; ++x) if (pf[x] >= 0) used = std::max(used, pf[x] - base + 1);
    std::vector<int32_t> slot(e->n_expert, -1);
    std::vector<uint8_t> copy(e->n_expert, 0);
    for (int x = 0; x < e->n_expert; ++x) {
        const bool need = tokens[x] > 0 && !on_cpu[x];
        if (views && pf[x] >= 0) {
            if (need) { slot[x] = pf[x]; e->cur.prefetch_hits++; }
            else      { e->cur.prefetch_wasted++; }
        } else if (need) {
            slot[x] = base + used++;
            copy[x] = 1;
            if (views && e->pf_ran[il]) e->cur.prefetch_misses++;
        }
    }
    GGML_ASSERT(used <= ol.n_stage && base + used <= ol.down_pool->ne[2]);   // within the layer's region
    stage_experts(e, il, slot, copy, upload_backend);
    std::fill(pf.begin(), pf.end(), -1);
    e->pf_ran[il] = 0;
    for (int64_t i = 0; i < k * n; ++i) {
        const int32_t x = c[i];
        const bool cold = x >= 0 && x < e->n_expert;
        if (views) {
            out[i] = cold && !on_cpu[x] ? slot[x] - base : -1;
        } else {
            out[i] = cold ? slot[x] : g[i];
        }
    }
    if (!hybrid) join_copies(e, il);
    e->cur.upload_ms += (now_us() - t0) / 1000.0;
    e->mark_us[il] = now_us();
}

// Share of a hybrid upload pass's distinct cold experts left to the CPU: the fixed share of the
// options, else the engine's adapted one (upload_join_op); 0 without an upload stream (a CPU pool:
// the "upload" is a memcpy). Caller holds g_mu.
double upload_share(const engine_t * e, bool has_stream) {
    if (e->opts.upload_cpu_share >= 0) return e->opts.upload_cpu_share;
    return has_stream ? e->upload_cpu_share : 0.0;
}

// Join of a hybrid upload pass (CPU op, n_tasks = 1; sources: the upload op's output, and the CPU
// share's launch op only to run after it): waits for layer il's copies and returns the first part of
// the upload op's output, the staged routes' ids [k, n]. The CPU share runs meanwhile, beside the
// graph (ostinato_moe_cpu_share). The adapted CPU share moves towards the point where the CPU share
// and the copies end together: a wait here means the copies were the longer part (the CPU takes
// more next time); a wait for the CPU share (its wait op) means the CPU was (it takes fewer).
void upload_join_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ggml_tensor * up = dst->src[0];
    std::memcpy(dst->data, up->data, ggml_nbytes(dst));
    const int il = op_ud_layer(ud);
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || il < 0 || il >= e->n_layer || e->layer_pool[il] < 0) return;
    const int64_t t0 = now_us();

    if (!e->pools[e->layer_pool[il]].upload_backend) return;
    join_copies(e, il);
    const int64_t t1 = now_us();
    e->cur.upload_ms += (t1 - t0) / 1000.0;
    e->mark_us[il] = t1;
    if (e->opts.upload_cpu_share < 0 && t1 - t0 > ADAPT_WAITED_US) {
        e->upload_cpu_share = std::min(1.0, e->upload_cpu_share + ADAPT_STEP);
    }
}

// Custom CPU op used as a timestamp after a branch: kind 1 = GPU branch, 2 = CPU branch, 3 = upload
// branch. The time since the layer's previous marker (route op, upload op or GPU marker) is added to
// the branch's total.
void mark_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    std::memset(dst->data, 0, ggml_nbytes(dst));
    const intptr_t v = (intptr_t) ud;
    const int il = (int) (v >> 2), kind = (int) (v & 3);
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || il < 0 || il >= e->n_layer) return;
    const int64_t t = now_us();
    const double ms = (t - e->mark_us[il]) / 1000.0;
    if (kind == 2) {
        e->cur.cpu_ms += ms;
    } else {
        e->cur.gpu_ms += ms;
        e->cur.gpu_timed = true;
    }
    e->mark_us[il] = t;
}

}  // namespace ost
