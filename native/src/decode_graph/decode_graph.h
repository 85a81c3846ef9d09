// Decode graph of the expert engine (internal to libllama): the route and join ops, the mailbox in
// mapped host memory, the CPU-branch graphs and the resident thread pool that runs them.
// Paper: arXiv 2611.11533, Section 3.4; docs/design.md "The native engine" item 5.
//
// Per forward pass of n <= max_tokens tokens (decode and the split path's short prefills):
//   GPU  route(il) -> GPU branch(il) -> join(il) -> ... next layer
//   CPU  worker: wait for header(il).seq == pass seq -> count routes -> if cold: CPU-branch graph(il)
//        -> header(il).done = pass seq
// The GPU never waits for the host except in join(il) at a cold position; a layer whose routes are
// all hot costs the GPU two small kernels. Nothing here depends on the GPU: in a CPU build the same
// ops run as CPU custom ops (CI exercises the mailbox protocol that way).
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "decode_graph/decode_ops.h"

#include <cstdint>
#include <string>
#include <vector>

struct ost_dgraph;

// Route counts of one layer in one pass, reported by the worker thread (under no lock of ours).
// cpu_bytes: expert weight bytes the CPU branch read; kernel: 0 no CPU branch ran, 1 the CPU branch's
// own kernel (cpu_branch/kernel.h), 2 ggml's graph compute.
struct ost_dg_layer_pass {
    int n = 0, n_cold = 0;          // tokens; cold routes left to the CPU branch
    int n_staged = 0;               // decode prefetch: experts staged for the layer in this pass
    int staged_routes = 0;          //   routes they served (on the GPU)
    int staged_used = 0;            //   staged experts that got a route
    double cpu_ms = 0;
    int64_t cpu_bytes = 0;
    int kernel = 0;
};
typedef void (*ost_dg_count_fn)(void * ud, int il, int k, const int32_t * ids, const ost_dg_layer_pass & p);

struct ost_dg_layer {
    bool moe = false;              // the layer has routed experts
    bool has_hot = false;          // its size class has pool tensors
    int zero0 = 0;                 // first zero slot of its size class
    const int32_t * table = nullptr;   // [n_expert] slot or -1, in the memory of the layer's pool
    int32_t * scratch = nullptr;       // [OSTINATO_SCRATCH] zeroed, in the memory of the layer's pool
    // decode prefetch (decode_graph/decode_ops.h): the layer's staging region (-1: none), and what its route op
    // needs to stage the next layer's predicted experts (next_max 0: no prediction)
    int stage_slot0 = -1;
    int next_max = 0;
    int next_slot0 = -1;
    std::vector<ostinato_copy_part> next_parts;
    const void * next_gate = nullptr;  // the next layer's router weights (F32, F16 or BF16 rows), type, row pitch
    ggml_type next_gate_type = GGML_TYPE_F32;
    int64_t next_gate_nb1 = 0;
    const float * next_router_b = nullptr;   // its router bias and selection bias [n_expert], F32, where the
    const float * next_sel_b = nullptr;      // gate is (or null); the gating: OSTINATO_PRED_* (ostinato_pred_score)
    int next_gating = OSTINATO_PRED_LOGIT;
    float * pred_logits = nullptr;     // [n_expert] in the memory of the layer's pool: the prediction's scores
};

struct ost_dg_config {
    int n_layer = 0, n_expert = 0, k = 0;
    int64_t n_embd = 0;
    int max_tokens = 64;           // largest pass that takes the decode graph
    int n_threads = 0;             // CPU-branch threads (0: physical cores, estimated)
    ggml_backend_buffer_type_t host_buft = nullptr;   // mailbox memory: the GPU's pinned host type, or CPU
    bool host_pool = false;        // the pools are host memory (CPU build): the CPU route op copies staged experts
    int copy_blocks = 0;           // decode prefetch: blocks of the stage copy kernel (GPU builds; >= 1, from the setting)
    bool ffn_kernel = true;        // the CPU branch on its own kernel (cpu_branch/kernel.h), else ggml's graph compute
    std::vector<ost_dg_layer> layers;
    ost_dg_count_fn count = nullptr;
    void * count_ud = nullptr;
};

// Returns nullptr with `err` set when the mailbox or the thread pool cannot be created.
ost_dgraph *   ost_dg_new(const ost_dg_config & cfg, std::string & err);
void           ost_dg_free(ost_dgraph * dg);
int            ost_dg_max_tokens(const ost_dgraph * dg);
// Graph building (called from the patched build_moe_ffn through engine/engine.cpp).
void           ost_dg_build_begin(ost_dgraph * dg, ggml_context * graph_ctx);
ggml_tensor *  ost_dg_route(ost_dgraph * dg, ggml_context * ctx, ggml_tensor * selected, ggml_tensor * cur, int il);
// Decode prefetch (decode_graph/decode_ops.h, predict op): the op of layer il over its FFN input cur [n_embd, 1]
// (F32) that stages layer il + 1's predicted cold experts; a node to expand into the graph before the
// layer's router. Null where layer il does not predict (ost_dg_predicts).
ggml_tensor *  ost_dg_predict(ost_dgraph * dg, ggml_context * ctx, ggml_tensor * cur, int il);
// Whether layer il's predict op stages the next layer's predicted experts (decode prefetch).
bool           ost_dg_predicts(const ost_dgraph * dg, int il);
ggml_context * ost_dg_cpu_begin(ost_dgraph * dg, ggml_context * graph_ctx, int il, ggml_tensor * cur, int64_t k,
                                ggml_tensor ** ids, ggml_tensor ** cur_cpu);
