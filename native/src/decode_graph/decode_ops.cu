// CUDA kernels of the decode-graph ops (see decode_graph/decode_ops.h). Compiled into ggml-cuda (native/patches
// add this file to its sources and two cases to ggml-cuda.cu). Paper: arXiv 2611.11533, Section 3.4.
#include "ggml-cuda/common.cuh"   // ggml/src is on ggml-cuda's include path
#include "ggml-impl.h"
#include "decode_graph/decode_ops.h"
#include "ostinato/cuda_ops.cuh"

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <string>

static const ostinato_op * ost_op_of(const ggml_tensor * t) {
    if (t->op != GGML_OP_CUSTOM || strncmp(t->name, OSTINATO_OP_PREFIX, sizeof(OSTINATO_OP_PREFIX) - 1) != 0) {
        return nullptr;
    }
    ggml_custom_op_params p;
    memcpy(&p, t->op_params, sizeof(p));
    const ostinato_op * o = (const ostinato_op *) p.userdata;
    return o && o->magic == OSTINATO_OP_MAGIC ? o : nullptr;
}

// Loads from the mailbox (host memory written by the CPU) that never hit a stale cached line.
static __device__ __forceinline__ int64_t ost_load_cv(const volatile int64_t * p) {
    int64_t v;
    asm volatile("ld.global.cv.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

static __device__ __forceinline__ float ost_load_cv(const float * p) {
    float v;
    asm volatile("ld.global.cv.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

static __device__ __forceinline__ int64_t ost_now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (int64_t) t;
}

// Index of expert x in the layer's stage list (staged for this pass), else -1.
static __device__ __forceinline__ int ost_staged_index(const int32_t * sc, const int n_st, const int32_t x) {
    for (int i = 0; i < n_st; ++i) {
        if (sc[OSTINATO_SC_STAGE + i] == x) return i;
    }
    return -1;
}

// Decode prefetch, 1 of 3 (side stream): the next layer's router on this layer's FFN input, one
// warp per expert (logit x = row x of the router . cur, summed in a fixed order: the same every run,
// then scored as the next layer's selection ranks it, ostinato_pred_score;
// not the order of ggml's router product, so a near tie may rank two experts the other way round,
// which changes what is staged, never what is computed).
static __device__ __forceinline__ float ost_weight(const void * row, const int type, const int i) {
    if (type == GGML_TYPE_F16) return __half2float(((const half *) row)[i]);
    if (type == GGML_TYPE_BF16) return __bfloat162float(((const nv_bfloat16 *) row)[i]);
    return ((const float *) row)[i];
}

static __global__ void ost_predict_kernel(const float * cur, const ostinato_op o) {
    const int warp = (int) (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32), lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) o.next_hdr->chain_t0_ns = ost_now_ns();   // the decode timeline's chain marks
    if (warp >= o.n_expert) return;
    const void * row = (const char *) o.next_gate + (int64_t) warp * o.next_gate_nb1;
    float sum = 0.0f;
    if (o.next_gate_type == GGML_TYPE_F32 && o.n_embd % 512 == 0 && ((uintptr_t) row & 15) == 0 &&
        ((uintptr_t) cur & 15) == 0) {
        // 16-byte loads, four in flight per lane with their own sums: the kernel runs beside the decode
        // step's own kernels, so it should hold its multiprocessors for as short a time as it can
        const float4 * r4 = (const float4 *) row;
        const float4 * c4 = (const float4 *) cur;
        float s4[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
        for (int i = lane; i < o.n_embd / 4; i += 128) {
            float4 w[4], c[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) { w[u] = r4[i + 32 * u]; c[u] = c4[i + 32 * u]; }
#pragma unroll
            for (int u = 0; u < 4; ++u) s4[u] += w[u].x * c[u].x + w[u].y * c[u].y + w[u].z * c[u].z + w[u].w * c[u].w;
        }
        sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
    } else {
        for (int i = lane; i < o.n_embd; i += 32) sum += ost_weight(row, o.next_gate_type, i) * cur[i];
    }
    for (int off = 16; off > 0; off /= 2) sum += __shfl_down_sync(0xffffffff, sum, off);
    if (lane == 0) o.pred_logits[warp] = ostinato_pred_score(sum, o.next_router_b, o.next_sel_b, o.next_gating, warp);
}

// Decode prefetch, 2 of 3 (side stream, one block): the top k of the logits, in descending order
// (ties: the lower expert), and of those the first next_max that are cold in the next layer: its
// stage list for this pass.
static __global__ void ost_select_kernel(const ostinato_op o) {
    __shared__ float best_v[32];   // one per warp (at most 32 warps in a block)
    __shared__ int best_i[32];
    __shared__ int chosen[OSTINATO_PREDICT_TOP];
    __shared__ int n_staged;
    const float * pred = o.pred_logits;
    if (threadIdx.x == 0) n_staged = 0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = (blockDim.x + 31) / 32;
    for (int r = 0; r < o.k && r < OSTINATO_PREDICT_TOP; ++r) {
        float v = -INFINITY;
        int vi = INT_MAX;
        for (int x = threadIdx.x; x < o.n_expert; x += blockDim.x) {
            bool taken = false;
            for (int q = 0; q < r; ++q) taken = taken || chosen[q] == x;
            const float p = pred[x];
            if (!taken && (p > v || (p == v && x < vi))) { v = p; vi = x; }
        }
        for (int off = 16; off > 0; off /= 2) {
            const float ov = __shfl_down_sync(0xffffffff, v, off);
            const int oi = __shfl_down_sync(0xffffffff, vi, off);
            if (ov > v || (ov == v && oi < vi)) { v = ov; vi = oi; }
        }
        if (lane == 0) { best_v[warp] = v; best_i[warp] = vi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bv = best_v[0];
            int bi = best_i[0];
            for (int w = 1; w < n_warps; ++w) {
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) { bv = best_v[w]; bi = best_i[w]; }
            }
            chosen[r] = bi < o.n_expert ? bi : -1;
            if (bi < o.n_expert && o.next_table[bi] < 0 && n_staged < o.next_max) {
                o.next_scratch[OSTINATO_SC_STAGE + n_staged++] = bi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        o.next_scratch[OSTINATO_SC_STAGE_N] = n_staged;
        __threadfence();
        o.next_scratch[OSTINATO_SC_STAGE_SEQ] = (int32_t) ost_load_cv(o.pass_seq);
        o.next_hdr->chain_sel_ns = ost_now_ns();
    }
}

// One block per token: the k lookups, the mailbox rows of a token with a cold route, and (last block)
// the layer header. The header's seq is written after a system fence, so the CPU that sees it sees
// the ids and rows too. A cold expert that the previous layer's predict op staged for this pass (its
// stage list) takes its staging slot instead of the CPU branch.
static __global__ void ost_route_kernel(const char * sel, const int64_t sel_nb0, const int64_t sel_nb1,
                                        const float * cur, int32_t * ids_gpu, const ostinato_op o, const int n) {
    const int t = blockIdx.x;
    __shared__ int n_cold_tok;
    if (threadIdx.x == 0) n_cold_tok = 0;
    __syncthreads();
    const int64_t seq = ost_load_cv(o.pass_seq);
    const int n_st = o.stage_slot0 >= 0 && o.scratch[OSTINATO_SC_STAGE_SEQ] == (int32_t) seq
                         ? o.scratch[OSTINATO_SC_STAGE_N] : 0;
    if (threadIdx.x < o.k) {
        const int j = threadIdx.x;
        const int32_t x = *(const int32_t *) (sel + t * sel_nb1 + j * sel_nb0);
        int32_t g = x, c = x;
        if (x >= 0 && x < o.n_expert) {
            const int32_t s = o.table[x];
            const int si = s >= 0 ? -1 : ost_staged_index(o.scratch, n_st, x);
            if (s >= 0) {
                g = s; c = -1;
            } else if (si >= 0) {
                g = o.stage_slot0 + si; c = -1;   // staged for this pass: the GPU branch computes it
                atomicOr(&o.scratch[OSTINATO_SC_USED], 1 << si);
                atomicAdd(&o.scratch[OSTINATO_SC_HITS], 1);
            } else {
                g = o.has_hot ? o.zero0 + j : x;   // a zero slot per position: exact zeros
                c = x;
                atomicAdd(&n_cold_tok, 1);
            }
        }
        ids_gpu[t * o.k + j] = g;
        o.ids_all[t * o.k + j] = x;
        o.ids_cpu[t * o.k + j] = c;
    }
    __syncthreads();
    if (n_cold_tok > 0) {
        const float * src = cur + (int64_t) t * o.n_embd;
        float * dst = o.cur + (int64_t) t * o.n_embd;
        for (int i = threadIdx.x; i < o.n_embd; i += blockDim.x) dst[i] = src[i];
        if (threadIdx.x == 0) atomicAdd(&o.scratch[OSTINATO_SC_COLD], n_cold_tok);
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(&o.scratch[OSTINATO_SC_BLOCKS], 1);
        if (prev == (int) gridDim.x - 1) {   // last block of the layer: publish
            __threadfence();
            const int nc = atomicAdd(&o.scratch[OSTINATO_SC_COLD], 0);
            const int used = atomicExch(&o.scratch[OSTINATO_SC_USED], 0);
            const int hits = atomicExch(&o.scratch[OSTINATO_SC_HITS], 0);
            o.scratch[OSTINATO_SC_NCOLD] = nc;   // for the join kernel (same stream, later)
            o.scratch[OSTINATO_SC_COLD] = 0;
            o.scratch[OSTINATO_SC_BLOCKS] = 0;
            o.hdr->n = n;
            o.hdr->n_cold = nc;
            o.hdr->n_staged = n_st;
            o.hdr->staged_routes = hits;
            o.hdr->staged_used = __popc(used);
            o.hdr->route_ns = ost_now_ns();
            __threadfence_system();
            o.hdr->seq = seq;
        }
    }
}

// Decode prefetch, 3 of 3 (side stream, after the select kernel that wrote the stage list): the
// staged experts' parts from mapped host memory into their staging slots, 16 bytes per load where
// addresses and sizes allow (else byte by byte), in chunks spread over the grid. Its last block to
// finish stamps the chain's end into the next layer's header (the decode timeline).
constexpr int64_t OST_STAGE_CHUNK = 64 * 1024;

static __global__ void ost_stage_copy_kernel(const ostinato_op o) {
    const int32_t * sc = o.next_scratch;
    const int m = sc[OSTINATO_SC_STAGE_N];
    int64_t per_part[OSTINATO_COPY_PARTS];
    int64_t per_expert = 0;
    for (int p = 0; p < o.next_n_parts; ++p) {
        per_part[p] = (o.next_parts[p].bytes + OST_STAGE_CHUNK - 1) / OST_STAGE_CHUNK;
        per_expert += per_part[p];
    }
    for (int64_t u = blockIdx.x; u < per_expert * m; u += gridDim.x) {
        const int i = (int) (u / per_expert);
        int64_t c = u % per_expert;
        int p = 0;
        while (c >= per_part[p]) c -= per_part[p++];
        const ostinato_copy_part & cp = o.next_parts[p];
        const int32_t x = sc[OSTINATO_SC_STAGE + i];
        const int64_t off = c * OST_STAGE_CHUNK, len = min(OST_STAGE_CHUNK, cp.bytes - off);
        const char * src = cp.src + (int64_t) x * cp.src_stride + off;
        char * dst = cp.dst + (int64_t) (o.next_slot0 + i) * cp.dst_stride + off;
        if (((uintptr_t) src | (uintptr_t) dst | (uintptr_t) len) & 15) {
            for (int64_t b = threadIdx.x; b < len; b += blockDim.x) dst[b] = src[b];
            continue;
        }
        const uint4 * s4 = (const uint4 *) src;
        uint4 * d4 = (uint4 *) dst;
        const int64_t n4 = len / 16, step = blockDim.x;
        int64_t j = threadIdx.x;
        // four loads in flight per thread: the reads cross PCIe, and fewer blocks must keep as many
        // bytes in flight (setting decode_prefetch_copy_blocks)
        for (; j + 3 * step < n4; j += 4 * step) {
            const uint4 v0 = s4[j], v1 = s4[j + step], v2 = s4[j + 2 * step], v3 = s4[j + 3 * step];
            d4[j] = v0; d4[j + step] = v1; d4[j + 2 * step] = v2; d4[j + 3 * step] = v3;
        }
        for (; j < n4; j += step) d4[j] = s4[j];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&o.next_scratch[OSTINATO_SC_COPY_DONE], 1) == (int) gridDim.x - 1) {
            o.next_scratch[OSTINATO_SC_COPY_DONE] = 0;
            o.next_hdr->chain_end_ns = ost_now_ns();
            __threadfence_system();
            o.next_hdr->chain_seq = ost_load_cv(o.pass_seq);
        }
    }
}

// One block per position (j, t). A hot position copies gpu + 0.0f; a cold one waits for the CPU
// branch of this pass (only if the layer has cold routes) and adds its row, read uncached from the
// mailbox.
static __global__ void ost_join_kernel(const float * gpu, const int32_t * ids_gpu, float * dst, const ostinato_op o) {
    const int j = blockIdx.x, t = blockIdx.y;
    const int64_t pos = (int64_t) t * o.k + j;
    const int64_t off = pos * o.n_embd;
    const int32_t id = ids_gpu[pos];
    // a zero slot is a cold route; a borrowed staging slot (>= zero0 + k) is hot
    const bool cold = o.has_hot ? (id >= o.zero0 && id < o.zero0 + o.k) : (id >= 0 && id < o.n_expert);
    if (!cold || o.scratch[2] == 0) {
        for (int i = threadIdx.x; i < o.n_embd; i += blockDim.x) dst[off + i] = (gpu ? gpu[off + i] : 0.0f) + 0.0f;
        return;
    }
    __shared__ int ok;
    if (threadIdx.x == 0) {
        const int64_t seq = ost_load_cv(o.pass_seq);
        const int64_t t0 = ost_now_ns();
        ok = 1;
        while (ost_load_cv(&o.hdr->done) != seq) {
            __nanosleep(256);
            if (ost_now_ns() - t0 > o.timeout_ns) { *o.status = 1; ok = 0; break; }
        }
        __threadfence_system();
        // the layer's first cold position reports its wait (the others wait for the same `done`)
        bool first = true;
        for (int64_t p = 0; p < pos && first; ++p) {
            const int32_t q = ids_gpu[p];
            first = !(o.has_hot ? (q >= o.zero0 && q < o.zero0 + o.k) : (q >= 0 && q < o.n_expert));
        }
        if (first) {
            o.hdr->wait_ns = ost_now_ns() - t0;
            __threadfence_system();
            o.hdr->wait_seq = seq;
        }
    }
    __syncthreads();
    const float * cpu = o.out + off;
    for (int i = threadIdx.x; i < o.n_embd; i += blockDim.x) {
        const float c = ok ? ost_load_cv(cpu + i) : 0.0f;
        dst[off + i] = (gpu ? gpu[off + i] : 0.0f) + c;
    }
}

// Route counts of up to OSTINATO_COUNT_MAX all-resident layers (count op): grid.y = the layer.
struct ost_count_args {
    const char * sel[OSTINATO_COUNT_MAX];
    int64_t nb0[OSTINATO_COUNT_MAX], nb1[OSTINATO_COUNT_MAX];
    int32_t il[OSTINATO_COUNT_MAX], k[OSTINATO_COUNT_MAX], n[OSTINATO_COUNT_MAX];
};

static __global__ void ost_count_kernel(const ost_count_args a, int32_t * table, const int n_expert) {
    const int s = blockIdx.y;
    const int64_t m = (int64_t) a.k[s] * a.n[s];
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (int64_t) gridDim.x * blockDim.x) {
        const int64_t t = i / a.k[s], j = i % a.k[s];
        const int32_t x = *(const int32_t *) (a.sel[s] + t * a.nb1[s] + j * a.nb0[s]);
        if (x >= 0 && x < n_expert) atomicAdd(&table[(int64_t) a.il[s] * n_expert + x], 1);
    }
}

bool ggml_cuda_ostinato_supports_op(const ggml_tensor * op, int device) {
    const ostinato_op * o = ost_op_of(op);
    if (!o) return false;
    if (o->kind == OSTINATO_OP_COUNT) {
        // only where the count table lives (the scheduler may offer an op over a host table to the GPU)
        const ggml_tensor * t = op->src[0];
        if (!t || t->type != GGML_TYPE_I32 || !t->buffer || !ggml_is_contiguous(t)) return false;
        const std::string want = std::string(GGML_CUDA_NAME) + std::to_string(device);
        if (want != ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer))) return false;
        for (int i = 1; i < GGML_MAX_SRC && op->src[i]; ++i) {
            if (op->src[i]->type != GGML_TYPE_I32) return false;
        }
        return true;
    }
    if (o->kind == OSTINATO_OP_ROUTE) {
        return op->src[0] && op->src[0]->type == GGML_TYPE_I32 && op->src[1] && op->src[1]->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_I32;
    }
    if (o->kind == OSTINATO_OP_PREDICT) {
        return op->src[0] && op->src[0]->type == GGML_TYPE_F32;
    }
    if (o->kind == OSTINATO_OP_JOIN) {
        return op->src[0] && op->src[0]->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 &&
               (!op->src[1] || op->src[1]->type == GGML_TYPE_F32);
    }
    return false;
}

