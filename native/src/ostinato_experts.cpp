// Ostinato native expert engine (see ostinato_experts.h). Paper: arXiv 2611.11533, Sections 2-3.
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

#include "ostinato_experts.h"
#include "ostinato_dgraph.h"

#include "ggml-backend.h"
#include "llama-model.h"
#include "llama-impl.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

using json = nlohmann::ordered_json;

namespace {

enum force_path_t { FORCE_AUTO = 0, FORCE_SPLIT = 1, FORCE_UPLOAD = 2 };

struct config_t {
    bool set = false;
    std::map<int, std::vector<int>> hot;   // layer -> hot expert ids
    int device = -1;                       // GPU index among GPU devices, -1 = CPU pool
    std::map<int, int> layer_device;       // layer -> GPU index (several GPUs); absent layer: `device`
    int64_t np = 512;                      // prefill threshold Np (tokens)
    int force = FORCE_AUTO;
};

struct size_class_t {
    int pool = 0;                               // index into engine_t::pools (classes are per pool)
    ggml_type t_up, t_gate, t_down;
    int64_t up0, up1, down0, down1;
    bool has_gate;
    bool has_bias = false;                      // expert biases (gpt-oss): one F32 row per expert
    std::vector<std::pair<int, int>> members;   // (layer, expert) in slot order
    int n_stage = 0;                            // max cold experts of one layer of the class
    ggml_tensor * up = nullptr, * gate = nullptr, * down = nullptr;   // [.., .., slots + k + n_stage]
    ggml_tensor * b_up = nullptr, * b_gate = nullptr, * b_down = nullptr;   // [.., slots + k + n_stage]
    bool operator==(const size_class_t & o) const {
        return pool == o.pool && t_up == o.t_up && t_gate == o.t_gate && t_down == o.t_down && up0 == o.up0 &&
               up1 == o.up1 && down0 == o.down0 && down1 == o.down1 && has_gate == o.has_gate &&
               has_bias == o.has_bias;
    }
};

struct pass_t {
    int64_t tokens = 0, routes = 0, hot = 0, cold = 0, distinct_cold = 0, upload_bytes = 0;
    double cpu_ms = 0, gpu_ms = 0, upload_ms = 0, total_ms = 0;
    bool gpu_timed = false;
    bool graph = false;                         // the pass ran (some of) its layers in the decode graph
    std::string path;
};

struct totals_t {
    int64_t passes = 0, tokens = 0, routes = 0, hot = 0, cold = 0, distinct_cold = 0, upload_bytes = 0;
    double cpu_ms = 0, gpu_ms = 0, upload_ms = 0, total_ms = 0;
    std::map<std::string, int64_t> paths;
    std::vector<int64_t> counts_prefill, counts_decode;   // [n_layer * n_expert]
    void add(const pass_t & p) {
        passes++; tokens += p.tokens; routes += p.routes; hot += p.hot; cold += p.cold;
        distinct_cold += p.distinct_cold; upload_bytes += p.upload_bytes;
        cpu_ms += p.cpu_ms; gpu_ms += p.gpu_ms; upload_ms += p.upload_ms; total_ms += p.total_ms;
        paths[p.path]++;
    }
};

// One expert pool: the hot experts (and zero and staging slots) of the MoE layers placed on one
// device, one set of pool tensors per size class, in one backend buffer of that device.
struct pool_t {
    int gpu = -1;                              // configured GPU index ("device" / "layer_device")
    ggml_backend_dev_t dev = nullptr;
    std::string name = "CPU";                  // backend device name, e.g. CUDA1
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_backend_t upload_backend = nullptr;   // GPU pool: own stream for the upload path's async copies
    ggml_tensor * table = nullptr;             // I32 [n_expert, n_layer]: index tables of the decode graph
    ggml_tensor * scratch = nullptr;           // I32 [4, n_layer]: the route kernel's counters
    int64_t bytes = 0, n_hot = 0;
    int n_classes = 0;
    std::vector<int> layers;                   // MoE layers assigned to this pool's device
};

struct engine_t {
    llama_model * model = nullptr;
    int n_layer = 0, n_expert = 0, k = 0;
    std::unordered_map<const ggml_tensor *, int> by_down;
    std::vector<ostinato_moe_layer> layers;
    std::vector<std::vector<uint8_t>> hot;     // [layer][expert]
    std::vector<int64_t> expert_bytes;         // per layer: bytes of one expert (up+gate+down)
    std::vector<std::vector<int32_t>> slot;    // [layer][expert]: pool slot (hot) or -1 (cold)
    std::vector<size_class_t> classes;
    std::vector<pool_t> pools;                 // one per device in use (one for a one-device config)
    std::vector<int> layer_pool;               // per layer: index into pools (-1: no MoE layer)
    std::string pool_device = "CPU";           // name of pools[0]'s device
    std::string host_buffer = "";             // buffer type holding the cold experts (e.g. CUDA_Host = pinned)
    int64_t pool_bytes = 0, n_hot = 0;
    std::vector<std::string> notes;
    ost_dgraph * dg = nullptr;                 // decode graph (created on first use)
    bool dg_failed = false;                    // its creation failed (note in `notes`)
    bool dg_running = false;                   // the current pass has decode-graph layers

