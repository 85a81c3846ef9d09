// Op-level tests of native/patches/10-ggml-negative-expert-ids.patch (CPU), 21-ggml-cuda-negative-
// expert-ids.patch (GPU backends) and 22-ggml-cuda-set-2d-async.patch (the GPU backend's 2D copy,
// ostinato_optest_set_2d), and of decode prefetch's score against llama.cpp's expert selection
// (ostinato_optest_pred_score, at the end), in the style of llama.cpp's
// test-backend-ops: a negative expert id in mul_mat_id means "a route computed by another branch":
// the CPU skips it and writes an exact-zero row; add_id adds no bias there. Every other row must be
// bitwise what the unpatched op computes. Exported from libostinato as ostinato_optest_negative_ids
// (tests/engine/test_native_ops.py calls it through ctypes).
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "decode_graph/decode_ops.h"
#include "cpu_branch/mxfp4.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

void fill(ggml_tensor * t, std::mt19937 & rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t n = ggml_nelements(t);
    std::vector<float> f(n);
    for (auto & x : f) x = nd(rng);
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(t->data, f.data(), n * sizeof(float));
    } else {
        ggml_quantize_chunk(t->type, f.data(), t->data, 0, n / t->ne[0], t->ne[0], nullptr);
    }
}

// One case: expert weights of `type`, n_tokens tokens, k routes each, ids with -1 at `neg` positions.
struct result_t { std::string json; bool ok; };

result_t run_case(ggml_type type, int64_t n_tokens, const std::vector<int> & neg_pos, int n_threads) {
    const int64_t K = 64, N = 32, E = 4, k = 2;
    ggml_init_params ip = { 64u << 20, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    std::mt19937 rng(42);
    ggml_tensor * as   = ggml_new_tensor_3d(ctx, type, K, N, E);
    ggml_tensor * b    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, 1, n_tokens);
    ggml_tensor * bias = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, N, E);
    ggml_tensor * ids  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n_tokens);
    ggml_tensor * ref_ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n_tokens);
    fill(as, rng); fill(b, rng); fill(bias, rng);
    int32_t * id = (int32_t *) ids->data, * rid = (int32_t *) ref_ids->data;
    for (int64_t i = 0; i < k * n_tokens; ++i) { id[i] = (int32_t) ((i * 3 + 1) % E); rid[i] = id[i]; }
    for (int p : neg_pos) id[p] = -1;   // the reference keeps a valid id there
    ggml_tensor * mm  = ggml_mul_mat_id(ctx, as, b, ids);
    ggml_tensor * mmr = ggml_mul_mat_id(ctx, as, b, ref_ids);
    ggml_tensor * ad  = ggml_add_id(ctx, mm, bias, ids);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, mmr);
    ggml_build_forward_expand(gf, ad);   // ad reads mm: mm is computed first
    ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    int bad_zero = 0, bad_same = 0, bad_bias = 0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int64_t pos = t * k + j;
            const float * m  = (const float *) ((const char *) mm->data  + t * mm->nb[2]  + j * mm->nb[1]);
            const float * mr = (const float *) ((const char *) mmr->data + t * mmr->nb[2] + j * mmr->nb[1]);
            const float * a  = (const float *) ((const char *) ad->data  + t * ad->nb[2]  + j * ad->nb[1]);
            const bool skipped = id[pos] < 0;
            for (int64_t r = 0; r < N; ++r) {
                if (skipped) {
                    bad_zero += m[r] != 0.0f || std::signbit(m[r]);
                    bad_bias += a[r] != m[r];   // no bias on a skipped route
                } else {
                    bad_same += std::memcmp(&m[r], &mr[r], sizeof(float)) != 0;
                    const float want = m[r] + ((const float *) ((const char *) bias->data + id[pos] * bias->nb[1]))[r];
                    bad_bias += std::memcmp(&a[r], &want, sizeof(float)) != 0;
                }
            }
        }
    }
    ggml_free(ctx);
    const bool ok = bad_zero == 0 && bad_same == 0 && bad_bias == 0;
    char buf[512];
    snprintf(buf, sizeof(buf),
             "{\"type\": \"%s\", \"tokens\": %lld, \"threads\": %d, \"skipped\": %zu, "
             "\"nonzero_skipped_values\": %d, \"changed_computed_values\": %d, \"wrong_bias_values\": %d, "
             "\"ok\": %s}", ggml_type_name(type), (long long) n_tokens, n_threads, neg_pos.size(), bad_zero,
             bad_same, bad_bias, ok ? "true" : "false");
    return {buf, ok};
}