// Decode prefetch's side stream, per device: the chain of layer l + 1 (predict, select, copy) is
// forked from the main stream at layer l's predict op (fork event); route(l + 1) waits for its
// select kernel (a sel event) and the ops after route(l + 1) for its copies (a done event), one of
// each per layer parity (the chain of l + 1 is forked before route(l) joins the chain of l); all are
// edges of the captured CUDA graph (or plain stream order when ggml runs without one). So the CPU
// branch of l + 1 can start while the copies run; the GPU branch that reads the staged slots cannot.
struct ost_side_t {
    cudaStream_t stream = nullptr;
    cudaEvent_t fork = nullptr, sel[2] = { nullptr, nullptr }, done[2] = { nullptr, nullptr };
    int pending[2] = { -1, -1 };   // per parity: the layer whose chain was forked and not yet joined
    bool failed = false;
};
static ost_side_t g_side[GGML_CUDA_MAX_DEVICES];

static ost_side_t * ost_side(int device) {
    ost_side_t & s = g_side[device];
    if (!s.stream && !s.failed) {
        if (cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking) != cudaSuccess ||
            cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming) != cudaSuccess ||
            cudaEventCreateWithFlags(&s.sel[0], cudaEventDisableTiming) != cudaSuccess ||
            cudaEventCreateWithFlags(&s.sel[1], cudaEventDisableTiming) != cudaSuccess ||
            cudaEventCreateWithFlags(&s.done[0], cudaEventDisableTiming) != cudaSuccess ||
            cudaEventCreateWithFlags(&s.done[1], cudaEventDisableTiming) != cudaSuccess) {
            (void) cudaGetLastError();
            s.failed = true;
            GGML_LOG_WARN("ostinato: cannot create the decode prefetch's stream on CUDA%d: decode prefetch off\n", device);
        }
    }
    return s.failed ? nullptr : &s;
}

