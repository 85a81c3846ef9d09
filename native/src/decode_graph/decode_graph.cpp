// Decode graph of the expert engine: see decode_graph/decode_graph.h and decode_graph/decode_ops.h.
#include "decode_graph/decode_graph.h"
#include "cpu_branch/kernel.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OST_RELAX() _mm_pause()
#else
#define OST_RELAX() std::this_thread::yield()
#endif

namespace {

constexpr int64_t WAIT_TIMEOUT_NS = 20LL * 1000 * 1000 * 1000;   // a wait this long means a lost pass
constexpr int     MAX_CPU_NODES   = 256;

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct cpu_job_t {
    int il = -1;
    int64_t n = 0;
    ggml_context * ctx = nullptr;   // the CPU branch's tensors (no data of its own)
    ggml_cgraph * g = nullptr;
    ggml_tensor * out = nullptr;
    ggml_tensor * ids = nullptr;    // mailbox leaves: CPU-branch ids, hidden rows
    ggml_tensor * cur = nullptr;
    ggml_cplan plan{};
    bool fast = false;              // the graph is the one the CPU branch's own kernel computes
    ost_ffn ffn;
};

struct jobset_t {
    std::vector<cpu_job_t> jobs;
    bool ready = false;             // intermediates allocated, plans made
    bool any_fast = false;          // some job runs on the kernel's team
    ~jobset_t() { for (auto & j : jobs) if (j.ctx) ggml_free(j.ctx); }
};

}  // namespace

struct ost_dgraph {
    ost_dg_config cfg;
    ggml_backend_buffer_t mbx_buf = nullptr;
    int64_t mbx_bytes = 0;
    volatile int64_t * pass_seq = nullptr;
    volatile int32_t * status = nullptr;
    ostinato_mbx_hdr * hdr = nullptr;   // [n_layer]
    int32_t * ids_all = nullptr;        // [n_layer][k * T]
    int32_t * ids_cpu = nullptr;        // [k * T]
    float * cur = nullptr;              // [n_embd * T]
    float * out = nullptr;              // [n_embd * k * T]
    std::vector<ostinato_op> ops;       // [3 * n_layer]: route, join, predict (addresses captured by CUDA graphs)

    std::map<ggml_context *, jobset_t> sets;
    ggml_gallocr_t galloc = nullptr;
    std::vector<uint8_t> work;
    ggml_threadpool * tp = nullptr;
    int n_threads = 1;
    ost_team * team = nullptr;          // the CPU branch's own kernel runs on it (spins during a pass)
    std::vector<uint8_t> ffn_ws;
    std::string fast_note;              // why a CPU-branch graph did not match the kernel (the last one)
    std::vector<int64_t> wait_seen;     // per layer: the last pass whose join wait was collected
    int64_t timeline_seen = 0;          // the last pass whose timeline was collected
    std::atomic<int64_t> n_fast{0}, n_graph{0};   // CPU-branch layer computes by the kernel / by ggml (read by info)

    // worker
    std::thread worker;
    std::mutex m;
    std::condition_variable cv;
    jobset_t * run = nullptr;
    size_t run_layers = 0;              // decode-graph layers of the last pass begun (its jobs)
    int64_t seq = 0;
    bool pending = false, quit = false, lost = false;
};