std::string g_out, g_out_backend;

// Patch 21 on a GPU backend: a mul_mat_id marked in op_params[15] with n_tokens > 8 (MMQ) and some
// ids -1. Skipped rows must be exact +0 and get no bias from add_id; the other rows must match the
// same backend's unmarked op on valid ids (to 1e-5 relative: the stream-k split of MMQ depends on
// the work, so partial sums may be added in another order).
result_t run_case_backend(ggml_backend_t be, ggml_type type, int64_t n_tokens, int stride) {
    const int64_t K = 256, N = 128, E = 8, k = 4;
    ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * as   = ggml_new_tensor_3d(ctx, type, K, N, E);
    ggml_tensor * b    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, 1, n_tokens);
    ggml_tensor * bias = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, N, E);
    ggml_tensor * ids  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n_tokens);
    ggml_tensor * ref_ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n_tokens);
    ggml_tensor * mm  = ggml_mul_mat_id(ctx, as, b, ids);
    mm->op_params[15] = 0x4F53544E;   // what ostinato_moe_tag_skips writes
    ggml_tensor * mmr = ggml_mul_mat_id(ctx, as, b, ref_ids);
    ggml_tensor * ad  = ggml_add_id(ctx, mm, bias, ids);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, mmr);
    ggml_build_forward_expand(gf, ad);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto upload = [&](ggml_tensor * t) {
        std::vector<float> f(ggml_nelements(t));
        for (auto & x : f) x = nd(rng);
        std::vector<uint8_t> q(ggml_nbytes(t));
        if (t->type == GGML_TYPE_F32) std::memcpy(q.data(), f.data(), q.size());
        else ggml_quantize_chunk(t->type, f.data(), q.data(), 0, ggml_nelements(t) / t->ne[0], t->ne[0], nullptr);
        ggml_backend_tensor_set(t, q.data(), 0, q.size());
    };
    upload(as); upload(b); upload(bias);
    std::vector<int32_t> id(k * n_tokens), rid(k * n_tokens);
    int64_t skipped = 0;
    for (int64_t i = 0; i < k * n_tokens; ++i) {
        rid[i] = (int32_t) ((i * 5 + i / k) % E);   // distinct within a token (k <= E, step 5 coprime)
        id[i] = i % stride == 1 ? -1 : rid[i];
        skipped += id[i] < 0;
    }
    ggml_backend_tensor_set(ids, id.data(), 0, id.size() * sizeof(int32_t));
    ggml_backend_tensor_set(ref_ids, rid.data(), 0, rid.size() * sizeof(int32_t));
    const bool computed = ggml_backend_graph_compute(be, gf) == GGML_STATUS_SUCCESS;
    std::vector<float> m(ggml_nelements(mm)), mr(ggml_nelements(mmr)), a(ggml_nelements(ad)), bi(ggml_nelements(bias));
    ggml_backend_tensor_get(mm, m.data(), 0, m.size() * sizeof(float));
    ggml_backend_tensor_get(mmr, mr.data(), 0, mr.size() * sizeof(float));
    ggml_backend_tensor_get(ad, a.data(), 0, a.size() * sizeof(float));
    ggml_backend_tensor_get(bias, bi.data(), 0, bi.size() * sizeof(float));
    int bad_zero = 0, bad_same = 0, bad_bias = 0;
    for (int64_t pos = 0; pos < k * n_tokens; ++pos) {
        for (int64_t r = 0; r < N; ++r) {
            const int64_t o = pos * N + r;
            if (id[pos] < 0) {
                bad_zero += m[o] != 0.0f || std::signbit(m[o]);
                bad_bias += a[o] != m[o];
            } else {
                bad_same += std::fabs(m[o] - mr[o]) > 1e-5f * (1.0f + std::fabs(mr[o]));
                bad_bias += std::fabs(a[o] - (m[o] + bi[id[pos] * N + r])) > 1e-6f * (1.0f + std::fabs(a[o]));
            }
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    const bool ok = computed && bad_zero == 0 && bad_same == 0 && bad_bias == 0;
    char out[512];
    snprintf(out, sizeof(out),
             "{\"type\": \"%s\", \"tokens\": %lld, \"skipped\": %lld, \"computed\": %s, "
             "\"nonzero_skipped_values\": %d, \"changed_computed_values\": %d, \"wrong_bias_values\": %d, "
             "\"ok\": %s}", ggml_type_name(type), (long long) n_tokens, (long long) skipped,
             computed ? "true" : "false", bad_zero, bad_same, bad_bias, ok ? "true" : "false");
    return {out, ok};
}

}  // namespace

