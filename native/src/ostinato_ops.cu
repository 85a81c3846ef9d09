// CUDA kernels of the decode-graph ops (see ostinato_ops.h). Compiled into ggml-cuda (native/patches
// add this file to its sources and two cases to ggml-cuda.cu). Paper: arXiv 2611.11533, Section 3.4.
#include "../vendor/llama.cpp/ggml/src/ggml-cuda/common.cuh"
#include "../vendor/llama.cpp/ggml/src/ggml-impl.h"
#include "ostinato_ops.h"
#include "ostinato_ops_cuda.cuh"

#include <algorithm>
#include <cstring>
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

// One block per token: the k lookups, the mailbox rows of a token with a cold route, and (last block)
// the layer header. The header's seq is written after a system fence, so the CPU that sees it sees
// the ids and rows too.
static __global__ void ost_route_kernel(const char * sel, const int64_t sel_nb0, const int64_t sel_nb1,
                                        const float * cur, int32_t * ids_gpu, const ostinato_op o, const int n) {
    const int t = blockIdx.x;
    __shared__ int n_cold_tok;
    if (threadIdx.x == 0) n_cold_tok = 0;
    __syncthreads();
    if (threadIdx.x < o.k) {
        const int j = threadIdx.x;
        const int32_t x = *(const int32_t *) (sel + t * sel_nb1 + j * sel_nb0);
        int32_t g = x, c = x;
        if (x >= 0 && x < o.n_expert) {
            const int32_t s = o.table[x];
            if (s >= 0) {
                g = s; c = -1;
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
        if (threadIdx.x == 0) atomicAdd(&o.scratch[0], n_cold_tok);
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(&o.scratch[1], 1);
        if (prev == (int) gridDim.x - 1) {   // last block of the layer: publish
            __threadfence();
            const int nc = atomicAdd(&o.scratch[0], 0);
            o.scratch[2] = nc;   // for the join kernel (same stream, later)
            o.scratch[0] = 0;
            o.scratch[1] = 0;
            o.hdr->n = n;
            o.hdr->n_cold = nc;
            __threadfence_system();
            o.hdr->seq = ost_load_cv(o.pass_seq);
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
    if (o->kind == OSTINATO_OP_JOIN) {
        return op->src[0] && op->src[0]->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 &&
               (!op->src[1] || op->src[1]->type == GGML_TYPE_F32);
    }
    return false;
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
        ost_route_kernel<<<n, 256, 0, stream>>>((const char *) sel->data, sel->nb[0], sel->nb[1],
                                                (const float *) cur->data, (int32_t *) dst->data, *o, n);
    } else if (o->kind == OSTINATO_OP_JOIN) {
        const ggml_tensor * ids = dst->src[0];
        const ggml_tensor * gpu = dst->src[1];
        GGML_ASSERT(ggml_is_contiguous(dst) && ggml_is_contiguous(ids) && (!gpu || ggml_is_contiguous(gpu)));
        GGML_ASSERT(dst->ne[0] == o->n_embd && dst->ne[1] == o->k);
        const dim3 grid((unsigned) o->k, (unsigned) dst->ne[2], 1);
        ost_join_kernel<<<grid, 256, 0, stream>>>(gpu ? (const float *) gpu->data : nullptr,
                                                  (const int32_t *) ids->data, (float *) dst->data, *o);
    } else if (o->kind == OSTINATO_OP_COUNT) {
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