namespace {

jobset_t * set_of(ost_dgraph * dg, ggml_context * graph_ctx) {
    auto it = dg->sets.find(graph_ctx);
    return it == dg->sets.end() ? nullptr : &it->second;
}

ggml_tensor * mailbox_tensor(ost_dgraph * dg, ggml_context * ctx, ggml_type type, int64_t ne0, int64_t ne1,
                             int64_t ne2, void * data) {
    ggml_tensor * t = ggml_new_tensor_3d(ctx, type, ne0, ne1, ne2);
    t->data = data;
    t->buffer = dg->mbx_buf;
    return t;
}

// Allocates the intermediates of every CPU-branch graph of a set in one shared compute buffer (the
// branches run one at a time): reserve for all first (the buffer only grows), then assign.
bool prepare(ost_dgraph * dg, jobset_t & js) {
    if (js.ready) return true;
    const size_t size0 = ggml_gallocr_get_buffer_size(dg->galloc, 0);
    for (auto & j : js.jobs) if (!ggml_gallocr_reserve(dg->galloc, j.g)) return false;
    if (ggml_gallocr_get_buffer_size(dg->galloc, 0) != size0) {
        for (auto & kv : dg->sets) kv.second.ready = false;   // their tensors pointed into the old buffer
    }
    size_t work = 0;
    for (auto & j : js.jobs) {
        if (!ggml_gallocr_alloc_graph(dg->galloc, j.g)) return false;
        // with the kernel on, ggml's compute serves only the layers it does not take: on a quarter
        // of the threads, as the OpenMP pool had (two OpenMP teams in one process with more threads
        // than cores make libgomp cut every wait short, prefill's too: docs/engine.md, Threads)
        j.plan = ggml_graph_plan(j.g, dg->cfg.ffn_kernel ? std::max(1, dg->n_threads / 4) : dg->n_threads, dg->tp);
        work = std::max(work, j.plan.work_size);
    }
    if (dg->work.size() < work) dg->work.resize(work);
    for (auto & j : js.jobs) j.plan.work_data = dg->work.data();
    js.ready = true;
    return true;
}

void worker_main(ost_dgraph * dg) {
    std::unique_lock<std::mutex> lk(dg->m);
    for (;;) {
        dg->cv.wait(lk, [&] { return dg->quit || dg->pending; });
        if (dg->quit) return;
        jobset_t * js = dg->run;
        const int64_t seq = dg->seq;
        lk.unlock();
        bool lost = false;
        for (auto & j : js->jobs) {
            ostinato_mbx_hdr * h = &dg->hdr[j.il];
            const int64_t t0 = now_ns();
            while (h->seq != seq) {
                OST_RELAX();
                if (now_ns() - t0 > WAIT_TIMEOUT_NS) { lost = true; break; }
            }
            if (lost) break;
            std::atomic_thread_fence(std::memory_order_acquire);
            ost_dg_layer_pass lp;
            lp.n = h->n; lp.n_cold = h->n_cold;
            lp.n_staged = h->n_staged; lp.staged_routes = h->staged_routes; lp.staged_used = h->staged_used;
            const int n = lp.n, n_cold = lp.n_cold;
            double cpu_ms = 0;
            int64_t bytes = 0;
            bool fast = false;
            if (n_cold > 0) {
                const int64_t c0 = now_ns();
                if (j.fast) {
                    ost_ffn_job fj;
                    fj.f = &j.ffn; fj.ids = dg->ids_cpu; fj.cur = dg->cur; fj.cur_stride = dg->cfg.n_embd;
                    fj.out = dg->out; fj.k = dg->cfg.k; fj.n = n;
                    ost_ffn_stats st;
                    fast = ost_ffn_run(dg->team, fj, dg->ffn_ws, &st);
                    bytes = st.bytes;
                }
                if (!fast) {
                    // ggml's own compute (OpenMP team): the kernel's team sleeps meanwhile
                    if (js->any_fast) ost_team_set_active(dg->team, false);
                    ggml_graph_compute(j.g, &j.plan);
                    if (js->any_fast) ost_team_set_active(dg->team, true);
                }
                cpu_ms = (now_ns() - c0) / 1e6;
                std::atomic_thread_fence(std::memory_order_release);
                h->done = seq;
                (fast ? dg->n_fast : dg->n_graph)++;
            }
            if (dg->cfg.count) {
                lp.cpu_ms = cpu_ms;
                lp.cpu_bytes = bytes;
                lp.kernel = n_cold > 0 ? (fast ? 1 : 2) : 0;
                dg->cfg.count(dg->cfg.count_ud, j.il, dg->cfg.k, dg->ids_all + (size_t) j.il * dg->cfg.k * dg->cfg.max_tokens,
                              lp);
            }
        }
        ost_team_set_active(dg->team, false);
        lk.lock();
        dg->lost = dg->lost || lost;
        dg->pending = false;
        dg->cv.notify_all();
    }
}

}  // namespace

