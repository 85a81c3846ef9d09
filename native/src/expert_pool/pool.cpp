// Expert engine: the expert pool (size classes, slots, index tables, its build) and the several-GPU
// check. See engine/engine.h.
#include "engine/engine.h"

#include <functional>

namespace ost {

namespace {
ggml_backend_dev_t pool_device(int gpu_index) {
    if (gpu_index >= 0) {
        int seen = 0;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t d = ggml_backend_dev_get(i);
            if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU) {
                if (seen++ == gpu_index) return d;
            }
        }
    }
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}
// Expert types whose GPU mul_mat_id of more than 8 rows runs MMQ, which patch 21 makes skip negative
// ids (ggml_cuda_should_use_mmq's list; on the GPUs MMQ serves for these types, compute capability 7.5
// and up). Other types (F16, BF16, F32) go to kernels that would read out of bounds: no pool views.
bool mmq_skips_negative_ids(ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q1_0: case GGML_TYPE_Q2_0:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S:
        case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_MXFP4: case GGML_TYPE_NVFP4:
            return true;
        default:
            return false;
    }
}
// The GPU that holds layer il's dense weights (its attention weights' buffer), or null when they are
// in host memory (partial offload, CPU build) or not found.
ggml_backend_dev_t dense_dev(const llama_model * model, int il) {
    const auto & L = model->layers[il];
    for (const ggml_tensor * t : {L.wq, L.wq_a, L.wqkv, L.wkv_a_mqa, L.attn_norm}) {
        if (!t || !t->buffer) continue;
        if (ggml_backend_buffer_is_host(t->buffer)) return nullptr;
        ggml_backend_dev_t d = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
        return d && ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU ? d : nullptr;
    }
    return nullptr;
}

// dense_dev as a GPU index (among the GPU devices, as "device" counts them, see pool_device); -1 if none.
int dense_gpu(const llama_model * model, int il) {
    ggml_backend_dev_t d = dense_dev(model, il);
    for (int g = 0; d != nullptr && g < (int) ggml_backend_dev_count(); ++g) {
        if (pool_device(g) == d) return g;
    }
    return -1;
}
}  // namespace

// Several GPUs (config with "layer_device"): each MoE layer's pool must be on the device where
// llama.cpp put the layer's dense weights (layer split), else every layer would move its hidden
// states between GPUs twice. Reads the device of the layer's attention weight buffer; a layer whose
// dense weights are in host memory (partial offload, CPU build) is not checked. Returns false with
// `err` naming the first layer that disagrees (the config is refused, nothing is adopted).
bool check_layer_devices(const llama_model * model, const engine_t * e, std::string & err) {
    for (int il = 0; il < e->n_layer; ++il) {
        const int pi = e->layer_pool[il];
        if (pi < 0) continue;
        ggml_backend_dev_t d = dense_dev(model, il);
        if (!d) continue;
        const pool_t & p = e->pools[pi];
        if (d != p.dev) {
            err = "layer " + std::to_string(il) + ": the residency set puts its experts on GPU " +
                  std::to_string(p.gpu) + " (" + p.name + ") but llama.cpp put its dense weights on " +
                  ggml_backend_dev_name(d) + "; load the model with split_mode LAYER and a tensor_split "
                  "that follows the set's per-GPU layer ranges (ExpertRuntime.adjust_model_params does)";
            return false;
        }
    }
    return true;
}

// Copies expert x of layer il (weights and biases) from its host tensors into `slot` of the class's
// pool tensors; synchronous.
void copy_expert(const llama_model * model, const size_class_t & c, int il, int x, int slot) {
    std::vector<uint8_t> tmp;   // only for experts outside host memory
    auto put = [&](const ggml_tensor * src, ggml_tensor * dst) {
        const int d = ggml_n_dims(src) >= 3 ? 2 : 1;   // weight slice or bias row
        const size_t nb = src->nb[d];
        // a slot's slice is contiguous; whole-expert slots stride the pool tensor by more than it
        GGML_ASSERT(dst->nb[d - 1] == src->nb[d - 1] && dst->nb[d] >= nb);
        if (src->buffer && ggml_backend_buffer_is_host(src->buffer)) {   // straight from (pinned) host memory
            ggml_backend_tensor_set(dst, (const char *) src->data + (size_t) x * nb, (size_t) slot * dst->nb[d], nb);
            return;
        }
        tmp.resize(nb);
        ggml_backend_tensor_get(src, tmp.data(), (size_t) x * nb, nb);
        ggml_backend_tensor_set(dst, tmp.data(), (size_t) slot * dst->nb[d], nb);
    };
    const auto & L = model->layers[il];
    for (auto [src, dst] : weight_parts(L, c.up, c.gate, c.down)) put(src, dst);
    for (auto [src, dst] : bias_parts(L, c.b_up, c.b_gate, c.b_down)) put(src, dst);
}