    // stats (guarded by mu)
    pass_t cur;
    bool in_pass = false;
    int64_t pass_t0_us = 0;
    std::vector<uint8_t> cold_seen;            // [layer * n_expert] for distinct cold experts
    std::vector<int64_t> mark_us;              // [layer]: time of the last marker
    totals_t total, request;
    std::deque<pass_t> last;
};

// Cold experts in pageable memory (mmap-ed weights) are pinned with cudaHostRegister through the
// CUDA backend's "ggml_backend_register_host_buffer" (DESIGN.md item 1): the upload path's copies then
// run at the pinned H2D bandwidth. Per model, once; unregistered when the model is freed.
struct pinned_t {
    const llama_model * model = nullptr;
    ggml_backend_reg_t reg = nullptr;
    std::vector<void *> ptrs;
    int64_t bytes = 0;
    bool already_pinned = false;   // the loader put the experts in a pinned (CUDA_Host) buffer
    std::string note;
};

std::mutex g_mu;
pinned_t g_pin;
config_t   g_cfg;                 // loader config: consumed by the next model load
int64_t    g_np = 512;            // run-time: prefill threshold Np and forced path (kept across loads)
int        g_force = FORCE_AUTO;
engine_t * g_eng = nullptr;
std::string g_err;
std::string g_out_info, g_out_stats, g_out_req;
bool g_graph_dirty = false;   // set by a residency switch: cached graphs reference the old pool
bool g_timing = false;        // timing mode: GPU branches get a synchronising marker
bool g_overlap = true;        // decode overlap: CPU branch after the GPU branch in the graph
int  g_dgraph = -1;           // decode graph: -1 auto (on when a pool is on a GPU), 0 off, 1 on
bool g_dgraph_broken = false; // a pass lost a wait: decode graph off until the next model load
int  g_dgraph_max = 64;       // largest pass (tokens) that takes the decode graph
int  g_cpu_threads = 0;       // CPU-branch threads of the decode graph (0: estimate physical cores)

int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

void free_engine(engine_t * e) {
    if (!e) return;
    ost_dg_free(e->dg);
    for (auto & p : e->pools) {
        if (p.upload_backend) ggml_backend_free(p.upload_backend);
        if (p.buf) ggml_backend_buffer_free(p.buf);
        if (p.ctx) ggml_free(p.ctx);
    }
    delete e;
}

ggml_backend_dev_t pool_device(int gpu_index) {
    if (gpu_index >= 0) {
        int seen = 0;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t d = ggml_backend_dev_get(i);
            if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU) {
                if (seen++ == gpu_index) return d;
            }
        }
    }
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}

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
    j["cpu_branch_ms"] = t.cpu_ms; j["gpu_branch_ms"] = t.gpu_ms; j["upload_ms"] = t.upload_ms;
    j["total_ms"] = t.total_ms;
    j["paths"] = json::object();
    for (const char * p : {"decode", "split", "upload"}) j["paths"][p] = 0;
    for (auto & kv : t.paths) j["paths"][kv.first] = kv.second;
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
                {"upload_bytes", p.upload_bytes}, {"upload_ms", p.upload_ms}, {"total_ms", p.total_ms},
                {"decode_graph", p.graph}};
}

// Counts one route (layer il, expert x) into the current pass and the totals; returns the expert's
// pool slot (>= 0: hot) or -1 (cold). Caller holds g_mu.
int32_t count_route(engine_t * e, int il, int32_t x, bool decode) {
    const size_t idx = (size_t) il * e->n_expert + x;
    (decode ? e->total.counts_decode : e->total.counts_prefill)[idx]++;
    (decode ? e->request.counts_decode : e->request.counts_prefill)[idx]++;
    e->cur.routes++;
    const int32_t s = e->slot[il][x];
    if (s >= 0) {
        e->cur.hot++;
    } else {
        e->cur.cold++;
        if (!e->cold_seen[idx]) { e->cold_seen[idx] = 1; e->cur.distinct_cold++; }
    }
    return s;
}

// Route counts of a decode-graph layer, reported by the decode graph's worker thread.
void dg_count(void * ud, int il, int n, int k, const int32_t * ids, int n_cold, double cpu_ms) {
    (void) n_cold;
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (e != (engine_t *) ud || il < 0 || il >= e->n_layer) return;
    const bool decode = e->cur.tokens == 1;
    for (int64_t i = 0; i < (int64_t) n * k; ++i) {
        if (ids[i] >= 0 && ids[i] < e->n_expert) count_route(e, il, ids[i], decode);
    }
    e->cur.cpu_ms += cpu_ms;
}

// Route op (custom CPU op, n_tasks = 1): reads selected_experts [k, n_tokens] (possibly a strided
// view), counts the routes into the current pass and writes the two planes of ids (see the header).
void route_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ggml_tensor * a = dst->src[0];
    const int il = (int) (intptr_t) ud;
    const int64_t k = a->ne[0], n = a->ne[1];
    int32_t * g = (int32_t *) dst->data;
    int32_t * c = g + k * n;
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    const bool ok = e && il >= 0 && il < e->n_layer;
    const bool split = ok && e->layers[il].has_hot;
    const int zero0 = split ? e->layers[il].zero0 : 0;
    const bool decode = n == 1;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t x = *(const int32_t *) ((const char *) a->data + t * a->nb[1] + j * a->nb[0]);
            const int64_t i = t * k + j;
            if (!ok || x < 0 || x >= e->n_expert) { g[i] = x; c[i] = x; continue; }
            const int32_t s = count_route(e, il, x, decode);
            if (s >= 0) {
                g[i] = s; c[i] = -1;
            } else {
                g[i] = split ? zero0 + (int32_t) j : x;   // a zero slot per position: exact zeros
                c[i] = x;
            }
        }
    }
    if (ok) e->mark_us[il] = now_us();
}