ost_dgraph * ost_dg_new(const ost_dg_config & cfg, std::string & err) {
    auto * dg = new ost_dgraph();
    dg->cfg = cfg;
    const int64_t L = cfg.n_layer, k = cfg.k, T = cfg.max_tokens, E = cfg.n_embd;
    auto align = [](int64_t x) { return (x + 255) & ~int64_t(255); };
    const int64_t o_hdr = 256, o_ids_all = align(o_hdr + L * (int64_t) sizeof(ostinato_mbx_hdr));
    const int64_t o_ids_cpu = align(o_ids_all + L * k * T * 4), o_cur = align(o_ids_cpu + k * T * 4);
    const int64_t o_out = align(o_cur + E * T * 4), size = align(o_out + E * k * T * 4);
    ggml_backend_buffer_type_t buft = cfg.host_buft ? cfg.host_buft : ggml_backend_cpu_buffer_type();
    dg->mbx_buf = ggml_backend_buft_alloc_buffer(buft, (size_t) size);
    if (!dg->mbx_buf) {
        err = "cannot allocate the decode graph's mailbox in " + std::string(ggml_backend_buft_name(buft));
        delete dg;
        return nullptr;
    }
    ggml_backend_buffer_clear(dg->mbx_buf, 0);
    dg->mbx_bytes = size;
    char * base = (char *) ggml_backend_buffer_get_base(dg->mbx_buf);
    dg->pass_seq = (volatile int64_t *) base;
    dg->status = (volatile int32_t *) (base + 64);
    dg->hdr = (ostinato_mbx_hdr *) (base + o_hdr);
    dg->ids_all = (int32_t *) (base + o_ids_all);
    dg->ids_cpu = (int32_t *) (base + o_ids_cpu);
    dg->cur = (float *) (base + o_cur);
    dg->out = (float *) (base + o_out);
    static std::atomic<int64_t> generations{0};
    const int64_t gen = ++generations;   // keys the CUDA side's checks of the ops' copy sources
    dg->ops.resize((size_t) 3 * L);
    dg->wait_seen.assign((size_t) L, 0);
    for (int il = 0; il < L; ++il) {
        const ost_dg_layer & l = cfg.layers[il];
        for (int kind : {OSTINATO_OP_ROUTE, OSTINATO_OP_JOIN, OSTINATO_OP_PREDICT}) {
            const int at = kind == OSTINATO_OP_ROUTE ? 0 : kind == OSTINATO_OP_JOIN ? 1 : 2;
            ostinato_op & o = dg->ops[(size_t) 3 * il + at];
            o = ostinato_op{};
            o.magic = OSTINATO_OP_MAGIC; o.kind = kind; o.il = il; o.k = (int32_t) k;
            o.n_expert = cfg.n_expert; o.zero0 = l.zero0; o.has_hot = l.has_hot ? 1 : 0;
            o.n_embd = (int32_t) E; o.max_tokens = (int32_t) T;
            o.table = l.table; o.scratch = l.scratch;
            o.hdr = &dg->hdr[il]; o.pass_seq = dg->pass_seq; o.status = dg->status;
            o.ids_all = dg->ids_all + (size_t) il * k * T; o.ids_cpu = dg->ids_cpu;
            o.cur = dg->cur; o.out = dg->out;
            o.timeout_ns = WAIT_TIMEOUT_NS;
            o.host_pool = cfg.host_pool ? 1 : 0;
            o.gen = gen;
            o.stage_slot0 = l.stage_slot0;
            // the next layer's prediction (decode prefetch), as the engine's config gives it
            const ost_dg_layer * nx = il + 1 < L ? &cfg.layers[il + 1] : nullptr;
            if (kind == OSTINATO_OP_PREDICT && l.next_max > 0 && nx && l.next_parts.size() <= OSTINATO_COPY_PARTS) {
                o.next_max = std::min(l.next_max, OSTINATO_STAGE_MAX);
                o.next_table = nx->table;
                o.next_scratch = nx->scratch;
                o.next_slot0 = nx->stage_slot0;
                o.next_n_parts = (int32_t) l.next_parts.size();
                for (size_t p = 0; p < l.next_parts.size(); ++p) o.next_parts[p] = l.next_parts[p];
                o.next_gate = l.next_gate;
                o.next_gate_type = (int32_t) l.next_gate_type;
                o.next_gate_nb1 = l.next_gate_nb1;
                o.next_router_b = l.next_router_b;
                o.next_sel_b = l.next_sel_b;
                o.next_gating = l.next_gating;
                o.pred_logits = l.pred_logits;
                o.next_hdr = &dg->hdr[il + 1];
                o.copy_blocks = cfg.copy_blocks;
            }
        }
    }
    dg->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    int nt = cfg.n_threads;
    if (nt <= 0) nt = std::max(1, (int) std::thread::hardware_concurrency() / 2);
    dg->n_threads = nt;
    // the resident pool: threads made (and placed) once, polling between CPU branches
    ggml_threadpool_params tpp = ggml_threadpool_params_default(nt);
    tpp.poll = 50;
    dg->tp = ggml_threadpool_new(&tpp);
    if (!dg->tp) {
        err = "cannot create the CPU-branch thread pool";
        ggml_gallocr_free(dg->galloc);
        ggml_backend_buffer_free(dg->mbx_buf);
        delete dg;
        return nullptr;
    }
    // the kernel's team: the worker thread is its thread 0
    dg->team = ost_team_new(nt);
    dg->worker = std::thread(worker_main, dg);
    return dg;
}