// Patch 21's op test on the backend device named `dev_name` (NULL: the first GPU; "CPU": the CPU
// backend, where patch 10 gives the same semantics); {"ok": true, "backend": null} where there is none.
extern "C" __attribute__((visibility("default"))) const char * ostinato_optest_negative_ids_backend(const char * dev_name) {
    ggml_backend_dev_t dev = dev_name ? ggml_backend_dev_by_name(dev_name)
                                      : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (!dev) {
        g_out_backend = "{\"ok\": true, \"backend\": null, \"cases\": []}";
        return g_out_backend.c_str();
    }
    ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
    std::string cases;
    bool ok = be != nullptr;
    if (be) {
        for (ggml_type type : {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K}) {
            // prefill-like passes above the vector kernel's 8 rows; a third or every second route skipped
            for (auto [n, stride] : std::vector<std::pair<int64_t, int>>{{16, 3}, {40, 2}, {9, 1000}}) {
                const result_t c = run_case_backend(be, type, n, stride);
                ok = ok && c.ok;
                cases += (cases.empty() ? "" : ", ") + c.json;
            }
        }
        ggml_backend_free(be);
    }
    g_out_backend = std::string("{\"ok\": ") + (ok ? "true" : "false") + ", \"backend\": \"" +
                    ggml_backend_dev_name(dev) + "\", \"cases\": [" + cases + "]}";
    return g_out_backend.c_str();
}

extern "C" __attribute__((visibility("default"))) const char * ostinato_optest_negative_ids(void) {
    std::string cases;
    bool ok = true;
    for (ggml_type type : {GGML_TYPE_F32, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}) {
        for (int n_threads : {1, 2}) {
            // decode-like (one token, one of two routes skipped), prefill-like, every route skipped
            for (auto [n, neg] : std::vector<std::pair<int64_t, std::vector<int>>>{
                     {1, {1}}, {5, {0, 3, 4, 9}}, {3, {0, 1, 2, 3, 4, 5}}, {4, {}}}) {
                const result_t c = run_case(type, n, neg, n_threads);
                ok = ok && c.ok;
                cases += (cases.empty() ? "" : ", ") + c.json;
            }
        }
    }
    g_out = std::string("{\"ok\": ") + (ok ? "true" : "false") + ", \"cases\": [" + cases + "]}";
    return g_out.c_str();
}

