// Ostinato decode-graph ops: the layout shared by the expert engine (libllama, engine/engine.cpp)
// and the CUDA backend (ggml-cuda, decode_graph/decode_ops.cu). Paper: arXiv 2611.11533, Section 3.4.
//
// Two ggml custom ops per MoE layer keep a forward pass on the GPU with no host round trip:
//   route (OSTINATO_OP_ROUTE): the index-table lookup as a kernel. In: selected_experts [k, n] (I32),
//     cur [n_embd, 1, n] (F32). Out: GPU-branch ids [k, n] (hot -> pool slot, cold -> zero slot
//     zero0 + j). Side effects in the mailbox (host memory the GPU reads and writes directly): the
//     layer's selected ids (route counts), the CPU-branch ids (cold -> expert, hot -> -1), the rows
//     of cur of tokens with a cold route, then the layer header (n, n_cold, seq = pass_seq).
//   join (OSTINATO_OP_JOIN): the wait kernel. In: the GPU branch [n_embd, k, n] (F32, may be
//     absent: layer without hot experts) and the GPU-branch ids. Out: gpu + cpu per position, where
//     cpu is the CPU branch's row for a cold position and 0.0f for a hot one (so the sum is what the
//     split path's ggml_add computes). A position waits for the layer header's `done` == pass_seq
//     only when it is cold; a layer with no cold route waits nowhere.
// The CPU branch between them runs on the engine's resident thread pool (engine/engine.cpp),
// which polls the layer headers in layer order.
//
// A layer whose experts are all resident needs neither: its hot slots hold the experts in expert
// order, so its GPU branch is the stock computation over tensors on those slots with the router's
// ids as they are. Its routes are counted by a third op at the end of the graph:
//   count (OSTINATO_OP_COUNT): src[0] one plane of the pool's count table, I32 [n_expert, n_layer]
//     (the op runs where that table lives), src[1..m] the selected_experts [k, n] of m <= 8 such
//     layers, whose indices are in op_params[OSTINATO_COUNT_LAYERS + i]. Adds 1 to table[il][x] per
//     route; the host reads the table when it reports stats. Output I32 [1], unused.
//
// Decode prefetch: a fourth op per layer,
//   predict (OSTINATO_OP_PREDICT): In: layer l's FFN input cur [n_embd, 1] (F32; decode steps only),
//     placed before layer l's router. It forks a side stream from the main one and queues there, off
//     the decode step's critical path: the next layer's router applied to cur (scores [n_expert] in
//     pred_logits, ostinato_pred_score), the top k of those as a prediction of layer l+1's routes, the first
//     next_max predicted experts that are cold in l+1 as l+1's stage list (its scratch), and the
//     copies of those experts from mapped host memory into l+1's decode staging region of the pool.
//     Route(l+1) waits for that chain's stage list (a stream edge after the select kernel), gives a
//     staged expert's routes its staging slot (the GPU branch computes them, the join adds 0) and
//     leaves the CPU branch only the cold routes nobody predicted; the ops after route(l+1), the GPU
//     branch first, wait for the chain's copies (a second edge), so the CPU branch can start while
//     they run. The choice is a function of the computation alone (no
//     timing), so every run computes the same. Paper Sec. 3.4 (the decode step), FreeToken Sec. 4
//     (PCIe and CPU as two paths for the cold experts).
//
// The CUDA backend recognises these ops by the node name prefix OSTINATO_OP_PREFIX *and* the magic of
// the struct that the custom op's userdata points to; every other custom op stays on the CPU.
#pragma once

#include <math.h>
#include <stdint.h>

#define OSTINATO_OP_MAGIC  0x4f53544fu   // "OSTO"
#define OSTINATO_OP_PREFIX "ostdev:"

enum ostinato_op_kind {
    OSTINATO_OP_ROUTE = 1,
    OSTINATO_OP_JOIN  = 2,
    OSTINATO_OP_COUNT = 3,
    OSTINATO_OP_PREDICT = 4,
};

// count op: op_params int32 slot of its first layer index (after ggml_custom_op_params, 24 bytes),
// and the most layers one op counts (ggml_custom_4d takes fewer than GGML_MAX_SRC sources, one is the table)
#define OSTINATO_COUNT_LAYERS 6
#define OSTINATO_COUNT_MAX    8

