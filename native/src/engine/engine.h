// Internal state of the expert engine, shared by its translation units (compiled into libllama):
// engine/engine.cpp (hooks called by the patched llama.cpp at graph build and per pass), engine/api.cpp
// (the C API, the options' check/apply, the model load/free hooks), engine/cpu_share.cpp (the hybrid
// pass's CPU share), expert_pool/pool.cpp (the expert pool and its build), expert_pool/borrow.cpp
// (borrowed decode slots), expert_pool/pinning.cpp (pinning), paths/split_upload_ops.cpp (the CPU ops
// of the split and upload paths), paths/route_counts.cpp (route counting, stats).
// Paper: arXiv 2611.11533, Sections 2-3 and Appendix B.
#pragma once

#include "ostinato.h"
#include "ostinato/engine_hooks.h"
#include "decode_graph/decode_graph.h"

#include "ggml-backend.h"
#include "llama-model.h"
#include "llama-impl.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

using json = nlohmann::ordered_json;

struct ost_dgraph;

namespace ost {

enum force_path_t { FORCE_AUTO = 0, FORCE_SPLIT = 1, FORCE_UPLOAD = 2 };

struct config_t {
    bool set = false;
    std::map<int, std::vector<int>> hot;   // layer -> hot expert ids
    int device = -1;                       // GPU index among GPU devices, -1 = CPU pool
    std::map<int, int> layer_device;       // layer -> GPU index (several GPUs); absent layer: `device`
    int64_t np = -1;                       // prefill threshold Np (tokens) named by the config, -1: none
    int force = -1;                        // forced path named by the config, -1: none
};

struct size_class_t {
    int pool = 0;                               // index into engine_t::pools (classes are per pool)
    ggml_type t_up, t_gate, t_down;
    int64_t up0, up1, down0, down1;
    bool has_gate;
    bool merged = false;                        // up slot holds merged gate_up rows (ffn_gate_up_exps)
    bool has_bias = false;                      // expert biases (gpt-oss): one F32 row per expert
    bool whole_slots = false;                   // a slot holds its expert's weight matrices next to each
                                                // other: the weight tensors are strided by a whole slot
    bool copy_2d_refused = false;               // the pool's 2D copy refused this class's (its pitch is
                                                // above the GPU's maximum): copies go matrix by matrix
    std::vector<std::pair<int, int>> members;   // (layer, expert) in slot order
    int n_stage = 0;                            // max cold experts of one layer of the class
    std::vector<std::pair<int, int>> borrowed;  // per staging slot: (layer, expert) lent to decode, or (-1, -1)
    // [.., .., slots + k + n_stage * (prefetch depth + 1)], biases [.., the same]
    ggml_tensor * up = nullptr, * gate = nullptr, * down = nullptr;
    ggml_tensor * b_up = nullptr, * b_gate = nullptr, * b_down = nullptr;
    bool operator==(const size_class_t & o) const {
        return pool == o.pool && t_up == o.t_up && t_gate == o.t_gate && t_down == o.t_down && up0 == o.up0 &&
               up1 == o.up1 && down0 == o.down0 && down1 == o.down1 && has_gate == o.has_gate && merged == o.merged &&
               has_bias == o.has_bias;
    }
};

struct pass_t {
    int64_t tokens = 0, routes = 0, hot = 0, cold = 0, distinct_cold = 0, upload_bytes = 0;
    int64_t borrowed = 0;                       // hot routes served by borrowed decode slots
    double cpu_ms = 0, gpu_ms = 0, upload_ms = 0, total_ms = 0;
    int64_t cpu_bytes = 0;                      // expert bytes the decode graph's CPU branch read
    int64_t cpu_layers = 0, cpu_kernel_layers = 0;   // its layer computes, of which by its own kernel
    bool gpu_timed = false;
    bool graph = false;                         // the pass ran (some of) its layers in the decode graph
    bool views = false;                         // some layer computed its GPU routes over pool views
    int64_t prefetch_hits = 0, prefetch_misses = 0, prefetch_wasted = 0;   // experts, prefetch on
    // decode prefetch: experts staged ahead of their layer, the cold routes they served on the GPU,
    // how many of them got a route, the bytes copied
    int64_t dpf_staged = 0, dpf_routes = 0, dpf_used = 0, dpf_bytes = 0;
    int64_t upload_copies = 0;                  // copy calls of the upload path (one per 2D copy)
    double cpu_wait_ms = 0;                     // hybrid passes: the graph waiting for the CPU share
    std::string path;
};

struct totals_t {
    int64_t passes = 0, tokens = 0, routes = 0, hot = 0, cold = 0, distinct_cold = 0, upload_bytes = 0;
    int64_t borrowed = 0, upload_copies = 0;
    int64_t graph_steps = 0;                   // one-token passes that ran in the decode graph
    double cpu_ms = 0, gpu_ms = 0, upload_ms = 0, total_ms = 0;
    int64_t cpu_bytes = 0, cpu_layers = 0, cpu_kernel_layers = 0;
    int64_t dpf_staged = 0, dpf_routes = 0, dpf_used = 0, dpf_bytes = 0;   // decode prefetch (pass_t)
    double join_wait_ms = 0;                   // the decode graph's joins waiting for the CPU branch
    double cpu_wait_ms = 0;                    // hybrid passes: the graph waiting for the CPU share
    ost_dg_timeline timeline;                  // the decode timeline of the one-token passes sampled
    std::map<std::string, int64_t> paths;
    std::vector<int64_t> counts_prefill, counts_decode;   // [n_layer * n_expert]
    void add(const pass_t & p) {
        passes++; tokens += p.tokens; routes += p.routes; hot += p.hot; cold += p.cold;
        distinct_cold += p.distinct_cold; upload_bytes += p.upload_bytes; borrowed += p.borrowed;
        upload_copies += p.upload_copies;
        cpu_ms += p.cpu_ms; gpu_ms += p.gpu_ms; upload_ms += p.upload_ms; total_ms += p.total_ms;
        cpu_bytes += p.cpu_bytes; cpu_layers += p.cpu_layers; cpu_kernel_layers += p.cpu_kernel_layers;
        cpu_wait_ms += p.cpu_wait_ms;
        dpf_staged += p.dpf_staged; dpf_routes += p.dpf_routes; dpf_used += p.dpf_used; dpf_bytes += p.dpf_bytes;
        paths[p.path]++;
        if (p.graph && p.path == "decode") graph_steps++;
    }
};

// A pool's 2D copy from host memory: height rows of width bytes at pitch spitch in host memory and
// dpitch in the pool. A GPU pool's is its backend's "ggml_backend_set_2d_async" (native/patches/22),
// queued on `backend`'s stream, false when nothing was queued (dst must be memory of that backend's
// device); a CPU pool's copies row by row now (set_2d_host, backend null).
using set_2d_fn = bool (*)(ggml_backend_t backend, void * dst, size_t dpitch, const void * src, size_t spitch,
                           size_t width, size_t height);

// One 2D copy of an expert run's weight matrices: rows at src / dst, spitch / dpitch apart. Per layer
// (engine_t::rows_2d, from layout_2d at the pool build) the copy of expert 0 into slot 0, with the
// host and pool strides of one expert; height 0 where the parts are not rows of one 2D copy.
struct rows_2d_t {
    const char * src = nullptr; char * dst = nullptr;
    size_t spitch = 0, dpitch = 0, width = 0, height = 0;
    size_t src_stride = 0, dst_stride = 0;   // bytes from one expert / slot to the next
};

// One expert pool: the hot experts (and zero and staging slots) of the MoE layers placed on one
// device, one set of pool tensors per size class, in one backend buffer of that device.
struct pool_t {
    int gpu = -1;                              // configured GPU index ("device" / "layer_device")
    ggml_backend_dev_t dev = nullptr;
    std::string name = "CPU";                  // backend device name, e.g. CUDA1
    ggml_context * ctx = nullptr;
    ggml_context * resident_ctx = nullptr;     // the all-resident layers' leaves over buf (no data of their own)
    ggml_backend_buffer_t buf = nullptr;
    ggml_backend_t upload_backend = nullptr;   // GPU pool: own stream for the upload path's async copies
    ggml_backend_t prefetch_backend = nullptr; // GPU pool with prefetch: a second stream, for predicted copies
    set_2d_fn set_2d = nullptr;                // its 2D copy (stage_experts): set_2d_host on a CPU pool,
                                               // the GPU backend's when it offers one, else null
    std::vector<ggml_backend_event_t> pf_event;   // [layer]: recorded on it after a layer's prefetch copies
    ggml_tensor * table = nullptr;             // I32 [n_expert, n_layer]: index tables of the decode graph
    ggml_tensor * scratch = nullptr;           // I32 [OSTINATO_SCRATCH, n_layer]: the route kernel's counters
                                               // and stage lists (decode_graph/decode_ops.h)
    ggml_tensor * pred = nullptr;              // F32 [n_expert]: the decode prefetch's logits (predict op)
    ggml_tensor * counts = nullptr;            // I32 [n_expert, n_layer, 2]: routes of all-resident layers
                                               // (plane 0 prefill, 1 decode), added to by the count op
    std::vector<int32_t> counts_seen;          // host: the table as last read (flush_counts)
    int64_t bytes = 0, n_hot = 0;
    int64_t routes = 0, hot_routes = 0;        // cumulative routes of this pool's layers (stats)
    int n_classes = 0;
    std::vector<int> layers;                   // MoE layers assigned to this pool's device
};

// What one graph build (keyed by its graph context) holds of the engine: the all-resident layers
// whose routes a count op at the end of the graph counts, per pool, and how many layers run without
// (on a GPU) or with (route op, CPU pool) host work; a decode step with only the former is served
// as the decode graph is.
struct built_t {
    std::map<int, std::vector<std::pair<int, ggml_tensor *>>> pending;   // pool -> (layer, selected)
    int plane = 0;                             // 0 prefill, 1 decode (one-token pass)
    int n_dev = 0, n_host = 0;
};

struct engine_t {
    ostinato_engine_options opts;              // the engine's options (load, switch, reconfigure)
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
    std::vector<int> layer_class;              // per layer: size class (-1: none)
    std::vector<float> cpu_use;                // [layer * n_expert]: decaying count of decode CPU uses
    int64_t decode_steps = 0, promotions = 0, handbacks = 0;
    ost_dgraph * dg = nullptr;                 // decode graph (created on first use)
    bool dg_failed = false;                    // its creation failed (note in `notes`)
    bool dg_running = false;                   // the current pass has decode-graph layers
    std::map<ggml_context *, built_t> built;   // per graph context (reset when a graph is built in it)
    double upload_cpu_share = 0.5;             // hybrid upload passes: adapted share of cold experts on the CPU
    int prefetch = 0;                          // prefetch depth the pool was built for (opts.prefetch_depth
                                               // at build): 0 off, d layers ahead with d + 1 staging regions
    std::vector<std::vector<int32_t>> pf_slot; // [layer][expert]: staging slot a prefetch put it in, or -1
    std::vector<uint8_t> pf_ran;               // [layer]: a prefetch ran for it in this pass (misses count)
    std::vector<uint8_t> pf_pending;           // [layer]: its prefetch copies are not joined yet