// Custom CPU op of the upload path (Section 3.3, n_tasks = 1): for layer il, copies each distinct
// cold expert of the pass once from host memory into the staging slots of the pool (ascending expert
// ids into ascending slots, so runs of consecutive cold experts go in one copy; asynchronous on the
// engine's own stream, joined once at the end) and writes pool ids: hot -> its slot, cold -> its
// staging slot. Hot experts are never uploaded.
void upload_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ggml_tensor * route = dst->src[0];
    const int il = (int) (intptr_t) ud;
    const int64_t k = route->ne[0], n = route->ne[1];
    const int32_t * g = (const int32_t *) route->data;   // plane 0: hot -> slot
    const int32_t * c = g + k * n;                        // plane 1: cold -> expert, hot -> -1
    int32_t * out = (int32_t *) dst->data;
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || il < 0 || il >= e->n_layer || !e->layers[il].has_hot) {
        for (int64_t i = 0; i < k * n; ++i) out[i] = g[i];
        return;
    }
    const int64_t t0 = now_us();
    const auto & L = e->model->layers[il];
    const auto & ol = e->layers[il];
    ggml_backend_t upload_backend = e->pools[e->layer_pool[il]].upload_backend;   // the layer's device
    std::vector<int32_t> slot(e->n_expert, -1);
    for (int64_t i = 0; i < k * n; ++i) if (c[i] >= 0 && c[i] < e->n_expert) slot[c[i]] = 1;   // seen
    int used = 0;
    for (int x = 0; x < e->n_expert; ++x) slot[x] = slot[x] == 1 ? ol.stage0 + used++ : -1;
    GGML_ASSERT(ol.stage0 + used <= ol.down_pool->ne[2]);
    // one expert = one ne[2] slice of a weight tensor, one row (nb[1]) of a bias tensor
    auto put = [&](const ggml_tensor * src, ggml_tensor * pool, int x0, int s0, int m) {
        const size_t nb = ggml_n_dims(src) >= 3 ? src->nb[2] : src->nb[1];
        const size_t sz = (size_t) m * nb;
        if (src->buffer && ggml_backend_buffer_is_host(src->buffer)) {
            const char * p = (const char *) src->data + (size_t) x0 * nb;
            if (upload_backend) ggml_backend_tensor_set_async(upload_backend, pool, p, (size_t) s0 * nb, sz);
            else                   ggml_backend_tensor_set(pool, p, (size_t) s0 * nb, sz);
        } else {
            std::vector<uint8_t> tmp(sz);
            ggml_backend_tensor_get(src, tmp.data(), (size_t) x0 * nb, sz);
            ggml_backend_tensor_set(pool, tmp.data(), (size_t) s0 * nb, sz);
        }
        e->cur.upload_bytes += (int64_t) sz;
    };
    for (int x = 0; x < e->n_expert;) {
        if (slot[x] < 0) { ++x; continue; }
        int m = 1;
        while (x + m < e->n_expert && slot[x + m] >= 0) ++m;   // consecutive experts, consecutive slots
        put(L.ffn_up_exps, ol.up_pool, x, slot[x], m);
        if (ol.gate_pool) put(L.ffn_gate_exps, ol.gate_pool, x, slot[x], m);
        put(L.ffn_down_exps, ol.down_pool, x, slot[x], m);
        if (ol.up_b_pool)   put(L.ffn_up_exps_b, ol.up_b_pool, x, slot[x], m);
        if (ol.gate_b_pool) put(L.ffn_gate_exps_b, ol.gate_b_pool, x, slot[x], m);
        if (ol.down_b_pool) put(L.ffn_down_exps_b, ol.down_b_pool, x, slot[x], m);
        x += m;
    }
    for (int64_t i = 0; i < k * n; ++i) {
        const int32_t x = c[i];
        out[i] = (x >= 0 && x < e->n_expert) ? slot[x] : g[i];
    }
    if (upload_backend) ggml_backend_synchronize(upload_backend);
    e->cur.upload_ms += (now_us() - t0) / 1000.0;
    e->mark_us[il] = now_us();
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

void unpin(pinned_t & p) {
    if (p.reg && !p.ptrs.empty()) {
        auto fn = (void (*)(void *)) ggml_backend_reg_get_proc_address(p.reg, "ggml_backend_unregister_host_buffer");
        const bool had_env = std::getenv("GGML_CUDA_REGISTER_HOST") != nullptr;   // see pin_experts
        if (!had_env) setenv("GGML_CUDA_REGISTER_HOST", "1", 1);
        if (fn) for (void * q : p.ptrs) fn(q);
        if (!had_env) unsetenv("GGML_CUDA_REGISTER_HOST");
    }
    p = pinned_t();
}

