// The CPU branch alone on a loaded model's expert tensors (C API ostinato_cpu_branch_bench): the
// CPU branch's own kernel (ostinato_cpuffn.h) against llama.cpp's own CPU MUL_MAT_ID graph on the
// same tensors, inputs and thread counts, and the host's read bandwidth, in one call. Serves
// `ostinato bench cpu-branch`, the calibration (the CPU branch's bandwidth per thread count) and the
// op-level test of the kernel and of native/patches/23 (outputs compared bit for bit).
#include "ostinato_engine.h"
#include "ostinato_cpuffn.h"

#include "ggml-cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct read_ctx {
    const uint8_t * p;
    size_t n;
    std::vector<uint64_t> * sums;
};

// Reads its slice of the buffer (16-byte loads, four accumulators) so that the loads are the cost.
void read_fn(void * c, int ith, int nth) {
    const read_ctx & r = *(const read_ctx *) c;
    const size_t per = (r.n / (size_t) nth) & ~size_t(255);
    const uint8_t * p = r.p + per * (size_t) ith;
    const size_t len = ith == nth - 1 ? r.n - per * (size_t) ith : per;
    uint64_t s = 0;
#if defined(__x86_64__) || defined(_M_X64)
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 64 <= len; i += 64) {
        a0 = _mm_add_epi64(a0, _mm_load_si128((const __m128i *) (p + i)));
        a1 = _mm_add_epi64(a1, _mm_load_si128((const __m128i *) (p + i + 16)));
        a2 = _mm_add_epi64(a2, _mm_load_si128((const __m128i *) (p + i + 32)));
        a3 = _mm_add_epi64(a3, _mm_load_si128((const __m128i *) (p + i + 48)));
    }
    alignas(16) uint64_t t[2];
    _mm_store_si128((__m128i *) t, _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3)));
    s = t[0] + t[1];
#else
    const uint64_t * q = (const uint64_t *) p;
    for (size_t i = 0; i < len / 8; ++i) s += q[i];
#endif
    (*r.sums)[(size_t) ith] = s;
}

// The experts' FFN as build_moe_ffn builds it (separate or merged gate_up), over views of the
// model's host tensors, in a CPU context of its own.
ggml_tensor * build_ffn(ggml_context * ctx, const llama_layer & L, ggml_tensor * cur, ggml_tensor * ids) {
    ggml_tensor * gate = nullptr, * up = nullptr;
    if (L.ffn_gate_up_exps) {
        ggml_tensor * gu = ggml_mul_mat_id(ctx, ggml_view_tensor(ctx, L.ffn_gate_up_exps), cur, ids);
        const int64_t n_ff = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], n_ff * gu->nb[0]);
    } else {
        up = ggml_mul_mat_id(ctx, ggml_view_tensor(ctx, L.ffn_up_exps), cur, ids);
        gate = ggml_mul_mat_id(ctx, ggml_view_tensor(ctx, L.ffn_gate_exps), cur, ids);
    }
    ggml_tensor * act = ggml_swiglu_split(ctx, gate, up);
    return ggml_mul_mat_id(ctx, ggml_view_tensor(ctx, L.ffn_down_exps), act, ids);
}

std::string g_bench_out;

}  // namespace