// Patch 22's test: "ggml_backend_set_2d_async" of the first GPU's backend registry copies `height`
// rows of `width` bytes from host memory at one pitch into a device tensor at another, on the
// backend's stream, and leaves every byte between the rows as it was; it refuses a backend that is
// not the GPU's (the CPU backend), a pitch smaller than the width and a pitch above the device's
// maximum (2^31 bytes here: the driver would move such a copy row by row), queueing nothing.
// {"ok": true, "backend": null} where the build has no GPU backend.
extern "C" __attribute__((visibility("default"))) const char * ostinato_optest_set_2d(void) {
    static std::string out;
    using set_2d_fn = bool (*)(ggml_backend_t, void *, size_t, const void *, size_t, size_t, size_t);
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    auto fn = dev ? (set_2d_fn) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                  "ggml_backend_set_2d_async") : nullptr;
    if (!dev) {
        out = "{\"ok\": true, \"backend\": null, \"offered\": false, \"cases\": []}";
        return out.c_str();
    }
    if (!fn) {   // a GPU build without patch 22
        out = std::string("{\"ok\": false, \"backend\": \"") + ggml_backend_dev_name(dev) + "\", \"offered\": false, \"cases\": []}";
        return out.c_str();
    }
    ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    std::string cases;
    bool ok = be != nullptr && cpu != nullptr;
    const size_t n = 1u << 20;
    ggml_init_params ip = { ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) n);
    ggml_backend_buffer_t buf = be ? ggml_backend_alloc_ctx_tensors(ctx, be) : nullptr;
    ok = ok && buf != nullptr;
    std::vector<uint8_t> host(n), before(n, 0xA5), got(n);
    for (size_t i = 0; i < n; ++i) host[i] = (uint8_t) (i * 131 + (i >> 8));
    struct case_t { size_t width, spitch, dpitch, height, src0, dst0; };
    // an expert's three matrices (host pitch > device pitch and the reverse), one row, rows back to back
    for (const case_t c : {case_t{4096, 20000, 9000, 3, 100, 64}, case_t{3000, 3000, 70000, 3, 0, 5},
                           case_t{65536, 65536, 65536, 1, 128, 256}, case_t{1000, 1000, 1000, 8, 7, 0}}) {
        if (!ok) break;
        ggml_backend_tensor_set(t, before.data(), 0, n);
        char * dst = (char *) t->data + c.dst0;
        const bool queued = fn(be, dst, c.dpitch, host.data() + c.src0, c.spitch, c.width, c.height);
        ggml_backend_synchronize(be);
        ggml_backend_tensor_get(t, got.data(), 0, n);
        std::vector<uint8_t> want = before;
        for (size_t r = 0; r < c.height; ++r) {
            std::memcpy(want.data() + c.dst0 + r * c.dpitch, host.data() + c.src0 + r * c.spitch, c.width);
        }
        const bool same = got == want;
        ok = ok && queued && same;
        char line[256];
        snprintf(line, sizeof(line), "{\"width\": %zu, \"height\": %zu, \"queued\": %s, \"bytes_as_expected\": %s}",
                 c.width, c.height, queued ? "true" : "false", same ? "true" : "false");
        cases += (cases.empty() ? "" : ", ") + std::string(line);
    }
    // refusals: the CPU backend, a pitch below the width (CUDA's invalid value) and a destination
    // pitch of 2^31 bytes (above cudaDevAttrMaxPitch; one row, so that not even a copy that was not
    // refused could write outside the buffer); nothing changes
    bool refused = false;
    if (ok) {
        ggml_backend_tensor_set(t, before.data(), 0, n);
        const bool cpu_q = fn(cpu, t->data, 4096, host.data(), 4096, 4096, 2);
        const bool pitch_q = fn(be, t->data, 100, host.data(), 4096, 4096, 2);
        const bool wide_q = fn(be, t->data, (size_t) 1 << 31, host.data(), 4096, 4096, 1);
        ggml_backend_synchronize(be);
        ggml_backend_tensor_get(t, got.data(), 0, n);
        refused = !cpu_q && !pitch_q && !wide_q && got == before;
        ok = refused;
    }
    if (buf) ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    if (cpu) ggml_backend_free(cpu);
    if (be) ggml_backend_free(be);
    out = std::string("{\"ok\": ") + (ok ? "true" : "false") + ", \"backend\": \"" + ggml_backend_dev_name(dev) +
          "\", \"offered\": true, \"refusals_ok\": " + (refused ? "true" : "false") + ", \"cases\": [" + cases + "]}";
    return out.c_str();
}

