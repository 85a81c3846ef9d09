// The hybrid pass's CPU share beside the graph: its runner thread, launch and wait ops, and their hooks.

#include "engine/engine.h"
#include "cpu_branch/kernel.h"

#include <condition_variable>
#include <memory>
#include <thread>

using namespace ost;

namespace {

// One per layer, for the life of the process: the CPU share's matched FFN (the model's tensors,
// rewritten at every graph build) and the number of its job on the share runner
struct cpu_share_t {
    ost_ffn f;
    uint64_t seq = 0;
    const ggml_tensor * launch = nullptr;   // its launch op in the graph built last
};
std::vector<std::unique_ptr<cpu_share_t>> g_cpu_share;   // [layer], guarded by g_mu

// The hybrid pass's CPU share beside the graph. A layer's launch op hands its job to the runner
// thread (thread 0 of a kernel team of its own) and returns: the main thread goes on with the graph
// (the join of the layer's copies, the prefetch ops that start the next layers' copies, the staged
// routes on the GPU) while the team computes. The wait op, placed after the staged routes, blocks
// only while the share still runs, and its output (the share's gather indices) feeds the add of the
// share's rows on the GPU, so the scheduler copies those rows there only after it. Layers run one
// after the other: one job at a time. (Computed on the main thread, as before, the share stopped
// the graph: no later layer's copies were issued while it ran; docs/engine.md.)
struct share_runner {
    std::mutex m;
    std::condition_variable cv;
    std::thread th;
    ost_team * team = nullptr;
    std::vector<uint8_t> ws;
    ost_ffn_job job;                 // the job posted last
    uint64_t posted = 0, taken = 0;  // jobs posted by launch ops, taken by the runner
    uint64_t done = 0;               // the last job finished
    ost_ffn_stats st;                // its stats
    int64_t t_start_us = 0, t_end_us = 0;   // its run on the team
};
share_runner * g_share = nullptr;   // made at the first launch; lives as long as the process

void share_main(share_runner * s) {
    std::unique_lock<std::mutex> lk(s->m);
    for (;;) {
        s->cv.wait(lk, [&] { return s->posted != s->taken; });
        const uint64_t seq = s->taken = s->posted;
        const ost_ffn_job job = s->job;
        lk.unlock();
        const int64_t t0 = now_us();
        ost_ffn_stats st;
        ost_ffn_run(s->team, job, s->ws, &st);   // job.force: it always computes
        const int64_t t1 = now_us();
        lk.lock();
        s->st = st;
        s->t_start_us = t0;
        s->t_end_us = t1;
        s->done = seq;
        s->cv.notify_all();
    }
}

share_runner * share_runner_get() {
    static std::once_flag once;
    std::call_once(once, [] {
        auto * s = new share_runner();
        // the decode graph's CPU-branch threads (every core but one by default): a prefill's CPU
        // share and a decode step's CPU branch never run at once
        const int n_opt = g_eng ? g_eng->opts.cpu_threads : 0;   // a pass is running: the engine is there
        int nt = n_opt > 0 ? n_opt : (int) std::thread::hardware_concurrency() - 1;
        s->team = ost_team_new(std::max(1, nt));
        s->th = std::thread(share_main, s);
        s->th.detach();
        g_share = s;
    });
    return g_share;
}

// Launch op (CPU, n_tasks = 1). Sources: cur [n_embd, 1, M], ids [k, M], then the weights (so that
// the scheduler orders and places the op). Its output [n_embd, k, M] is written by the runner after
// the op returns; the wait op reads it, and keeps the sources alive until the job is done.
void share_launch_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    auto * cs = (cpu_share_t *) ud;
    const ggml_tensor * cur = dst->src[0];
    const ggml_tensor * ids = dst->src[1];
    ost_ffn_job job;
    job.f = &cs->f;
    job.ids = (const int32_t *) ids->data;
    job.k = (int) ids->ne[0];
    job.n = (int) ids->ne[1];
    job.cur = (const float *) cur->data;
    job.cur_stride = (int64_t) (cur->nb[2] / sizeof(float));
    job.out = (float *) dst->data;
    job.zero_unrouted = true;
    // the upload op leaves to the uploads any expert whose arithmetic the kernel cannot match
    // (cpu_route_cap): what the kernel computes here is ggml's
    job.force = true;
    share_runner * s = share_runner_get();
    {
        std::lock_guard<std::mutex> lk(s->m);
        s->job = job;
        cs->seq = ++s->posted;
    }
    s->cv.notify_all();
}