// Pins the routed-expert tensors of `model` (all of them: a residency switch changes which are cold).
// Ranges are page-aligned and merged within one buffer (gaps under 64 MiB are pinned too) to keep
// the calls few.
void pin_experts(llama_model * model, ggml_backend_dev_t dev) {
    if (g_pin.model == model) return;
    unpin(g_pin);
    g_pin.model = model;
    if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) return;
    struct range_t { const void * buf; uintptr_t a, b; };
    std::vector<range_t> r;
    for (const auto & L : model->layers) {
        // the expert biases too: a copy that spans the end of a pinned range into pageable memory
        // fails (cudaMemcpyAsync: invalid argument), which aborted gpt-oss's upload path
        for (const ggml_tensor * t : {L.ffn_up_exps, L.ffn_gate_exps, L.ffn_down_exps, L.ffn_gate_up_exps,
                                      L.ffn_up_exps_b, L.ffn_gate_exps_b, L.ffn_down_exps_b}) {
            if (!t || !t->buffer || !ggml_backend_buffer_is_host(t->buffer) || !t->data) continue;
            if (std::strstr(ggml_backend_buffer_name(t->buffer), "CUDA_Host")) { g_pin.already_pinned = true; continue; }
            r.push_back({t->buffer, (uintptr_t) t->data, (uintptr_t) t->data + ggml_nbytes(t)});
        }
    }
    if (r.empty()) return;
    const uintptr_t page = 4096, gap = 64u << 20;
    std::sort(r.begin(), r.end(), [](const range_t & x, const range_t & y) {
        return x.buf != y.buf ? x.buf < y.buf : x.a < y.a;
    });
    std::vector<std::pair<uintptr_t, uintptr_t>> m;
    const void * last_buf = nullptr;
    for (auto [buf, a, b] : r) {
        a &= ~(page - 1); b = (b + page - 1) & ~(page - 1);
        if (!m.empty() && buf == last_buf && a <= m.back().second + gap) m.back().second = std::max(m.back().second, b);
        else m.push_back({a, b});
        last_buf = buf;
    }
    g_pin.reg = ggml_backend_dev_backend_reg(dev);
    auto fn = (bool (*)(void *, size_t)) ggml_backend_reg_get_proc_address(g_pin.reg, "ggml_backend_register_host_buffer");
    if (!fn) { g_pin.note = "the GPU backend cannot pin host memory: cold experts stay pageable"; return; }
    // ggml's CUDA backend registers only when GGML_CUDA_REGISTER_HOST is set
    const bool had_env = std::getenv("GGML_CUDA_REGISTER_HOST") != nullptr;
    if (!had_env) setenv("GGML_CUDA_REGISTER_HOST", "1", 1);
    const int64_t t0 = now_us();
    int64_t failed = 0;
    for (auto [a, b] : m) {
        if (fn((void *) a, b - a)) { g_pin.ptrs.push_back((void *) a); g_pin.bytes += (int64_t) (b - a); }
        else failed += (int64_t) (b - a);
    }
    if (!had_env) unsetenv("GGML_CUDA_REGISTER_HOST");
    if (failed) {
        g_pin.note = "pinning " + std::to_string(failed >> 20) + " MiB of cold experts failed (cudaHostRegister): "
                     "those stay pageable and upload slower";
        LLAMA_LOG_WARN("ostinato: %s\n", g_pin.note.c_str());
    }
    LLAMA_LOG_INFO("ostinato: pinned %.1f MiB of host experts in %zu ranges, %.1f ms\n", g_pin.bytes / 1048576.0,
                   g_pin.ptrs.size(), (now_us() - t0) / 1000.0);
}

// Several GPUs (config with "layer_device"): each MoE layer's pool must be on the device where
// llama.cpp put the layer's dense weights (layer split), else every layer would move its hidden
// states between GPUs twice. Reads the device of the layer's attention weight buffer; a layer whose
// dense weights are in host memory (partial offload, CPU build) is not checked. Returns false with
// `err` naming the first layer that disagrees (the config is refused, nothing is adopted).
bool check_layer_devices(const llama_model * model, const engine_t * e, std::string & err) {
    for (int il = 0; il < e->n_layer; ++il) {
        const int pi = e->layer_pool[il];
        if (pi < 0) continue;
        const auto & L = model->layers[il];
        const ggml_tensor * w = nullptr;
        for (const ggml_tensor * t : {L.wq, L.wq_a, L.wqkv, L.wkv_a_mqa, L.attn_norm}) {
            if (t && t->buffer) { w = t; break; }
        }
        if (!w || ggml_backend_buffer_is_host(w->buffer)) continue;
        ggml_backend_dev_t d = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(w->buffer));
        if (!d || ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_CPU) continue;
        const pool_t & p = e->pools[pi];
        if (d != p.dev) {
            err = "layer " + std::to_string(il) + ": the residency set puts its experts on GPU " +
                  std::to_string(p.gpu) + " (" + p.name + ") but llama.cpp put its dense weights on " +
                  ggml_backend_dev_name(d) + "; load the model with split_mode LAYER and a tensor_split "
                  "that follows the set's per-GPU layer ranges (ExpertRuntime.adjust_model_params does)";
            return false;
        }
    }
    return true;
}

