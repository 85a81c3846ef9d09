// The CPU branch alone on a loaded model's expert tensors (C API ostinato_cpu_branch_bench): the
// CPU branch's own kernel (cpu_branch/kernel.h) against llama.cpp's own CPU MUL_MAT_ID graph on the
// same tensors, inputs and thread counts, and the host's read bandwidth, in one call. Serves
// `ostinato bench cpu-branch`, the calibration (the CPU branch's bandwidth per thread count) and the
// op-level test of the kernel and of native/patches/23 (outputs compared bit for bit).
#include "engine/engine.h"
#include "cpu_branch/kernel.h"
#include "cpu_branch/dot.h"
#include "cpu_branch/gemm.h"

#include "ggml-cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25   // Linux 6.1 (older headers lack it; older kernels answer EINVAL)
#endif

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

// The experts' FFN as build_moe_ffn builds it (separate or merged gate_up; SwiGLU, or with
// limit > 0 the clamped SwiGLU of deepseek4's experts), over views of the model's host tensors, in a
// CPU context of its own. *gate_out and *up_out: the activation's two inputs [n_ff, k, n].
ggml_tensor * build_ffn(ggml_context * ctx, const llama_layer & L, ggml_tensor * cur, ggml_tensor * ids, float limit,
                        ggml_tensor ** gate_out, ggml_tensor ** up_out) {
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
    *gate_out = gate;
    *up_out = up;
    ggml_tensor * act = limit > 0.0f ? ggml_swiglu_clamp(ctx, gate, up, limit) : ggml_swiglu_split(ctx, gate, up);
    return ggml_mul_mat_id(ctx, ggml_view_tensor(ctx, L.ffn_down_exps), act, ids);
}

std::string g_bench_out;

// The page sizes behind [p, p + n): from /proc/self/smaps, the mapping that holds p (its kernel page
// size, and how much of it is mapped by huge pages: anonymous, shmem or file THPs). Empty off Linux.
json smaps_of(const void * p) {
    json out = json::object();
#if defined(__linux__)
    std::ifstream f("/proc/self/smaps");
    std::string line;
    bool in = false;
    const uintptr_t a = (uintptr_t) p;
    while (std::getline(f, line)) {
        const std::string first = line.substr(0, line.find(' '));
        if (first.empty()) continue;
        if (first.back() != ':') {
            // a mapping's header: "lo-hi perms offset dev inode [path]"
            if (in) break;
            const size_t dash = first.find('-');
            if (dash == std::string::npos) continue;
            const uintptr_t lo = std::stoull(first.substr(0, dash), nullptr, 16);
            const uintptr_t hi = std::stoull(first.substr(dash + 1), nullptr, 16);
            in = a >= lo && a < hi;
            if (in) {
                out["mapping_bytes"] = (int64_t) (hi - lo);
                const size_t slash = line.find('/');
                out["mapping"] = slash == std::string::npos ? std::string("[anonymous]") : line.substr(slash);
            }
            continue;
        }
        if (!in) continue;
        const std::string key = first.substr(0, first.size() - 1);
        if (key == "VmFlags") {
            out["vm_flags"] = line.substr(first.size() + 1);
        } else {
            for (const char * k : {"Rss", "AnonHugePages", "ShmemPmdMapped", "FilePmdMapped", "KernelPageSize", "MMUPageSize"}) {
                if (key == k) out[key + "_kib"] = std::atoll(line.c_str() + first.size());
            }
        }
    }
#else
    (void) p;
#endif
    return out;
}

// The layer's expert tensors (gate/up or gate_up, down), each with its bytes
struct expert_mem {
    std::string kind;                    // "model", "anon" (4 KiB pages), "huge" (THPs)
    std::vector<const ggml_tensor *> src;
    std::vector<ggml_tensor> shadow;     // copies of the tensors with data in this memory
    void * base = nullptr;               // the private copy (anon, huge)
    size_t bytes = 0;
    json info = json::object();
    ~expert_mem() {
#if defined(__linux__)
        if (base) munmap(base, bytes);
#endif
    }
};

