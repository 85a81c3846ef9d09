// The decode graph's route, join and predict ops on the CPU (CPU builds; the CUDA kernels: decode_ops.cu).
#include "decode_graph/decode_graph.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace {

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

// CPU implementation of the predict op (CPU builds; same effects as the predict, select and copy
// kernels): the next layer's router on cur, the top k of its logits (descending; ties: the lower
// expert), the first next_max of them that are cold in the next layer as its stage list, and their
// copies into their slots, done at once (the kernels' side stream).
void predict_cpu(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ostinato_op & o = *(const ostinato_op *) ud;
    const ggml_tensor * c = dst->src[0];
    const float * cur = (const float *) c->data;
    if (o.next_max <= 0 || !o.host_pool || ggml_nelements(c) != o.n_embd || !ggml_is_contiguous(c)) return;
    o.next_hdr->chain_t0_ns = now_ns();
    thread_local std::vector<float> pred;   // once per decode step and layer: no allocation after the first
    thread_local std::vector<int> order;
    pred.resize((size_t) o.n_expert);
    order.resize((size_t) o.n_expert);
    for (int x = 0; x < o.n_expert; ++x) {
        const char * row = (const char *) o.next_gate + (int64_t) x * o.next_gate_nb1;
        float sum = 0.0f;
        for (int i = 0; i < o.n_embd; ++i) {
            const float w = o.next_gate_type == GGML_TYPE_F16  ? ggml_fp16_to_fp32(((const ggml_fp16_t *) row)[i])
                          : o.next_gate_type == GGML_TYPE_BF16 ? ggml_bf16_to_fp32(((const ggml_bf16_t *) row)[i])
                                                               : ((const float *) row)[i];
            sum += w * cur[i];
        }
        pred[(size_t) x] = ostinato_pred_score(sum, o.next_router_b, o.next_sel_b, o.next_gating, x);
    }
    for (int x = 0; x < o.n_expert; ++x) order[(size_t) x] = x;
    const int k = std::min({ o.k, o.n_expert, OSTINATO_PREDICT_TOP });   // as the select kernel
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
        return pred[(size_t) a] > pred[(size_t) b] || (pred[(size_t) a] == pred[(size_t) b] && a < b);
    });
    int m = 0;
    for (int r = 0; r < k && m < o.next_max; ++r) {
        const int x = order[(size_t) r];
        if (o.next_table[x] >= 0) continue;
        o.next_scratch[OSTINATO_SC_STAGE + m++] = x;
    }
    o.next_scratch[OSTINATO_SC_STAGE_N] = m;
    o.next_scratch[OSTINATO_SC_STAGE_SEQ] = (int32_t) *o.pass_seq;
    o.next_hdr->chain_sel_ns = now_ns();
    for (int i = 0; i < m; ++i) {
        const int32_t x = o.next_scratch[OSTINATO_SC_STAGE + i];
        for (int p = 0; p < o.next_n_parts; ++p) {
            const ostinato_copy_part & cp = o.next_parts[p];
            std::memcpy(cp.dst + (int64_t) (o.next_slot0 + i) * cp.dst_stride, cp.src + (int64_t) x * cp.src_stride,
                        (size_t) cp.bytes);
        }
    }
    o.next_hdr->chain_end_ns = now_ns();
    std::atomic_thread_fence(std::memory_order_release);
    o.next_hdr->chain_seq = *o.pass_seq;
}