// Sets the slot stride (nb[2], and nb[3] after it) of class c's weight tensors: a whole slot with
// whole-expert slots, one matrix (ggml's contiguous layout) without.
static void set_slot_stride(size_class_t & c, bool whole) {
    const size_t slot_bytes = (c.gate ? 3 : 2) * c.up->nb[1] * (size_t) c.up->ne[1];
    for (ggml_tensor * t : {c.up, c.gate, c.down}) {
        if (!t) continue;
        t->nb[2] = whole ? slot_bytes : t->nb[1] * (size_t) t->ne[1];
        t->nb[3] = t->nb[2] * (size_t) t->ne[2];
    }
}

// Allocates pool p's tensors (index pi in e->pools) in one buffer of its device and places them:
// the tables, then per size class its weight tensors in the order of their host tensors' addresses
// (those of the class's first layer) at one pitch, when they hold the same bytes per expert, then the
// bias rows. llama.cpp's files put a layer's up, gate and down experts next to each other, so a slot's
// matrices sit at one pitch in the pool as the expert's do in host memory and stage_experts copies
// them with one 2D copy. The pitch is one class tensor, or with whole-expert slots (the weight tensors
// strided by a slot, see build_engine) one matrix: the tensors start one matrix apart and interleave.
// Falls back to ggml's sequential placement when the buffer type caps the size (several buffers; then
// without whole-expert slots). Null when the allocation fails.
static ggml_backend_buffer_t alloc_pool(engine_t * e, pool_t & p, int pi) {
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(p.dev);
    const size_t align = ggml_backend_buft_get_alignment(buft);
    auto room = [&](const ggml_tensor * t) { return GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), align); };
    std::vector<std::pair<ggml_tensor *, size_t>> at;   // tensor, offset
    size_t off = 0;
    auto place = [&](ggml_tensor * t) { if (t) { at.push_back({t, off}); off += room(t); } };
    place(p.table); place(p.scratch); place(p.pred); place(p.counts);
    for (const auto & c : e->classes) {
        if (c.pool != pi) continue;
        const auto & L = e->model->layers[c.members.front().first];
        std::vector<std::pair<const void *, ggml_tensor *>> w;   // host address of the first layer's part
        for (auto [src, dst] : weight_parts(L, c.up, c.gate, c.down)) w.push_back({src->data, dst});
        std::sort(w.begin(), w.end());
        if (c.whole_slots) {
            // part i of slot s at off + s * slot + i * matrix; then the room the last part's padding needs
            const size_t matrix = w[0].second->nb[2] / w.size();
            size_t pad = 0;
            for (size_t i = 0; i < w.size(); ++i) {
                at.push_back({w[i].second, off + i * matrix});
                pad = std::max(pad, room(w[i].second) - ggml_nbytes(w[i].second));
            }
            off += GGML_PAD((size_t) w[0].second->ne[2] * w[0].second->nb[2] + pad, align);
        } else {
            bool same = true;
            size_t pitch = 0;
            for (auto & [h, t] : w) { same = same && t->nb[2] == c.up->nb[2]; pitch = std::max(pitch, room(t)); }
            for (auto & [h, t] : w) {
                if (same) { at.push_back({t, off}); off += pitch; }
                else place(t);
            }
        }
        place(c.b_up); place(c.b_gate); place(c.b_down);
    }
    size_t n_tensors = 0;
    for (ggml_tensor * t = ggml_get_first_tensor(p.ctx); t; t = ggml_get_next_tensor(p.ctx, t)) n_tensors++;
    GGML_ASSERT(at.size() == n_tensors);   // every tensor of the pool's context is placed
    if (off > ggml_backend_buft_get_max_size(buft)) {
        // ggml places tensor after tensor: whole-expert slots would take a slot's room per part
        for (auto & c : e->classes) {
            if (c.pool != pi || !c.whole_slots) continue;
            c.whole_slots = false;
            set_slot_stride(c, false);
        }
        return ggml_backend_alloc_ctx_tensors_from_buft(p.ctx, buft);
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, std::max<size_t>(off, 1));
    if (!buf) return nullptr;
    char * base = (char *) ggml_backend_buffer_get_base(buf);
    for (auto [t, o] : at) {
        if (ggml_backend_tensor_alloc(buf, t, base + o) != GGML_STATUS_SUCCESS) {
            ggml_backend_buffer_free(buf);
            return nullptr;
        }
    }
    return buf;
}