bool build_engine(llama_model * model, const config_t & cfg, std::string & err) {
    auto * e = new engine_t();
    e->model = model;
    e->n_layer = (int) model->layers.size();
    e->n_expert = (int) model->hparams.n_expert;
    e->k = (int) model->hparams.n_expert_used();
    if (e->n_expert <= 0 || e->k <= 0) {
        err = "model has no routed experts (dense model): run stock";
        free_engine(e);
        return false;
    }
    e->layers.resize(e->n_layer);
    e->hot.assign(e->n_layer, std::vector<uint8_t>(e->n_expert, 0));
    e->expert_bytes.assign(e->n_layer, 0);
    for (auto & kv : cfg.hot) {
        if (kv.first < 0 || kv.first >= e->n_layer) {
            err = "residency set names layer " + std::to_string(kv.first) + " but the model has " +
                  std::to_string(e->n_layer) + " layers";
            free_engine(e);
            return false;
        }
        for (int x : kv.second) {
            if (x < 0 || x >= e->n_expert) {
                err = "residency set names expert " + std::to_string(x) + " of layer " +
                      std::to_string(kv.first) + " but the model has " + std::to_string(e->n_expert) +
                      " experts";
                free_engine(e);
                return false;
            }
            e->hot[kv.first][x] = 1;
        }
    }
    for (auto & kv : cfg.layer_device) {
        if (kv.first < 0 || kv.first >= e->n_layer) {
            err = "layer_device names layer " + std::to_string(kv.first) + " but the model has " +
                  std::to_string(e->n_layer) + " layers";
            free_engine(e);
            return false;
        }
    }
    // one pool per device in use, in order of first use by the layers (one-device config: one pool)
    e->layer_pool.assign(e->n_layer, -1);
    auto pool_of = [&](int gpu) {
        for (size_t i = 0; i < e->pools.size(); ++i) if (e->pools[i].gpu == gpu) return (int) i;
        pool_t p;
        p.gpu = gpu;
        e->pools.push_back(p);
        return (int) e->pools.size() - 1;
    };
    // size classes over the layers that have hot experts and a supported expert layout
    std::vector<int> layer_class(e->n_layer, -1);
    for (int il = 0; il < e->n_layer && il < (int) model->layers.size(); ++il) {
        const auto & L = model->layers[il];
        if (!L.ffn_down_exps) continue;
        e->by_down[L.ffn_down_exps] = il;
        e->layers[il].il = il;
        {
            auto ld = cfg.layer_device.find(il);
            const int pi = pool_of(ld != cfg.layer_device.end() ? ld->second : cfg.device);
            e->layer_pool[il] = pi;
            e->pools[pi].layers.push_back(il);
        }
        const int64_t eb = (int64_t) L.ffn_down_exps->nb[2] + (L.ffn_up_exps ? (int64_t) L.ffn_up_exps->nb[2] : 0) +
                           (L.ffn_gate_exps ? (int64_t) L.ffn_gate_exps->nb[2] : 0) +
                           (L.ffn_gate_up_exps ? (int64_t) L.ffn_gate_up_exps->nb[2] : 0);
        e->expert_bytes[il] = eb;
        int n_hot_l = 0;
        for (int x = 0; x < e->n_expert; ++x) n_hot_l += e->hot[il][x];
        if (n_hot_l == 0) continue;
        const bool biases = L.ffn_up_exps_b || L.ffn_gate_exps_b || L.ffn_down_exps_b;
        const bool biases_ok = !biases || (L.ffn_up_exps_b && L.ffn_down_exps_b &&
            (L.ffn_gate_exps_b != nullptr) == (L.ffn_gate_exps != nullptr) &&
            L.ffn_up_exps_b->type == GGML_TYPE_F32 && L.ffn_down_exps_b->type == GGML_TYPE_F32 &&
            (!L.ffn_gate_exps_b || L.ffn_gate_exps_b->type == GGML_TYPE_F32));
        if (!L.ffn_up_exps || L.ffn_gate_up_exps || !biases_ok) {
            // merged gate_up or a partial set of expert biases: not handled, the layer runs stock
            e->notes.push_back("layer " + std::to_string(il) + ": expert layout not supported, runs stock");
            std::fill(e->hot[il].begin(), e->hot[il].end(), 0);
            continue;
        }
        size_class_t c{};
        c.pool = e->layer_pool[il];
        c.t_up = L.ffn_up_exps->type; c.up0 = L.ffn_up_exps->ne[0]; c.up1 = L.ffn_up_exps->ne[1];
        c.has_gate = L.ffn_gate_exps != nullptr;
        c.t_gate = c.has_gate ? L.ffn_gate_exps->type : GGML_TYPE_F32;
        c.t_down = L.ffn_down_exps->type; c.down0 = L.ffn_down_exps->ne[0]; c.down1 = L.ffn_down_exps->ne[1];
        c.has_bias = biases;
        int ci = -1;
        for (size_t i = 0; i < e->classes.size(); ++i) if (e->classes[i] == c) { ci = (int) i; break; }
        if (ci < 0) { e->classes.push_back(c); ci = (int) e->classes.size() - 1; }
        for (int x = 0; x < e->n_expert; ++x) if (e->hot[il][x]) e->classes[ci].members.push_back({il, x});
        e->classes[ci].n_stage = std::max(e->classes[ci].n_stage, e->n_expert - n_hot_l);
        layer_class[il] = ci;
        e->layers[il].has_hot = true;
    }

    for (int il = 0; il < e->n_layer; ++il) {
        const auto & L = model->layers[il];
        if (L.ffn_down_exps && L.ffn_down_exps->buffer) {
            e->host_buffer = ggml_backend_buffer_name(L.ffn_down_exps->buffer);
            break;
        }
    }
    if (e->pools.empty()) pool_of(cfg.device);
    for (auto & p : e->pools) {
        p.dev = pool_device(p.gpu);
        if (!p.dev) { err = "no backend device for the expert pool"; free_engine(e); return false; }
        p.name = ggml_backend_dev_name(p.dev);
        if (!cfg.layer_device.empty() && p.gpu >= 0 && ggml_backend_dev_type(p.dev) == GGML_BACKEND_DEVICE_TYPE_CPU &&
            ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) != nullptr) {
            // several GPUs named on a GPU build: a missing GPU is an error, not a CPU pool (a
            // CPU-only build puts every pool in a CPU buffer, which is what CI tests)
            err = "the residency set names GPU " + std::to_string(p.gpu) + " but this machine has no such GPU";
            free_engine(e);
            return false;
        }
    }
    e->pool_device = e->pools[0].name;
    if (!cfg.layer_device.empty() && !check_layer_devices(model, e, err)) { free_engine(e); return false; }
    {
        // host experts are pinned once per model; cudaHostRegisterPortable makes them pinned for
        // every device, so the first GPU pool's backend does it for all pools
        ggml_backend_dev_t pin_dev = e->pools[0].dev;
        for (auto & p : e->pools) {
            if (ggml_backend_dev_type(p.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) { pin_dev = p.dev; break; }
        }
        pin_experts(model, pin_dev);
    }

    for (auto & c : e->classes) e->pools[c.pool].n_classes++;
    for (auto & p : e->pools) {
        const size_t n_tensors = 6 * (size_t) p.n_classes + 3;   // up, gate, down + their bias rows; tables
        ggml_init_params ip = { ggml_tensor_overhead() * n_tensors, nullptr, true };
        p.ctx = ggml_init(ip);
        if (!p.layers.empty()) {
            p.table = ggml_new_tensor_2d(p.ctx, GGML_TYPE_I32, e->n_expert, e->n_layer);
            p.scratch = ggml_new_tensor_2d(p.ctx, GGML_TYPE_I32, 4, e->n_layer);
        }
    }
    for (auto & c : e->classes) {
        // hot slots, k zero slots, then the upload path's staging slots (preallocated here)
        ggml_context * ctx = e->pools[c.pool].ctx;
        const int64_t n_slots = (int64_t) c.members.size() + e->k + c.n_stage;
        c.up = ggml_new_tensor_3d(ctx, c.t_up, c.up0, c.up1, n_slots);
        if (c.has_gate) c.gate = ggml_new_tensor_3d(ctx, c.t_gate, c.up0, c.up1, n_slots);
        c.down = ggml_new_tensor_3d(ctx, c.t_down, c.down0, c.down1, n_slots);
        if (c.has_bias) {
            c.b_up = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.up1, n_slots);
            if (c.has_gate) c.b_gate = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.up1, n_slots);
            c.b_down = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.down1, n_slots);
        }
    }
    for (int il = 0; il < e->n_layer; ++il) {
        if (!e->layers[il].has_hot) continue;
        auto & l = e->layers[il];
        auto & c = e->classes[layer_class[il]];
        l.up_pool = c.up; l.gate_pool = c.gate; l.down_pool = c.down;
        l.up_b_pool = c.b_up; l.gate_b_pool = c.b_gate; l.down_b_pool = c.b_down;
        l.zero0 = (int) c.members.size();
        l.stage0 = l.zero0 + e->k;
    }
    for (auto & p : e->pools) {
        if (p.n_classes == 0 && p.layers.empty()) continue;
        p.buf = ggml_backend_alloc_ctx_tensors_from_buft(p.ctx, ggml_backend_dev_buffer_type(p.dev));
        if (!p.buf) {
            err = std::string("cannot allocate the expert pool on ") + p.name;
            free_engine(e);
            return false;
        }
        ggml_backend_buffer_set_usage(p.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(p.buf, 0);   // zero slots (and any padding) are all-zero
        p.bytes = (int64_t) ggml_backend_buffer_get_size(p.buf);
        e->pool_bytes += p.bytes;
        if (ggml_backend_dev_type(p.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            // a stream of our own per device for the upload path's copies (joined at the end of
            // each upload op)
            p.upload_backend = ggml_backend_dev_init(p.dev, nullptr);
        }
    }
    // copy hot experts into their slots; fill the index table
    e->slot.assign(e->n_layer, std::vector<int32_t>(e->n_expert, -1));
    std::vector<uint8_t> tmp;
    auto copy_expert = [&](ggml_tensor * src, ggml_tensor * dst, int x, int slot) {
        const int d = ggml_n_dims(src) >= 3 ? 2 : 1;   // weight slice or bias row
        const size_t nb = src->nb[d];
        GGML_ASSERT(dst->nb[d] == nb);
        if (src->buffer && ggml_backend_buffer_is_host(src->buffer)) {   // straight from (pinned) host memory
            ggml_backend_tensor_set(dst, (const char *) src->data + (size_t) x * nb, (size_t) slot * nb, nb);
            return;
        }
        tmp.resize(nb);
        ggml_backend_tensor_get(src, tmp.data(), (size_t) x * nb, nb);
        ggml_backend_tensor_set(dst, tmp.data(), (size_t) slot * nb, nb);
    };
    for (auto & c : e->classes) {
        for (size_t s = 0; s < c.members.size(); ++s) {
            const auto [il, x] = c.members[s];
            const auto & L = model->layers[il];
            copy_expert(L.ffn_up_exps, c.up, x, (int) s);
            if (c.has_gate) copy_expert(L.ffn_gate_exps, c.gate, x, (int) s);
            copy_expert(L.ffn_down_exps, c.down, x, (int) s);
            if (c.b_up)   copy_expert(L.ffn_up_exps_b, c.b_up, x, (int) s);
            if (c.b_gate) copy_expert(L.ffn_gate_exps_b, c.b_gate, x, (int) s);
            if (c.b_down) copy_expert(L.ffn_down_exps_b, c.b_down, x, (int) s);
            e->slot[il][x] = (int32_t) s;
            e->n_hot++;
            e->pools[c.pool].n_hot++;
        }
    }
    for (auto & p : e->pools) {   // the decode graph's index tables, one row per layer of the pool
        if (!p.table) continue;
        std::vector<int32_t> rows((size_t) e->n_layer * e->n_expert, -1);
        for (int il : p.layers) {
            if (!e->layers[il].has_hot) continue;
            std::copy(e->slot[il].begin(), e->slot[il].end(), rows.begin() + (size_t) il * e->n_expert);
        }
        ggml_backend_tensor_set(p.table, rows.data(), 0, rows.size() * sizeof(int32_t));
    }
    const size_t nle = (size_t) e->n_layer * e->n_expert;
    totals_init(e->total, nle);
    totals_init(e->request, nle);
    if (g_eng && g_eng->model == model) {   // residency switch: keep the counters
        e->total = g_eng->total;
        e->request = g_eng->request;
        e->last = g_eng->last;
    }
    e->cold_seen.assign(nle, 0);
    e->mark_us.assign(e->n_layer, 0);
    free_engine(g_eng);
    g_eng = e;
    g_graph_dirty = true;
    return true;
}

const char * keep(std::string & slot, const json & j) {
    slot = j.dump();
    return slot.c_str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// hooks called by the patched llama.cpp

const ostinato_moe_layer * ostinato_moe_lookup(const ggml_tensor * down_exps) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng || !down_exps) return nullptr;
    auto it = g_eng->by_down.find(down_exps);
    if (it == g_eng->by_down.end()) return nullptr;
    return &g_eng->layers[it->second];
}