// CPU implementation of the route op (CPU builds; same effects as ost_route_kernel).
void route_cpu(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ostinato_op & o = *(const ostinato_op *) ud;
    const ggml_tensor * sel = dst->src[0];
    const ggml_tensor * cur = dst->src[1];
    const int64_t n = sel->ne[1];
    GGML_ASSERT(sel->ne[0] == o.k && n <= o.max_tokens && ggml_is_contiguous(cur) && ggml_is_contiguous(dst));
    int32_t * ids_gpu = (int32_t *) dst->data;
    const int64_t seq = *o.pass_seq;
    int32_t * sc = o.scratch;
    const int n_st = o.stage_slot0 >= 0 && sc[OSTINATO_SC_STAGE_SEQ] == (int32_t) seq ? sc[OSTINATO_SC_STAGE_N] : 0;
    int n_cold = 0, hits = 0;
    uint32_t used = 0;
    for (int64_t t = 0; t < n; ++t) {
        int cold_tok = 0;
        for (int j = 0; j < o.k; ++j) {
            const int32_t x = *(const int32_t *) ((const char *) sel->data + t * sel->nb[1] + j * sel->nb[0]);
            int32_t g = x, c = x;
            if (x >= 0 && x < o.n_expert) {
                const int32_t s = o.table[x];
                int si = -1;
                for (int i = 0; s < 0 && i < n_st && si < 0; ++i) if (sc[OSTINATO_SC_STAGE + i] == x) si = i;
                if (s >= 0) { g = s; c = -1; }
                else if (si >= 0) { g = o.stage_slot0 + si; c = -1; used |= 1u << si; hits++; }
                else { g = o.has_hot ? o.zero0 + j : x; c = x; cold_tok++; }
            }
            ids_gpu[t * o.k + j] = g;
            o.ids_all[t * o.k + j] = x;
            o.ids_cpu[t * o.k + j] = c;
        }
        if (cold_tok) {
            std::memcpy(o.cur + t * o.n_embd, (const char *) cur->data + t * o.n_embd * sizeof(float),
                        o.n_embd * sizeof(float));
        }
        n_cold += cold_tok;
    }
    sc[OSTINATO_SC_NCOLD] = n_cold;
    o.hdr->n = (int32_t) n;
    o.hdr->n_cold = n_cold;
    o.hdr->n_staged = n_st;
    o.hdr->staged_routes = hits;
    o.hdr->staged_used = __builtin_popcount(used);
    o.hdr->route_ns = now_ns();
    std::atomic_thread_fence(std::memory_order_release);
    o.hdr->seq = seq;
}

// CPU implementation of the join op (CPU builds; same result as ost_join_kernel).
void join_cpu(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    const ostinato_op & o = *(const ostinato_op *) ud;
    const int32_t * ids = (const int32_t *) dst->src[0]->data;
    const float * gpu = dst->src[1] ? (const float *) dst->src[1]->data : nullptr;
    float * d = (float *) dst->data;
    const int64_t n = dst->ne[2];
    const int32_t n_cold = o.scratch[OSTINATO_SC_NCOLD];
    bool waited = n_cold == 0, ok = true;
    for (int64_t pos = 0; pos < n * o.k; ++pos) {
        const int32_t id = ids[pos];
        // a zero slot is a cold route; a borrowed staging slot (>= zero0 + k) is hot
        const bool cold = o.has_hot ? (id >= o.zero0 && id < o.zero0 + o.k) : (id >= 0 && id < o.n_expert);
        const int64_t off = pos * o.n_embd;
        if (cold && n_cold != 0 && !waited) {
            const int64_t seq = *o.pass_seq, t0 = now_ns();
            while (o.hdr->done != seq) {
                std::this_thread::yield();
                if (now_ns() - t0 > o.timeout_ns) { *o.status = 1; ok = false; break; }
            }
            std::atomic_thread_fence(std::memory_order_acquire);
            waited = true;
            o.hdr->wait_ns = now_ns() - t0;
            std::atomic_thread_fence(std::memory_order_release);
            o.hdr->wait_seq = seq;
        }
        for (int64_t i = 0; i < o.n_embd; ++i) {
            const float c = (cold && n_cold != 0 && ok) ? o.out[off + i] : 0.0f;
            d[off + i] = (gpu ? gpu[off + i] : 0.0f) + c;
        }
    }
}