// build_engine's phases, in order. A phase that refuses returns fail(why), which frees the engine.
using fail_fn = std::function<bool(const std::string &)>;
using pool_of_fn = std::function<int(int)>;   // a configured GPU index's pool (added on first use)

// Sizes the per-layer tables; checks the residency set's and layer map's layers and experts.
static bool check_config(engine_t * e, const config_t & cfg, const fail_fn & fail) {
    e->layers.resize(e->n_layer);
    e->hot.assign(e->n_layer, std::vector<uint8_t>(e->n_expert, 0));
    e->expert_bytes.assign(e->n_layer, 0);
    for (auto & kv : cfg.hot) {
        if (kv.first < 0 || kv.first >= e->n_layer) {
            return fail("residency set names layer " + std::to_string(kv.first) + " but the model has " +
                  std::to_string(e->n_layer) + " layers");
        }
        for (int x : kv.second) {
            if (x < 0 || x >= e->n_expert) {
                return fail("residency set names expert " + std::to_string(x) + " of layer " +
                      std::to_string(kv.first) + " but the model has " + std::to_string(e->n_expert) +
                      " experts");
            }
            e->hot[kv.first][x] = 1;
        }
    }
    for (auto & kv : cfg.layer_device) {
        if (kv.first < 0 || kv.first >= e->n_layer) {
            return fail("layer_device names layer " + std::to_string(kv.first) + " but the model has " +
                  std::to_string(e->n_layer) + " layers");
        }
    }
    return true;
}