// The prediction's score (decode_graph/decode_ops.h, ostinato_pred_score: decode prefetch's predict op) ranks a
// token's experts as llama.cpp's selection does: for each gating the score knows (the logit alone,
// sigmoid, sqrt(softplus)), with and without a router bias and a selection bias, the top k of the
// scores are the top k of the selection that build_moe_ffn builds on the same logits (router bias
// added, gating op, selection bias added, argsort_top_k), on the CPU. Softmax with a selection bias,
// which the score only approximates (logit + bias), is left out. {"ok", "cases": [{gating,
// router_bias, sel_bias, tokens, mismatches}]}.
extern "C" __attribute__((visibility("default"))) const char * ostinato_optest_pred_score(void) {
    static std::string out;
    const int E = 64, T = 16, k = 8;
    std::mt19937 rng(2026);
    std::string cases;
    bool ok = true;
    for (int gating : {OSTINATO_PRED_LOGIT, OSTINATO_PRED_SIGMOID, OSTINATO_PRED_SQRT_SOFTPLUS}) {
        for (int with_rb : {0, 1}) {
            for (int with_sb : {0, 1}) {
                if (gating == OSTINATO_PRED_LOGIT && with_sb) continue;
                ggml_init_params ip = { 16u << 20, nullptr, false };
                ggml_context * ctx = ggml_init(ip);
                ggml_tensor * logits = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, E, T);
                ggml_tensor * rb = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, E);
                ggml_tensor * sb = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, E);
                fill(logits, rng);
                fill(rb, rng);
                fill(sb, rng);
                // the selection as build_moe_ffn builds it (llama-graph.cpp)
                ggml_tensor * l = with_rb ? ggml_add(ctx, logits, rb) : logits;
                ggml_tensor * probs = gating == OSTINATO_PRED_SIGMOID       ? ggml_sigmoid(ctx, l)
                                    : gating == OSTINATO_PRED_SQRT_SOFTPLUS ? ggml_sqrt(ctx, ggml_softplus(ctx, l))
                                                                            : ggml_soft_max(ctx, l);
                ggml_tensor * selp = with_sb ? ggml_add(ctx, probs, sb) : probs;
                ggml_tensor * top = ggml_argsort_top_k(ctx, selp, k);   // [k, T]
                ggml_cgraph * gf = ggml_new_graph(ctx);
                ggml_build_forward_expand(gf, top);
                ggml_graph_compute_with_ctx(ctx, gf, 1);
                int mismatches = 0;
                for (int t = 0; t < T; ++t) {
                    std::vector<std::pair<float, int>> sc((size_t) E);
                    for (int x = 0; x < E; ++x) {
                        const float lg = ((const float *) logits->data)[(size_t) t * E + x];
                        sc[(size_t) x] = { ostinato_pred_score(lg, with_rb ? (const float *) rb->data : nullptr,
                                                               with_sb ? (const float *) sb->data : nullptr, gating, x), x };
                    }
                    std::partial_sort(sc.begin(), sc.begin() + k, sc.end(), [](const auto & a, const auto & b) {
                        return a.first > b.first || (a.first == b.first && a.second < b.second);
                    });
                    std::vector<int> want, got;
                    for (int j = 0; j < k; ++j) {
                        want.push_back(sc[(size_t) j].second);
                        got.push_back(((const int32_t *) ((const char *) top->data + t * top->nb[1]))[j]);
                    }
                    std::sort(want.begin(), want.end());
                    std::sort(got.begin(), got.end());
                    mismatches += want != got;
                }
                ggml_free(ctx);
                ok = ok && mismatches == 0;
                char buf[160];
                snprintf(buf, sizeof(buf), "{\"gating\": %d, \"router_bias\": %s, \"sel_bias\": %s, \"tokens\": %d, \"mismatches\": %d}",
                         gating, with_rb ? "true" : "false", with_sb ? "true" : "false", T, mismatches);
                cases += (cases.empty() ? "" : ", ") + std::string(buf);
            }
        }
    }
    out = std::string("{\"ok\": ") + (ok ? "true" : "false") + ", \"cases\": [" + cases + "]}";
    return out.c_str();
}

