// Ostinato decode-graph ops: the layout shared by the expert engine (libllama, ostinato_experts.cpp)
// and the CUDA backend (ggml-cuda, ostinato_ops.cu). Paper: arXiv 2611.11533, Section 3.4.
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
// The CPU branch between them runs on the engine's resident thread pool (ostinato_experts.cpp),
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
// The CUDA backend recognises these ops by the node name prefix OSTINATO_OP_PREFIX *and* the magic of
// the struct that the custom op's userdata points to; every other custom op stays on the CPU.
#pragma once

#include <stdint.h>

#define OSTINATO_OP_MAGIC  0x4f53544fu   // "OSTO"
#define OSTINATO_OP_PREFIX "ostdev:"

enum ostinato_op_kind {
    OSTINATO_OP_ROUTE = 1,
    OSTINATO_OP_JOIN  = 2,
    OSTINATO_OP_COUNT = 3,
};

// count op: op_params int32 slot of its first layer index (after ggml_custom_op_params, 24 bytes),
// and the most layers one op counts (ggml_custom_4d takes fewer than GGML_MAX_SRC sources, one is the table)
#define OSTINATO_COUNT_LAYERS 6
#define OSTINATO_COUNT_MAX    8

// One layer's header in the mailbox; one cache line each so that the GPU's writes to one layer and
// the CPU's polling of another do not share a line.
struct ostinato_mbx_hdr {
    volatile int64_t seq;      // written by route (GPU) last: pass_seq of the pass whose ids are in
    volatile int64_t done;     // written by the CPU branch last: pass_seq whose output rows are ready
    volatile int32_t n;        // tokens of the layer in this pass
    volatile int32_t n_cold;   // cold routes of the layer in this pass
    volatile int64_t wait_ns;  // written by join (GPU): how long its first cold position waited for `done`
    volatile int64_t wait_seq; // written by join after wait_ns: the pass it measured
    int32_t pad[6];
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
    int32_t  pad0;
    const int32_t * table;     // device (or host in a CPU build): [n_expert] slot of a hot expert, -1 cold
    int32_t * scratch;         // device: [4] per layer: cold-route accumulator, blocks done, n_cold of the pass
    struct ostinato_mbx_hdr * hdr;        // mailbox: this layer's header
    const volatile int64_t * pass_seq;    // mailbox: sequence number of the running pass (set by the host)
    volatile int32_t * status;            // mailbox: set to 1 by a wait that timed out
    int32_t * ids_all;         // mailbox: [k * max_tokens] selected ids of this layer (route counts)
    int32_t * ids_cpu;         // mailbox: [k * max_tokens] CPU-branch ids (shared by all layers)
    float   * cur;             // mailbox: [n_embd * max_tokens] hidden rows (shared by all layers)
    const float * out;         // mailbox: [n_embd * k * max_tokens] CPU-branch output (shared)
    int64_t  timeout_ns;       // a wait longer than this gives up (status = 1) instead of hanging the GPU
};
