// The C API (ctypes), the options' check and apply (reconfigure), and the model load/free hooks.

#include "engine/engine.h"
#include "cpu_branch/kernel.h"
#include "cpu_branch/dot.h"
#include "paths/hybrid_split.h"

using namespace ost;

namespace ost {

// the placement of the model load running on this thread (ostinato_model_load), else null: the
// config travels with the load call, as tensor_buft_overrides do, not through a global
thread_local const config_t * t_load_cfg = nullptr;
// the options of that load (ostinato_model_load), likewise
thread_local const ostinato_engine_options * t_load_opts = nullptr;

}  // namespace ost

namespace {

// The CPU branch's thread team (process-wide: one kernel, one team per pool) takes the options'
// spins, claims, prefetch distance and row pairs.
void set_team(const ostinato_engine_options & o) {
    ost_ffn_set_spins(o.cpu_branch_spins);
    ost_ffn_set_claims(o.cpu_branch_claims != 0);
    ost_ffn_set_prefetch_rows(o.cpu_branch_prefetch_rows);
    ost_dot_set_mode(o.cpu_branch_row_pairs);
}

// Builds the engine for `model` with `cfg` and `opts` (a load or a switch); false with g_err set on refusal.
bool adopt(llama_model * model, const config_t & cfg, const ostinato_engine_options & opts) {
    std::string err;
    const int64_t t0 = now_us();
    bool ok;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_dgraph_broken = false;
        ok = build_engine(model, cfg, opts, err);
        if (!ok) g_err = err;
        else set_team(opts);
    }
    if (!ok) {
        LLAMA_LOG_ERROR("ostinato: %s\n", err.c_str());
        return false;
    }
    LLAMA_LOG_INFO("ostinato: expert pool on %s: %lld hot experts, %zu size classes, %.1f MiB, %.1f ms; "
                   "cold experts in %s\n",
                   g_eng->pool_device.c_str(), (long long) g_eng->n_hot, g_eng->classes.size(),
                   g_eng->pool_bytes / 1048576.0, (now_us() - t0) / 1000.0, g_eng->host_buffer.c_str());
    if (g_eng->pools.size() > 1) {
        for (const auto & p : g_eng->pools) {
            LLAMA_LOG_INFO("ostinato:   pool of GPU %d on %s: %zu MoE layers, %lld hot experts, %d size classes, "
                           "%.1f MiB\n", p.gpu, p.name.c_str(), p.layers.size(), (long long) p.n_hot,
                           p.n_classes, p.bytes / 1048576.0);
        }
    }
    return true;
}

// Parses the JSON placement config (see ostinato.h); false with `err` on bad input.
bool parse_config(const char * js, config_t & c, std::string & err) {
    try {
        json j = json::parse(js);
        c = config_t();
        c.set = true;
        if (j.contains("hot")) {
            for (auto & kv : j["hot"].items()) {
                c.hot[std::stoi(kv.key())] = kv.value().get<std::vector<int>>();
            }
        }
        c.device = j.value("device", -1);
        if (j.contains("layer_device") && !j["layer_device"].is_null()) {
            for (auto & kv : j["layer_device"].items()) {
                const int d = kv.value().get<int>();
                if (d < -1) throw std::runtime_error("layer_device values must be GPU indices (>= 0) or -1");
                c.layer_device[std::stoi(kv.key())] = d;
            }
        }
        c.np = j.value("prefill_threshold", (int64_t) -1);   // absent: the options'
        if (j.contains("prefill_threshold") && c.np < 1) throw std::runtime_error("prefill_threshold must be >= 1");
        const std::string f = j.value("force_path", std::string());
        if (f.empty()) c.force = -1;
        else if (f == "auto") c.force = FORCE_AUTO;
        else if (f == "split") c.force = FORCE_SPLIT;
        else if (f == "upload") c.force = FORCE_UPLOAD;
        else throw std::runtime_error("force_path must be auto, split or upload");
        return true;
    } catch (const std::exception & ex) {
        err = std::string("bad expert config: ") + ex.what();
        return false;
    }
}

// Options `o` with the Np and forced path a config names.
ostinato_engine_options with_config(ostinato_engine_options o, const config_t & c) {
    if (c.np > 0) o.prefill_threshold = c.np;
    if (c.force >= 0) o.force_path = c.force;
    return o;
}