void ost_dg_free(ost_dgraph * dg) {
    if (!dg) return;
    {
        std::unique_lock<std::mutex> lk(dg->m);
        dg->cv.wait(lk, [&] { return !dg->pending; });
        dg->quit = true;
        dg->cv.notify_all();
    }
    dg->worker.join();
    ost_team_free(dg->team);
    dg->sets.clear();
    if (dg->galloc) ggml_gallocr_free(dg->galloc);
    if (dg->tp) ggml_threadpool_free(dg->tp);
    if (dg->mbx_buf) ggml_backend_buffer_free(dg->mbx_buf);
    delete dg;
}

int ost_dg_max_tokens(const ost_dgraph * dg) { return dg ? dg->cfg.max_tokens : 0; }

void ost_dg_set_ffn_kernel(ost_dgraph * dg, bool on) { if (dg) dg->cfg.ffn_kernel = on; }

void ost_dg_info(const ost_dgraph * dg, int & n_threads, int64_t & mailbox_bytes) {
    n_threads = dg ? dg->n_threads : 0;
    mailbox_bytes = dg ? dg->mbx_bytes : 0;
}

void ost_dg_kernel_info(const ost_dgraph * dg, int64_t & n_fast, int64_t & n_graph, std::string & note) {
    n_fast = dg ? dg->n_fast.load() : 0;
    n_graph = dg ? dg->n_graph.load() : 0;
    note = dg ? dg->fast_note : std::string();
}

double ost_dg_collect_wait(ost_dgraph * dg) {
    if (!dg) return 0.0;
    int64_t ns = 0;
    for (int il = 0; il < dg->cfg.n_layer; ++il) {
        ostinato_mbx_hdr & h = dg->hdr[il];
        const int64_t s = h.wait_seq;
        if (s > dg->wait_seen[(size_t) il]) {
            std::atomic_thread_fence(std::memory_order_acquire);
            ns += h.wait_ns;
            dg->wait_seen[(size_t) il] = s;
        }
    }
    return ns / 1e6;
}

