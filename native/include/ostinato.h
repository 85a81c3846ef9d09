// The C API of Ostinato's native additions: what ostinatod/engine/native.py reaches through ctypes.
// The expert engine's functions (ostinato_experts_*, ostinato_model_load, ostinato_hybrid_split) are
// in libllama, whose patched sources call the engine's hooks (include/ostinato/engine_hooks.h); the
// chat shim's, the sampler's and the version (ostinato_chat_*, ostinato_sampler_*, ...) in
// libostinato. Method: arXiv 2611.11533, Sections 2-3 and Appendix B.
#pragma once

#include "llama.h"

#include <stdint.h>

extern "C" {
#if defined(_WIN32)
#  define OSTINATO_API __declspec(dllexport)
#else
#  define OSTINATO_API __attribute__((visibility("default")))
#endif
// Placement config (JSON):
//   {"hot": {"<layer>": [expert ids]}, "device": -1|gpu index, "prefill_threshold": Np,
//    "force_path": "auto"|"split"|"upload", "layer_device": {"<layer>": gpu index}}
// "layer_device" (optional, several GPUs): the GPU of each layer; an absent layer (or no map) is on
// "device". One expert pool per device in use (each with its own size classes, staging slots and
// upload stream). With the map, the load (and a switch) fails when a layer's dense weights sit on
// another GPU than its layer_device says (see docs/engine.md "Several GPUs"); without it nothing is
// checked and everything is as with one device. On a CPU-only build every pool is a CPU buffer.
// Validates a config without loading anything: 0, or -1 (see ostinato_experts_last_error).
OSTINATO_API int          ostinato_experts_check(const char * json);
// llama_model_load_from_file with the expert engine's placement `json` for this load only (NULL or
// "": a stock load); the config travels with the call like tensor_buft_overrides, no global is left
// set. NULL on a bad config (last error says why) or a failed load. Np and the forced path of the
// config become the run-time values.
OSTINATO_API struct llama_model * ostinato_model_load(const char * path, struct llama_model_params params,
                                                      const char * json);
// Rebuild the pool of the loaded model with another config (same JSON) at a request boundary.
OSTINATO_API int          ostinato_experts_switch(const char * json);
OSTINATO_API int          ostinato_experts_active(void);
OSTINATO_API const char * ostinato_experts_last_error(void);
// Np (tokens) and forced path ("auto", "split", "upload") at run time; 0 on success.
OSTINATO_API int          ostinato_experts_set_threshold(int64_t np);
OSTINATO_API int          ostinato_experts_force_path(const char * path);
// Timing mode (1/0): GPU-branch times per pass at the cost of one sync per layer (calibration).
OSTINATO_API int          ostinato_experts_set_timing(int on);
// Decode overlap on (1) or off (0); see ostinato_moe_overlap.
OSTINATO_API int          ostinato_experts_set_overlap(int on);
// Decode graph: -1 auto (on when a pool is on a GPU), 0 off, 1 on (also in a CPU build: tests).
// max_tokens (1..4096, 0 keeps) is the largest pass that takes it. Takes effect at the next graph.
OSTINATO_API int          ostinato_experts_set_decode_graph(int mode, int max_tokens);
// Borrowed decode memory on (1, default) or off (0): during decode the upload path's staging slots
// hold the cold experts the CPU branch computed most lately; handed back before an upload pass.
OSTINATO_API int          ostinato_experts_set_borrow(int on);
// Per-layer pool views for split and upload passes (see ostinato_moe_views): on (1, default) or off
// (0: every pass computes over the whole size class, as before; for measurements). Next graph.
OSTINATO_API int          ostinato_experts_set_views(int on);
// Upload-path copies: on (1, default), an expert's weight matrices go in one 2D copy (the GPU backend's,
// which refuses a pitch above the device's maximum; row by row into a CPU pool) where they sit at one
// pitch in host memory and in the pool (llama.cpp's layout: a layer's expert tensors are adjacent in
// the file; the pool places its class tensors likewise); off (0), one copy per matrix (for
// measurements). Takes effect at the next copy.
OSTINATO_API int          ostinato_experts_set_copy_2d(int on);
// Whole-expert slots: on (1), the pools built from now on (next model load or residency switch) give
// each size class whose weight matrices hold the same bytes per expert one slot = [the expert's
// matrices, in host order] (the class tensors strided by a whole slot), so that an upload copy of an
// expert has a pitch of one matrix, within any device's 2D copy limit; off (0, default), one tensor
// after the other (pitch: a whole class tensor). Computation is unchanged.
OSTINATO_API int          ostinato_experts_set_whole_slots(int on);
// Hybrid upload passes (pool views): share 0..1 of the distinct cold experts computed by the CPU
// branch instead of uploaded (the ones with the fewest routes), or -1: adapted per layer so that the
// CPU branch and the copies end together (0 where the pool has no upload stream: CPU pools). 0, the
// default, builds upload passes without a CPU branch (measured on the H200: the CPU branch of a long
// pass costs more than the copies it saves). Returns -1 (refused) for other values.
OSTINATO_API int          ostinato_experts_set_upload_cpu_share(double share);
// Most tokens a hybrid pass's CPU branch takes (1..4096; default 64); -1 (refused) otherwise.
OSTINATO_API int          ostinato_experts_set_hybrid_rows(int rows);
// The cost-model split of hybrid upload passes (docs/engine.md "The prefill's CPU share"; used while the share above is 0):
// per layer, the CPU branch takes the cold experts with the fewest routes while its time
// alpha_us + routes * expert bytes / cpu_gbps stays under the uploads' time of the rest (expert
// bytes / h2d_gbps each), see paths/hybrid_split.h. cpu_gbps and h2d_gbps in 1e9 bytes/s (from the
// calibration); 0, 0, 0 (default) turns it off (no CPU branch in upload passes). -1 (refused) for
// negative or non-finite values, or only one of the bandwidths.
OSTINATO_API int          ostinato_experts_set_cpu_split(double alpha_us, double cpu_gbps, double h2d_gbps);
// The split rule alone (paths/hybrid_split.h) for tests: routes[0..m) ascending, n_upload experts to
// upload without a CPU share; returns how many of the first experts the CPU takes.
OSTINATO_API int          ostinato_hybrid_split(const int32_t * routes, int m, int n_upload, double alpha_us,
                                                double beta_us, double upload_us);
// Prefetch depth for upload passes with pool views: 0 (off, default), 1 (each layer predicts the next
// one) or 2 (each layer predicts the next two; a layer's staged set is the union of both predictions).
// The pool then has depth + 1 staging regions (layer il stages in region il % (depth + 1), so that the
// copies for the next layers run while this layer's staged routes compute); takes effect at the next
// load or residency switch. -1 (refused) outside 0..OSTINATO_PREFETCH_MAX_DEPTH.
OSTINATO_API int          ostinato_experts_set_prefetch(int depth);
// The all-resident path (see ostinato_moe_resident) on (1, default) or off (0: such layers take the
// route op as any other; for measurements). Takes effect at the next graph.
OSTINATO_API int          ostinato_experts_set_resident_path(int on);
// Decode prefetch (docs/engine.md "Decode prefetch"): in decode steps each layer's route op predicts
// the next layer's routes (its router on this layer's FFN input) and stages up to max_experts of the
// predicted cold experts on the GPU (a copy kernel on a side stream, joined before the next route
// op), whose routes the GPU branch then computes instead of the CPU branch. 0 (the library's
// default) turns it off; at most OSTINATO_STAGE_MAX (16), else -1. Needs 3 staging regions (prefill
// prefetch depth 2) and host experts the GPU can read; takes effect at the next pass (call between
// passes).
OSTINATO_API int          ostinato_experts_set_decode_prefetch(int max_experts);
// Blocks (of 512 threads) of the decode prefetch's copy kernel on the GPU, 1..1024 (default 8);
// -1 outside. Takes effect at the next pass (the decode graph is made anew).
OSTINATO_API int          ostinato_experts_set_decode_prefetch_blocks(int blocks);
// Threads of the decode graph's CPU branch (0: the physical cores, estimated); a change re-creates
// the pool at the next pass (call between passes).
OSTINATO_API int          ostinato_experts_set_cpu_threads(int n);
// The decode graph's CPU branch on its own kernel (1, default: cpu_branch/kernel.h) or on ggml's graph
// compute (0; for measurements). Takes effect at the next graph.
OSTINATO_API int          ostinato_experts_set_cpu_kernel(int on);
// The CPU branch kernel's software prefetch distance in weight rows (0 = off, at most
// OST_PREFETCH_ROWS_MAX = 64; read once per phase of a run): docs/engine.md "CPU branch kernel".
// Returns the previous distance, or -1 out of range (nothing changed).
OSTINATO_API int          ostinato_experts_set_cpu_prefetch(int rows);
// The CPU branch kernel's row-pair dot products: 0 off (ggml-cpu's vec_dot row by row, the default),
// 1 AVX2, 2 AVX-512 (the next lower set where the CPU lacks it; process-wide): docs/engine.md "Row
// pairs". Returns the previous mode, or -1 out of range (nothing changed).
OSTINATO_API int          ostinato_experts_set_cpu_row_pairs(int mode);
// Pauses a waiting thread of the CPU branch's team spins before it yields on every further try
// (default 256; process-wide): docs/engine.md "CPU branch kernel". Returns the previous count, or -1
// for a negative one (nothing changed).
OSTINATO_API int          ostinato_experts_set_cpu_spins(int spins);
// How the CPU branch's team takes a layer's work: 1 claims (the threads on a core take its items one at
// a time, nobody waits for a thread that is not running; the default), 0 barriers (every thread in
// every phase; process-wide): docs/engine.md "CPU branch kernel". Returns the previous mode.
OSTINATO_API int          ostinato_experts_set_cpu_claims(int on);
// The CPU branch alone on `model`'s expert tensors (loaded in host memory, not repacked): its own
// kernel against llama.cpp's CPU MUL_MAT_ID graph on the same inputs, bit for bit, and the host's
// read bandwidth. args: {"layer": -1 (first MoE layer), "experts": [E...], "tokens": [n...],
// "threads": [t...], "reps": 10, "ggml": true, "read_bw_bytes": 268435456, "flush_bytes": 268435456}. Returns JSON ({"error": ...}
// on bad input), valid until the next call. Exported by the bench library libostinato_cpubench
// (native/bench/cpu_branch_bench.cpp), not by libllama.
OSTINATO_API const char * ostinato_cpu_branch_bench(const struct llama_model * model, const char * args_json);
// Stats as JSON; the returned string stays valid until the next call of the same function.
OSTINATO_API const char * ostinato_experts_info(void);
OSTINATO_API const char * ostinato_experts_stats(int with_counts);
OSTINATO_API const char * ostinato_experts_take_request_stats(void);
OSTINATO_API void         ostinato_experts_reset_stats(void);
}