extern "C" const char * ostinato_cpu_branch_bench(const struct llama_model * model, const char * args_json) {
    json out;
    try {
        const json a = json::parse(args_json ? args_json : "{}");
        if (!model) throw std::runtime_error("no model");
        const int n_layer = (int) model->layers.size();
        int il = a.value("layer", -1);
        if (il < 0) {
            for (int i = 0; i < n_layer; ++i) {
                if (model->layers[(size_t) i].ffn_down_exps) { il = i; break; }
            }
        }
        if (il < 0 || il >= n_layer || !model->layers[(size_t) il].ffn_down_exps) {
            throw std::runtime_error("layer " + std::to_string(il) + " has no routed experts");
        }
        const llama_layer & L = model->layers[(size_t) il];
        const ggml_tensor * down = L.ffn_down_exps;
        if (down->buffer && !ggml_backend_buffer_is_host(down->buffer)) {
            throw std::runtime_error("the layer's experts are not in host memory (load the model on the CPU)");
        }
        const int k = (int) model->hparams.n_expert_used();
        const int64_t n_expert = down->ne[2], n_embd = down->ne[1];
        const int reps = std::max(1, a.value("reps", 10));
        const auto experts_list = a.value("experts", std::vector<int>{1, 2, 4});
        const auto tokens_list = a.value("tokens", std::vector<int>{1});
        const auto threads_list = a.value("threads", std::vector<int>{1});
        const bool with_ggml = a.value("ggml", true);
        // the kernel's software prefetch distance in rows (ost_ffn_set_prefetch_rows), per row of the grid
        const auto prefetch_list = a.value("prefetch_rows", std::vector<int>{ost_ffn_prefetch_rows()});
        if (prefetch_list.empty()) throw std::runtime_error("prefetch_rows must not be empty");
        for (int v : prefetch_list) {
            if (v < 0 || v > OST_PREFETCH_ROWS_MAX) {
                throw std::runtime_error("prefetch_rows must be 0.." + std::to_string(OST_PREFETCH_ROWS_MAX) + ", got " + std::to_string(v));
            }
        }
        const int prefetch_was = ost_ffn_prefetch_rows();
        struct restore_t { int v; ~restore_t() { ost_ffn_set_prefetch_rows(v); } } restore{prefetch_was};
        const int64_t bw_bytes = a.value("read_bw_bytes", (int64_t) 256 << 20);
        // read before every timed run, so that the experts come from memory as in a decode step
        // (whose cold experts differ layer by layer), not from a cache warmed by the run before
        const int64_t flush_bytes = a.value("flush_bytes", (int64_t) 256 << 20);
        std::vector<uint8_t> flush_buf((size_t) std::max<int64_t>(flush_bytes, 0) + 256);
        uint8_t * flush_p = (uint8_t *) (((uintptr_t) flush_buf.data() + 255) & ~uintptr_t(255));
        if (flush_bytes > 0) std::memset(flush_p, 1, (size_t) flush_bytes);
        if (threads_list.empty() || experts_list.empty() || tokens_list.empty()) {
            throw std::runtime_error("experts, tokens and threads must not be empty");
        }
        std::unique_ptr<ost_team, void (*)(ost_team *)> flush_team(
            ost_team_new(std::max(1, *std::max_element(threads_list.begin(), threads_list.end()))), ost_team_free);
        std::vector<uint64_t> flush_sums((size_t) ost_team_size(flush_team.get()));
        read_ctx flush_rc{ flush_p, (size_t) std::max<int64_t>(flush_bytes, 0), &flush_sums };
        auto flush = [&] { if (flush_bytes > 0) ost_team_run(flush_team.get(), read_fn, &flush_rc); };
        out["flush_bytes"] = flush_bytes;
        out["layer"] = il;
        out["n_expert"] = n_expert;
        out["k"] = k;
        out["n_embd"] = n_embd;
        out["merged_gate_up"] = L.ffn_gate_up_exps != nullptr;
        out["type_up"] = ggml_type_name((L.ffn_gate_up_exps ? L.ffn_gate_up_exps : L.ffn_up_exps)->type);
        out["type_down"] = ggml_type_name(down->type);

        // the host's read bandwidth, per thread count, over a buffer larger than the caches
        json bw = json::array();
        if (bw_bytes > 0) {
            std::vector<uint8_t> buf((size_t) bw_bytes + 256);
            uint8_t * p = (uint8_t *) (((uintptr_t) buf.data() + 255) & ~uintptr_t(255));
            std::memset(p, 1, (size_t) bw_bytes);
            for (int nt : threads_list) {
                ost_team * team = ost_team_new(nt);
                ost_team_set_active(team, true);
                std::vector<uint64_t> sums((size_t) nt);
                read_ctx rc{ p, (size_t) bw_bytes, &sums };
                std::vector<double> ts;
                for (int r = 0; r < std::max(3, reps / 2) + 1; ++r) {
                    const double t0 = now_ms();
                    ost_team_run(team, read_fn, &rc);
                    if (r > 0) ts.push_back(now_ms() - t0);
                }
                ost_team_free(team);
                const double ms = median(ts);
                bw.push_back(json{{"threads", nt}, {"ms", ms}, {"gbps", bw_bytes / ms / 1e6}});
            }
        }
        out["read_bw"] = bw;

        json rows = json::array();
        for (int n_exp : experts_list) {
            const int E = (int) std::min<int64_t>(std::max(1, n_exp), n_expert);
            for (int n : tokens_list) {
                n = std::max(1, n);
                // E distinct experts spread over the layer; token t's position j routes to
                // expert (t k + j) mod E of them (distinct within a token), -1 past E
                std::vector<int32_t> ids((size_t) k * n, -1);
                for (int t = 0; t < n; ++t) {
                    for (int j = 0; j < std::min(k, E); ++j) {
                        ids[(size_t) t * k + j] = (int32_t) (((int64_t) ((t * k + j) % E) * n_expert) / E);
                    }
                }
                // distinct experts the routes reach (fewer than E when n k < E)
                std::vector<int32_t> used(ids.begin(), ids.end());
                used.erase(std::remove(used.begin(), used.end(), -1), used.end());
                std::sort(used.begin(), used.end());
                const int64_t n_used = std::unique(used.begin(), used.end()) - used.begin();
                std::vector<float> x((size_t) n_embd * n);
                uint32_t s = 12345u + (uint32_t) (E * 131 + n);
                for (auto & v : x) { s = s * 1664525u + 1013904223u; v = ((s >> 8) / 8388608.0f) - 1.0f; }

                // ggml's graph over the same tensors
                const size_t mem = ggml_tensor_overhead() * 32 + ggml_graph_overhead() +
                                   (size_t) n * k * (3 * 2 * (size_t) std::max<int64_t>(n_embd, down->ne[0]) + n_embd) * 4 +
                                   (size_t) n * (n_embd * 4 + k * 4) + (1 << 20);
                ggml_init_params ip = { mem, nullptr, false };
                ggml_context * ctx = ggml_init(ip);
                ggml_tensor * cur = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, 1, n);
                ggml_tensor * ids_t = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n);
                std::memcpy(cur->data, x.data(), x.size() * 4);
                std::memcpy(ids_t->data, ids.data(), ids.size() * 4);
                ggml_tensor * o = build_ffn(ctx, L, cur, ids_t);
                ggml_cgraph * g = ggml_new_graph(ctx);
                ggml_build_forward_expand(g, o);
                ost_ffn f;
                std::string why;
                const bool matched = ost_ffn_match(o, ids_t, cur, f, why);
                std::vector<float> ko((size_t) n_embd * k * n, 0.0f);
                std::vector<uint8_t> ws;
                for (int pfr : prefetch_list) for (int nt : threads_list) {
                    ost_ffn_set_prefetch_rows(pfr);
                    // ggml is timed once per shape and thread count (the prefetch is the kernel's only)
                    const bool time_ggml = with_ggml && pfr == prefetch_list.front();
                    json row{{"experts", n_used}, {"tokens", n}, {"threads", nt}, {"routes", (int64_t) n * std::min(k, E)},
                             {"prefetch_rows", pfr},
                             {"bytes", matched ? n_used * f.expert_bytes : 0}, {"matched", matched}};
                    if (!matched) row["unmatched"] = why;
                    // kernel
                    bool kernel_ran = false;
                    if (matched) {
                        ost_team * team = ost_team_new(nt);
                        ost_team_set_active(team, true);
                        ost_ffn_job job;
                        job.f = &f; job.ids = ids.data(); job.cur = x.data(); job.cur_stride = n_embd;
                        job.out = ko.data(); job.k = k; job.n = n;
                        std::vector<double> ts;
                        ost_ffn_stats st;
                        kernel_ran = true;
                        for (int r = 0; r < reps + 2 && kernel_ran; ++r) {
                            flush();
                            const double t0 = now_ms();
                            kernel_ran = ost_ffn_run(team, job, ws, &st);
                            if (r >= 2) ts.push_back(now_ms() - t0);
                        }
                        ost_team_free(team);
                        row["kernel"] = kernel_ran;   // false: an expert ggml-cpu would tile (>= 8 routes)
                        if (kernel_ran) {
                            const double ms = median(ts);
                            row["kernel_ms"] = ms;
                            row["kernel_gbps"] = st.bytes / ms / 1e6;
                        }
                    }
                    if (time_ggml || kernel_ran) {
                        ggml_cplan plan = ggml_graph_plan(g, nt, nullptr);
                        std::vector<uint8_t> work(plan.work_size + 64);
                        plan.work_data = work.data();
                        std::vector<double> ts;
                        for (int r = 0; r < (time_ggml ? reps + 2 : 1); ++r) {
                            flush();
                            const double t0 = now_ms();
                            ggml_graph_compute(g, &plan);
                            if (r >= 2) ts.push_back(now_ms() - t0);
                        }
                        if (time_ggml) {
                            const double ms = median(ts);
                            row["ggml_ms"] = ms;
                            if (matched) row["ggml_gbps"] = (double) n_used * f.expert_bytes / ms / 1e6;
                        }
                    }
                    if (kernel_ran) {
                        // bit for bit, at every routed position (the others are not the kernel's)
                        bool equal = true;
                        double diff = 0.0;
                        const float * go = (const float *) o->data;
                        for (int64_t q = 0; q < (int64_t) k * n; ++q) {
                            if (ids[(size_t) q] < 0) continue;
                            const float * a0 = go + q * n_embd, * b0 = ko.data() + q * n_embd;
                            equal = equal && std::memcmp(a0, b0, (size_t) n_embd * 4) == 0;
                            for (int64_t i = 0; i < n_embd; ++i) diff = std::max(diff, (double) std::fabs(a0[i] - b0[i]));
                        }
                        row["bitwise_equal"] = equal;
                        row["max_abs_diff"] = diff;
                    }
                    rows.push_back(row);
                }
                ggml_free(ctx);
            }
        }
        out["rows"] = rows;
        out["expert_bytes"] = (int64_t) (down->nb[2] + (L.ffn_gate_up_exps ? L.ffn_gate_up_exps->nb[2] :
                                                        L.ffn_up_exps->nb[2] + (L.ffn_gate_exps ? L.ffn_gate_exps->nb[2] : 0)));
    } catch (const std::exception & ex) {
        out = json{{"error", ex.what()}};
    }
    g_bench_out = out.dump();
    return g_bench_out.c_str();
}