// Puts the layer's experts in memory of `kind`: the model's own ("model"), or a private anonymous
// copy with 4 KiB pages ("anon", MADV_NOHUGEPAGE) or with transparent huge pages ("huge":
// MADV_HUGEPAGE before the first touch, then MADV_COLLAPSE). What the kernel did is in `info`
// (madvise's answers, the mapping's smaps).
void place(expert_mem & m, const std::vector<const ggml_tensor *> & ts, const std::string & kind) {
    m.kind = kind;
    m.src = ts;
    m.shadow.clear();
    for (const ggml_tensor * t : ts) m.shadow.push_back(*t);
    if (kind == "model") {
        m.info["smaps"] = smaps_of(ts[0]->data);
        return;
    }
#if defined(__linux__)
    const size_t huge = (size_t) 2 << 20;
    size_t total = 0;
    std::vector<size_t> off;
    for (const ggml_tensor * t : ts) {
        off.push_back(total);
        total += (ggml_nbytes(t) + huge - 1) & ~(huge - 1);   // each tensor on a 2 MiB boundary
    }
    m.bytes = total + huge;
    void * p = mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error(std::string("mmap of the expert copy: ") + strerror(errno));
    m.base = p;
    char * b = (char *) (((uintptr_t) p + huge - 1) & ~(uintptr_t) (huge - 1));
    const int adv = madvise(b, total, kind == "huge" ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    m.info["madvise"] = adv ? strerror(errno) : "ok";
    for (size_t i = 0; i < ts.size(); ++i) {
        std::memcpy(b + off[i], ts[i]->data, ggml_nbytes(ts[i]));
        m.shadow[i].data = b + off[i];
    }
    if (kind == "huge") {
        const int c = madvise(b, total, MADV_COLLAPSE);
        m.info["collapse"] = c ? strerror(errno) : "ok";
    }
    m.info["smaps"] = smaps_of(b);
#else
    throw std::runtime_error("memory kind " + kind + " needs Linux");
#endif
}

// The tensor of `m` in place of model tensor `t` (itself when not one of the layer's)
const ggml_tensor * in_mem(const expert_mem & m, const ggml_tensor * t) {
    const ggml_tensor * s = t && t->view_src ? t->view_src : t;
    for (size_t i = 0; i < m.src.size(); ++i) {
        if (m.src[i] == s || m.src[i] == t) return &m.shadow[i];
    }
    return t;
}

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
        // pauses before a waiting team thread yields, per row of the grid (ost_ffn_set_spins)
        const auto spins_list = a.value("spins", std::vector<int>{ost_ffn_spins()});
        if (spins_list.empty()) throw std::runtime_error("spins must not be empty");
        for (int v : spins_list) if (v < 0) throw std::runtime_error("spins must be >= 0");
        struct spins_t { int was; ~spins_t() { ost_ffn_set_spins(was); } } spins_restore{ost_ffn_spins()};
        // the row-pair dot products' mode (ost_dot_set_mode: 0 off = vec_dot row by row, 1 AVX2, 2 AVX-512),
        // per row of the grid
        const auto pairs_list = a.value("row_pairs", std::vector<int>{ost_dot_mode()});
        if (pairs_list.empty()) throw std::runtime_error("row_pairs must not be empty");
        for (int v : pairs_list) if (v < 0 || v > OST_DOT_AVX512) throw std::runtime_error("row_pairs must be 0, 1 or 2");
        struct pairs_t { int was; ~pairs_t() { ost_dot_set_mode(was); } } pairs_restore{ost_dot_mode()};
        // how the team takes the work (ost_ffn_set_claims: 1 claims, 0 barriers), per row of the grid
        const bool claims_was = ost_ffn_set_claims(true);
        ost_ffn_set_claims(claims_was);
        const auto claims_list = a.value("claims", std::vector<int>{claims_was ? 1 : 0});
        if (claims_list.empty()) throw std::runtime_error("claims must not be empty");
        for (int v : claims_list) if (v != 0 && v != 1) throw std::runtime_error("claims must be 0 or 1");
        struct claims_t { bool was; ~claims_t() { ost_ffn_set_claims(was); } } claims_restore{claims_was};
        // the tiled experts' integer sums on AMX tiles (1, where the CPU has them; 2 AMX with the
        // per-sub-block scaling at any token count, 3 with the two byte planes at any token count)
        // or AVX-512 VNNI (0), per row of the grid (ost_gemm_set_amx, ost_gemm_set_amx_planes)
        const bool amx_was = ost_gemm_set_amx(true);
        ost_gemm_set_amx(amx_was);
        const auto amx_list = a.value("amx", std::vector<int>{amx_was ? 1 : 0});
        if (amx_list.empty()) throw std::runtime_error("amx must not be empty");
        for (int v : amx_list) if (v < 0 || v > 3) throw std::runtime_error("amx must be 0, 1, 2 or 3");
        struct amx_t { bool was; ~amx_t() { ost_gemm_set_amx(was); } } amx_restore{amx_was};
        const int planes_was = ost_gemm_set_amx_planes(0);
        struct planes_t { int was; ~planes_t() { ost_gemm_set_amx_planes(was); } } planes_restore{planes_was};
        const int prefetch_was = ost_ffn_prefetch_rows();
        struct restore_t { int v; ~restore_t() { ost_ffn_set_prefetch_rows(v); } } restore{prefetch_was};
        // where the kernel reads the experts from, per row of the grid (place())
        const auto memory_list = a.value("memory", std::vector<std::string>{"model"});
        if (memory_list.empty()) throw std::runtime_error("memory must not be empty");
        for (const std::string & m : memory_list) {
            if (m != "model" && m != "anon" && m != "huge") throw std::runtime_error("memory kinds are model, anon, huge; got " + m);
        }
        // the kernel's phases timed in every run (ost_ffn_stats)
        struct timing_t { bool was; ~timing_t() { ost_ffn_set_phase_timing(was); } } timing{ost_ffn_set_phase_timing(true)};
        const int64_t bw_bytes = a.value("read_bw_bytes", (int64_t) 256 << 20);
        // read before every timed run, so that the experts come from memory as in a decode step
        // (whose cold experts differ layer by layer), not from a cache warmed by the run before
        const int64_t flush_bytes = a.value("flush_bytes", (int64_t) 256 << 20);
        // > 0: the FFN's activation is ggml's clamped SwiGLU with this limit (deepseek4's experts)
        const float swiglu_limit = a.value("swiglu_limit", 0.0f);
        if (swiglu_limit < 0.0f) throw std::runtime_error("swiglu_limit must be >= 0");
        out["swiglu_limit"] = swiglu_limit;
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
        json memories = json::array();
        std::vector<const ggml_tensor *> layer_ts;
        for (const ggml_tensor * t : {L.ffn_gate_up_exps, L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps}) {
            if (t) layer_ts.push_back(t);
        }
        for (size_t mi = 0; mi < memory_list.size(); ++mi) {
        expert_mem mem;
        place(mem, layer_ts, memory_list[mi]);
        // the host's read bandwidth over these tensors, per thread count (after a flush, as the kernel)
        json mem_bw = json::array();
        for (int nt : threads_list) {
            ost_team * team = ost_team_new(nt);
            ost_team_set_active(team, true);
            std::vector<uint64_t> sums((size_t) nt);
            std::vector<double> ts;
            int64_t bytes = 0;
            for (int r = 0; r < std::max(3, reps / 2); ++r) {
                double ms = 0;
                bytes = 0;
                for (const ggml_tensor & t : mem.shadow) {
                    const uint8_t * lo = (const uint8_t *) (((uintptr_t) t.data + 63) & ~uintptr_t(63));
                    read_ctx rc{ lo, (size_t) ggml_nbytes(&t) - (size_t) (lo - (const uint8_t *) t.data), &sums };
                    flush();
                    const double t0 = now_ms();
                    ost_team_run(team, read_fn, &rc);
                    ms += now_ms() - t0;
                    bytes += (int64_t) rc.n;
                }
                ts.push_back(ms);
            }
            ost_team_free(team);
            const double ms = median(ts);
            mem_bw.push_back(json{{"threads", nt}, {"ms", ms}, {"gbps", bytes / ms / 1e6}});
        }
        memories.push_back(json{{"memory", mem.kind}, {"read_bw", mem_bw}, {"info", mem.info}});
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

                // ggml's graph over the same tensors (the model's own memory)
                const size_t mem_sz = ggml_tensor_overhead() * 32 + ggml_graph_overhead() +
                                   (size_t) n * k * (3 * 2 * (size_t) std::max<int64_t>(n_embd, down->ne[0]) + n_embd) * 4 +
                                   (size_t) n * (n_embd * 4 + k * 4) + (1 << 20);
                ggml_init_params ip = { mem_sz, nullptr, false };
                ggml_context * ctx = ggml_init(ip);
                ggml_tensor * cur = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, 1, n);
                ggml_tensor * ids_t = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n);
                std::memcpy(cur->data, x.data(), x.size() * 4);
                std::memcpy(ids_t->data, ids.data(), ids.size() * 4);
                ggml_tensor * gate_t = nullptr, * up_t = nullptr;
                ggml_tensor * o = build_ffn(ctx, L, cur, ids_t, swiglu_limit, &gate_t, &up_t);
                ggml_cgraph * g = ggml_new_graph(ctx);
                ggml_build_forward_expand(g, o);
                ost_ffn f;
                std::string why;
                const bool matched = ost_ffn_match(o, ids_t, cur, f, why);
                // the kernel reads the experts from this row's memory
                f.up = in_mem(mem, f.up);
                f.gate = f.gate ? in_mem(mem, f.gate) : nullptr;
                f.down = in_mem(mem, f.down);
                std::vector<float> ko((size_t) n_embd * k * n, 0.0f);
                std::vector<uint8_t> ws;
                for (int ax : amx_list) for (int cl : claims_list) for (int rp : pairs_list) for (int sp : spins_list)
                for (int pfr : prefetch_list) for (int nt : threads_list) {
                    ost_gemm_set_amx(ax != 0);
                    ost_gemm_set_amx_planes(ax == 2 ? INT_MAX : ax == 3 ? 1 : 0);
                    ost_ffn_set_claims(cl != 0);
                    ost_ffn_set_prefetch_rows(pfr);
                    ost_ffn_set_spins(sp);
                    ost_dot_set_mode(rp);
                    // ggml is timed once per shape and thread count (the prefetch, the memory, the spins and the
                    // row pairs are the kernel's)
                    const bool time_ggml = with_ggml && pfr == prefetch_list.front() && mi == 0 && sp == spins_list.front() &&
                                           cl == claims_list.front() && ax == amx_list.front() &&
                                           rp == pairs_list.front();
                    json row{{"experts", n_used}, {"tokens", n}, {"threads", nt}, {"routes", (int64_t) n * std::min(k, E)},
                             {"prefetch_rows", pfr}, {"memory", mem.kind}, {"spins", sp}, {"row_pairs", rp}, {"claims", cl},
                             {"amx", ax},
                             // with the software prefetch on, the kernel takes vec_dot row by row
                             {"row_pairs_isa", pfr > 0 ? std::string("off") : ost_dot_isa()},
                             {"row_pairs_types", pfr > 0 ? std::string() : ost_dot_types()},
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
                        std::vector<ost_ffn_stats> sts;
                        ost_ffn_stats st;
                        kernel_ran = true;
                        for (int r = 0; r < reps + 2 && kernel_ran; ++r) {
                            flush();
                            const double t0 = now_ms();
                            kernel_ran = ost_ffn_run(team, job, ws, &st);
                            if (r >= 2) { ts.push_back(now_ms() - t0); sts.push_back(st); }
                        }
                        ost_team_free(team);
                        row["kernel"] = kernel_ran;   // false: a tiled expert of a type cpu_branch/gemm.h does not serve
                        if (kernel_ran) {
                            const double ms = median(ts);
                            // experts computed as ggml's tiled kernel does, on which instruction set
                            row["tiled_experts"] = st.tiled_experts;
                            // AMX with one scheme forced (--amx 2, 3): which
                            const std::string isa = ost_gemm_isa(), forced = ax == 2 ? "-scaled" : ax == 3 ? "-planes" : "";
                            row["tiled_isa"] = st.tiled_experts ? isa + (isa == "amx" ? forced : std::string()) : std::string("off");
                            row["kernel_ms"] = ms;
                            row["kernel_gbps"] = st.bytes / ms / 1e6;
                            // median per phase over the runs (us): where the time goes
                            json ph = json::object();
                            auto med = [&](int64_t ost_ffn_stats::*fld) {
                                std::vector<double> v;
                                for (const auto & x : sts) v.push_back((double) (x.*fld) / 1e3);
                                return median(v);
                            };
                            ph["prepare"] = med(&ost_ffn_stats::prepare_ns);
                            ph["wake"] = med(&ost_ffn_stats::wake_ns);
                            ph["quant"] = med(&ost_ffn_stats::quant_ns);
                            ph["gate_up"] = med(&ost_ffn_stats::gate_up_ns);
                            ph["act"] = med(&ost_ffn_stats::act_ns);
                            ph["down"] = med(&ost_ffn_stats::down_ns);
                            ph["idle"] = med(&ost_ffn_stats::idle_ns);
                            ph["total"] = med(&ost_ffn_stats::total_ns);
                            row["phases_us"] = ph;
                            // threads that took part in a run (claims: those that took an item), median
                            std::vector<double> used;
                            for (const auto & x : sts) used.push_back(x.threads);
                            row["threads_used"] = median(used);
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
                        if (swiglu_limit > 0.0f) {
                            // the share of the activation's elements at routed positions that the clamp changed
                            int64_t n_el = 0, n_cl = 0;
                            for (int64_t t = 0; t < n; ++t) for (int64_t j = 0; j < k; ++j) {
                                if (ids[(size_t) (t * k + j)] < 0) continue;
                                const char * gp = (const char *) gate_t->data + t * gate_t->nb[2] + j * gate_t->nb[1];
                                const char * up = (const char *) up_t->data + t * up_t->nb[2] + j * up_t->nb[1];
                                for (int64_t i = 0; i < gate_t->ne[0]; ++i) {
                                    const float gv = ((const float *) gp)[i], uv = ((const float *) up)[i];
                                    n_el++;
                                    n_cl += gv > swiglu_limit || std::fabs(uv) > swiglu_limit;
                                }
                            }
                            row["swiglu_clamped_share"] = n_el ? (double) n_cl / n_el : 0.0;
                        }
                    }
                    rows.push_back(row);
                }
                ggml_free(ctx);
            }
        }
        }
        out["memories"] = memories;
        out["rows"] = rows;
        out["expert_bytes"] = (int64_t) (down->nb[2] + (L.ffn_gate_up_exps ? L.ffn_gate_up_exps->nb[2] :
                                                        L.ffn_up_exps->nb[2] + (L.ffn_gate_exps ? L.ffn_gate_exps->nb[2] : 0)));
    } catch (const std::exception & ex) {
        out = json{{"error", ex.what()}};
    }
    g_bench_out = out.dump();
    return g_bench_out.c_str();
}
