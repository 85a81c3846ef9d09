// The CPU branch's own kernel: its thread team, the claim board and ost_ffn_run; see cpu_branch/kernel.h.
#include "cpu_branch/kernel.h"
#include "cpu_branch/dot.h"
#include "cpu_branch/gemm.h"
#include "cpu_branch/run.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define OST_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define OST_PAUSE() __asm__ __volatile__("yield")
#else
#define OST_PAUSE() std::this_thread::yield()
#endif

using namespace ost_kernel;   // the run's state and items (cpu_branch/run.h)

// ---------------------------------------------------------------------------------------------
// thread team

namespace {

// Spins a little, then yields on every try: a thread that only spins gathers CPU time and the
// scheduler then runs it last, so on a machine with more runnable threads than cores the thread a
// barrier waits for may not run for a whole time slice (measured on the 2-core CI machine under
// load: ~40 ms per kernel run with pure spinning). Yielding costs ~1 us when nothing else waits,
// but on the 16-core H200 host a yielded core goes to any other runnable thread (docs/engine.md,
// "CPU branch kernel": never yielding made the kernel 1.2-1.7x faster there, and one run 10 ms slow).
constexpr int SPINS_BEFORE_YIELD = 256;            // the default; ost_ffn_set_spins changes it
std::atomic<int> g_spins{SPINS_BEFORE_YIELD};

template <class Done> inline void spin_until(Done done) {
    for (int i = 0; !done(); ++i) {
        if (i < g_spins.load(std::memory_order_relaxed)) OST_PAUSE();
        else std::this_thread::yield();
    }
}

// Barrier of n threads that spin (then yield) while they wait; reusable at once (the last to arrive
// resets the count before it releases the others).
struct spin_barrier {
    alignas(64) std::atomic<int> arrived{0};
    alignas(64) std::atomic<uint64_t> phase{0};
    void wait(int n) {
        if (n <= 1) return;
        const uint64_t ph = phase.load(std::memory_order_acquire);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
            arrived.store(0, std::memory_order_relaxed);
            phase.fetch_add(1, std::memory_order_acq_rel);
        } else {
            spin_until([&] { return phase.load(std::memory_order_acquire) != ph; });
        }
    }
};

}  // namespace

struct ost_board;

struct ost_team {
    int n = 1;
    std::vector<std::thread> threads;
    std::mutex m;
    std::condition_variable cv;
    std::atomic<uint64_t> gen{0};          // one more per run
    std::atomic<bool> active{false};
    std::atomic<bool> quit{false};
    void (*fn)(void *, int, int) = nullptr;
    void * ctx = nullptr;
    spin_barrier barrier;
    // the kernel's work board (claims, no barriers; made at the first ost_ffn_run on this team)
    std::atomic<ost_board *> board{nullptr};
};

namespace {
// Whether the team's board has an item to claim, and working it (the kernel section below).
bool board_open(const ost_board * b);
void board_work(ost_board * b, int ith);
void board_free(ost_board * b);
}  // namespace

namespace {

bool board_has_work(const ost_team * t) {
    const ost_board * b = t->board.load(std::memory_order_acquire);
    return b && board_open(b);
}

void team_main(ost_team * t, int ith) {
    uint64_t seen = 0;
    for (;;) {
        // spin while a pass is in flight, sleep between passes
        for (int i = 0; t->gen.load(std::memory_order_acquire) == seen && !t->quit.load(std::memory_order_relaxed); ++i) {
            if (board_has_work(t)) {
                // the kernel's items: taken by whoever is here, nobody waits for a thread that is not
                board_work(t->board.load(std::memory_order_acquire), ith);
                i = 0;
                continue;
            }
            if (t->active.load(std::memory_order_relaxed)) {
                if (i < g_spins.load(std::memory_order_relaxed)) OST_PAUSE();
                else std::this_thread::yield();
                continue;
            }
            std::unique_lock<std::mutex> lk(t->m);
            t->cv.wait(lk, [&] {
                return t->gen.load(std::memory_order_acquire) != seen || t->quit.load() || t->active.load() ||
                       board_has_work(t);
            });
        }
        if (t->quit.load()) return;
        seen = t->gen.load(std::memory_order_acquire);
        t->fn(t->ctx, ith, t->n);
        ost_team_barrier(t);
    }
}

}  // namespace

