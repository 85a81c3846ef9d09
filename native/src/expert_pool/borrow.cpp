// The borrowed decode slots: staging slots lent to the cold experts decode computes most on the CPU.
#include "engine/engine.h"

#include <functional>

namespace ost {

// Sets one entry of the decode graph's index table (device memory of the layer's pool).
void set_table(engine_t * e, int il, int x, int32_t v) {
    const int pi = e->layer_pool[il];
    if (pi < 0 || !e->pools[pi].table) return;
    ggml_backend_tensor_set(e->pools[pi].table, &v, ((size_t) il * e->n_expert + x) * sizeof(int32_t), sizeof(int32_t));
}

// Borrowed decode memory (docs/engine.md): during decode, the staging slots that the upload path
// reserves for the largest prefill hold extra experts, the cold ones the CPU branch computed most
// often lately (a count of decode CPU uses that decays per step). Promotions happen at token
// boundaries, both branches' index tables together (host slot map and the device table); every
// borrowed slot is handed back before a pass that takes the upload path.
constexpr float BORROW_DECAY    = 0.98f;   // per decode step: a use counts half after ~34 steps
constexpr float BORROW_MIN_USES = 2.0f;    // decayed uses before an expert is promoted
constexpr int   BORROW_EVERY    = 8;       // decode steps between promotion rounds
constexpr int   BORROW_PER_ROUND = 2;      // promotions per round (each copies one expert)

void borrow_release(engine_t * e) {
    for (auto & c : e->classes) {
        for (auto & b : c.borrowed) {
            if (b.first < 0) continue;
            e->slot[b.first][b.second] = -1;
            set_table(e, b.first, b.second, -1);
            b = {-1, -1};
            e->handbacks++;
        }
    }
}

void borrow_step(engine_t * e) {
    if (++e->decode_steps % BORROW_EVERY) return;
    const float decay = std::pow(BORROW_DECAY, (float) BORROW_EVERY);
    for (auto & u : e->cpu_use) u *= decay;
    std::vector<std::pair<float, size_t>> cand;
    for (size_t idx = 0; idx < e->cpu_use.size(); ++idx) {
        if (e->cpu_use[idx] < BORROW_MIN_USES) continue;
        const int il = (int) (idx / e->n_expert), x = (int) (idx % e->n_expert);
        const int ci = e->layer_class[il];
        if (ci < 0 || e->slot[il][x] >= 0 || e->classes[ci].borrowed.empty()) continue;
        cand.push_back({e->cpu_use[idx], idx});
    }
    const size_t n = std::min(cand.size(), (size_t) BORROW_PER_ROUND);
    std::partial_sort(cand.begin(), cand.begin() + n, cand.end(), std::greater<>());
    for (size_t i = 0; i < n; ++i) {
        const int il = (int) (cand[i].second / e->n_expert), x = (int) (cand[i].second % e->n_expert);
        auto & c = e->classes[e->layer_class[il]];
        int j = -1;
        float low = 0;
        for (size_t q = 0; q < c.borrowed.size(); ++q) {   // a free slot, else the least used borrowed one
            if (c.borrowed[q].first < 0) { j = (int) q; break; }
            const float u = e->cpu_use[(size_t) c.borrowed[q].first * e->n_expert + c.borrowed[q].second];
            if (j < 0 || u < low) { j = (int) q; low = u; }
        }
        if (j < 0) continue;
        auto & b = c.borrowed[j];
        if (b.first >= 0) {
            // overwriting a lent slot is safe here: the previous pass's output was read (sampling
            // syncs the GPU) before this pass begins, so no kernel still reads the slot
            if (cand[i].first < 2 * low) continue;   // hysteresis: replace only a clearly colder one
            e->slot[b.first][b.second] = -1;
            set_table(e, b.first, b.second, -1);
            e->handbacks++;
        }
        const int slot = e->layers[il].stage0 + j;
        copy_expert(e->model, c, il, x, slot);
        b = {il, x};
        e->slot[il][x] = slot;
        set_table(e, il, x, slot);
        e->promotions++;
    }
}

}  // namespace ost