    // stats (guarded by mu)
    pass_t cur;
    bool in_pass = false;
    int64_t pass_t0_us = 0;
    std::vector<uint8_t> cold_seen;            // [layer * n_expert] for distinct cold experts
    std::vector<int64_t> mark_us;              // [layer]: time of the last marker
    std::vector<rows_2d_t> rows_2d;            // [layer]: its experts' 2D copy geometry (layout_2d)
    totals_t total, request;
    std::deque<pass_t> last;
};

// Cold experts in pageable memory (mmap-ed weights) are pinned with cudaHostRegister through the
// CUDA backend's "ggml_backend_register_host_buffer" (docs/design.md native engine item 1): the upload path's copies then
// run at the pinned H2D bandwidth. Per model, once; unregistered when the model is freed.
struct pinned_t {
    const llama_model * model = nullptr;
    ggml_backend_reg_t reg = nullptr;
    std::vector<void *> ptrs;
    int64_t bytes = 0;
    bool already_pinned = false;   // the loader put the experts in a pinned (CUDA_Host) buffer
    std::string note;
};

// guarded by g_mu
extern std::mutex g_mu;
extern pinned_t g_pin;
extern engine_t * g_eng;
extern std::string g_err;
extern bool g_graph_dirty, g_dgraph_broken;
// The options in force: the engine's, or the defaults where no engine is active. Caller holds g_mu.
inline const ostinato_engine_options & opts_of(const engine_t * e) {
    static const ostinato_engine_options defaults{};
    return e ? e->opts : defaults;
}

// op_params slot and value with which a mul_mat_id is marked as holding negative ids (patch 21 reads
// them in the CUDA backend; ggml's own use of a mul_mat_id's op_params ends at index 2 + GGML_MAX_SRC)
constexpr int     OSTINATO_SKIPS_PARAM = 15;
constexpr int32_t OSTINATO_SKIPS_MAGIC = 0x4F53544E;   // "OSTN"
static_assert(OSTINATO_SKIPS_PARAM < GGML_MAX_OP_PARAMS / (int) sizeof(int32_t), "op_params slot");
// the count op's layer indices: past ggml_custom_op_params (fun, n_tasks, userdata) and within op_params
static_assert(OSTINATO_COUNT_LAYERS * sizeof(int32_t) >= 3 * sizeof(void *) &&
              OSTINATO_COUNT_LAYERS + OSTINATO_COUNT_MAX <= GGML_MAX_OP_PARAMS / (int) sizeof(int32_t) &&
              OSTINATO_COUNT_MAX + 1 < GGML_MAX_SRC, "count op layout");

// userdata of the route and upload ops: the layer, whether the pass uses pool views and whether its
// upload op is a hybrid one
inline intptr_t op_ud(int il, bool views, bool hybrid = false) {
    return ((intptr_t) il << 2) | (hybrid ? 2 : 0) | (views ? 1 : 0);
}
inline int  op_ud_layer(void * ud) { return (int) ((intptr_t) ud >> 2); }
inline bool op_ud_views(void * ud) { return ((intptr_t) ud & 1) != 0; }
inline bool op_ud_hybrid(void * ud) { return ((intptr_t) ud & 2) != 0; }
// the adapted share of hybrid passes: its step, and the wait (us) that counts as one
constexpr double ADAPT_STEP = 0.02, ADAPT_WAITED_US = 50;
// hybrid upload passes' cost-model split (the options' cpu_split_*): off while a bandwidth is 0
inline bool split_on(const ostinato_engine_options & o) { return o.cpu_split_cpu_gbps > 0 && o.cpu_split_h2d_gbps > 0; }
// upload passes with views are built hybrid (with a CPU branch)
inline bool hybrid_on(const ostinato_engine_options & o) { return o.upload_cpu_share != 0 || split_on(o); }
constexpr int OST_COPY_BLOCKS_MAX = 1024;

// The tensor in a layer's "up" slot: merged gate_up rows when the file has them, else up; and its
// bias. The expert FFN code of the patched build_moe_ffn takes merged layers through the same slot.
inline const ggml_tensor * up_src(const llama_layer & L) { return L.ffn_gate_up_exps ? L.ffn_gate_up_exps : L.ffn_up_exps; }
inline const ggml_tensor * up_b_src(const llama_layer & L) { return L.ffn_gate_up_exps ? L.ffn_gate_up_exps_b : L.ffn_up_exps_b; }
// An expert's weight parts as (host tensor, pool tensor) pairs: up (or merged gate_up), gate where
// the pool has one, down. Biases are not among them.
inline std::vector<std::pair<const ggml_tensor *, ggml_tensor *>> weight_parts(const llama_layer & L, ggml_tensor * up,
                                                                               ggml_tensor * gate, ggml_tensor * down) {
    std::vector<std::pair<const ggml_tensor *, ggml_tensor *>> w = {{up_src(L), up}};
    if (gate) w.push_back({L.ffn_gate_exps, gate});
    w.push_back({L.ffn_down_exps, down});
    return w;
}
// An expert's bias rows as (host tensor, pool tensor) pairs, for the pool's bias tensors that exist
// (up or merged gate_up, gate, down; gpt-oss).
inline std::vector<std::pair<const ggml_tensor *, ggml_tensor *>> bias_parts(const llama_layer & L, ggml_tensor * up_b,
                                                                             ggml_tensor * gate_b, ggml_tensor * down_b) {
    std::vector<std::pair<const ggml_tensor *, ggml_tensor *>> b;
    if (up_b) b.push_back({up_b_src(L), up_b});
    if (gate_b) b.push_back({L.ffn_gate_exps_b, gate_b});
    if (down_b) b.push_back({L.ffn_down_exps_b, down_b});
    return b;
}

int64_t now_us();
void free_engine(engine_t * e);
// paths/route_counts.cpp
void totals_init(totals_t & t, size_t n);
json totals_json(const engine_t & e, const totals_t & t, bool with_counts);
json pass_json(const pass_t & p);
int32_t count_route(engine_t * e, int il, int32_t x, bool decode);
void dg_count(void * ud, int il, int k, const int32_t * ids, const ost_dg_layer_pass & p);
// Adds the decode graph's join waits of completed passes to the totals, and with `timeline` the
// decode timeline of the latest pass (at a pass's begin, and where stats are reset or taken for a
// request: a stats read from another thread could meet a pass still running). Caller holds g_mu.
void collect_dg_stats(engine_t * e, bool timeline = false);
void count_op(ggml_tensor * dst, int ith, int nth, void * ud);
void flush_counts(engine_t * e);
// paths/split_upload_ops.cpp
void route_op(ggml_tensor * dst, int ith, int nth, void * ud);
void upload_op(ggml_tensor * dst, int ith, int nth, void * ud);
void upload_join_op(ggml_tensor * dst, int ith, int nth, void * ud);
void prefetch_op(ggml_tensor * dst, int ith, int nth, void * ud);
rows_2d_t layout_2d(const engine_t * e, int il);
bool copy_rows_2d(const engine_t * e, int il, int x0, int s0, int m, rows_2d_t & r);
bool set_2d_host(ggml_backend_t, void * dst, size_t dpitch, const void * src, size_t spitch, size_t width,
                 size_t height);
void stage_experts(engine_t * e, int il, const std::vector<int32_t> & slot, const std::vector<uint8_t> & copy,
                   ggml_backend_t stream);
void join_copies(engine_t * e, int il);
double upload_share(const engine_t * e, bool has_stream);
void mark_op(ggml_tensor * dst, int ith, int nth, void * ud);
// expert_pool/pinning.cpp
void unpin(pinned_t & p);
void pin_experts(llama_model * model, ggml_backend_dev_t dev);
// expert_pool/pool.cpp
// Copies expert x of layer il (weights and biases) from its host tensors into `slot` of class c's
// pool tensors; synchronous.
void copy_expert(const llama_model * model, const size_class_t & c, int il, int x, int slot);
bool build_engine(llama_model * model, const config_t & cfg, const ostinato_engine_options & opts, std::string & err);
// expert_pool/borrow.cpp
void borrow_release(engine_t * e);
void borrow_step(engine_t * e);

}  // namespace ost