// Gives each MoE layer its pool and, where it has hot experts of a supported layout, its size class.
static void assign_layers(engine_t * e, llama_model * model, const config_t & cfg, const pool_of_fn & pool_of,
                          std::vector<int> & layer_class) {
    for (int il = 0; il < e->n_layer && il < (int) model->layers.size(); ++il) {
        const auto & L = model->layers[il];
        if (!L.ffn_down_exps) continue;
        e->by_down[L.ffn_down_exps] = il;
        e->layers[il].il = il;
        {
            // without a layer map, a GPU config's pool follows the layer: where llama.cpp put the
            // layer's dense weights (its default split over every visible GPU), else `device`
            auto ld = cfg.layer_device.find(il);
            int gpu = cfg.device;
            if (ld != cfg.layer_device.end()) gpu = ld->second;
            else if (cfg.device >= 0 && cfg.layer_device.empty()) {
                const int g = dense_gpu(model, il);
                if (g >= 0) gpu = g;
            }
            const int pi = pool_of(gpu);
            e->layer_pool[il] = pi;
            e->pools[pi].layers.push_back(il);
        }
        const int64_t eb = (int64_t) L.ffn_down_exps->nb[2] + (L.ffn_up_exps ? (int64_t) L.ffn_up_exps->nb[2] : 0) +
                           (L.ffn_gate_exps ? (int64_t) L.ffn_gate_exps->nb[2] : 0) +
                           (L.ffn_gate_up_exps ? (int64_t) L.ffn_gate_up_exps->nb[2] : 0);
        e->expert_bytes[il] = eb;
        int n_hot_l = 0;
        for (int x = 0; x < e->n_expert; ++x) n_hot_l += e->hot[il][x];
        if (n_hot_l == 0) continue;
        const ggml_tensor * up = up_src(L), * up_b = up_b_src(L);
        const bool merged = L.ffn_gate_up_exps != nullptr;
        const bool biases = up_b || L.ffn_gate_exps_b || L.ffn_down_exps_b;
        const bool biases_ok = !biases || (up_b && L.ffn_down_exps_b &&
            (L.ffn_gate_exps_b != nullptr) == (L.ffn_gate_exps != nullptr) &&
            up_b->type == GGML_TYPE_F32 && L.ffn_down_exps_b->type == GGML_TYPE_F32 &&
            (!L.ffn_gate_exps_b || L.ffn_gate_exps_b->type == GGML_TYPE_F32));
        // per-expert weight scales are indexed by expert id, which the pool's slot ids are not
        const bool scales = L.ffn_up_exps_s || L.ffn_gate_exps_s || L.ffn_down_exps_s;
        const char * unsupported = !up ? "no up or gate_up expert tensor"
                                 : (merged && L.ffn_gate_exps) ? "merged gate_up beside a separate gate"
                                 : !biases_ok ? "a partial set of expert biases"
                                 : scales ? "per-expert weight scales" : nullptr;
        if (unsupported) {
            // the layer runs stock (all cold, counted); one note per layout
            const std::string note = std::string("expert layout not supported (") + unsupported + "): runs stock";
            if (std::find(e->notes.begin(), e->notes.end(), note) == e->notes.end()) {
                e->notes.push_back(note);
                LLAMA_LOG_WARN("ostinato: layer %d and others like it: %s\n", il, note.c_str());
            }
            std::fill(e->hot[il].begin(), e->hot[il].end(), 0);
            continue;
        }
        size_class_t c{};
        c.pool = e->layer_pool[il];
        c.t_up = up->type; c.up0 = up->ne[0]; c.up1 = up->ne[1];
        c.merged = merged;
        c.has_gate = L.ffn_gate_exps != nullptr;
        c.t_gate = c.has_gate ? L.ffn_gate_exps->type : GGML_TYPE_F32;
        c.t_down = L.ffn_down_exps->type; c.down0 = L.ffn_down_exps->ne[0]; c.down1 = L.ffn_down_exps->ne[1];
        c.has_bias = biases;
        int ci = -1;
        for (size_t i = 0; i < e->classes.size(); ++i) if (e->classes[i] == c) { ci = (int) i; break; }
        if (ci < 0) { e->classes.push_back(c); ci = (int) e->classes.size() - 1; }
        for (int x = 0; x < e->n_expert; ++x) if (e->hot[il][x]) e->classes[ci].members.push_back({il, x});
        e->classes[ci].n_stage = std::max(e->classes[ci].n_stage, e->n_expert - n_hot_l);
        layer_class[il] = ci;
        e->layers[il].has_hot = true;
    }
}

// Finds the pools' devices (checked against the layer map) and pins the host experts.
static bool open_devices(engine_t * e, llama_model * model, const config_t & cfg, const pool_of_fn & pool_of,
                         std::string & err, const fail_fn & fail) {
    for (int il = 0; il < e->n_layer; ++il) {
        const auto & L = model->layers[il];
        if (L.ffn_down_exps && L.ffn_down_exps->buffer) {
            e->host_buffer = ggml_backend_buffer_name(L.ffn_down_exps->buffer);
            break;
        }
    }
    if (e->pools.empty()) pool_of(cfg.device);
    for (auto & p : e->pools) {
        p.dev = pool_device(p.gpu);
        if (!p.dev) return fail("no backend device for the expert pool");
        p.name = ggml_backend_dev_name(p.dev);
        if (!cfg.layer_device.empty() && p.gpu >= 0 && ggml_backend_dev_type(p.dev) == GGML_BACKEND_DEVICE_TYPE_CPU &&
            ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) != nullptr) {
            // several GPUs named on a GPU build: a missing GPU is an error, not a CPU pool (a
            // CPU-only build puts every pool in a CPU buffer, which is what CI tests)
            return fail("the residency set names GPU " + std::to_string(p.gpu) + " but this machine has no such GPU");
        }
    }
    e->pool_device = e->pools[0].name;
    if (!cfg.layer_device.empty() && !check_layer_devices(model, e, err)) return fail(err);
    {
        // host experts are pinned once per model; cudaHostRegisterPortable makes them pinned for
        // every device, so the first GPU pool's backend does it for all pools
        ggml_backend_dev_t pin_dev = e->pools[0].dev;
        for (auto & p : e->pools) {
            if (ggml_backend_dev_type(p.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) { pin_dev = p.dev; break; }
        }
        pin_experts(model, pin_dev);
    }
    return true;
}