void           ost_dg_cpu_end(ost_dgraph * dg, ggml_context * graph_ctx, int il, ggml_tensor * out);
ggml_tensor *  ost_dg_join(ost_dgraph * dg, ggml_context * ctx, ggml_tensor * ids_gpu, ggml_tensor * out_gpu, int il);
// The route, join and predict ops on the CPU (decode_graph/cpu_ops.cpp): the custom ops' functions
// (CPU builds), their userdata the layer's ostinato_op.
void           route_cpu(ggml_tensor * dst, int ith, int nth, void * ud);
void           join_cpu(ggml_tensor * dst, int ith, int nth, void * ud);
void           predict_cpu(ggml_tensor * dst, int ith, int nth, void * ud);
// Around each graph compute: begin hands the pass's CPU-branch jobs (if the graph built in
// graph_ctx has any) to the worker; end waits for the worker. Returns false from begin when the
// graph has no decode-graph layers.
bool           ost_dg_pass_begin(ost_dgraph * dg, ggml_context * graph_ctx);
// Returns false (and `err`) if a wait timed out in this pass: the decode graph should be turned off.
bool           ost_dg_pass_end(ost_dgraph * dg, std::string & err);
// CPU-branch time of the passes so far (ms) and the number of layers that had cold routes.
void           ost_dg_info(const ost_dgraph * dg, int & n_threads, int64_t & mailbox_bytes);
// Layer computes of the CPU branch by its own kernel / by ggml so far, and why a CPU-branch graph
// built did not match the kernel (the last such; empty if every one did). The note is read between
// passes (graph builds happen on the context's thread).
void           ost_dg_kernel_info(const ost_dgraph * dg, int64_t & n_fast, int64_t & n_graph, std::string & note);
// Time the GPU's join ops waited for the CPU branch (ms), summed over the layers of the passes
// completed since the last call (a pass still running on the GPU is counted at a later call).
double         ost_dg_collect_wait(ost_dgraph * dg);

// The decode timeline (docs/engine.md, "Decode timeline"): the GPU time from one MoE layer's route op
// to the next layer's, per pair of adjacent decode-graph layers of one-token passes, split by
// whether the first layer of the pair had routes for the CPU branch (its join waited for them) or
// not (the GPU's work alone: attention, router, GPU branch, join, the decode prefetch's join).
struct ost_dg_timeline {
    int64_t passes = 0;            // one-token passes collected
    double span_ms = 0;            // their first MoE layer's route to their last's, summed
    int64_t cpu_layers = 0;        // intervals whose layer had CPU-branch routes
    double cpu_ms = 0, cpu_wait_ms = 0;   //   their time, and of it the join's wait
    int64_t gpu_layers = 0;        // intervals whose layer had none
    double gpu_ms = 0;
    // decode prefetch: intervals whose second layer was staged by a chain of this pass (forked at the
    // first layer's predict op); the chains' lengths (router product to the end of the copies), of
    // that the copies (stage list to end), and the time the main stream waited for the copies after
    // the second layer's route op (the chain's end past the route's publication, where positive) in
    // how many of them
    int64_t chain_layers = 0;
    double chain_ms = 0, chain_copy_ms = 0, chain_wait_ms = 0;
    int64_t chain_late = 0;
    void add(const ost_dg_timeline & o) {
        passes += o.passes; span_ms += o.span_ms; cpu_layers += o.cpu_layers; cpu_ms += o.cpu_ms;
        cpu_wait_ms += o.cpu_wait_ms; gpu_layers += o.gpu_layers; gpu_ms += o.gpu_ms;
        chain_layers += o.chain_layers; chain_ms += o.chain_ms; chain_copy_ms += o.chain_copy_ms;
        chain_wait_ms += o.chain_wait_ms; chain_late += o.chain_late;
    }
};
// The timeline of the latest pass whose routes were published, when it is a one-token pass not
// read before and every layer of its graph has published (a pass still running is read as done
// and dropped). Each call samples one pass; empty otherwise.
ost_dg_timeline ost_dg_collect_timeline(ost_dgraph * dg);
// The CPU branch's own kernel on or off (ggml's graph compute for every layer; for measurements):
// cfg.ffn_kernel, read when a graph is built.
void           ost_dg_set_ffn_kernel(ost_dgraph * dg, bool on);
