// Expert engine: route counting (passes, totals, count tables, decode-graph reports) and its stats JSON.
#include "engine/engine.h"

namespace ost {

void totals_init(totals_t & t, size_t n) {
    t = totals_t();
    t.counts_prefill.assign(n, 0);
    t.counts_decode.assign(n, 0);
}

json totals_json(const engine_t & e, const totals_t & t, bool with_counts) {
    json j;
    j["passes"] = t.passes; j["tokens"] = t.tokens; j["routes"] = t.routes;
    j["hot_routes"] = t.hot; j["cold_routes"] = t.cold;
    j["hot_route_share"] = t.routes ? double(t.hot) / double(t.routes) : 0.0;
    j["distinct_cold_experts"] = t.distinct_cold; j["upload_bytes"] = t.upload_bytes;
    j["upload_copies"] = t.upload_copies;
    j["borrowed_routes"] = t.borrowed;
    j["cpu_branch_ms"] = t.cpu_ms; j["gpu_branch_ms"] = t.gpu_ms; j["upload_ms"] = t.upload_ms;
    j["total_ms"] = t.total_ms;
    j["cpu_branch_bytes"] = t.cpu_bytes; j["cpu_branch_layers"] = t.cpu_layers;
    j["cpu_kernel_layers"] = t.cpu_kernel_layers; j["join_wait_ms"] = t.join_wait_ms;
    j["cpu_share_wait_ms"] = t.cpu_wait_ms;
    j["decode_prefetch_staged"] = t.dpf_staged; j["decode_prefetch_routes"] = t.dpf_routes;
    j["decode_prefetch_used"] = t.dpf_used; j["decode_prefetch_bytes"] = t.dpf_bytes;
    const ost_dg_timeline & tl = t.timeline;
    j["decode_timeline"] = json{{"passes", tl.passes}, {"span_ms", tl.span_ms},
                                {"cpu_layers", tl.cpu_layers}, {"cpu_ms", tl.cpu_ms}, {"cpu_wait_ms", tl.cpu_wait_ms},
                                {"gpu_layers", tl.gpu_layers}, {"gpu_ms", tl.gpu_ms},
                                {"chain_layers", tl.chain_layers}, {"chain_ms", tl.chain_ms},
                                {"chain_copy_ms", tl.chain_copy_ms}, {"chain_wait_ms", tl.chain_wait_ms},
                                {"chain_late", tl.chain_late}};
    j["paths"] = json::object();
    for (const char * p : {"decode", "split", "upload"}) j["paths"][p] = 0;
    for (auto & kv : t.paths) j["paths"][kv.first] = kv.second;
    j["decode_graph_steps"] = t.graph_steps;
    if (with_counts) {
        json cp = json::array(), cd = json::array();
        for (int il = 0; il < e.n_layer; ++il) {
            json rp = json::array(), rd = json::array();
            for (int x = 0; x < e.n_expert; ++x) {
                rp.push_back(t.counts_prefill[(size_t) il * e.n_expert + x]);
                rd.push_back(t.counts_decode[(size_t) il * e.n_expert + x]);
            }
            cp.push_back(rp); cd.push_back(rd);
        }
        j["counts_prefill"] = cp; j["counts_decode"] = cd;
    }
    return j;
}

json pass_json(const pass_t & p) {
    return json{{"tokens", p.tokens}, {"routes", p.routes}, {"hot_routes", p.hot},
                {"cold_routes", p.cold}, {"distinct_cold_experts", p.distinct_cold}, {"path", p.path},
                {"cpu_branch_ms", p.cpu_ms}, {"gpu_branch_ms", p.gpu_ms}, {"gpu_timed", p.gpu_timed},
                {"upload_bytes", p.upload_bytes}, {"upload_copies", p.upload_copies}, {"upload_ms", p.upload_ms}, {"total_ms", p.total_ms},
                {"decode_graph", p.graph}, {"pool_views", p.views}, {"prefetch_hits", p.prefetch_hits},
                {"prefetch_misses", p.prefetch_misses}, {"prefetch_wasted", p.prefetch_wasted},
                {"cpu_branch_bytes", p.cpu_bytes}, {"cpu_branch_layers", p.cpu_layers},
                {"cpu_kernel_layers", p.cpu_kernel_layers}, {"cpu_share_wait_ms", p.cpu_wait_ms},
                {"decode_prefetch_staged", p.dpf_staged},
                {"decode_prefetch_routes", p.dpf_routes}, {"decode_prefetch_used", p.dpf_used},
                {"decode_prefetch_bytes", p.dpf_bytes}};
}

// Counts one route (layer il, expert x) into the current pass and the totals; returns the expert's
// pool slot (>= 0: hot) or -1 (cold). Caller holds g_mu.
int32_t count_route(engine_t * e, int il, int32_t x, bool decode) {
    const size_t idx = (size_t) il * e->n_expert + x;
    (decode ? e->total.counts_decode : e->total.counts_prefill)[idx]++;
    (decode ? e->request.counts_decode : e->request.counts_prefill)[idx]++;
    e->cur.routes++;
    const int32_t s = e->slot[il][x];
    pool_t * pool = e->layer_pool[il] >= 0 ? &e->pools[e->layer_pool[il]] : nullptr;
    if (pool) pool->routes++;
    if (s >= 0) {
        e->cur.hot++;
        if (pool) pool->hot_routes++;
        if (!e->hot[il][x]) e->cur.borrowed++;
    } else {
        e->cur.cold++;
        if (!e->cold_seen[idx]) { e->cold_seen[idx] = 1; e->cur.distinct_cold++; }
        if (decode) e->cpu_use[idx] += 1.0f;
    }
    return s;
}

// Route counts of a decode-graph layer, reported by the decode graph's worker thread.
void dg_count(void * ud, int il, int k, const int32_t * ids, const ost_dg_layer_pass & p) {
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (e != (engine_t *) ud || il < 0 || il >= e->n_layer) return;
    const bool decode = e->cur.tokens == 1;
    for (int64_t i = 0; i < (int64_t) p.n * k; ++i) {
        if (ids[i] >= 0 && ids[i] < e->n_expert) count_route(e, il, ids[i], decode);
    }
    e->cur.cpu_ms += p.cpu_ms;
    e->cur.cpu_bytes += p.cpu_bytes;
    e->cur.cpu_layers += p.kernel != 0;
    e->cur.cpu_kernel_layers += p.kernel == 1;
    e->cur.dpf_staged += p.n_staged;
    e->cur.dpf_routes += p.staged_routes;
    e->cur.dpf_used += p.staged_used;
    e->cur.dpf_bytes += (int64_t) p.n_staged * e->expert_bytes[il];
}

void collect_dg_stats(engine_t * e, bool timeline) {
    if (!e || !e->dg) return;
    const double ms = ost_dg_collect_wait(e->dg);
    e->total.join_wait_ms += ms;
    e->request.join_wait_ms += ms;
    if (!timeline) return;
    const ost_dg_timeline tl = ost_dg_collect_timeline(e->dg);
    e->total.timeline.add(tl);
    e->request.timeline.add(tl);
}

// Count op on the CPU (a CPU pool's all-resident layers; n_tasks = 1; same effect as
// ost_count_kernel, see decode_graph/decode_ops.h): adds each route of the source layers to the count table.
void count_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth; (void) ud;
    if (ith != 0) return;
    const ggml_tensor * table = dst->src[0];
    int32_t * c = (int32_t *) table->data;
    const int64_t n_expert = table->ne[0];
    for (int i = 1; i < GGML_MAX_SRC && dst->src[i]; ++i) {
        const ggml_tensor * sel = dst->src[i];
        const int32_t il = dst->op_params[OSTINATO_COUNT_LAYERS + i - 1];
        GGML_ASSERT(il >= 0 && il < table->ne[1]);
        for (int64_t t = 0; t < sel->ne[1]; ++t) {
            for (int64_t j = 0; j < sel->ne[0]; ++j) {
                const int32_t x = *(const int32_t *) ((const char *) sel->data + t * sel->nb[1] + j * sel->nb[0]);
                // relaxed atomics: flush_counts may read the table meanwhile (a stats call)
                if (x >= 0 && x < n_expert) __atomic_fetch_add(&c[il * n_expert + x], 1, __ATOMIC_RELAXED);
            }
        }
    }
}

