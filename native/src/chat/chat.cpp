// Ostinato chat shim: see ostinato.h. Thin glue over llama.cpp's common/chat; the template
// engine, tool-call grammars and the PEG output parsers are llama.cpp's own.
#include "ostinato.h"

#include "chat.h"
#include "common.h"
#include "json.h"
#include "sampling.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace {

thread_local std::string g_last_error;

char * dup_string(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (out) {
        std::memcpy(out, s.data(), s.size());
        out[s.size()] = '\0';
    }
    return out;
}

char * error_json(const std::string & type, const std::string & message) {
    common_json err = common_json::object();
    err["type"]    = type;
    err["message"] = message;
    common_json out = common_json::object();
    out["error"] = err;
    return dup_string(out.dump_safe());
}

const char * trigger_type_name(common_grammar_trigger_type t) {
    switch (t) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:        return "token";
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:         return "word";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:      return "pattern";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: return "pattern_full";
    }
    return "word";
}

common_json msg_to_json(const common_chat_msg & msg) {
    common_json j = common_json::object();
    j["role"]              = msg.role.empty() ? std::string("assistant") : msg.role;
    j["content"]           = msg.content;
    j["reasoning_content"] = msg.reasoning_content;
    common_json calls = common_json::array();
    for (const auto & tc : msg.tool_calls) {
        common_json c = common_json::object();
        c["id"]        = tc.id;
        c["name"]      = tc.name;
        c["arguments"] = tc.arguments;
        calls.push_back(c);
    }
    j["tool_calls"] = calls;
    return j;
}

std::string random_call_id() {
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    static const char alphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::string id = "call_";
    for (int i = 0; i < 24; i++) {
        id += alphabet[rng() % (sizeof(alphabet) - 1)];
    }
    return id;
}

struct chat_parser {
    common_chat_parser_params params;
    common_chat_msg           prev;
    std::vector<std::string>  ids;  // tool call ids, stable across feeds
};

}  // namespace