ggml_tensor * ostinato_moe_route(ggml_context * ctx, ggml_tensor * selected_experts, ggml_tensor * cur, int il) {
    ggml_tensor * args[2] = { selected_experts, cur };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, selected_experts->ne[0], selected_experts->ne[1], 2, 1,
                                     args, cur ? 2 : 1, route_op, 1, (void *) (intptr_t) il);
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

ggml_tensor * ostinato_moe_upload(ggml_context * ctx, ggml_tensor * route, int il) {
    ggml_tensor * args[1] = { route };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, route->ne[0], route->ne[1], 1, 1, args, 1,
                                     upload_op, 1, (void *) (intptr_t) il);
    ggml_format_name(t, "ostinato_upload-%d", il);
    return t;
}

namespace {

// Decode graph wanted for this engine (auto: a pool on a GPU); creates it on first use. Holds g_mu.
ost_dgraph * dgraph_of(engine_t * e) {
    if (!e || g_dgraph == 0 || g_dgraph_broken || g_timing || e->dg_failed) return nullptr;
    if (g_dgraph < 0) {
        bool gpu = false;
        for (auto & p : e->pools) gpu = gpu || ggml_backend_dev_type(p.dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
        if (!gpu) return nullptr;
    }
    if (e->dg) return e->dg;
    ost_dg_config c;
    c.n_layer = e->n_layer; c.n_expert = e->n_expert; c.k = e->k;
    c.n_embd = e->model->hparams.n_embd;
    c.max_tokens = g_dgraph_max;
    c.n_threads = g_cpu_threads;
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
        l.scratch = (int32_t *) e->pools[pi].scratch->data + (size_t) 4 * il;
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
    if (g_eng && g_eng->dg) ost_dg_build_begin(g_eng->dg, graph_ctx);
}

int ostinato_moe_overlap(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_overlap ? 1 : 0;
}

int ostinato_moe_timing(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_timing ? 1 : 0;
}

int ostinato_moe_upload_path(int64_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (n_tokens <= 1) return 0;   // decode
    if (g_force == FORCE_UPLOAD) return 1;
    if (g_force == FORCE_SPLIT) return 0;
    return n_tokens >= g_np ? 1 : 0;
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
        e->cur = pass_t();
        e->cur.tokens = n_tokens;
        std::fill(e->cold_seen.begin(), e->cold_seen.end(), 0);
        e->in_pass = true;
        e->pass_t0_us = now_us();
        e->dg_running = false;
        dg = e->dg;
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
    e->cur.graph = e->dg_running;
    e->dg_running = false;
    e->total.add(e->cur);
    e->request.add(e->cur);
    e->last.push_back(e->cur);
    while (e->last.size() > 32) e->last.pop_front();
}

bool ostinato_on_model_loaded(llama_model * model) {
    config_t cfg;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_cfg.set) return true;
        cfg = g_cfg;
    }
    std::string err;
    const int64_t t0 = now_us();
    bool ok;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_dgraph_broken = false;
        ok = build_engine(model, cfg, err);
        if (!ok) g_err = err;
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

bool ostinato_keep_on_host(const char * name) {
    if (!name || std::strncmp(name, "blk.", 4) != 0 || !std::strstr(name, "_exps.")) return false;
    std::lock_guard<std::mutex> lock(g_mu);
    return g_cfg.set;
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

int ostinato_experts_configure(const char * js) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_err.clear();
    if (!js || !*js) { g_cfg = config_t(); return 0; }
    try {
        json j = json::parse(js);
        config_t c;
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
        c.np = j.value("prefill_threshold", g_np);   // absent: keep the current value
        if (c.np < 1) throw std::runtime_error("prefill_threshold must be >= 1");
        const std::string f = j.value("force_path", std::string(
            g_force == FORCE_SPLIT ? "split" : g_force == FORCE_UPLOAD ? "upload" : "auto"));
        if (f == "auto") c.force = FORCE_AUTO;
        else if (f == "split") c.force = FORCE_SPLIT;
        else if (f == "upload") c.force = FORCE_UPLOAD;
        else throw std::runtime_error("force_path must be auto, split or upload");
        if (c.np != g_np || c.force != g_force) g_graph_dirty = true;
        g_np = c.np;
        g_force = c.force;
        g_cfg = c;
        return 0;
    } catch (const std::exception & ex) {
        g_err = std::string("bad expert config: ") + ex.what();
        return -1;
    }
}

int ostinato_experts_switch(const char * js) {
    llama_model * model;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_eng) { g_err = "no model with an active expert engine"; return -1; }
        model = g_eng->model;
    }
    if (ostinato_experts_configure(js) != 0) return -1;
    return ostinato_on_model_loaded(model) ? 0 : -1;
}