// Reads each pool's count table (all-resident layers, see decode_graph/decode_ops.h) and adds what it gained
// since the last read to the totals, the request's counts and the pool's routes (all hot). The table
// only grows (modulo 2^32), so a read while a pass still runs loses nothing: the rest comes with the
// next read. Caller holds g_mu.
void flush_counts(engine_t * e) {
    if (!e) return;
    for (auto & p : e->pools) {
        if (!p.counts) continue;
        const size_t n = (size_t) ggml_nelements(p.counts), plane = n / 2;
        std::vector<int32_t> now(n);
        ggml_backend_tensor_get(p.counts, now.data(), 0, n * sizeof(int32_t));
        if (p.counts_seen.size() != n) p.counts_seen.assign(n, 0);
        for (size_t i = 0; i < n; ++i) {
            const int64_t d = (int64_t) (uint32_t) ((uint32_t) now[i] - (uint32_t) p.counts_seen[i]);
            if (d == 0) continue;
            const bool decode = i >= plane;
            const size_t idx = i % plane;   // layer * n_expert + expert
            for (totals_t * t : {&e->total, &e->request}) {
                (decode ? t->counts_decode : t->counts_prefill)[idx] += d;
                t->routes += d;
                t->hot += d;
            }
            p.routes += d;
            p.hot_routes += d;
        }
        p.counts_seen = std::move(now);
    }
}

}  // namespace ost