// The main stream waits for the chains forked for layers <= il (normally: the one of layer il).
static void ost_side_join(int device, cudaStream_t stream, int il) {
    ost_side_t & s = g_side[device];
    for (int p = 0; p < 2; ++p) {
        if (s.pending[p] < 0 || s.pending[p] > il) continue;
        CUDA_CHECK(cudaStreamWaitEvent(stream, s.done[p], 0));
        s.pending[p] = -1;
    }
}

// Route(il)'s side of the join: the main stream waits for the stage list of layer il's chain only
// (its select kernel); older chains are joined whole. Returns the parity whose copies the ops after
// the route kernel still wait for (ost_side_join_copies), or -1.
static int ost_side_join_stage_list(int device, cudaStream_t stream, int il) {
    ost_side_t & s = g_side[device];
    int open = -1;
    for (int p = 0; p < 2; ++p) {
        if (s.pending[p] < 0 || s.pending[p] > il) continue;
        if (s.pending[p] == il) {
            CUDA_CHECK(cudaStreamWaitEvent(stream, s.sel[p], 0));
            open = p;
        } else {
            CUDA_CHECK(cudaStreamWaitEvent(stream, s.done[p], 0));
            s.pending[p] = -1;
        }
    }
    return open;
}

static void ost_side_join_copies(int device, cudaStream_t stream, int p) {
    if (p < 0) return;
    ost_side_t & s = g_side[device];
    CUDA_CHECK(cudaStreamWaitEvent(stream, s.done[p], 0));
    s.pending[p] = -1;
}