// Empty when `o` is valid, else what is wrong with it (the field's name first).
std::string check_options(const ostinato_engine_options & o) {
    auto bad = [](const char * f, const char * want) { return std::string(f) + " must be " + want; };
    if (o.prefill_threshold < 1) return bad("prefill_threshold", ">= 1");
    if (o.force_path < FORCE_AUTO || o.force_path > FORCE_UPLOAD) return bad("force_path", "0 (auto), 1 (split) or 2 (upload)");
    if (o.decode_graph < -1 || o.decode_graph > 1) return bad("decode_graph", "-1 (auto), 0 or 1");
    if (o.decode_graph_max_tokens < 1 || o.decode_graph_max_tokens > 4096) return bad("decode_graph_max_tokens", "1..4096");
    if (o.cpu_threads < 0) return bad("cpu_threads", ">= 0");
    if (o.hybrid_rows < 1 || o.hybrid_rows > 4096) return bad("hybrid_rows", "1..4096");
    if (!(o.upload_cpu_share >= 0 && o.upload_cpu_share <= 1) && o.upload_cpu_share != -1) {
        return bad("upload_cpu_share", "0..1 or -1 (adapted)");
    }
    if (!std::isfinite(o.cpu_split_alpha_us) || !std::isfinite(o.cpu_split_cpu_gbps) || !std::isfinite(o.cpu_split_h2d_gbps) ||
        o.cpu_split_alpha_us < 0 || o.cpu_split_cpu_gbps < 0 || o.cpu_split_h2d_gbps < 0 ||
        (o.cpu_split_cpu_gbps > 0) != (o.cpu_split_h2d_gbps > 0)) {
        return bad("cpu_split_*", "finite, >= 0, both bandwidths > 0 or both 0");
    }
    if (o.prefetch_depth < 0 || o.prefetch_depth > OSTINATO_PREFETCH_MAX_DEPTH) return bad("prefetch_depth", "0..2");
    if (o.decode_prefetch_experts < 0 || o.decode_prefetch_experts > OSTINATO_STAGE_MAX) return bad("decode_prefetch_experts", "0..16");
    if (o.decode_prefetch_copy_blocks < 1 || o.decode_prefetch_copy_blocks > OST_COPY_BLOCKS_MAX) {
        return bad("decode_prefetch_copy_blocks", "1..1024");
    }
    if (o.cpu_branch_prefetch_rows < 0 || o.cpu_branch_prefetch_rows > OST_PREFETCH_ROWS_MAX) return bad("cpu_branch_prefetch_rows", "0..64");
    if (o.cpu_branch_row_pairs < OST_DOT_OFF || o.cpu_branch_row_pairs > OST_DOT_AVX512) return bad("cpu_branch_row_pairs", "0, 1 or 2");
    if (o.cpu_branch_spins < 0) return bad("cpu_branch_spins", ">= 0");
    return "";
}

// The one place that decides what a change of engine e's options from e->opts to `n` needs (between
// passes; caller holds g_mu). Cached graphs hold the path choice, timing markers, the branch order,
// pool views, the all-resident path, the CPU-branch jobs (matched at graph build) and the hybrid
// pass's CPU branch and shape: those rebuild. The decode graph captures its max tokens (mailbox), CPU
// threads (pool), decode prefetch (staging, predictions) and copy blocks (a CUDA graph's launch shape):
// freed, made anew at the next pass. The team takes its settings now. The pool's layout
// (prefetch_depth, pool_whole_expert_slots) is read at its next build (load or residency switch);
// borrow, copy_2d and the split's costs are read at each pass or copy.
void apply_options(engine_t * e, const ostinato_engine_options & n) {
    const ostinato_engine_options & w = e->opts;
    const bool graphs = n.prefill_threshold != w.prefill_threshold || n.force_path != w.force_path ||
                        n.timing != w.timing || n.decode_overlap != w.decode_overlap ||
                        n.decode_graph != w.decode_graph || n.pool_views != w.pool_views ||
                        n.resident_path != w.resident_path || n.cpu_branch_kernel != w.cpu_branch_kernel ||
                        hybrid_on(n) != hybrid_on(w) || n.hybrid_rows != w.hybrid_rows;
    const bool dgraph = n.decode_graph_max_tokens != w.decode_graph_max_tokens || n.cpu_threads != w.cpu_threads ||
                        n.decode_prefetch_experts != w.decode_prefetch_experts ||
                        n.decode_prefetch_copy_blocks != w.decode_prefetch_copy_blocks;
    if (dgraph && e->dg) {
        ost_dg_free(e->dg);
        e->dg = nullptr;
        g_graph_dirty = true;   // its ops point into the old mailbox
    }
    if (graphs) g_graph_dirty = true;
    e->opts = n;
    ost_dg_set_ffn_kernel(e->dg, n.cpu_branch_kernel != 0);
    set_team(n);
}

}  // namespace

