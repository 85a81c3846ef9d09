// The C API of Ostinato's native additions: what ostinatod/engine/native.py reaches through ctypes.
// The expert engine's functions (ostinato_experts_*, ostinato_model_load, ostinato_hybrid_split) are
// in libllama, whose patched sources call the engine's hooks (include/ostinato/engine_hooks.h); the
// chat shim's, the sampler's and the version (ostinato_chat_*, ostinato_sampler_*, ...) in
// libostinato. Method: arXiv 2611.11533, Sections 2-3 and Appendix B.
#pragma once

#include "llama.h"

#include <stdint.h>

// Engine options: the expert engine's tuning, one value passed with the model load (ostinato_model_load)
// and held by the engine; changed between passes with ostinato_experts_reconfigure. The member
// initialisers are the library's defaults. ostinatod/engine/options.py (EngineOptions) mirrors it
// field by field in this order (its ctypes Structure is generated from its fields): keep them in step.
struct ostinato_engine_options {
    // --- user-settable (ostinatod/settings.py EngineTuning, the [engine] table) ---
    int32_t decode_borrow = 1;              // borrowed decode memory: during decode the upload path's staging
                                            // slots hold the cold experts the CPU branch computed most lately
    int32_t upload_copy_2d = 1;             // upload-path copies: an expert's weight matrices in one 2D copy where
                                            // they sit at one pitch in host memory and in the pool; 0 one per matrix
    int32_t pool_whole_expert_slots = 0;    // pools built with whole-expert slots (a slot = the expert's matrices,
                                            // in host order) where a class's matrices hold the same bytes per expert
    double  upload_cpu_share = 0;           // hybrid upload passes (pool views): share 0..1 of the distinct cold
                                            // experts the CPU branch computes instead of uploading (fewest routes
                                            // first), -1 adapted per layer; 0 builds them without a CPU branch
    int32_t decode_prefetch_experts = 0;    // decode prefetch (docs/engine.md): most predicted cold experts staged
                                            // per layer and step, 0..16; needs 3 staging regions (prefetch depth 2)
    int32_t decode_prefetch_copy_blocks = 8;  // blocks (of 512 threads) of its copy kernel, 1..1024
    int32_t cpu_branch_kernel = 1;          // the CPU branch on its own kernel (cpu_branch/kernel.h), 0 ggml's graph
    int32_t cpu_branch_prefetch_rows = 0;   // the kernel's software prefetch distance in rows, 0..64 (0 off)
    int32_t cpu_branch_row_pairs = 0;       // the kernel's row-pair dot products: 0 off, 1 AVX2, 2 AVX-512
    int32_t cpu_branch_spins = 256;         // pauses a waiting team thread spins before it yields, >= 0
    int32_t cpu_branch_claims = 1;          // the team takes a layer's work by claims (1) or with barriers (0)
    // --- resolved at the load (ostinatod/engine/options.py EngineOptions) ---
    int64_t prefill_threshold = 512;        // Np (tokens, >= 1): passes of >= Np tokens take the upload path
    int32_t force_path = 0;                 // prefill passes: 0 auto (by Np), 1 split, 2 upload
    int32_t timing = 0;                     // timing mode: GPU-branch times per pass, one sync per layer (calibration)
    int32_t decode_overlap = 1;             // see ostinato_moe_overlap
    int32_t decode_graph = -1;              // decode graph: -1 auto (on when a pool is on a GPU), 0 off, 1 on (also CPU builds: tests)
    int32_t decode_graph_max_tokens = 64;   // largest pass (tokens, 1..4096) that takes the decode graph
    int32_t cpu_threads = 0;                // threads of the decode graph's CPU branch (0: the physical cores, estimated)
    int32_t pool_views = 1;                 // per-layer pool views for split and upload passes (ostinato_moe_views)
    int32_t resident_path = 1;              // the all-resident path (ostinato_moe_resident); 0 for measurements
    int32_t hybrid_rows = 64;               // most tokens (1..4096) a hybrid pass's CPU branch takes
    // the cost-model split of hybrid upload passes (docs/engine.md "The prefill's CPU share"; used while
    // upload_cpu_share is 0): per layer the CPU branch takes the cold experts with the fewest routes while
    // alpha_us + routes * expert bytes / cpu_gbps stays under the uploads' time of the rest (expert bytes /
    // h2d_gbps each), paths/hybrid_split.h. GB/s (1e9 bytes/s); 0, 0, 0 turns it off
    double  cpu_split_alpha_us = 0;
    double  cpu_split_cpu_gbps = 0;
    double  cpu_split_h2d_gbps = 0;
    int32_t prefetch_depth = 0;             // prefetch for upload passes with views: 0 off, 1 or 2 layers ahead
                                            // (OSTINATO_PREFETCH_MAX_DEPTH); the pool gets depth + 1 staging regions
};

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
// llama_model_load_from_file with the expert engine's placement `json` and options `opts` (NULL: the
// defaults) for this load only (json NULL or "": a stock load); both travel with the call like
// tensor_buft_overrides, no global is left set, and the engine holds the options. NULL on a bad config
// or bad options (last error says why) or a failed load. Np and the forced path named by the config
// (optional keys) replace those of `opts`.
OSTINATO_API struct llama_model * ostinato_model_load(const char * path, struct llama_model_params params,
                                                      const char * json, const struct ostinato_engine_options * opts);
// Rebuild the pool of the loaded model with another config (same JSON) and options `opts` (NULL: the
// engine's current ones) at a request boundary; on failure the old pool and options stay.
OSTINATO_API int          ostinato_experts_switch(const char * json, const struct ostinato_engine_options * opts);
OSTINATO_API int          ostinato_experts_active(void);
OSTINATO_API const char * ostinato_experts_last_error(void);
// The library's default options (the member initialisers above) into *out; sizeof the struct (ctypes checks it).
OSTINATO_API void         ostinato_engine_options_default(struct ostinato_engine_options * out);
OSTINATO_API int          ostinato_engine_options_size(void);
// The options of the active engine into *out; -1 (last error says why) without one.
OSTINATO_API int          ostinato_experts_options(struct ostinato_engine_options * out);
// Validates `o` (-1, last error naming the field, nothing changed), then makes it the active engine's
// options. Call between passes. What a change needs is decided here: cached graphs rebuilt (the path
// choice, timing, overlap, views, the all-resident path, the CPU kernel, the hybrid pass's shape, decode
// graph mode), the decode graph made anew at the next pass (its max tokens, CPU threads, decode prefetch),
// the CPU branch's team set (spins, claims, prefetch rows, row pairs: process-wide, the team's); the
// pool's layout (prefetch_depth, pool_whole_expert_slots) takes effect at the next pool build (model load
// or residency switch); the rest at the next pass or copy. -1 without an active engine.
OSTINATO_API int          ostinato_experts_reconfigure(const struct ostinato_engine_options * o);
// The split rule alone (paths/hybrid_split.h) for tests: routes[0..m) ascending, n_upload experts to
// upload without a CPU share; returns how many of the first experts the CPU takes.
OSTINATO_API int          ostinato_hybrid_split(const int32_t * routes, int m, int n_upload, double alpha_us,
                                                double beta_us, double upload_us);
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