ost_dg_timeline ost_dg_collect_timeline(ost_dgraph * dg) {
    if (!dg) return {};
    const int L = dg->cfg.n_layer;
    int64_t s = 0;
    for (int il = 0; il < L; ++il) s = std::max(s, (int64_t) dg->hdr[il].seq);
    if (s <= dg->timeline_seen) return {};
    dg->timeline_seen = s;
    std::atomic_thread_fence(std::memory_order_acquire);
    ost_dg_timeline tl;
    int n = 0, prev = -1;
    int64_t first = 0, last = 0;
    for (int il = 0; il < L; ++il) {
        const ostinato_mbx_hdr & h = dg->hdr[il];
        if (h.seq != s) continue;
        if (h.n != 1) return {};   // a prefill of a few tokens: not a decode step
        n++;
        if (prev < 0) first = h.route_ns;
        // adjacent layers only: an all-resident layer between two has no route op
        if (prev >= 0 && prev == il - 1) {
            const ostinato_mbx_hdr & p = dg->hdr[prev];
            const double ms = (h.route_ns - p.route_ns) / 1e6;
            if (ms < 0) {
                // timers of two GPUs that disagree: no interval
            } else if (p.n_cold > 0) {
                tl.cpu_layers++;
                tl.cpu_ms += ms;
                tl.cpu_wait_ms += p.wait_seq == s ? p.wait_ns / 1e6 : 0.0;
            } else {
                tl.gpu_layers++;
                tl.gpu_ms += ms;
            }
            if (ms >= 0 && h.chain_seq == s) {
                // the chain that staged this layer's experts, forked at the previous layer's predict op
                tl.chain_layers++;
                tl.chain_ms += (h.chain_end_ns - h.chain_t0_ns) / 1e6;
                tl.chain_copy_ms += (h.chain_end_ns - h.chain_sel_ns) / 1e6;
                if (h.chain_end_ns > h.route_ns) {
                    tl.chain_wait_ms += (h.chain_end_ns - h.route_ns) / 1e6;
                    tl.chain_late++;
                }
            }
        }
        last = h.route_ns;
        prev = il;
    }
    // every layer of the pass's graph (its CPU-branch jobs, one per decode-graph layer), else it
    // still runs (run_layers, not run: a rebuilt graph frees the job set run points to)
    if (n < 2 || (size_t) n != dg->run_layers) return {};
    tl.passes = 1;
    tl.span_ms = (last - first) / 1e6;
    return tl;
}

void ost_dg_build_begin(ost_dgraph * dg, ggml_context * graph_ctx) {
    dg->sets.erase(graph_ctx);
}

bool ost_dg_predicts(const ost_dgraph * dg, int il) {
    return dg && il >= 0 && il < dg->cfg.n_layer && dg->ops[(size_t) 3 * il + 2].next_max > 0;
}

ggml_tensor * ost_dg_predict(ost_dgraph * dg, ggml_context * ctx, ggml_tensor * cur, int il) {
    if (!ost_dg_predicts(dg, il)) return nullptr;
    // on the GPU the op's kernels read cur on a side stream while the step's later ops run: as a graph
    // output its memory is never handed to a later tensor of the graph (ggml-alloc), so the prediction
    // reads the values it was forked with, whatever the timing (a few KB per layer)
    ggml_set_output(cur);
    if (cur->view_src) ggml_set_output(cur->view_src);
    ggml_tensor * args[1] = { cur };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, 1, 1, 1, 1, args, 1, predict_cpu, 1, &dg->ops[(size_t) 3 * il + 2]);
    ggml_format_name(t, OSTINATO_OP_PREFIX "predict-%d", il);
    return t;
}

ggml_tensor * ost_dg_route(ost_dgraph * dg, ggml_context * ctx, ggml_tensor * selected, ggml_tensor * cur, int il) {
    ggml_tensor * args[2] = { selected, cur };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, selected->ne[0], selected->ne[1], 1, 1, args, 2,
                                     route_cpu, 1, &dg->ops[(size_t) 3 * il]);
    ggml_format_name(t, OSTINATO_OP_PREFIX "route-%d", il);
    return t;
}

