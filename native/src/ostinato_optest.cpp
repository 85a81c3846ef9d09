// Op-level test of native/patches/10-ggml-negative-expert-ids.patch, in the style of llama.cpp's
// test-backend-ops: a negative expert id in mul_mat_id means "a route computed by another branch":
// the CPU skips it and writes an exact-zero row; add_id adds no bias there. Every other row must be
// bitwise what the unpatched op computes. Exported from libostinato as ostinato_optest_negative_ids
// (tests/test_native_ops.py calls it through ctypes).
#include "ggml.h"
#include "ggml-cpu.h"

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

std::string g_out;

}  // namespace

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