// Per-layer scratch in the pool's memory (I32, OSTINATO_SCRATCH per layer): the route kernel's
// counters and the layer's stage list.
#define OSTINATO_SCRATCH     32
#define OSTINATO_SC_COLD      0   // cold-route accumulator of the running route kernel
#define OSTINATO_SC_BLOCKS    1   // its blocks done
#define OSTINATO_SC_NCOLD     2   // n_cold of the pass (for the join kernel)
#define OSTINATO_SC_COPY_DONE 3   // blocks of the running stage copy kernel done (its last one stamps the chain's end)
#define OSTINATO_SC_USED      4   // accumulators: bit i = staged expert i got a route; staged routes
#define OSTINATO_SC_HITS      5
#define OSTINATO_SC_STAGE_SEQ 6   // stage list: the pass it was written for (low 32 bits of pass_seq)
#define OSTINATO_SC_STAGE_N   7   //   its length
#define OSTINATO_SC_STAGE     8   //   its experts; expert i is in slot stage_slot0 + i
#define OSTINATO_STAGE_MAX   16   // most experts staged for one layer per pass
#define OSTINATO_PREDICT_TOP 32   // most of the predicted top k the select kernel ranks (k above: the first 32)
#define OSTINATO_COPY_PARTS   6   // weight matrices and bias rows of one expert (up, gate, down + biases)

// One layer's header in the mailbox; two cache lines each so that the GPU's writes to one layer and
// the CPU's polling of another do not share a line.
struct ostinato_mbx_hdr {
    volatile int64_t seq;      // written by route (GPU) last: pass_seq of the pass whose ids are in
    volatile int64_t done;     // written by the CPU branch last: pass_seq whose output rows are ready
    volatile int32_t n;        // tokens of the layer in this pass
    volatile int32_t n_cold;   // cold routes of the layer in this pass
    volatile int64_t wait_ns;  // written by join (GPU): how long its first cold position waited for `done`
    volatile int64_t wait_seq; // written by join after wait_ns: the pass it measured
    volatile int32_t n_staged;      // written by route before seq: experts staged for this layer in this pass
    volatile int32_t staged_routes; //   routes of the layer they served (computed by the GPU branch)
    volatile int32_t staged_used;   //   of those experts, how many got a route
    int32_t pad;
    volatile int64_t route_ns;      // written by route before seq: when it published (GPU %globaltimer,
                                    //   CPU steady clock; ns): the decode timeline's marks
    // the decode prefetch chain that staged this layer's experts (forked at the previous layer's
    // predict op), same clock: when its router product began, its stage list was written, its
    // copies ended; chain_seq (written last) is the pass they belong to
    volatile int64_t chain_t0_ns;
    volatile int64_t chain_sel_ns;
    volatile int64_t chain_end_ns;
    volatile int64_t chain_seq;
    int64_t pad2[4];
};
static_assert(sizeof(ostinato_mbx_hdr) == 128, "one mailbox header per two cache lines");

// The prediction's score of expert x (decode prefetch's predict op, and the prefill prefetch's
// predictions through ostinato_moe_prefetch_scores): the order in which the next layer's selection
// ranks its experts, from its router's logit: logit + the router's bias (ffn_gate_inp_b, where the
// layer has one), through the gating function where a selection bias (exp_probs_b, DeepSeek V3's
// and GLM-4.5's "e_score_correction_bias") is added after it: sigmoid, or sqrt(softplus) (deepseek4).
// Softmax keeps the logits' order, so without a selection bias the logit is the score (with one,
// logit + bias: an approximation). Not the
// selection's arithmetic (a ranking only: what is staged, never what is computed).
#define OSTINATO_PRED_LOGIT         0
#define OSTINATO_PRED_SIGMOID       1
#define OSTINATO_PRED_SQRT_SOFTPLUS 2
#ifdef __CUDACC__
#define OSTINATO_HD __host__ __device__
#else
#define OSTINATO_HD
#endif
static inline OSTINATO_HD float ostinato_pred_score(float logit, const float * router_b, const float * sel_b, int gating,
                                                    int x) {
    float v = logit + (router_b ? router_b[x] : 0.0f);
    if (!sel_b) return v;
    if (gating == OSTINATO_PRED_SIGMOID) v = 1.0f / (1.0f + expf(-v));
    else if (gating == OSTINATO_PRED_SQRT_SOFTPLUS) v = sqrtf(v > 20.0f ? v : log1pf(expf(v)));
    return v + sel_b[x];
}