// Whether the GPU may read every copy source of `o` at its host address (pinned and mapped host
// memory under unified addressing): checked once per decode graph generation and layer.
static bool ost_sources_mapped(const ostinato_op & o) {
    static std::map<std::pair<int64_t, int>, bool> seen;
    const auto key = std::make_pair(o.gen, (int) o.il);
    auto it = seen.find(key);
    if (it != seen.end()) return it->second;
    bool ok = o.next_n_parts > 0;
    for (int p = 0; p < o.next_n_parts && ok; ++p) {
        const ostinato_copy_part & cp = o.next_parts[p];
        const char * ends[2] = { cp.src, cp.src + (int64_t) (o.n_expert - 1) * cp.src_stride + cp.bytes - 1 };
        for (const char * q : ends) {
            cudaPointerAttributes attr;
            if (cudaPointerGetAttributes(&attr, q) != cudaSuccess) { (void) cudaGetLastError(); ok = false; break; }
            ok = ok && attr.type == cudaMemoryTypeHost && attr.devicePointer == (const void *) q;
        }
    }
    if (!ok) {
        GGML_LOG_WARN("ostinato: layer %d's host experts are not mapped for the GPU: no decode prefetch for layer %d\n",
                      o.il + 1, o.il + 1);
    }
    if (seen.size() > 4096) seen.clear();
    seen[key] = ok;
    return ok;
}