bool ostinato_on_model_loaded(llama_model * model) {
    if (!t_load_cfg) return true;   // a stock load
    return adopt(model, *t_load_cfg, t_load_opts ? *t_load_opts : ostinato_engine_options{});
}

bool ostinato_keep_on_host(const char * name) {
    if (!name || std::strncmp(name, "blk.", 4) != 0 || !std::strstr(name, "_exps.")) return false;
    return t_load_cfg != nullptr;
}

void ostinato_on_model_free(llama_model * model) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_eng && g_eng->model == model) {
        free_engine(g_eng);
        g_eng = nullptr;
    }
    if (g_pin.model == model) unpin(g_pin);
}

// ---------------------------------------------------------------------------------------------
// C API (ctypes)

extern "C" {

int ostinato_experts_check(const char * js) {
    config_t c;
    std::string err;
    const bool ok = parse_config(js ? js : "", c, err);
    std::lock_guard<std::mutex> lock(g_mu);
    g_err = ok ? "" : err;
    return ok ? 0 : -1;
}

struct llama_model * ostinato_model_load(const char * path, struct llama_model_params params, const char * js,
                                         const struct ostinato_engine_options * opts) {
    if (!js || !*js) return llama_model_load_from_file(path, params);
    config_t c;
    std::string err;
    const ostinato_engine_options base = opts ? *opts : ostinato_engine_options{};
    if (parse_config(js, c, err)) err = check_options(base);
    if (!err.empty()) {
        std::lock_guard<std::mutex> lock(g_mu);
        g_err = err;
        return nullptr;
    }
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_err.clear();
    }
    const ostinato_engine_options o = with_config(base, c);
    t_load_cfg = &c;   // read by the loader hooks of this load (this thread) only
    t_load_opts = &o;
    llama_model * model = llama_model_load_from_file(path, params);
    t_load_cfg = nullptr;
    t_load_opts = nullptr;
    return model;
}

int ostinato_experts_switch(const char * js, const struct ostinato_engine_options * opts) {
    llama_model * model;
    ostinato_engine_options base;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (!g_eng) { g_err = "no model with an active expert engine"; return -1; }
        model = g_eng->model;
        base = opts ? *opts : g_eng->opts;
    }
    config_t c;
    std::string err;
    if (parse_config(js ? js : "", c, err)) err = check_options(base);
    if (!err.empty()) {
        std::lock_guard<std::mutex> lock(g_mu);
        g_err = err;
        return -1;
    }
    return adopt(model, c, with_config(base, c)) ? 0 : -1;
}

int ostinato_experts_active(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_eng != nullptr ? 1 : 0;
}

const char * ostinato_experts_last_error(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    return g_err.c_str();
}

void ostinato_engine_options_default(struct ostinato_engine_options * out) {
    if (out) *out = ostinato_engine_options{};
}

int ostinato_engine_options_size(void) { return (int) sizeof(ostinato_engine_options); }

int ostinato_experts_options(struct ostinato_engine_options * out) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) { g_err = "no model with an active expert engine"; return -1; }
    if (out) *out = g_eng->opts;
    return 0;
}

int ostinato_experts_reconfigure(const struct ostinato_engine_options * o) {
    const std::string err = o ? check_options(*o) : "no options";
    std::lock_guard<std::mutex> lock(g_mu);
    if (!err.empty()) { g_err = "bad engine options: " + err; return -1; }
    if (!g_eng) { g_err = "no model with an active expert engine"; return -1; }
    apply_options(g_eng, *o);
    return 0;
}

int ostinato_hybrid_split(const int32_t * routes, int m, int n_upload, double alpha_us, double beta_us,
                          double upload_us) {
    if (!routes || m < 0) return 0;
    ost_split_cost c;
    c.alpha_us = alpha_us;
    c.beta_us = beta_us;
    c.upload_us = upload_us;
    return ost_split_experts(routes, m, n_upload, c);
}

}  // extern "C"