ost_team * ost_team_new(int n) {
    auto * t = new ost_team();
    t->n = std::max(1, n);
    for (int i = 1; i < t->n; ++i) t->threads.emplace_back(team_main, t, i);
    return t;
}

void ost_team_free(ost_team * t) {
    if (!t) return;
    {
        std::lock_guard<std::mutex> lk(t->m);
        t->quit = true;
    }
    t->cv.notify_all();
    for (auto & th : t->threads) th.join();
    board_free(t->board.load());
    delete t;
}

int ost_team_size(const ost_team * t) { return t ? t->n : 1; }

void ost_team_set_active(ost_team * t, bool active) {
    if (!t || t->active.load() == active) return;
    {
        std::lock_guard<std::mutex> lk(t->m);
        t->active = active;
    }
    if (active) t->cv.notify_all();
}

void ost_team_barrier(ost_team * t) {
    if (t) t->barrier.wait(t->n);
}

void ost_team_run(ost_team * t, void (*fn)(void *, int, int), void * ctx) {
    if (!t || t->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    t->fn = fn;
    t->ctx = ctx;
    if (t->active.load(std::memory_order_relaxed)) {
        t->gen.fetch_add(1, std::memory_order_acq_rel);
    } else {
        {
            std::lock_guard<std::mutex> lk(t->m);
            t->gen.fetch_add(1, std::memory_order_acq_rel);
        }
        t->cv.notify_all();
    }
    fn(ctx, 0, t->n);
    ost_team_barrier(t);
}

namespace {

std::atomic<bool> g_phase_timing{false};

// ---------------------------------------------------------------------------------------------
// the work board: a run's items taken by claims, without barriers
//
// With barriers (run_phases on ost_team_run) every phase of a run waits for every thread of the team:
// one thread that the scheduler has taken off its core (it yielded while another thread was
// runnable there: the thread that launches the CUDA graph and waits for it, the HTTP server, an
// interrupt) holds the whole layer until it runs again, up to a time slice. On the board a run's
// phases are lists of items (tokens to quantise, the tiled experts' packs of them, chunks of
// gate/up rows, routes' activations, their packs, chunks of down rows) that whichever threads are
// on a core claim one at a time; the thread that completes a phase's last item opens the next
// phase that has items, the one that completes the last down chunk ends the run. A thread that is
// not running holds nothing (at most the one item it claimed), so the layer's time is its work
// over the threads that are there.
//
// One word says what can be claimed: (epoch, next item), epoch = run * 8 + phase, phase 7 = closed.
// A claim is a compare-and-swap of that word, so it succeeds only while the epoch it read is still
// open; the run's state (run_t, the totals) is written only while the word is closed and read only
// by a thread holding a claim of its epoch (until that item is counted done, which the run's end
// waits for). A late thread whose claim fails touches nothing.

constexpr int PH_CLOSED = 7;
constexpr int ITEM_BITS = 24;
constexpr uint64_t ITEM_MASK = (uint64_t(1) << ITEM_BITS) - 1;

inline uint64_t board_word(uint64_t epoch, uint64_t item) { return epoch << ITEM_BITS | item; }

std::atomic<bool> g_claims{true};   // the board (ost_ffn_set_claims); false: run_phases with barriers

}  // namespace

struct ost_board {
    run_t r;
    alignas(64) std::atomic<uint64_t> claim{board_word(PH_CLOSED, 0)};
    alignas(64) std::atomic<uint64_t> finished{0};   // the last run whose items are all done
    std::atomic<int64_t> total[PH_N] = {};
    struct alignas(64) counter { std::atomic<int64_t> v{0}; };
    counter done[PH_N];
    // phase timing: when each phase opened and closed, when each thread first took an item
    std::atomic<int64_t> t_open[PH_N] = {}, t_close[PH_N] = {};
    uint64_t run = 0;   // the worker's count of runs
    ost_team * team = nullptr;
};

namespace {

bool board_open(const ost_board * b) {
    const uint64_t c = b->claim.load(std::memory_order_acquire);
    const int ph = (int) ((c >> ITEM_BITS) & 7);
    return ph < PH_N && (int64_t) (c & ITEM_MASK) < b->total[ph].load(std::memory_order_relaxed);
}

// Opens a phase (stores the word); threads of an inactive team sleep on its condition variable, so
// they are woken (under its mutex: none of them misses the word between its check and its wait).
void board_publish(ost_board * b, uint64_t word) {
    ost_team * t = b->team;
    if (t->active.load(std::memory_order_relaxed)) {
        b->claim.store(word, std::memory_order_release);
        return;
    }
    {
        std::lock_guard<std::mutex> lk(t->m);
        b->claim.store(word, std::memory_order_release);
    }
    t->cv.notify_all();
}

// Takes the next item of the open phase: false when there is none (the phase's items are all taken,
// or the board is closed).
bool board_claim(ost_board * b, uint64_t & epoch, int64_t & item) {
    uint64_t c = b->claim.load(std::memory_order_acquire);
    for (;;) {
        const int ph = (int) ((c >> ITEM_BITS) & 7);
        // a total read after the word changed is another run's: the exchange below then fails
        if (ph >= PH_N || (int64_t) (c & ITEM_MASK) >= b->total[ph].load(std::memory_order_relaxed)) return false;
        if (b->claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
            epoch = c >> ITEM_BITS;
            item = (int64_t) (c & ITEM_MASK);
            return true;
        }
    }
}

void board_work(ost_board * b, int ith) {
    uint64_t epoch = 0;
    int64_t item = 0;
    while (board_claim(b, epoch, item)) {
        run_t & r = b->r;   // this run's state until the item is counted done
        const int ph = (int) (epoch & 7);
        if (r.timing && r.t_start[(size_t) ith] == 0) r.t_start[(size_t) ith] = now_ns();
        run_item(r, ph, item);
        const int64_t total = b->total[ph].load(std::memory_order_relaxed);
        if (b->done[ph].v.fetch_add(1, std::memory_order_acq_rel) + 1 != total) continue;
        // the phase's last item: open the next phase that has items (they follow in order; the
        // down rows always have some), or end the run
        if (r.timing) b->t_close[ph].store(now_ns(), std::memory_order_relaxed);
        if (ph == PH_DOWN) {
            b->finished.store(epoch >> 3, std::memory_order_release);
        } else {
            int next = ph + 1;
            while (b->total[next].load(std::memory_order_relaxed) == 0) ++next;
            if (r.timing) b->t_open[next].store(now_ns(), std::memory_order_relaxed);
            board_publish(b, board_word(epoch - ph + next, 0));
        }
    }
}

void board_free(ost_board * b) { delete b; }

// The run prepared in b->r on the board of b->team: the caller (thread 0) publishes it, works on it, and waits
// until its last item is done. False (the caller runs the barrier path) for a run of more items per
// phase than the word holds.
bool board_run(ost_board * b) {
    run_t & r = b->r;
    int64_t totals[PH_N];
    for (int ph = 0; ph < PH_N; ++ph) totals[ph] = phase_items(r, ph);
    for (int64_t x : totals) if (x > (int64_t) ITEM_MASK) return false;
    const uint64_t run = ++b->run;
    for (int ph = 0; ph < PH_N; ++ph) {
        b->total[ph].store(totals[ph], std::memory_order_relaxed);
        b->done[ph].v.store(0, std::memory_order_relaxed);
    }
    int first = 0;
    while (totals[first] == 0) ++first;   // the down rows have items
    if (r.timing) {
        for (int ph = 0; ph < PH_N; ++ph) { b->t_open[ph] = 0; b->t_close[ph] = 0; }
        b->t_open[first] = r.t_launch;
    }
    board_publish(b, board_word(run * 8 + first, 0));
    for (int i = 0; b->finished.load(std::memory_order_acquire) != run; ++i) {
        if (board_open(b)) { board_work(b, 0); i = 0; continue; }
        if (i < g_spins.load(std::memory_order_relaxed)) OST_PAUSE();
        else std::this_thread::yield();
    }
    // closed before the next run's state is written: a claim of this run read earlier now fails
    b->claim.exchange(board_word(run * 8 + PH_CLOSED, 0), std::memory_order_acq_rel);
    return true;
}

// A board run's phase timing in ost_ffn_stats' fields: each phase from its opening to the completion
// of its last item, the handoffs between phases as idle, the team's start as the mean delay to the
// first item of the other threads that took one.
void fill_board_timing(const ost_board * b, int64_t t0, int64_t t_end, ost_ffn_stats * st) {
    const run_t & r = b->r;
    if (!st || !r.timing) return;
    st->prepare_ns = r.t_launch - t0;
    st->total_ns = t_end - t0;
    int64_t wake = 0;
    int took = 0;
    for (int i = 1; i < r.nth; ++i) {
        if (!r.t_start[(size_t) i]) continue;
        wake += r.t_start[(size_t) i] - r.t_launch;
        took++;
    }
    st->wake_ns = took ? wake / took : 0;
    st->threads = took + 1;
    int64_t idle = 0, close = 0;
    for (int ph = 0; ph < PH_N; ++ph) {
        if (b->total[ph].load(std::memory_order_relaxed) == 0) continue;   // not run
        if (close) idle += b->t_open[ph] - close;
        *phase_stat(st, ph) += b->t_close[ph] - b->t_open[ph];
        close = b->t_close[ph];
    }
    st->idle_ns = idle;
}

}  // namespace

bool ost_ffn_run(ost_team * team, const ost_ffn_job & job, std::vector<uint8_t> & ws, ost_ffn_stats * st) {
    static thread_local run_t own;
    const int64_t t0 = g_phase_timing.load(std::memory_order_relaxed) ? now_ns() : 0;
    const int nth = ost_team_size(team);
    // a team's runs go on its board (made here, by its one caller) unless barriers are asked for
    ost_board * b = nullptr;
    if (nth > 1 && g_claims.load(std::memory_order_relaxed)) {
        b = team->board.load(std::memory_order_relaxed);
        if (!b) {
            b = new ost_board();
            b->team = team;
            team->board.store(b, std::memory_order_release);
        }
    }
    run_t & r = b ? b->r : own;
    bool empty = false;
    r.timing = false;
    if (!prepare(r, job, ws, nth, &empty)) return false;
    bool on_board = false;
    if (!empty) {
        r.nth = nth;
        r.timing = t0 != 0;
        if (r.timing) {
            r.t_start.assign((size_t) r.nth, 0);
            r.t_arrive.assign((size_t) PH_N * r.nth, 0);
            r.t_leave.assign((size_t) PH_N * r.nth, 0);
            r.t_launch = now_ns();
        }
        // (the barrier path below, where the board refuses the run, writes the same zeros again)
        if (b && job.zero_unrouted) zero_unrouted_rows(job, 0, 1);
        on_board = b && board_run(b);
        if (!on_board) {
            team_ctx c{ &r, team };
            ost_team_run(team, team_fn, &c);
        }
    } else if (job.zero_unrouted) {
        zero_unrouted_rows(job, 0, 1);
    }
    fill_stats(r, empty, st);
    if (!empty) {
        const int64_t t_end = r.timing ? now_ns() : 0;
        if (on_board) fill_board_timing(b, t0, t_end, st);
        else fill_timing(r, t0, t_end, st);
    }
    return true;
}

bool ost_ffn_set_claims(bool on) { return g_claims.exchange(on); }
int ost_ffn_set_prefetch_rows(int rows) { return g_prefetch_rows.exchange(std::max(0, rows)); }
bool ost_ffn_set_phase_timing(bool on) { return g_phase_timing.exchange(on); }
int ost_ffn_set_spins(int spins) { return g_spins.exchange(std::max(0, spins)); }
int ost_ffn_spins() { return g_spins.load(); }
bool ost_ffn_claims() { return g_claims.load(); }
int ost_ffn_prefetch_rows() { return g_prefetch_rows.load(); }

int32_t ost_ffn_tiled_rows(ggml_type up, ggml_type gate, ggml_type down) {
    // a type ost_gemm_rows serves is computed as ggml's tiled kernel computes it, from any count
    int32_t cap = INT32_MAX;
    for (ggml_type t : {up, gate, down}) {
        if (!ost_gemm_serves(t)) cap = std::min(cap, tiled_rows_of(t));
    }
    return cap;
}