int ostinato_experts_active(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_eng != nullptr ? 1 : 0;
}

const char * ostinato_experts_last_error(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_err.c_str();
}

int ostinato_experts_set_threshold(int64_t np) {
    if (np < 1) return -1;
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_np != np) g_graph_dirty = true;   // the path is part of the cached graph
    g_np = np;
    return 0;
}

int ostinato_experts_force_path(const char * p) {
    std::lock_guard<std::mutex> lock(g_mu);
    const std::string f = p ? p : "auto";
    if (f == "auto") g_force = FORCE_AUTO;
    else if (f == "split") g_force = FORCE_SPLIT;
    else if (f == "upload") g_force = FORCE_UPLOAD;
    else return -1;
    g_graph_dirty = true;
    return 0;
}

int ostinato_experts_set_timing(int on) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_timing != (on != 0)) g_graph_dirty = true;   // the markers are part of the graph
    g_timing = on != 0;
    return 0;
}

int ostinato_experts_set_overlap(int on) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_overlap != (on != 0)) g_graph_dirty = true;   // the branch order is part of the graph
    g_overlap = on != 0;
    return 0;
}

int ostinato_experts_set_decode_graph(int mode, int max_tokens) {
    if (mode < -1 || mode > 1 || max_tokens < 0 || max_tokens > 4096) return -1;
    std::lock_guard<std::mutex> lock(g_mu);
    if (max_tokens > 0 && max_tokens != g_dgraph_max) {
        g_dgraph_max = max_tokens;
        if (g_eng && g_eng->dg) { ost_dg_free(g_eng->dg); g_eng->dg = nullptr; }   // mailbox size
    }
    g_dgraph = mode;
    g_graph_dirty = true;
    return 0;
}