// One part of an expert to copy into a staging slot: bytes at src + expert * src_stride (host memory
// mapped for the GPU) to dst + slot * dst_stride (the pool).
struct ostinato_copy_part {
    const char * src;
    char * dst;
    int64_t src_stride, dst_stride, bytes;
};

// userdata of one op node (stable for the life of the expert pool: CUDA graphs capture its values).
struct ostinato_op {
    uint32_t magic;            // OSTINATO_OP_MAGIC
    int32_t  kind;             // ostinato_op_kind
    int32_t  il;               // layer
    int32_t  k;                // experts per token
    int32_t  n_expert;
    int32_t  zero0;            // first zero slot of the layer's size class (GPU-branch id of a cold route is zero0 + j)
    int32_t  has_hot;          // 0: no pool tensors for this layer, every route is cold
    int32_t  n_embd;           // row length of cur and of the output
    int32_t  max_tokens;       // rows the mailbox holds
    int32_t  host_pool;        // 1: the pool is host memory (a CPU build): the CPU route op copies staged experts
    const int32_t * table;     // device (or host in a CPU build): [n_expert] slot of a hot expert, -1 cold
    int32_t * scratch;         // device: [OSTINATO_SCRATCH] per layer: counters and the stage list (above)
    struct ostinato_mbx_hdr * hdr;        // mailbox: this layer's header
    const volatile int64_t * pass_seq;    // mailbox: sequence number of the running pass (set by the host)
    volatile int32_t * status;            // mailbox: set to 1 by a wait that timed out
    int32_t * ids_all;         // mailbox: [k * max_tokens] selected ids of this layer (route counts)
    int32_t * ids_cpu;         // mailbox: [k * max_tokens] CPU-branch ids (shared by all layers)
    float   * cur;             // mailbox: [n_embd * max_tokens] hidden rows (shared by all layers)
    const float * out;         // mailbox: [n_embd * k * max_tokens] CPU-branch output (shared)
    int64_t  timeout_ns;       // a wait longer than this gives up (status = 1) instead of hanging the GPU
    // decode prefetch: this layer's staging region (route op), and the prediction for the next layer
    // (predict op)
    int32_t  stage_slot0;      // first slot of this layer's decode staging region; -1: never staged
    int32_t  next_max;         // predict op: most experts staged for layer il + 1 per pass (0: no prediction)
    const int32_t * next_table;   // device: layer il + 1's index table row
    int32_t * next_scratch;       // device: layer il + 1's scratch (its stage list)
    int32_t  next_slot0;          // first slot of layer il + 1's decode staging region
    int32_t  next_n_parts;
    struct ostinato_copy_part next_parts[OSTINATO_COPY_PARTS];
    const void * next_gate;    // predict op: layer il + 1's router weights, row x = expert x (F32, F16 or BF16)
    int32_t  next_gate_type;   //   its ggml_type
    int64_t  next_gate_nb1;    //   bytes from one expert's row to the next
    const float * next_router_b;  //   its router bias [n_expert] (F32) or null; where the gate is
    const float * next_sel_b;     //   its selection bias [n_expert] (F32) or null; where the gate is
    int32_t  next_gating;         //   OSTINATO_PRED_*: how the prediction scores a logit (ostinato_pred_score)
    float  * pred_logits;      // device: [n_expert] the prediction's scores (one per pool: the chains are serial)
    int64_t  gen;              // the decode graph's generation (a cache key for checks of next_parts)
    struct ostinato_mbx_hdr * next_hdr;   // predict op: layer il + 1's header (the chain's stamps)
    int32_t  copy_blocks;      // predict op: blocks of the stage copy kernel (setting decode_prefetch_copy_blocks)
};
