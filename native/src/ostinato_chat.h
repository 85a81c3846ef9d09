// Ostinato chat shim: llama.cpp's common/chat (templates, tool-call grammars, PEG output parsing)
// behind a C API that speaks JSON strings, for the ctypes bindings in ostinatod/engine/native.py.
//
// Ownership: every returned char* is freed with ostinato_string_free; handles with their _free.
// Nothing throws across this boundary: failures come back as {"error": {"type", "message"}} (JSON
// functions) or NULL plus ostinato_last_error() (handle constructors).
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

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
