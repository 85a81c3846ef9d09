// Expert engine: the JSON of the C API's info and stats calls (pool layout, decode graph, borrowed
// slots, per-pass and cumulative route counts). See ostinato.h and engine/engine.h.
#include "engine/engine.h"
#include "cpu_branch/kernel.h"
#include "cpu_branch/dot.h"
#include "cpu_branch/mxfp4.h"

using namespace ost;

namespace {

std::string g_out_info, g_out_stats, g_out_req;   // each call's string lives until its next call

const char * keep(std::string & slot, const json & j) {
    slot = j.dump();
    return slot.c_str();
}

// The decode graph's state (mode, whether a lost wait broke it or its creation failed, its CPU
// branch's threads and kernel layers): in info and in stats, so that a run's figures say which
// path its decode steps took. Caller holds g_mu.
json decode_graph_json() {
    const ostinato_engine_options & o = opts_of(g_eng);
    json d = json{{"mode", o.decode_graph < 0 ? "auto" : o.decode_graph ? "on" : "off"}, {"max_tokens", o.decode_graph_max_tokens},
                  {"broken", g_dgraph_broken}, {"failed", g_eng && g_eng->dg_failed}};
    if (g_eng && g_eng->dg) {
        int nt = 0; int64_t mb = 0;
        ost_dg_info(g_eng->dg, nt, mb);
        d["active"] = true;
        d["cpu_threads"] = nt;
        d["mailbox_bytes"] = mb;
        int64_t nf = 0, ng = 0; std::string note;
        ost_dg_kernel_info(g_eng->dg, nf, ng, note);
        d["cpu_kernel"] = json{{"on", (bool) o.cpu_branch_kernel}, {"layers_kernel", nf}, {"layers_ggml", ng},
                               {"prefetch_rows", ost_ffn_prefetch_rows()},
                               {"row_pairs", json{{"mode", ost_dot_mode()}, {"isa", ost_dot_isa()},
                                                  {"types", ost_dot_types()}}},
                               {"mxfp4_rows", json{{"isa", ost_mxfp4_isa()}, {"tail", ost_mxfp4_tail()},
                                                   {"min_routes", ost_mxfp4_min_tokens()}}}};
        if (!note.empty()) d["cpu_kernel"]["unmatched"] = note;
    }
    // decode prefetch: how many layers' route ops stage the next layer's predicted experts
    json pf = json{{"max_experts", o.decode_prefetch_experts}, {"copy_blocks", o.decode_prefetch_copy_blocks}};
    if (g_eng && g_eng->dg) {
        int n = 0;
        for (int il = 0; il < g_eng->n_layer; ++il) n += ost_dg_predicts(g_eng->dg, il) ? 1 : 0;
        pf["layers"] = n;
        if (o.decode_prefetch_experts > 0 && n == 0) {
            pf["note"] = g_eng->prefetch + 1 < 3 ? "needs 3 staging regions (prefill prefetch depth 2)"
                                                 : "no layer pair on one pool with cold experts in host memory";
        }
    }
    d["prefetch"] = pf;
    return d;
}

}  // namespace

