// Hooks of the Ostinato expert engine that the patched llama.cpp calls (C++ linkage, inside libllama):
// native/patches/11 (the loader keeps routed experts on the host), 12 (model load/free, graph build,
// forward pass), 13 (build_moe_ffn: the branches of a MoE layer, built by ostinato_moe_build_branches,
// engine/moe_branches.cpp). Found through the include path that native/CMakeLists.txt gives libllama.
// Not part of the C API (include/ostinato.h). Method: arXiv 2611.11533, Sections 2-3 and Appendix B.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "llama.h"

#include <cstdint>
#include <functional>

struct llama_model;
struct ggml_cgraph;

// Graph-time view of one MoE layer (what build_moe_ffn needs).
struct ostinato_moe_layer {
    int il = -1;
    bool has_hot = false;                    // false: layer computed by the stock code (all cold)
    // pool of the layer's size class, [.., .., n_slots + k + n_stage * regions]: hot experts, k zero
    // slots, then the upload path's staging slots, one region of n_stage per prefetch depth + 1 (so
    // that an upload-path pass is one mul_mat_id per matrix)
    ggml_tensor * up_pool   = nullptr;
    ggml_tensor * gate_pool = nullptr;
    ggml_tensor * down_pool = nullptr;
    // per-slot expert biases (gpt-oss), [n, n_slots + k + n_stage * regions]; zero slots' rows are 0; else null
    ggml_tensor * up_b_pool   = nullptr;
    ggml_tensor * gate_b_pool = nullptr;
    ggml_tensor * down_b_pool = nullptr;
    int zero0  = 0;                          // first zero slot
    int stage0 = 0;                          // first staging slot
    int view_stage0 = 0;                     // first staging slot of the layer's region in pool-view passes
                                             // (with prefetch depth d: region il % (d + 1) of d + 1)
    int hot0   = 0;                          // the layer's hot slots: [hot0, hot0 + n_hot), in expert order
    int n_hot  = 0;
    int n_stage = 0;                         // staging slots of the class
    // a layer whose experts are all resident (n_hot == n_expert): its hot slots as tensors of their
    // own (up, gate, down, their bias rows; null where the layer has none), leaves over the pool's
    // memory rather than graph views, so that its graph has the node sequence of stock's and the
    // GPU backend fuses the same patterns (a VIEW node between two products splits a fusion)
    ggml_tensor * resident[6] = { nullptr, nullptr, nullptr, nullptr, nullptr, nullptr };
    // passes of more than OSTINATO_VIEW_MIN_TOKENS tokens compute the GPU routes over views of the
    // layer's own slots (see ostinato_moe_views); false where the pool's device cannot skip negative ids
    bool views = false;
};

// Split and upload passes of at least this many tokens use per-layer pool views. Below it the GPU's
// mul_mat_id runs the vector kernel (MMVQ, at most 8 rows), whose grid does not grow with the pool and
// which does not skip negative ids.
constexpr int64_t OSTINATO_VIEW_MIN_TOKENS = 9;
// deepest prefetch: a layer predicts the routes of at most this many layers after it
constexpr int OSTINATO_PREFETCH_MAX_DEPTH = 2;

// Hooks used by the patched llama.cpp (C++ linkage, inside libllama).
// Returns the layer entry when the engine is active for the model owning down_exps, else nullptr.
const ostinato_moe_layer * ostinato_moe_lookup(const ggml_tensor * down_exps);
// Route op of layer il: custom CPU op over selected_experts [k, n_tokens] that counts the routes and
// applies the index tables. Returns I32 [k, n_tokens, 2]: plane 0 the GPU-branch ids (hot -> pool
// slot, cold -> zero slot; for a layer without hot experts: the expert ids), plane 1 the CPU-branch
// ids (cold -> expert id, hot -> -1). `cur` (may be null) is taken as a second source only so that
// the hidden states reach the host in the same scheduler split as the ids: the CPU branch then
// starts without waiting for the GPU branch (decode overlap, docs/design.md native engine item 5).
// With `views` (see ostinato_moe_views) plane 0 holds ids into the layer's hot view instead: hot ->
// slot - hot0, cold -> -1 (skipped, exact zeros); a borrowed decode slot counts as cold there.
// `pred`, `pred2` (may be null): the predicted experts of the next layers (see
// ostinato_moe_prefetch_gate), sources only so that they reach the host in the same scheduler split.
ggml_tensor * ostinato_moe_route(ggml_context * ctx, ggml_tensor * selected_experts, ggml_tensor * cur, int il,
                                 bool views = false, ggml_tensor * pred = nullptr, ggml_tensor * pred2 = nullptr);