// ---- libostinato: the chat shim (llama.cpp's common/chat: templates, tool-call grammars, PEG output
// parsing) behind a C API that speaks JSON strings, the sampler and the version.
//
// Ownership: every returned char* is freed with ostinato_string_free; handles with their _free.
// Nothing throws across this boundary: failures come back as {"error": {"type", "message"}} (JSON
// functions) or NULL plus ostinato_last_error() (handle constructors).
#ifdef __cplusplus
extern "C" {
#endif

// Version of the native additions ("0.1.0"), checked by the ctypes bindings at load.
const char * ostinato_native_version(void);

// Text of the last error of a handle constructor on this thread ("" if none). Not to be freed.
const char * ostinato_last_error(void);

void ostinato_string_free(char * s);

// Chat templates of a model (the GGUF's tokenizer.chat_template, or template_override when not NULL).
void * ostinato_chat_init(const struct llama_model * model, const char * template_override);
void   ostinato_chat_free(void * tmpls);

// {"caps": {...}, "source": str, "supports_thinking": bool}
char * ostinato_chat_info(void * tmpls);

// Render a chat request. json_request: {"messages": [...OpenAI shape...], "tools": [...],
// "tool_choice": "auto"|"none"|"required", "parallel_tool_calls": bool, "enable_thinking": bool,
// "add_generation_prompt": bool, "json_schema": {...}|null, "chat_template_kwargs": {...}}.
// Returns {"prompt", "format", "format_name", "grammar", "grammar_lazy", "grammar_triggers":
// [{"type": "token"|"word"|"pattern"|"pattern_full", "value", "token"}], "preserved_tokens",
// "additional_stops", "generation_prompt", "parser", "supports_thinking", "thinking_start_tag",
// "thinking_end_tags"} or {"error": ...}.
char * ostinato_chat_apply(void * tmpls, const char * json_request);

// Grammar sampler for an apply result (tool-call / json_schema grammar; lazy with its triggers).
// Returns NULL if the result has no grammar (ostinato_last_error() == "") or on error.
struct llama_sampler * ostinato_chat_grammar_sampler(const struct llama_model * model,
                                                     const char * json_apply_result);

// Streaming output parser built from an apply result (format, generation_prompt, parser).
// json_options: {"parse_tool_calls": bool, "reasoning": bool} or NULL.
void * ostinato_chat_parser_new(const char * json_apply_result, const char * json_options);
void   ostinato_chat_parser_free(void * parser);

// Parse the whole generated text so far. Returns {"msg": {"role", "content", "reasoning_content",
// "tool_calls": [{"id", "name", "arguments"}]}, "diffs": [{"content_delta",
// "reasoning_content_delta", "tool_call_index", "tool_call_delta": {"id", "name", "arguments"}}],
// "parse_error": str (only when the final parse failed and the text was kept as content)}.
char * ostinato_chat_parser_feed(void * parser, const char * text_so_far, int is_partial);

// Sampler for one request: llama.cpp's common_sampler. json_params: {"temperature" (<= 0: greedy),
// "top_k", "top_p", "min_p", "seed", "ignore_eos" (bans EOG tokens, drops the grammar),
// "logit_bias": [[token, bias], ...], "json_schema": bool (grammar is an output format)};
// json_apply_result: an ostinato_chat_apply result whose grammar applies, or NULL.
// NULL on error (ostinato_last_error()).
void *  ostinato_sampler_new(const struct llama_model * model, const char * json_params,
                             const char * json_apply_result);
// Sample at batch index idx and accept the token. Returns the token, or -1 (ostinato_last_error()).
int32_t ostinato_sampler_sample(void * sampler, struct llama_context * ctx, int32_t idx);
void    ostinato_sampler_free(void * sampler);

// tensor_buft_overrides keeping the expert tensors of layers [0, n_layers) in host memory, like
// llama.cpp's --n-cpu-moe (the "stock" baseline). NULL-terminated; owned by the library.
const struct llama_model_tensor_buft_override * ostinato_n_cpu_moe_overrides(int n_layers);

#ifdef __cplusplus
}
#endif