// Makes the pools' tensors (tables, per size class its slots) and sets each layer's slots in them.
static void lay_out_pools(engine_t * e, const std::vector<int> & layer_class) {
    for (auto & c : e->classes) e->pools[c.pool].n_classes++;
    for (auto & p : e->pools) {
        const size_t n_tensors = 6 * (size_t) p.n_classes + 5;   // up, gate, down + their bias rows; tables
        ggml_init_params ip = { ggml_tensor_overhead() * n_tensors, nullptr, true };
        p.ctx = ggml_init(ip);
        if (!p.layers.empty()) {
            p.table = ggml_new_tensor_2d(p.ctx, GGML_TYPE_I32, e->n_expert, e->n_layer);
            p.scratch = ggml_new_tensor_2d(p.ctx, GGML_TYPE_I32, OSTINATO_SCRATCH, e->n_layer);
            p.pred = ggml_new_tensor_1d(p.ctx, GGML_TYPE_F32, e->n_expert);
            p.counts = ggml_new_tensor_3d(p.ctx, GGML_TYPE_I32, e->n_expert, e->n_layer, 2);
            p.counts_seen.assign((size_t) ggml_nelements(p.counts), 0);   // the buffer is cleared below
        }
    }
    for (auto & c : e->classes) {
        // hot slots, k zero slots, then the upload path's staging slots (preallocated here)
        ggml_context * ctx = e->pools[c.pool].ctx;
        // prefetch depth d: d + 1 staging regions, layer il stages in region il % (d + 1) in pool-view
        // passes (the copies for the next d layers never land in a region a layer still reads)
        const int64_t n_slots = (int64_t) c.members.size() + e->k + c.n_stage * (e->opts.prefetch_depth + 1);
        c.up = ggml_new_tensor_3d(ctx, c.t_up, c.up0, c.up1, n_slots);
        if (c.has_gate) c.gate = ggml_new_tensor_3d(ctx, c.t_gate, c.up0, c.up1, n_slots);
        c.down = ggml_new_tensor_3d(ctx, c.t_down, c.down0, c.down1, n_slots);
        // whole-expert slots: where the weight parts hold the same bytes per expert (then their stride,
        // a whole slot, is a multiple of each part's block size)
        c.whole_slots = e->opts.pool_whole_expert_slots && c.up->nb[2] == c.down->nb[2] && (!c.gate || c.gate->nb[2] == c.up->nb[2]);
        if (c.whole_slots) set_slot_stride(c, true);
        if (c.has_bias) {
            c.b_up = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.up1, n_slots);
            if (c.has_gate) c.b_gate = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.up1, n_slots);
            c.b_down = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.down1, n_slots);
        }
    }
    for (int il = 0; il < e->n_layer; ++il) {
        if (!e->layers[il].has_hot) continue;
        auto & l = e->layers[il];
        auto & c = e->classes[layer_class[il]];
        l.up_pool = c.up; l.gate_pool = c.gate; l.down_pool = c.down;
        l.up_b_pool = c.b_up; l.gate_b_pool = c.b_gate; l.down_b_pool = c.b_down;
        l.zero0 = (int) c.members.size();
        l.stage0 = l.zero0 + e->k;
        l.n_stage = c.n_stage;
        l.view_stage0 = l.stage0 + (il % (e->opts.prefetch_depth + 1)) * c.n_stage;
        // members are in (layer, expert) order: the layer's hot slots are one run, in expert order
        l.hot0 = -1; l.n_hot = 0;
        for (size_t s = 0; s < c.members.size(); ++s) {
            if (c.members[s].first != il) continue;
            if (l.hot0 < 0) l.hot0 = (int) s;
            l.n_hot++;
        }
        const bool on_cpu = ggml_backend_dev_type(e->pools[c.pool].dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
        l.views = on_cpu || (mmq_skips_negative_ids(c.t_up) && mmq_skips_negative_ids(c.t_down) &&
                             (!c.has_gate || mmq_skips_negative_ids(c.t_gate)));
    }
}