// Upload path: custom CPU op over the route op's output that copies each distinct cold expert of
// layer il once into the staging slots of the pool and returns pool ids [k, n_tokens] (hot -> its
// slot, cold -> its staging slot): the whole layer then runs on the GPU in one branch. With `views`
// it returns ids into the staging view only (cold -> staging slot - stage0, hot -> -1); the hot
// routes are computed over the hot view with the route op's plane 0.
ggml_tensor * ostinato_moe_upload(ggml_context * ctx, ggml_tensor * route, int il, bool views = false,
                                  bool hybrid = false);
// 1 when upload passes with views are built hybrid (a CPU share other than 0 is set), else 0.
int ostinato_moe_hybrid(void);
// A hybrid pass's CPU branch `out` (the expert FFN graph over `cur` [n_embd, 1, M] and `ids` [k, M],
// -1 where another part computes the route) as one CPU op that starts it on the CPU share's own
// thread team (the CPU branch's kernel, cpu_branch/kernel.h; exact zeros at the -1 ids, as ggml-cpu
// writes) and returns at once: the graph goes on meanwhile. Its output is complete only after the
// wait op of ostinato_moe_cpu_wait. Returns `out` itself where the kernel is off or the graph is of
// another shape (biases, scales): ggml's graph computes it in place.
ggml_tensor * ostinato_moe_cpu_share(ggml_context * ctx, ggml_tensor * out, ggml_tensor * ids, ggml_tensor * cur, int il);
// The wait for a CPU share started by ostinato_moe_cpu_share (`out`, its result): a CPU op that
// returns `gather` [M] (I32) once the share is done, so that an op that takes its output instead of
// `gather` runs after it (the scheduler copies `out` to the GPU only then); `ids` and `cur`, the
// share's inputs, stay alive until it. Returns `gather` itself where `out` is not such a share.
ggml_tensor * ostinato_moe_cpu_wait(ggml_context * ctx, ggml_tensor * out, ggml_tensor * gather, ggml_tensor * ids,
                                    ggml_tensor * cur, int il);
// Hybrid upload pass (views and hybrid): the upload op returns I32 [k*n + k*M + 2*M] (n tokens, M =
// min(n, the options' hybrid_rows)): the staged routes' ids [k, n] (cold and uploaded -> slot - stage0,
// else -1); the CPU branch's ids [k, M] over M gathered tokens (cold experts computed on the CPU ->
// expert id, else -1); the M tokens to gather for it; the M rows to scatter its output to. The CPU
// takes the cold experts with the fewest routes (its share, at most M tokens); rows past the tokens
// it takes point at distinct other tokens with all ids -1 (their output is 0, scattered onto rows
// that get + 0). The join op, after that CPU branch (cpu_out, for order), waits for the copies and
// returns the staged routes' ids [k, n].
ggml_tensor * ostinato_moe_upload_join(ggml_context * ctx, ggml_tensor * upload, ggml_tensor * cpu_out, int il,
                                       int64_t k, int64_t n_tokens);