// Wait op (CPU, n_tasks = 1). Sources: the launch op's output, the share's gather indices [M]
// (copied to the output), then the job's inputs (cur rows, ids: alive until here). Waits for the
// layer's job, counts it into the pass.
void share_wait_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) return;
    auto * cs = (cpu_share_t *) ud;
    share_runner * s = share_runner_get();
    const int64_t t0 = now_us();
    ost_ffn_stats st;
    int64_t ms_run = 0;
    {
        std::unique_lock<std::mutex> lk(s->m);
        s->cv.wait(lk, [&] { return s->done >= cs->seq; });
        st = s->st;
        ms_run = s->t_end_us - s->t_start_us;
    }
    const int64_t t1 = now_us();
    std::memcpy(dst->data, dst->src[1]->data, ggml_nbytes(dst));
    std::lock_guard<std::mutex> lock(g_mu);
    engine_t * e = g_eng;
    if (!e || !e->in_pass || st.experts == 0) return;
    e->cur.cpu_bytes += st.bytes;
    e->cur.cpu_layers++;
    e->cur.cpu_kernel_layers++;
    e->cur.cpu_ms += ms_run / 1000.0;
    e->cur.cpu_wait_ms += (t1 - t0) / 1000.0;
    if (e->opts.upload_cpu_share < 0 && t1 - t0 > ADAPT_WAITED_US) {   // the CPU was the longer part
        e->upload_cpu_share = std::max(0.0, e->upload_cpu_share - ADAPT_STEP);
    }
}

}  // namespace

ggml_tensor * ostinato_moe_cpu_share(ggml_context * ctx, ggml_tensor * out, ggml_tensor * ids, ggml_tensor * cur, int il) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng || !g_eng->opts.cpu_branch_kernel || il < 0) return out;
    ost_ffn f;
    std::string why;
    if (!ost_ffn_match(out, ids, cur, f, why)) return out;
    if ((int) g_cpu_share.size() <= il) g_cpu_share.resize((size_t) il + 1);
    auto & cs = g_cpu_share[(size_t) il];
    if (!cs) cs = std::make_unique<cpu_share_t>();
    cs->f = f;
    ggml_tensor * args[5] = { cur, ids, const_cast<ggml_tensor *>(f.down), const_cast<ggml_tensor *>(f.up),
                              const_cast<ggml_tensor *>(f.gate) };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_F32, out->ne[0], out->ne[1], out->ne[2], out->ne[3], args,
                                     f.gate ? 5 : 4, share_launch_op, 1, cs.get());
    ggml_format_name(t, "ostinato_cpu_share-%d", il);
    cs->launch = t;
    return t;
}

ggml_tensor * ostinato_moe_cpu_wait(ggml_context * ctx, ggml_tensor * out, ggml_tensor * gather, ggml_tensor * ids,
                                    ggml_tensor * cur, int il) {
    std::lock_guard<std::mutex> lock(g_mu);
    cpu_share_t * cs = il >= 0 && il < (int) g_cpu_share.size() ? g_cpu_share[(size_t) il].get() : nullptr;
    if (!cs || cs->launch != out) return gather;   // computed by ggml's graph: nothing runs beside it
    ggml_tensor * args[4] = { out, gather, cur, ids };
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, gather->ne[0], 1, 1, 1, args, 4, share_wait_op, 1, cs);
    ggml_format_name(t, "ostinato_cpu_wait-%d", il);
    return t;
}