// Allocates each pool's buffer (cleared) and, on a GPU, its copy streams and prefetch events.
static bool alloc_pools(engine_t * e, const fail_fn & fail) {
    for (size_t pi = 0; pi < e->pools.size(); ++pi) {
        pool_t & p = e->pools[pi];
        if (p.n_classes == 0 && p.layers.empty()) continue;
        p.buf = alloc_pool(e, p, (int) pi);
        if (!p.buf) {
            return fail(std::string("cannot allocate the expert pool on ") + p.name);
        }
        ggml_backend_buffer_set_usage(p.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(p.buf, 0);   // zero slots (and any padding) are all-zero
        if (ggml_backend_buffer_is_host(p.buf)) p.set_2d = set_2d_host;
        p.bytes = (int64_t) ggml_backend_buffer_get_size(p.buf);
        e->pool_bytes += p.bytes;
        if (ggml_backend_dev_type(p.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            // a stream of our own per device for the upload path's copies (joined at the end of
            // each upload op)
            p.upload_backend = ggml_backend_dev_init(p.dev, nullptr);
            p.set_2d = (set_2d_fn) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(p.dev),
                                                                     "ggml_backend_set_2d_async");
            if (e->opts.prefetch_depth > 0) {
                // predicted copies on a stream of their own: a layer's misses never queue behind
                // the copies predicted for the layers after it; an event per layer joins its copies
                p.prefetch_backend = ggml_backend_dev_init(p.dev, nullptr);
                p.pf_event.assign(e->n_layer, nullptr);
                bool events = p.prefetch_backend != nullptr;
                for (int il : p.layers) events = events && (p.pf_event[il] = ggml_backend_event_new(p.dev)) != nullptr;
                if (!events) {
                    // a device without events: the predicted copies go on the upload stream,
                    // which each upload op joins whole
                    for (auto & ev : p.pf_event) if (ev) ggml_backend_event_free(ev);
                    p.pf_event.clear();
                    if (p.prefetch_backend) ggml_backend_free(p.prefetch_backend);
                    p.prefetch_backend = nullptr;
                }
            }
        }
    }
    return true;
}

// Makes the all-resident layers' leaves over their hot slots.
static void make_resident_leaves(engine_t * e) {
    // all-resident layers: leaves over their hot slots (see ostinato_moe_layer::resident)
    for (int il = 0; il < e->n_layer; ++il) {
        auto & l = e->layers[il];
        if (!l.has_hot || l.n_hot != e->n_expert) continue;
        pool_t & p = e->pools[e->layer_pool[il]];
        if (!p.resident_ctx) {
            ggml_init_params ip = { ggml_tensor_overhead() * 6 * (size_t) e->n_layer, nullptr, true };
            p.resident_ctx = ggml_init(ip);
        }
        ggml_tensor * pool[6] = { l.up_pool, l.gate_pool, l.down_pool, l.up_b_pool, l.gate_b_pool, l.down_b_pool };
        static const char * part[6] = { "up", "gate", "down", "up_b", "gate_b", "down_b" };
        for (int i = 0; i < 6; ++i) {
            ggml_tensor * t = pool[i];
            if (!t) continue;
            const int d = i < 3 ? 2 : 1;   // the slot dimension: experts of a weight, rows of a bias
            ggml_tensor * r = d == 2 ? ggml_new_tensor_3d(p.resident_ctx, t->type, t->ne[0], t->ne[1], l.n_hot)
                                     : ggml_new_tensor_2d(p.resident_ctx, t->type, t->ne[0], l.n_hot);
            GGML_ASSERT(r->nb[d - 1] == t->nb[d - 1] && r->nb[d] <= t->nb[d]);
            for (int j = d; j < GGML_MAX_DIMS; ++j) r->nb[j] = j == d ? t->nb[d] : r->nb[j - 1] * r->ne[j - 1];
            r->buffer = t->buffer;
            r->data = (char *) t->data + (size_t) l.hot0 * t->nb[d];
            ggml_format_name(r, "ostinato.blk.%d.resident_%s", il, part[i]);
            l.resident[i] = r;
        }
    }
}

// Copies the hot experts into their slots and fills the index tables.
static void fill_pools(engine_t * e, llama_model * model, const std::vector<int> & layer_class) {
    // copy hot experts into their slots; fill the index table
    e->slot.assign(e->n_layer, std::vector<int32_t>(e->n_expert, -1));
    e->layer_class = layer_class;
    for (auto & c : e->classes) c.borrowed.assign(c.n_stage, {-1, -1});
    for (auto & c : e->classes) {
        for (size_t s = 0; s < c.members.size(); ++s) {
            const auto [il, x] = c.members[s];
            copy_expert(model, c, il, x, (int) s);
            e->slot[il][x] = (int32_t) s;
            e->n_hot++;
            e->pools[c.pool].n_hot++;
        }
    }
    for (auto & p : e->pools) {   // the decode graph's index tables, one row per layer of the pool
        if (!p.table) continue;
        std::vector<int32_t> rows((size_t) e->n_layer * e->n_expert, -1);
        for (int il : p.layers) {
            if (!e->layers[il].has_hot) continue;
            std::copy(e->slot[il].begin(), e->slot[il].end(), rows.begin() + (size_t) il * e->n_expert);
        }
        ggml_backend_tensor_set(p.table, rows.data(), 0, rows.size() * sizeof(int32_t));
    }
}

// Sets up the counters (kept across a residency switch), prefetch state and 2D copy layouts.
static void init_state(engine_t * e, llama_model * model) {
    const size_t nle = (size_t) e->n_layer * e->n_expert;
    totals_init(e->total, nle);
    totals_init(e->request, nle);
    if (g_eng && g_eng->model == model) {   // residency switch: keep the counters
        flush_counts(g_eng);   // the old pool's count tables go with it
        e->total = g_eng->total;
        e->request = g_eng->request;
        e->last = g_eng->last;
        for (size_t i = 0; i < e->pools.size() && i < g_eng->pools.size(); ++i) {
            e->pools[i].routes = g_eng->pools[i].routes;
            e->pools[i].hot_routes = g_eng->pools[i].hot_routes;
        }
    }
    e->prefetch = e->opts.prefetch_depth;
    e->pf_slot.assign(e->n_layer, std::vector<int32_t>(e->n_expert, -1));
    e->pf_ran.assign(e->n_layer, 0);
    e->pf_pending.assign(e->n_layer, 0);
    e->cold_seen.assign(nle, 0);
    e->cpu_use.assign(nle, 0.0f);
    e->mark_us.assign(e->n_layer, 0);
    e->rows_2d.assign(e->n_layer, rows_2d_t());
    for (int il = 0; il < e->n_layer; ++il) if (e->layers[il].has_hot) e->rows_2d[il] = layout_2d(e, il);
}

bool build_engine(llama_model * model, const config_t & cfg, const ostinato_engine_options & opts, std::string & err) {
    auto * e = new engine_t();
    e->opts = opts;
    auto fail = [&](const std::string & why) { err = why; free_engine(e); return false; };
    e->model = model;
    e->n_layer = (int) model->layers.size();
    e->n_expert = (int) model->hparams.n_expert;
    e->k = (int) model->hparams.n_expert_used();
    if (e->n_expert <= 0 || e->k <= 0) {
        return fail("model has no routed experts (dense model): run stock");
    }
    if (!check_config(e, cfg, fail)) return false;
    // one pool per device in use, in order of first use by the layers (one-device config: one pool)
    e->layer_pool.assign(e->n_layer, -1);
    auto pool_of = [&](int gpu) {
        for (size_t i = 0; i < e->pools.size(); ++i) if (e->pools[i].gpu == gpu) return (int) i;
        pool_t p;
        p.gpu = gpu;
        e->pools.push_back(p);
        return (int) e->pools.size() - 1;
    };
    // size classes over the layers that have hot experts and a supported expert layout
    std::vector<int> layer_class(e->n_layer, -1);
    assign_layers(e, model, cfg, pool_of, layer_class);
    if (!open_devices(e, model, cfg, pool_of, err, fail)) return false;
    lay_out_pools(e, layer_class);
    if (!alloc_pools(e, fail)) return false;
    make_resident_leaves(e);
    fill_pools(e, model, layer_class);
    init_state(e, model);
    free_engine(g_eng);
    g_eng = e;
    g_graph_dirty = true;
    return true;
}


}  // namespace ost