void ggml_cuda_ostinato_graph_end(ggml_backend_cuda_context & ctx) {
    // (no chain was ever forked on a device whose side stream was not made: pending stays -1)
    ost_side_join(ctx.device, ctx.stream(), INT_MAX);
}

bool ggml_cuda_ostinato_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ostinato_op * o = ost_op_of(dst);
    if (!o) return false;
    cudaStream_t stream = ctx.stream();
    if (o->kind == OSTINATO_OP_ROUTE) {
        const ggml_tensor * sel = dst->src[0];
        const ggml_tensor * cur = dst->src[1];
        const int n = (int) sel->ne[1];
        GGML_ASSERT(sel->ne[0] == o->k && n <= o->max_tokens && cur->ne[0] == o->n_embd);
        GGML_ASSERT(ggml_is_contiguous(cur) && ggml_is_contiguous(dst) && ggml_nelements(cur) == (int64_t) o->n_embd * n);
        // this layer's stage list (the chain forked at the previous layer's predict op) is written;
        // its staged experts are in place before the next op (the GPU branch that reads them)
        const int open = ost_side_join_stage_list(ctx.device, stream, o->il);
        ost_route_kernel<<<n, 256, 0, stream>>>((const char *) sel->data, sel->nb[0], sel->nb[1],
                                                (const float *) cur->data, (int32_t *) dst->data, *o, n);
        CUDA_CHECK(cudaGetLastError());
        ost_side_join_copies(ctx.device, stream, open);
    } else if (o->kind == OSTINATO_OP_PREDICT) {
        const ggml_tensor * cur = dst->src[0];
        ost_side_t * side = nullptr;   // (the engine gives a prediction only for F32, F16 and BF16 routers)
        if (o->next_max > 0 && cur->ne[0] == o->n_embd && ggml_nelements(cur) == o->n_embd &&
            ggml_is_contiguous(cur) && ost_sources_mapped(*o)) {
            side = ost_side(ctx.device);
        }
        if (side) {
            CUDA_CHECK(cudaEventRecord(side->fork, stream));
            CUDA_CHECK(cudaStreamWaitEvent(side->stream, side->fork, 0));
            const int warps = 256 / 32;
            ost_predict_kernel<<<(o->n_expert + warps - 1) / warps, 256, 0, side->stream>>>((const float *) cur->data, *o);
            ost_select_kernel<<<1, 256, 0, side->stream>>>(*o);
            const int p = (o->il + 1) & 1;
            CUDA_CHECK(cudaEventRecord(side->sel[p], side->stream));
            // 8 blocks of 512 threads by default (setting decode_prefetch_copy_blocks): on the H200 they
            // copied a chain's staged experts as fast as 32 (60 against 56 us) and the decode step's own
            // kernels ran ~11 us per layer faster beside them (docs/engine.md, "Decode timeline")
            ost_stage_copy_kernel<<<o->copy_blocks, 512, 0, side->stream>>>(*o);
            CUDA_CHECK(cudaGetLastError());
            CUDA_CHECK(cudaEventRecord(side->done[p], side->stream));
            side->pending[p] = o->il + 1;
        }
        // else: no chain; route(il + 1) finds no stage list of this pass and leaves its cold routes to the CPU
    } else if (o->kind == OSTINATO_OP_JOIN) {
        // a chain whose route op did not come (never in the graphs the engine builds): joined here
        ost_side_join(ctx.device, stream, o->il);
        const ggml_tensor * ids = dst->src[0];
        const ggml_tensor * gpu = dst->src[1];
        GGML_ASSERT(ggml_is_contiguous(dst) && ggml_is_contiguous(ids) && (!gpu || ggml_is_contiguous(gpu)));
        GGML_ASSERT(dst->ne[0] == o->n_embd && dst->ne[1] == o->k);
        const dim3 grid((unsigned) o->k, (unsigned) dst->ne[2], 1);
        ost_join_kernel<<<grid, 256, 0, stream>>>(gpu ? (const float *) gpu->data : nullptr,
                                                  (const int32_t *) ids->data, (float *) dst->data, *o);
    } else if (o->kind == OSTINATO_OP_COUNT) {
        // (an open chain is joined after the graph's last node: ggml_cuda_ostinato_graph_end)
        const ggml_tensor * table = dst->src[0];
        ost_count_args a{};
        int m = 0;
        int64_t most = 1;
        for (int i = 1; i < GGML_MAX_SRC && dst->src[i] && m < OSTINATO_COUNT_MAX; ++i, ++m) {
            const ggml_tensor * sel = dst->src[i];
            a.sel[m] = (const char *) sel->data; a.nb0[m] = sel->nb[0]; a.nb1[m] = sel->nb[1];
            a.il[m] = dst->op_params[OSTINATO_COUNT_LAYERS + m];
            a.k[m] = (int32_t) sel->ne[0]; a.n[m] = (int32_t) sel->ne[1];
            GGML_ASSERT(a.il[m] >= 0 && a.il[m] < table->ne[1]);
            most = std::max(most, sel->ne[0] * sel->ne[1]);
        }
        if (m > 0) {
            const dim3 grid((unsigned) std::min<int64_t>((most + 255) / 256, 64), (unsigned) m, 1);
            ost_count_kernel<<<grid, 256, 0, stream>>>(a, (int32_t *) table->data, (int) table->ne[0]);
        }
    } else {
        return false;
    }
    CUDA_CHECK(cudaGetLastError());
    return true;
}