ggml_context * ost_dg_cpu_begin(ost_dgraph * dg, ggml_context * graph_ctx, int il, ggml_tensor * cur, int64_t k,
                                ggml_tensor ** ids, ggml_tensor ** cur_cpu) {
    GGML_ASSERT(cur->ne[0] == dg->cfg.n_embd && cur->ne[1] == 1 && cur->ne[2] <= dg->cfg.max_tokens);
    const int64_t n = cur->ne[2];
    ggml_init_params ip = { ggml_tensor_overhead() * MAX_CPU_NODES + ggml_graph_overhead_custom(MAX_CPU_NODES, false),
                            nullptr, true };
    cpu_job_t job;
    job.il = il;
    job.n = n;
    job.ctx = ggml_init(ip);
    GGML_ASSERT(job.ctx != nullptr);
    *ids = mailbox_tensor(dg, job.ctx, GGML_TYPE_I32, k, n, 1, dg->ids_cpu);
    *cur_cpu = mailbox_tensor(dg, job.ctx, GGML_TYPE_F32, cur->ne[0], 1, n, dg->cur);
    job.ids = *ids;
    job.cur = *cur_cpu;
    dg->sets[graph_ctx].jobs.push_back(job);
    return job.ctx;
}

void ost_dg_cpu_end(ost_dgraph * dg, ggml_context * graph_ctx, int il, ggml_tensor * out) {
    jobset_t * js = set_of(dg, graph_ctx);
    GGML_ASSERT(js && !js->jobs.empty() && js->jobs.back().il == il);
    cpu_job_t & j = js->jobs.back();
    GGML_ASSERT(out->type == GGML_TYPE_F32 && out->view_src == nullptr && ggml_is_contiguous(out) &&
                out->ne[0] == dg->cfg.n_embd && out->ne[1] == dg->cfg.k && out->ne[2] == j.n);
    out->data = dg->out;   // the branch writes straight into the mailbox
    out->buffer = dg->mbx_buf;
    j.out = out;
    j.g = ggml_new_graph_custom(j.ctx, MAX_CPU_NODES, false);
    ggml_build_forward_expand(j.g, out);
    std::string why;
    j.fast = dg->cfg.ffn_kernel && ost_ffn_match(out, j.ids, j.cur, j.ffn, why);
    if (j.fast) js->any_fast = true;
    else if (dg->cfg.ffn_kernel) dg->fast_note = why;
}

ggml_tensor * ost_dg_join(ost_dgraph * dg, ggml_context * ctx, ggml_tensor * ids_gpu, ggml_tensor * out_gpu, int il) {
    ggml_tensor * args[2] = { ids_gpu, out_gpu };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_F32, dg->cfg.n_embd, ids_gpu->ne[0], ids_gpu->ne[1], 1, args,
                                     out_gpu ? 2 : 1, join_cpu, 1, &dg->ops[(size_t) 3 * il + 1]);
    ggml_format_name(t, OSTINATO_OP_PREFIX "join-%d", il);
    return t;
}

bool ost_dg_pass_begin(ost_dgraph * dg, ggml_context * graph_ctx) {
    jobset_t * js = set_of(dg, graph_ctx);
    if (!js || js->jobs.empty()) return false;
    if (!prepare(dg, *js)) {
        GGML_ABORT("ostinato: cannot allocate the CPU-branch graphs of the decode graph");
    }
    std::unique_lock<std::mutex> lk(dg->m);
    dg->cv.wait(lk, [&] { return !dg->pending; });
    // unique in the process, not per decode graph: the layers' stage lists live in the pool's scratch,
    // which outlives a decode graph made anew (a setting changed), and are matched by pass number
    static std::atomic<int64_t> passes{0};
    dg->seq = ++passes;
    *dg->pass_seq = dg->seq;   // read by the route and join ops of this pass
    std::atomic_thread_fence(std::memory_order_seq_cst);
    dg->run = js;
    dg->run_layers = js->jobs.size();
    dg->pending = true;
    if (js->any_fast) ost_team_set_active(dg->team, true);   // spins until the pass ends
    dg->cv.notify_all();
    return true;
}

bool ost_dg_pass_end(ost_dgraph * dg, std::string & err) {
    std::unique_lock<std::mutex> lk(dg->m);
    dg->cv.wait(lk, [&] { return !dg->pending; });
    if (*dg->status != 0 || dg->lost) {
        err = dg->lost ? "decode graph: a layer's route op did not arrive within 20 s"
                       : "decode graph: a join waited more than 20 s for the CPU branch";
        return false;
    }
    return true;
}