// Prefetch (upload passes with pool views, when on): the router weights [n_embd, n_expert] of MoE
// layer il + dist (1 <= dist <= the prefetch depth) when that layer takes a prefetch in this pass (its
// experts have a pool, it is not the last layer, it is on il's pool, it is not all-resident and sees
// n_tokens >= OSTINATO_VIEW_MIN_TOKENS), with its index in *il_next; else null. The graph applies them
// to layer il's FFN input and takes the top k per token: a prediction of that layer's routes, ready at
// layer il's route op.
ggml_tensor * ostinato_moe_prefetch_gate(int il, int64_t n_tokens, int dist, int * il_next);
// The prefetch's prediction of layer il_next's routes ranks the experts as that layer's selection
// does (ostinato_pred_score, in ggml ops): logits [n_expert, n] plus the router's bias, through the
// gating function where a selection bias follows it, plus that bias. Returns `logits` as it is for a
// layer with neither bias.
ggml_tensor * ostinato_moe_prefetch_scores(ggml_context * ctx, ggml_tensor * logits, int il_next);
// Prefetch op (CPU; after layer il's upload op, or its join when hybrid, in graph order; the one for
// il + 1 before the one for il + 2): starts the copies of the cold experts among pred [k, n] (a
// prediction for layer il_next) that no earlier prediction brought, into the next free slots of
// il_next's staging region, on the pool's prefetch stream, and returns; il_next's upload op takes
// them as staged (hits), uploads the experts it needs that were not predicted (misses, on the upload
// stream, which does not queue behind predictions for later layers) and waits for both. Returns a
// 1-element tensor to expand into the graph; `after` orders it.
ggml_tensor * ostinato_moe_prefetch(ggml_context * ctx, ggml_tensor * pred, ggml_tensor * after, int il_next);
// Per-layer pool views (prefill; docs/engine.md "Pool views"): 1 when layer il, in a split or upload pass whose layer
// sees n_tokens tokens, computes its GPU routes over views of the pool (its hot slots; the staging
// slots) with negative ids for the routes of the other branch. MMQ's mul_mat_id grid covers every
// expert matrix of its src0 (a stream-k range over all of them), so over the whole size class (all
// layers' slots) most of the GPU would scan empty matrices; a view keeps stock's grid.
int  ostinato_moe_views(int il, int64_t n_tokens);
// out[0..5] = views of the layer's up, gate, down pools and their bias pools (null where absent) over
// its hot slots (hot = true) or its class's staging slots. Built in the graph's context.
void ostinato_moe_pool_views(ggml_context * ctx, const ostinato_moe_layer * l, bool hot, ggml_tensor * out[6]);
// Marks a mul_mat_id node (and those of LoRA terms under an add) as one whose ids may be negative:
// the patched CUDA backend then writes exact zeros at those positions (patch 21).
void ostinato_moe_tag_skips(ggml_tensor * t);
// Timing marker after a branch (kind 1: GPU branch, 2: CPU branch, 3: upload branch); a node to
// expand into the graph. Kind 1 and 3 read GPU memory (a sync point): only used in timing mode.
ggml_tensor * ostinato_moe_mark(ggml_context * ctx, ggml_tensor * after, int il, int kind);
// 1 while timing mode is on (calibration): GPU branches get a (synchronising) timing marker.
int  ostinato_moe_timing(void);
// 1 (default): the CPU branch follows the GPU branch in the graph and runs while it computes (decode
// overlap); 0: the CPU branch runs first, in the route op's split (one host round trip per layer
// fewer, no overlap). Calibration measures both and keeps the faster.
int  ostinato_moe_overlap(void);
// 1 when a forward pass of n_tokens takes the upload path, else 0 (split path / decode).
int  ostinato_moe_upload_path(int64_t n_tokens);
// Decode graph (Sec. 3.4, see decode_graph/decode_graph.h). 1 when layer il of a pass of n_tokens takes it:
// the engine's decode graph is on (auto: a pool on a GPU), the pass is a decode step or a split-path
// prefill of at most its max tokens, and cur is [n_embd, 1, n] F32 contiguous.
int            ostinato_moe_graph_layer(int il, const ggml_tensor * cur, int64_t n_tokens);
// GPU route op of layer il: ids [k, n] of the GPU branch (hot -> slot, cold -> zero slot, staged ->
// its staging slot); writes the cold routes and their hidden rows to the mailbox for the CPU branch.
ggml_tensor *  ostinato_moe_route_dev(ggml_context * ctx, ggml_tensor * selected_experts, ggml_tensor * cur, int il);
// Decode prefetch (docs/engine.md "Decode prefetch"): the predict op of MoE layer il (its routed
// experts `down_exps`) over its FFN input cur [n_embd, 1] in a decode step, which stages layer
// il + 1's predicted cold experts on the GPU beside the step; a node to expand into the graph before
// the layer's router. Null where the layer does not predict (off, not a decode step, no decode graph,
// an all-resident layer or next layer, ...).
ggml_tensor *  ostinato_moe_dg_predict(ggml_context * ctx, ggml_tensor * cur, const ggml_tensor * down_exps, int il,
                                       int64_t n_tokens);
// CPU branch of layer il as a graph of its own: returns the context to build it in, with its two
// leaves (ids [k, n] and cur [n_embd, 1, n] in the mailbox); end registers its output [n_embd, k, n].
ggml_context * ostinato_moe_cpu_begin(ggml_context * graph_ctx, int il, ggml_tensor * cur, int64_t k,
                                      ggml_tensor ** ids, ggml_tensor ** cur_cpu);