extern "C" {

const char * ostinato_last_error(void) { return g_last_error.c_str(); }

void ostinato_string_free(char * s) { std::free(s); }

void * ostinato_chat_init(const struct llama_model * model, const char * template_override) {
    g_last_error.clear();
    try {
        auto ptr = common_chat_templates_init(model, template_override ? template_override : "");
        if (!ptr) {
            g_last_error = "common_chat_templates_init returned no templates";
            return nullptr;
        }
        return ptr.release();
    } catch (const std::exception & e) {
        g_last_error = std::string("chat template: ") + e.what();
    } catch (...) {
        g_last_error = "chat template: unknown error";
    }
    return nullptr;
}

void ostinato_chat_free(void * tmpls) {
    if (tmpls) {
        common_chat_templates_free(static_cast<common_chat_templates *>(tmpls));
    }
}

char * ostinato_chat_info(void * tmpls) {
    try {
        auto * t = static_cast<common_chat_templates *>(tmpls);
        common_json caps = common_json::object();
        for (const auto & [k, v] : common_chat_templates_get_caps(t)) {
            caps[k] = v;
        }
        common_json out = common_json::object();
        out["caps"]              = caps;
        out["source"]            = common_chat_templates_source(t);
        out["explicit"]          = common_chat_templates_was_explicit(t);
        out["supports_thinking"] = common_chat_templates_support_enable_thinking(t);
        return dup_string(out.dump_safe());
    } catch (const std::exception & e) {
        return error_json("template_error", e.what());
    }
}

char * ostinato_chat_apply(void * tmpls, const char * json_request) {
    if (!tmpls || !json_request) {
        return error_json("invalid_request", "no templates or request");
    }
    try {
        common_json req = common_json::parse_no_throw(json_request);
        if (req.is_discarded() || !req.is_object()) {
            return error_json("invalid_request", "request is not a JSON object");
        }
        common_chat_templates_inputs inputs;
        inputs.use_jinja = true;
        inputs.messages  = common_chat_msgs_parse_oaicompat(req.value("messages", common_json::array()));
        common_json tools = req.value("tools", common_json());
        if (!tools.is_null() && !tools.empty()) {
            inputs.tools = common_chat_tools_parse_oaicompat(tools);
        }
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(req.value("tool_choice", std::string("auto")));
        inputs.parallel_tool_calls   = req.value("parallel_tool_calls", true);
        inputs.add_generation_prompt = req.value("add_generation_prompt", true);
        inputs.enable_thinking       = req.value("enable_thinking", true);
        inputs.reasoning_format      = COMMON_REASONING_FORMAT_AUTO;
        common_json schema = req.value("json_schema", common_json());
        if (!schema.is_null()) {
            inputs.json_schema = schema.dump();
        }
        common_json kwargs = req.value("chat_template_kwargs", common_json::object());
        if (kwargs.is_object()) {
            for (auto it = kwargs.begin(); it != kwargs.end(); ++it) {
                inputs.chat_template_kwargs[it.key()] = it.value().dump();
            }
        }

        common_chat_params p = common_chat_templates_apply(static_cast<common_chat_templates *>(tmpls), inputs);

        common_json out = common_json::object();
        out["prompt"]       = p.prompt;
        out["format"]       = (int) p.format;
        out["format_name"]  = std::string(common_chat_format_name(p.format));
        out["grammar"]      = p.grammar;
        out["grammar_lazy"] = p.grammar_lazy;
        common_json triggers = common_json::array();
        for (const auto & t : p.grammar_triggers) {
            common_json tj = common_json::object();
            tj["type"]  = std::string(trigger_type_name(t.type));
            tj["value"] = t.value;
            tj["token"] = (int) t.token;
            triggers.push_back(tj);
        }
        out["grammar_triggers"]   = triggers;
        out["preserved_tokens"]   = p.preserved_tokens;
        out["additional_stops"]   = p.additional_stops;
        out["generation_prompt"]  = p.generation_prompt;
        out["parser"]             = p.parser;
        out["supports_thinking"]  = p.supports_thinking;
        out["thinking_start_tag"] = p.thinking_start_tag;
        out["thinking_end_tags"]  = p.thinking_end_tags;
        return dup_string(out.dump_safe());
    } catch (const std::invalid_argument & e) {
        return error_json("invalid_request", e.what());
    } catch (const std::exception & e) {
        return error_json("template_error", e.what());
    } catch (...) {
        return error_json("template_error", "unknown error while applying the chat template");
    }
}

void * ostinato_chat_parser_new(const char * json_apply_result, const char * json_options) {
    g_last_error.clear();
    try {
        common_json r = common_json::parse_no_throw(json_apply_result ? json_apply_result : "");
        if (r.is_discarded() || !r.is_object()) {
            g_last_error = "apply result is not a JSON object";
            return nullptr;
        }
        common_json opt = common_json::parse_no_throw(json_options ? json_options : "{}");
        if (opt.is_discarded() || !opt.is_object()) {
            opt = common_json::object();
        }
        auto * p = new chat_parser();
        p->params.format            = (common_chat_format) r.value("format", 0);
        p->params.generation_prompt = r.value("generation_prompt", std::string());
        p->params.reasoning_format  = opt.value("reasoning", true) ? COMMON_REASONING_FORMAT_AUTO
                                                                   : COMMON_REASONING_FORMAT_NONE;
        p->params.parse_tool_calls  = opt.value("parse_tool_calls", true);
        const std::string parser = r.value("parser", std::string());
        if (!parser.empty()) {
            try {
                p->params.parser.load(parser);
            } catch (...) {
                delete p;
                throw;
            }
        }
        p->prev.role = "assistant";
        return p;
    } catch (const std::exception & e) {
        g_last_error = std::string("chat parser: ") + e.what();
    } catch (...) {
        g_last_error = "chat parser: unknown error";
    }
    return nullptr;
}

void ostinato_chat_parser_free(void * parser) { delete static_cast<chat_parser *>(parser); }

char * ostinato_chat_parser_feed(void * parser, const char * text_so_far, int is_partial) {
    if (!parser) {
        return error_json("invalid_request", "no parser");
    }
    auto * p = static_cast<chat_parser *>(parser);
    const std::string text = text_so_far ? text_so_far : "";
    std::string parse_error;
    common_chat_msg msg;
    try {
        msg = common_chat_parse(text, is_partial != 0, p->params);
    } catch (const std::exception & e) {
        if (is_partial) {
            // a prefix that does not parse yet: keep the previous state, more text may fix it
            msg = p->prev;
        } else {
            // final text does not match the format: keep everything the model said as content
            parse_error = e.what();
            msg = common_chat_msg();
            msg.role    = "assistant";
            msg.content = text;
            if (!p->prev.reasoning_content.empty() && text.find(p->prev.reasoning_content) == std::string::npos) {
                msg.reasoning_content = p->prev.reasoning_content;
            }
        }
    } catch (...) {
        msg = p->prev;
        parse_error = "unknown parse error";
    }
    msg.role = "assistant";
    msg.set_tool_call_ids(p->ids, random_call_id);

    common_json diffs = common_json::array();
    try {
        for (const auto & d : common_chat_msg_diff::compute_diffs(p->prev, msg)) {
            common_json dj = common_json::object();
            dj["content_delta"]           = d.content_delta;
            dj["reasoning_content_delta"] = d.reasoning_content_delta;
            if (d.tool_call_index != std::string::npos) {
                dj["tool_call_index"] = (int64_t) d.tool_call_index;
                common_json tc = common_json::object();
                tc["id"]        = d.tool_call_delta.id;
                tc["name"]      = d.tool_call_delta.name;
                tc["arguments"] = d.tool_call_delta.arguments;
                dj["tool_call_delta"] = tc;
            } else {
                dj["tool_call_index"] = nullptr;
            }
            diffs.push_back(dj);
        }
        p->prev = msg;
    } catch (const std::exception & e) {
        // the parse went backwards (fewer tool calls, renamed call): report no diff for this feed
        if (!is_partial) {
            p->prev = msg;
            if (parse_error.empty()) {
                parse_error = e.what();
            }
        }
    }
    try {
        common_json out = common_json::object();
        out["msg"]   = msg_to_json(msg);
        out["diffs"] = diffs;
        if (!parse_error.empty()) {
            out["parse_error"] = parse_error;
        }
        return dup_string(out.dump_safe());
    } catch (const std::exception & e) {
        return error_json("parse_error", e.what());
    }
}

// --n-cpu-moe for the ctypes loader: llama.cpp's own override list (common.h, llm_add_n_cpu_ffn_overrides),
// kept alive for the process and terminated by a {NULL, NULL} entry.
const struct llama_model_tensor_buft_override * ostinato_n_cpu_moe_overrides(int n_layers) {
    static std::mutex mu;
    static std::map<int, std::vector<llama_model_tensor_buft_override>> cache;
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(n_layers);
    if (it == cache.end()) {
        std::vector<llama_model_tensor_buft_override> v;
        llm_add_n_cpu_ffn_overrides(n_layers < 0 ? 0 : n_layers, LLM_FFN_EXPS_REGEX, v);
        v.push_back({nullptr, nullptr});
        it = cache.emplace(n_layers, std::move(v)).first;
    }
    return it->second.data();
}

// ---- sampler: llama.cpp's common_sampler (grammar checked on the sampled token first, the full
// vocabulary only when it is rejected, as in llama-server) ----

void * ostinato_sampler_new(const struct llama_model * model, const char * json_params, const char * json_apply_result) {
    g_last_error.clear();
    try {
        common_json prm = common_json::parse_no_throw(json_params ? json_params : "{}");
        if (prm.is_discarded() || !prm.is_object()) {
            g_last_error = "sampler params are not a JSON object";
            return nullptr;
        }
        const llama_vocab * vocab = llama_model_get_vocab(model);
        common_params_sampling sp;
        sp.temp      = prm.value("temperature", 0.8);
        sp.top_k     = prm.value("top_k", 40);
        sp.top_p     = prm.value("top_p", 0.95);
        sp.min_p     = prm.value("min_p", 0.05);
        sp.seed      = (uint32_t) prm.value("seed", (long long) LLAMA_DEFAULT_SEED);
        sp.no_perf   = true;
        sp.ignore_eos = prm.value("ignore_eos", false);
        common_json bias = prm.value("logit_bias", common_json::array());
        for (size_t i = 0; i < bias.size(); i++) {
            const common_json & b = bias.at(i);
            sp.logit_bias.push_back({ (llama_token) b.at((size_t) 0).get<int>(), b.at((size_t) 1).get<float>() });
        }
        if (sp.ignore_eos) {
            const int n_vocab = llama_vocab_n_tokens(vocab);
            for (llama_token t = 0; t < n_vocab; t++) {
                if (llama_vocab_is_eog(vocab, t)) {
                    sp.logit_bias.push_back({ t, -INFINITY });
                }
            }
        }
        common_json r = common_json::parse_no_throw(json_apply_result ? json_apply_result : "null");
        if (!r.is_discarded() && r.is_object() && !sp.ignore_eos) {
            // (under ignore_eos a completed grammar would only allow the banned EOG: no grammar)
            const std::string grammar = r.value("grammar", std::string());
            if (!grammar.empty()) {
                sp.grammar = common_grammar(prm.value("json_schema", false) ? COMMON_GRAMMAR_TYPE_OUTPUT_FORMAT
                                                                           : COMMON_GRAMMAR_TYPE_TOOL_CALLS,
                                            grammar);
                sp.grammar_lazy      = r.value("grammar_lazy", false);
                sp.generation_prompt = r.value("generation_prompt", std::string());
                common_json triggers = r.value("grammar_triggers", common_json::array());
                for (size_t i = 0; i < triggers.size(); i++) {
                    const common_json & t = triggers.at(i);
                    const std::string type = t.value("type", std::string("word"));
                    common_grammar_trigger trig;
                    trig.value = t.value("value", std::string());
                    trig.token = (llama_token) t.value("token", (int) LLAMA_TOKEN_NULL);
                    trig.type  = type == "token"        ? COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN
                               : type == "pattern"      ? COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN
                               : type == "pattern_full" ? COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL
                                                        : COMMON_GRAMMAR_TRIGGER_TYPE_WORD;
                    sp.grammar_triggers.push_back(trig);
                }
            }
        }
        common_sampler * smpl = common_sampler_init(model, sp);
        if (!smpl) {
            g_last_error = "failed to create the sampler (grammar does not compile?)";
        }
        return smpl;
    } catch (const std::exception & e) {
        g_last_error = std::string("sampler: ") + e.what();
    } catch (...) {
        g_last_error = "sampler: unknown error";
    }
    return nullptr;
}

int32_t ostinato_sampler_sample(void * sampler, struct llama_context * ctx, int32_t idx) {
    g_last_error.clear();
    if (!sampler) {
        g_last_error = "no sampler";
        return -1;
    }
    try {
        auto * smpl = static_cast<common_sampler *>(sampler);
        const llama_token tok = common_sampler_sample(smpl, ctx, idx, false);
        common_sampler_accept(smpl, tok, true);
        return tok;
    } catch (const std::exception & e) {
        g_last_error = std::string("sampling: ") + e.what();
    } catch (...) {
        g_last_error = "sampling: unknown error";
    }
    return -1;
}

void ostinato_sampler_free(void * sampler) {
    if (sampler) {
        common_sampler_free(static_cast<common_sampler *>(sampler));
    }
}

}  // extern "C"