// The CPU branch's MXFP4 rows x many tokens (cpu_branch/mxfp4.h, ost_mxfp4_rows in libllama) against
// ggml-cpu's vec_dot (ggml_vec_dot_mxfp4_q8_0) per (row, token), bit for bit: block counts 1, 2, 3,
// 5, 8, 65 (odd ones end in ggml's scalar tail, there with large same-signed products so that its
// rounding shows), row counts 1-17 (odd: a lone last row), tokens 1-40 (tiles of 8 and every
// remainder), rows at a padded stride. {"served", "tail", "ok", "cases", "mismatches", "first_bad"}.
extern "C" __attribute__((visibility("default"))) const char * ostinato_optest_mxfp4_rows(void) {
    static std::string out;
    const bool served = ost_mxfp4_serves();
    std::mt19937 rng(47);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const auto * tr = ggml_get_type_traits_cpu(GGML_TYPE_MXFP4);
    const auto * ty = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    int cases = 0, mismatches = 0;
    std::string first_bad = "null";
    for (const int K : {32, 64, 96, 160, 256, 2080}) {
        const int nb = K / 32;
        for (const int nrows : {1, 2, 3, 7, 17}) {
            const size_t rb = ggml_row_size(GGML_TYPE_MXFP4, K), stride = rb + (nrows % 2 ? 5 : 0);
            std::vector<float> wf((size_t) K * nrows);
            for (size_t i = 0; i < wf.size(); ++i) {
                wf[i] = nd(rng) * (i % 53 == 0 ? 40.0f : 1.0f);
                if ((nb % 2) && (int) (i % (size_t) K) >= K - 32 && (i / (size_t) K) % 2 == 0) wf[i] = 3.0f + std::fabs(wf[i]);
            }
            std::vector<uint8_t> wq(rb * nrows), w(stride * nrows);
            ggml_quantize_chunk(GGML_TYPE_MXFP4, wf.data(), wq.data(), 0, nrows, K, nullptr);
            for (int i = 0; i < nrows; ++i) memcpy(w.data() + i * stride, wq.data() + i * rb, rb);
            const int T = 40;
            const size_t yb = ggml_row_size(GGML_TYPE_Q8_0, K);
            std::vector<uint8_t> yq(yb * T);
            std::vector<float> yf((size_t) K);
            for (int j = 0; j < T; ++j) {
                for (int i = 0; i < K; ++i) yf[(size_t) i] = nd(rng) * (j % 4 == 0 ? 25.0f : 1.0f);
                if (nb % 2) for (int i = K - 32; i < K; ++i) yf[(size_t) i] = 90.0f + 15.0f * nd(rng);
                ty->from_float(yf.data(), yq.data() + (size_t) j * yb, K);
            }
            std::vector<float> ref((size_t) T * nrows);
            for (int j = 0; j < T; ++j)
                for (int i = 0; i < nrows; ++i)
                    tr->vec_dot(K, &ref[(size_t) j * nrows + i], 0, w.data() + i * stride, 0, yq.data() + (size_t) j * yb, 0, 1);
            for (int n = 1; n <= T && served; ++n) {
                // tokens in a shuffled order, outputs at their own places
                std::vector<const void *> ys((size_t) n);
                std::vector<float> mine((size_t) n * nrows + 1, -7.0f);
                std::vector<float *> outs((size_t) n);
                for (int j = 0; j < n; ++j) {
                    const int src = (j * 7 + 3) % T;
                    ys[(size_t) j] = yq.data() + (size_t) src * yb;
                    outs[(size_t) j] = mine.data() + (size_t) j * nrows;
                }
                const bool ran = ost_mxfp4_rows(K, w.data(), stride, nrows, ys.data(), n, outs.data());
                int bad = 0;
                for (int j = 0; j < n && ran; ++j) {
                    const int src = (j * 7 + 3) % T;
                    bad += memcmp(outs[(size_t) j], &ref[(size_t) src * nrows], sizeof(float) * nrows) != 0;
                }
                if (!ran || mine.back() != -7.0f) bad += 1;
                ++cases;
                if (bad && first_bad == "null") {
                    char buf[96];
                    snprintf(buf, sizeof(buf), "{\"K\": %d, \"rows\": %d, \"tokens\": %d, \"ran\": %s}", K, nrows, n, ran ? "true" : "false");
                    first_bad = buf;
                }
                mismatches += bad;
            }
        }
    }
    out = std::string("{\"served\": ") + (served ? "true" : "false") + ", \"tail\": \"" + ost_mxfp4_tail() +
          "\", \"ok\": " + (served && mismatches == 0 ? "true" : "false") + ", \"cases\": " + std::to_string(cases) +
          ", \"mismatches\": " + std::to_string(mismatches) + ", \"first_bad\": " + first_bad + "}";
    return out.c_str();
}