void           ostinato_moe_cpu_end(ggml_context * graph_ctx, int il, ggml_tensor * out);
// Join op of layer il: out_gpu (may be null: no hot expert) + the CPU branch at cold positions.
ggml_tensor *  ostinato_moe_join(ggml_context * ctx, ggml_tensor * ids_gpu, ggml_tensor * out_gpu, int il);
// 1 when every expert of layer il is resident in its pool (whose hot slots then hold them in expert
// order, so that tensors over them take the router's ids as they are) and the all-resident path is
// on (the options' resident_path): the layer needs no route op on any path.
int  ostinato_moe_resident(int il);
// Registers the routes of all-resident layer il (selected_experts [k, n] of a pass of n_tokens) for
// the count op that ostinato_graph_build_end adds to the graph built in graph_ctx.
void ostinato_moe_count_routes(ggml_context * graph_ctx, ggml_tensor * selected_experts, int il, int64_t n_tokens);
// Called before a graph is built in graph_ctx (its CPU-branch graphs are made anew).
void ostinato_graph_build_begin(ggml_context * graph_ctx);
// Called after it: appends the count ops of its all-resident layers (one per pool and per
// OSTINATO_COUNT_MAX layers) to gf, after every other node, so that no fused pattern is split.
void ostinato_graph_build_end(ggml_context * graph_ctx, ggml_cgraph * gf);
// False once after a residency switch: the context must rebuild its cached graph.
bool ostinato_graph_reusable(void);
// Around the compute of the graph built in graph_ctx (its decode-graph layers' CPU branches run
// between the two; end waits for them).
void ostinato_pass_begin(int64_t n_tokens, ggml_context * graph_ctx);
void ostinato_pass_end(int64_t n_tokens);
// Returns false (and sets the last error) when the configured residency set cannot be applied.
bool ostinato_on_model_loaded(llama_model * model);
// True while a config is set and `name` is a routed-expert tensor (blk.N.ffn_*_exps.*): the loader
// then keeps it in host memory.
bool ostinato_keep_on_host(const char * name);
void ostinato_on_model_free(llama_model * model);

// The branches of a MoE layer (patch 13). build_moe_ffn, after the router, hands the engine what it
// needs of the graph context: the graph, the layer, its input and routes, its expert tensors in host
// memory and stock's expert FFN as a function of expert tensors and ids (the patch's moe_experts:
// stock's ops, names and callbacks, over other tensors and ids).
struct ostinato_moe_build {
    ggml_context * ctx = nullptr;                  // the graph's context (llm_graph_context::ctx0)
    ggml_cgraph * gf = nullptr;
    ggml_backend_sched_t sched = nullptr;          // may be null (then nothing is pinned to the CPU)
    ggml_backend_t backend_cpu = nullptr;          // may be null
    int il = -1;
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    int64_t n_tokens = 0;                          // tokens of the pass (ubatch.n_tokens)
    bool weight_before_ffn = false;                // llama4: router weights applied before the FFN
    ggml_tensor * cur = nullptr;                   // FFN input [n_embd, 1, n] ([n_embd, k, n] with weight_before_ffn)
    ggml_tensor * selected_experts = nullptr;      // the router's ids [k, n] (I32)
    // the layer's expert tensors in host memory: up (a merged layer's gate_up), gate (null when
    // merged), down, and their biases (null where absent)
    ggml_tensor * up = nullptr;
    ggml_tensor * gate = nullptr;
    ggml_tensor * down = nullptr;
    ggml_tensor * up_b = nullptr;
    ggml_tensor * gate_b = nullptr;
    ggml_tensor * down_b = nullptr;
    // stock's expert FFN built in `ctx` over the expert tensors given (as the six above) and ids [k, n]
    // for input x; on_cpu: its nodes pinned to the CPU backend; skips: its mul_mat_ids marked as
    // holding negative ids (patch 21). Returns [n_embd, k, n].
    std::function<ggml_tensor *(ggml_context * ctx, ggml_tensor * up, ggml_tensor * gate, ggml_tensor * down,
                                ggml_tensor * up_b, ggml_tensor * gate_b, ggml_tensor * down_b,
                                ggml_tensor * ids, ggml_tensor * x, bool on_cpu, bool skips)> experts;
    std::function<void(ggml_tensor * t, const char * name, int il)> cb;   // the graph's tensor callback
};
// Builds the expert part of MoE layer a.il for the path of this pass (all-resident, decode graph, no
// hot expert, upload path with or without pool views, hybrid, prefetch; split path / decode) in a.ctx
// and a.gf: the route ops, each branch through a.experts, the join. Returns the experts' output
// [n_embd, k, n] before the router weights are applied, or nullptr when the engine does not run this
// layer (no pool for the model): the caller then builds stock's expert FFN. engine/moe_branches.cpp.
ggml_tensor * ostinato_moe_build_branches(const ostinato_moe_build & a);