extern "C" {

const char * ostinato_experts_info(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    json j;
    const ostinato_engine_options & o = opts_of(g_eng);
    j["active"] = g_eng != nullptr;
    j["prefill_threshold"] = o.prefill_threshold;
    j["force_path"] = o.force_path == FORCE_AUTO ? "auto" : o.force_path == FORCE_SPLIT ? "split" : "upload";
    j["timing"] = (bool) o.timing;
    j["overlap"] = (bool) o.decode_overlap;
    j["decode_graph"] = decode_graph_json();
    // the CPU branch's thread team (process-wide, set from the options at a load or reconfigure)
    j["cpu_team"] = json{{"spins", ost_ffn_spins()}, {"claims", ost_ffn_claims()},
                         {"prefetch_rows", ost_ffn_prefetch_rows()}, {"row_pairs", ost_dot_mode()}};
    if (g_eng) {
        const engine_t & e = *g_eng;
        j["pool_device"] = e.pool_device;
        j["pool_bytes"] = e.pool_bytes;
        j["host_buffer"] = e.host_buffer;
        j["host_pinned"] = g_pin.model == e.model && (g_pin.already_pinned || g_pin.bytes > 0);
        j["pinned_bytes"] = g_pin.model == e.model ? g_pin.bytes : 0;
        if (g_pin.model == e.model && !g_pin.note.empty()) j["pin_note"] = g_pin.note;
        j["hot_experts"] = e.n_hot;
        j["n_layer"] = e.n_layer; j["n_expert"] = e.n_expert; j["n_expert_used"] = e.k;
        json cls = json::array();
        for (auto & c : e.classes) {
            // whether an expert's weight matrices go in one 2D copy (the class's first layer, slot 0)
            const bool one_copy = !c.members.empty() && e.rows_2d[c.members.front().first].height > 0;
            cls.push_back(json{{"type_up", ggml_type_name(c.t_up)}, {"type_down", ggml_type_name(c.t_down)}, {"merged_gate_up", c.merged},
                               {"up_shape", {c.up0, c.up1}}, {"down_shape", {c.down0, c.down1}},
                               {"slots", c.members.size()}, {"zero_slots", e.k}, {"staging_slots", c.n_stage}, {"pool", c.pool},
                               {"expert_rows_at_one_pitch", one_copy}, {"whole_slots", c.whole_slots},
                               {"copy_2d_refused", c.copy_2d_refused}});
        }
        j["size_classes"] = cls;
        json pools = json::array();
        for (auto & p : e.pools) {
            pools.push_back(json{{"gpu", p.gpu}, {"device", p.name}, {"bytes", p.bytes},
                                 {"hot_experts", p.n_hot}, {"size_classes", p.n_classes},
                                 {"layers", p.layers}, {"upload_stream", p.upload_backend != nullptr},
                                 {"copy_2d", p.set_2d != nullptr}});
        }
        j["pools"] = pools;
        j["expert_bytes"] = e.expert_bytes;
        int moe_layers = 0;
        for (auto & l : e.layers) moe_layers += l.il >= 0;
        j["moe_layers"] = moe_layers;
        int lent = 0;
        for (auto & c : e.classes) for (auto & b : c.borrowed) lent += b.first >= 0;
        j["borrowed"] = json{{"on", (bool) o.decode_borrow}, {"slots_lent", lent}, {"promotions", e.promotions},
                             {"handbacks", e.handbacks}};
        // prefill: pool views and the hybrid upload pass's CPU share (fixed, or the adapted value)
        j["prefill"] = json{{"pool_views", (bool) o.pool_views}, {"view_min_tokens", OSTINATO_VIEW_MIN_TOKENS},
                            {"upload_cpu_share", upload_share(&e, std::any_of(e.pools.begin(), e.pools.end(),
                                                     [](const pool_t & p) { return p.upload_backend != nullptr; }))},
                            {"upload_cpu_share_adapted", o.upload_cpu_share < 0},
                            {"hybrid_rows", o.hybrid_rows},
                            {"cpu_split", split_on(o) && o.upload_cpu_share == 0
                                              ? json{{"alpha_us", o.cpu_split_alpha_us}, {"cpu_gbps", o.cpu_split_cpu_gbps},
                                                     {"h2d_gbps", o.cpu_split_h2d_gbps}}
                                              : json(nullptr)},
                            {"prefetch", e.prefetch}, {"copy_2d", (bool) o.upload_copy_2d},
                            {"whole_slots", std::any_of(e.classes.begin(), e.classes.end(),
                                                        [](const size_class_t & c) { return c.whole_slots; })}};
        j["notes"] = e.notes;
    }
    return keep(g_out_info, j);
}

const char * ostinato_experts_stats(int with_counts) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) return keep(g_out_stats, json{{"active", false}});
    flush_counts(g_eng);
    collect_dg_stats(g_eng);
    json j = totals_json(*g_eng, g_eng->total, with_counts != 0);
    j["active"] = true;
    json pools = json::array();   // per device: pool bytes and hot experts
    for (auto & p : g_eng->pools) {
        pools.push_back(json{{"gpu", p.gpu}, {"device", p.name}, {"bytes", p.bytes}, {"hot_experts", p.n_hot},
                             {"routes", p.routes}, {"hot_routes", p.hot_routes},
                             {"hot_route_share", p.routes ? double(p.hot_routes) / double(p.routes) : 0.0}});
    }
    j["pools"] = pools;
    j["decode_graph"] = decode_graph_json();
    json last = json::array();
    for (auto & p : g_eng->last) last.push_back(pass_json(p));
    j["last_passes"] = last;
    return keep(g_out_stats, j);
}

const char * ostinato_experts_take_request_stats(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) return keep(g_out_req, json{{"active", false}});
    flush_counts(g_eng);
    collect_dg_stats(g_eng, true);   // the request's last decode step (the engine's thread, between passes)
    json j = totals_json(*g_eng, g_eng->request, true);
    j["active"] = true;
    totals_init(g_eng->request, (size_t) g_eng->n_layer * g_eng->n_expert);
    return keep(g_out_req, j);
}

void ostinato_experts_reset_stats(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_eng) return;
    flush_counts(g_eng);   // what the count tables hold so far goes with the reset
    collect_dg_stats(g_eng, true);   // and the last pass's timeline, not counted after it
    const size_t n = (size_t) g_eng->n_layer * g_eng->n_expert;
    totals_init(g_eng->total, n);
    totals_init(g_eng->request, n);
    g_eng->last.clear();
    for (auto & p : g_eng->pools) p.routes = p.hot_routes = 0;
}

}  // extern "C"