int ostinato_experts_set_cpu_threads(int n) {
    if (n < 0) return -1;
    std::lock_guard<std::mutex> lock(g_mu);
    g_cpu_threads = n;
    return 0;
}

const char * ostinato_experts_info(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    json j;
    j["active"] = g_eng != nullptr;
    j["prefill_threshold"] = g_np;
    j["force_path"] = g_force == FORCE_AUTO ? "auto" : g_force == FORCE_SPLIT ? "split" : "upload";
    j["timing"] = g_timing;
    j["overlap"] = g_overlap;
    j["decode_graph"] = json{{"mode", g_dgraph < 0 ? "auto" : g_dgraph ? "on" : "off"}, {"max_tokens", g_dgraph_max},
                             {"broken", g_dgraph_broken}};
    if (g_eng && g_eng->dg) {
        int nt = 0; int64_t mb = 0;
        ost_dg_info(g_eng->dg, nt, mb);
        j["decode_graph"]["active"] = true;
        j["decode_graph"]["cpu_threads"] = nt;
        j["decode_graph"]["mailbox_bytes"] = mb;
    }
    if (g_eng) {
        const engine_t & e = *g_eng;
        j["pool_device"] = e.pool_device;
        j["pool_bytes"] = e.pool_bytes;
        j["host_buffer"] = e.host_buffer;
        j["host_pinned"] = g_pin.model == e.model && (g_pin.already_pinned || g_pin.bytes > 0);
        j["pinned_bytes"] = g_pin.model == e.model ? g_pin.bytes : 0;
        if (g_pin.model == e.model && !g_pin.note.empty()) j["pin_note"] = g_pin.note;
        j["hot_experts"] = e.n_hot;
        j["n_layer"] = e.n_layer; j["n_expert"] = e.n_expert; j["n_expert_used"] = e.k;
        json cls = json::array();
        for (auto & c : e.classes) {
            cls.push_back(json{{"type_up", ggml_type_name(c.t_up)}, {"type_down", ggml_type_name(c.t_down)},
                               {"up_shape", {c.up0, c.up1}}, {"down_shape", {c.down0, c.down1}},
                               {"slots", c.members.size()}, {"zero_slots", e.k}, {"staging_slots", c.n_stage}, {"pool", c.pool}});
        }
        j["size_classes"] = cls;
        json pools = json::array();
        for (auto & p : e.pools) {
            pools.push_back(json{{"gpu", p.gpu}, {"device", p.name}, {"bytes", p.bytes},
                                 {"hot_experts", p.n_hot}, {"size_classes", p.n_classes},
                                 {"layers", p.layers}, {"upload_stream", p.upload_backend != nullptr}});
        }
        j["pools"] = pools;
        j["expert_bytes"] = e.expert_bytes;
        int moe_layers = 0;
        for (auto & l : e.layers) moe_layers += l.il >= 0;
        j["moe_layers"] = moe_layers;
        j["notes"] = e.notes;
    }
    return keep(g_out_info, j);
}

const char * ostinato_experts_stats(int with_counts) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) return keep(g_out_stats, json{{"active", false}});
    json j = totals_json(*g_eng, g_eng->total, with_counts != 0);
    j["active"] = true;
    json pools = json::array();   // per device: pool bytes and hot experts
    for (auto & p : g_eng->pools) {
        pools.push_back(json{{"gpu", p.gpu}, {"device", p.name}, {"bytes", p.bytes}, {"hot_experts", p.n_hot}});
    }
    j["pools"] = pools;
    json last = json::array();
    for (auto & p : g_eng->last) last.push_back(pass_json(p));
    j["last_passes"] = last;
    return keep(g_out_stats, j);
}

const char * ostinato_experts_take_request_stats(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) return keep(g_out_req, json{{"active", false}});
    json j = totals_json(*g_eng, g_eng->request, true);
    j["active"] = true;
    totals_init(g_eng->request, (size_t) g_eng->n_layer * g_eng->n_expert);
    return keep(g_out_req, j);
}

void ostinato_experts_reset_stats(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) return;
    const size_t n = (size_t) g_eng->n_layer * g_eng->n_expert;
    totals_init(g_eng->total, n);
    totals_init(g_eng->request, n);
    g_eng->last.clear();
}

}  // extern "C"
