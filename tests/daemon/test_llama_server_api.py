"""llama-server's own API beside ours (docs/api.md "llama-server's API"), on the shared live daemon
(tiny model, n_ctx 2048, 2 slots): routes without /v1, /completion, /infill (llama.vscode's
request), /tokenize, /detokenize, /apply-template, input_tokens, /props, /slots, grammar and
json_schema, timings, timings_per_token, return_progress, context-overflow fields, llama-server's
400s, the llamacpp:* metrics. Pure parts (the FIM prompt, the grammar refusal text, timings) are
tested without the daemon."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ostinatod.engine.infill import NULL, FimTokens, infill_tokens
from ostinatod.engine.types import EngineError


def _post(daemon, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(daemon.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(daemon, path: str) -> tuple[int, dict, dict]:
    with urllib.request.urlopen(daemon.url + path, timeout=60) as r:
        raw = r.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode()
        return r.status, body, dict(r.headers)


def _stream(daemon, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(daemon.url + path, data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


MSGS = [{"role": "user", "content": "What is the best book?"}]


def test_routes_without_v1_share_the_handlers(live_daemon):
    code, models, _ = _get(live_daemon, "/models")
    assert code == 200 and models == _get(live_daemon, "/v1/models")[1]
    code, chat = _post(live_daemon, "/chat/completions", {"messages": MSGS, "max_tokens": 2})
    assert code == 200 and chat["object"] == "chat.completion"
    assert set(chat["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                    "prompt_per_second", "predicted_per_second"}
    assert chat["timings"]["predicted_n"] == chat["usage"]["completion_tokens"]
    code, native = _post(live_daemon, "/completions", {"prompt": "Once upon", "n_predict": 2})
    assert code == 200 and native["stop"] is True and "timings" in native  # llama-server's native one
    # a ready daemon's health has no "error" key (llama-server's clients read one as a failure)
    code, health, _ = _get(live_daemon, "/health")
    assert code == 200 and health["status"] == "ok" and "error" not in health


def test_completion_native_answer(live_daemon):
    code, r = _post(live_daemon, "/completion", {"prompt": "I believe the meaning of life is",
                                                 "n_predict": 3, "n_probs": 2, "temperature": 0})
    assert code == 200
    assert r["stop_type"] == "limit" and r["truncated"] is False and isinstance(r["has_new_line"], bool)
    assert r["timings"]["predicted_n"] == r["tokens_predicted"] == 3
    assert r["timings"]["prompt_n"] + r["timings"]["cache_n"] == r["tokens_evaluated"]
    assert r["generation_settings"]["n_predict"] == 3
    probs = r["completion_probabilities"]
    assert len(probs) == 3 and all(len(p["top_logprobs"]) == 2 and p["logprob"] <= 0 and
                                   isinstance(p["id"], int) for p in probs)
    code, r = _post(live_daemon, "/completion", {"prompt": "x", "n_predict": 2,
                                                 "response_fields": ["content", "timings/predicted_n"]})
    assert code == 200 and set(r) == {"content", "timings/predicted_n"}


def test_completion_prompt_forms(live_daemon):
    # llama-server's prompt forms: token ids, ids and texts mixed, {"prompt_string"}, and a list
    # of prompts answered as a list (same prompt, temperature 0: same text)
    text = "I believe the meaning of life is"
    ids = _post(live_daemon, "/tokenize", {"content": text})[1]["tokens"]
    common = {"n_predict": 3, "temperature": 0}
    code, one = _post(live_daemon, "/completion", dict(common, prompt=ids))
    assert code == 200 and one["prompt"] == text and one["tokens_evaluated"] == len(ids)
    code, many = _post(live_daemon, "/completion", dict(common, prompt=[ids, text, {"prompt_string": text}]))
    assert code == 200 and [r["index"] for r in many] == [0, 1, 2]
    assert len({r["content"] for r in many}) == 1 and many[0]["content"] == one["content"]
    code, r = _post(live_daemon, "/completion", dict(common, prompt=[ids[0], text, ids[0]]))
    assert code == 200 and r["tokens_evaluated"] == 2 + len(ids)
    for bad in ({"prompt_string": text, "multimodal_data": ["aGk="]}, [ids, 5.5], [10 ** 9], ["x"] * 65):
        code, r = _post(live_daemon, "/completion", dict(common, prompt=bad))
        assert code == 400 and r["error"]["param"] == "prompt", bad
    code, r = _post(live_daemon, "/completion", dict(common, prompt=[text, text], stream=True))
    assert code == 400 and r["error"]["param"] == "stream"


def test_completion_ignore_eos_lists_the_banned_tokens(live_daemon):
    # llama-server's generation_settings show ignore_eos's ban as a null (-inf) bias per EOG token
    code, r = _post(live_daemon, "/completion", {"prompt": "Once upon a time", "n_predict": 2,
                                                 "ignore_eos": True, "logit_bias": [[11, -5]]})
    assert code == 200
    bias = r["generation_settings"]["logit_bias"]
    assert {"token": 11, "bias": -5.0} in bias
    eog = [b["token"] for b in bias if b["bias"] is None]
    assert 151645 in eog and 151643 in eog  # Qwen2's <|im_end|>, <|endoftext|>
    code, r = _post(live_daemon, "/completion", {"prompt": "Once upon a time", "n_predict": 2})
    assert code == 200 and r["generation_settings"]["logit_bias"] == []


def test_completion_stream_chunks(live_daemon):
    chunks = _stream(live_daemon, "/completion", {"prompt": "Hello", "n_predict": 3, "timings_per_token": True,
                                                  "return_progress": True})
    assert chunks[-1]["stop"] is True and chunks[-1]["stop_type"] == "limit"
    progress = [c for c in chunks if "prompt_progress" in c]
    assert progress and progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    # with timings_per_token the progress chunks carry the prompt's timings so far: none at the
    # first (the slot is given, nothing computed), the prefilled tokens at the last
    first, last = progress[0]["timings"], progress[-1]["timings"]
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0 and first["predicted_n"] == 0
    pp = progress[-1]["prompt_progress"]
    assert last["prompt_n"] == pp["processed"] - pp["cache"] and last["prompt_ms"] > 0
    deltas = [c for c in chunks if not c["stop"] and c.get("content")]
    assert deltas and all("timings" in c for c in deltas)


def test_responses_stream_progress_and_timings(live_daemon):
    # llama-server's telemetry in a Responses stream: response.in_progress events with
    # prompt_progress, timings on each delta event and on response.completed
    chunks = _stream(live_daemon, "/v1/responses", {"input": "This is a test " * 6, "max_output_tokens": 3,
                                                    "timings_per_token": True, "return_progress": True})
    progress = [c for c in chunks if "prompt_progress" in c]
    assert progress and all(c["type"] == "response.in_progress" and "timings" in c for c in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    deltas = [c for c in chunks if c["type"] in ("response.output_text.delta", "response.reasoning_text.delta")]
    assert deltas and all("prompt_per_second" in c["timings"] for c in deltas)
    done = chunks[-1]
    assert done["type"] == "response.completed" and done["timings"]["predicted_n"] == 3
    plain = _stream(live_daemon, "/v1/responses", {"input": "Hi", "max_output_tokens": 2})
    assert not any("prompt_progress" in c for c in plain)
    assert [c["type"] for c in plain if "timings" in c] == ["response.completed"]


def test_tokenize_detokenize_apply_template_input_tokens(live_daemon):
    code, r = _post(live_daemon, "/tokenize", {"content": "hello world", "with_pieces": True})
    assert code == 200 and [p["piece"] for p in r["tokens"]] == ["hello", " world"]
    ids = [p["id"] for p in r["tokens"]]
    assert _post(live_daemon, "/tokenize", {"content": "hello world"})[1] == {"tokens": ids}
    assert _post(live_daemon, "/detokenize", {"tokens": ids})[1] == {"content": "hello world"}
    assert _post(live_daemon, "/detokenize", {"tokens": [10 ** 9]})[0] == 400
    code, r = _post(live_daemon, "/apply-template", {"messages": MSGS})
    assert code == 200 and "What is the best book?" in r["prompt"]
    n_template = len(_post(live_daemon, "/tokenize", {"content": r["prompt"]})[1]["tokens"])
    code, r = _post(live_daemon, "/chat/completions/input_tokens", {"messages": MSGS})
    assert code == 200 and r["input_tokens"] == n_template


# the keys of llama-server's GET /props answer (tools/server of the pinned sdist, get_res_props)
LLAMA_PROPS_KEYS = {"default_generation_settings", "total_slots", "model_alias", "model_ftype", "model_path",
                    "modalities", "media_marker", "endpoint_slots", "endpoint_props", "endpoint_metrics", "ui",
                    "ui_settings", "chat_template", "chat_template_caps", "bos_token", "eos_token", "build_info",
                    "is_sleeping", "cors_proxy_enabled"}


def test_props_web_ui_request_and_slots(live_daemon):
    from ostinatod.synth.writer import chat_template

    # the llama.cpp web UI's request (its PropsService: GET ./props?autoload=false)
    code, p, _ = _get(live_daemon, "/props?autoload=false")
    assert code == 200
    assert set(p) >= LLAMA_PROPS_KEYS
    assert p["default_generation_settings"]["n_ctx"] == 2048 and p["total_slots"] == 2
    assert set(p["default_generation_settings"]["params"]) >= {"n_predict", "temperature", "top_k", "top_p"}
    assert p["model_path"].endswith(".gguf") and p["model_ftype"]
    assert p["modalities"] == {"vision": False, "video": False, "audio": False}
    # the template the synthetic model's GGUF holds (the web UI reads it; llama.cpp trims its end)
    assert p["chat_template"].strip() == chat_template().strip()
    # read-only, refused as llama-server refuses it without --props
    code, r = _post(live_daemon, "/props", {})
    assert code == 501 and r["error"]["type"] == "not_supported_error"
    code, slots, _ = _get(live_daemon, "/slots")
    assert code == 200 and [s["id"] for s in slots] == [0, 1]
    assert all(s["n_ctx"] == 2048 and s["is_processing"] is False for s in slots)


# llama.vscode's chunk of another file for its ring of extra context ({"text", "time", "filename"})
VSCODE_CHUNK = {"text": "def sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
                "time": 1764970000000, "filename": "/home/u/proj/util.py"}


def test_infill_llama_vscode_requests(live_daemon):
    # the two /infill bodies llama.vscode sends (src/llama-server.ts, createRequestPayload): first
    # its ring update, which only evaluates the extra context into the cache (n_predict 0) ...
    ring = {"input_prefix": "", "input_suffix": "", "input_extra": [VSCODE_CHUNK], "prompt": "",
            "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    code, r = _post(live_daemon, "/infill", ring)
    assert code == 200, r
    assert r["content"] == "" and r["tokens_predicted"] == 0 and r["stop_type"] == "limit"
    assert r["timings"]["predicted_n"] == 0 and r["tokens_evaluated"] > 0
    # ... then a completion at the cursor (its n_predict is 128 by default; 8 here), which finds
    # the extra context in the cache
    fim = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
           "input_extra": [VSCODE_CHUNK], "prompt": "    return ", "n_predict": 8, "top_k": 40, "top_p": 0.99,
           "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
           "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}
    code, r = _post(live_daemon, "/infill", fim)
    assert code == 200, r
    # what llama.vscode reads (its LlamaResponse)
    assert isinstance(r["content"], str) and isinstance(r["tokens_cached"], int) and r["truncated"] is False
    assert isinstance(r["generation_settings"], dict)
    t = r["timings"]
    assert {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
            "predicted_per_second"} <= set(t) and 1 <= t["predicted_n"] <= 8
    assert t["cache_n"] > 0  # the ring update's tokens were reused


def test_infill_llama_vim_request(live_daemon):
    # the body llama.vim sends on each keystroke (it names the fields it reads)
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
            "prompt": "    return ", "n_predict": 4, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                                "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                                "tokens_cached"]}
    code, r = _post(live_daemon, "/infill", body)
    assert code == 200, r
    assert set(r) == set(body["response_fields"])
    assert isinstance(r["content"], str) and 1 <= r["timings/predicted_n"] <= 4 and r["truncated"] is False
    code, r = _post(live_daemon, "/infill", dict(body, input_extra=[{"filename": 1, "text": "x"}]))
    assert code == 400 and "filename" in r["error"]["message"]


def test_infill_prompt_layout_and_missing_fim_tokens():
    def tok(text: str) -> list[int]:  # one token per character, ids from 1000
        return [1000 + ord(c) for c in text]

    fim = FimTokens(pre=1, suf=2, mid=3, rep=4, sep=5)
    got = infill_tokens(fim, tok, "ab", "cd", [{"filename": "f", "text": "x"}], "p", n_batch=64,
                        n_predict=4, n_ctx=512)
    assert got == ([4] + tok("myproject\n") + [5] + tok("f\n") + tok("x") + [5] + tok("filename\n")
                   + [1] + tok("ab") + tok("p") + [2] + tok("cd") + [3])
    # prefix keeps its end, suffix its start (3:1 of the batch)
    got = infill_tokens(FimTokens(1, 2, 3), tok, "0123456789", "abcdefgh", [], "", n_batch=8,
                        n_predict=4, n_ctx=512)
    assert got == [1] + tok("456789") + [2] + [3]
    with pytest.raises(EngineError) as e:
        infill_tokens(FimTokens(NULL, 2, NULL), tok, "a", "b", [], "", 64, 4, 512)
    assert e.value.status == 400 and "prefix token is missing" in e.value.message
    assert "middle token is missing" in e.value.message and "suffix" not in e.value.message


def test_grammar_and_json_schema_enforced(live_daemon):
    code, r = _post(live_daemon, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 8,
                                                          "grammar": 'root ::= "a"{5,5}'})
    assert code == 200 and r["choices"][0]["message"]["content"] == "aaaaa"
    code, r = _post(live_daemon, "/completion", {"prompt": "x", "n_predict": 16, "json_schema": {"const": "42"}})
    assert code == 200 and json.loads(r["content"]) == "42"
    code, r = _post(live_daemon, "/completion", {"prompt": "x", "grammar": 'root ::= "b" | "c"', "n_predict": 4})
    assert code == 200 and r["content"] in ("b", "c")
    code, r = _post(live_daemon, "/chat/completions", {"messages": MSGS, "grammar": "root ::= (unclosed"})
    assert code == 400 and r["error"]["code"] == "invalid_grammar"
    assert "expecting ')' at the end of the grammar" in r["error"]["message"]
    code, r = _post(live_daemon, "/completion", {"prompt": "x", "grammar": "root ::= missing"})
    assert code == 400 and "Undefined rule identifier 'missing'" in r["error"]["message"]


def test_chat_stream_timings_per_token_and_progress(live_daemon):
    chunks = _stream(live_daemon, "/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 3, "timings_per_token": True, "return_progress": True,
        "stream_options": {"include_usage": True}})
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress[0]["cache"] == progress[0]["processed"] and progress[-1]["processed"] == progress[-1]["total"]
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and all("timings" in c for c in content)
    assert chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"]
    plain = _stream(live_daemon, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
    assert not any("prompt_progress" in c for c in plain) and "timings" in plain[-1]
    assert not any("timings" in c for c in plain[:-1])


def test_context_overflow_names_prompt_tokens_and_context(live_daemon):
    code, r = _post(live_daemon, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]})
    assert code == 400 and r["error"]["code"] == "context_length_exceeded"
    assert r["error"]["n_ctx"] == 2048 and r["error"]["n_prompt_tokens"] > 2048


@pytest.mark.parametrize("extra,messages", [
    ({"add_generation_prompt": True, "continue_final_message": True}, None),
    ({"continue_final_message": True}, None),  # add_generation_prompt is true by default
    ({}, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "assistant", "content": "c"}]),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, None),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, None),
    ({"grammar": 'root ::= "a"', "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, None),
])
def test_contradictory_chat_options_are_400s(live_daemon, extra, messages):
    msgs = messages or [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    code, r = _post(live_daemon, "/chat/completions", dict(extra, messages=msgs, max_tokens=1))
    assert code == 400 and r["error"]["code"] == "invalid_request"


def test_metrics_llamacpp_series(live_daemon):
    assert _post(live_daemon, "/completion", {"prompt": "Hello", "n_predict": 2})[0] == 200
    code, text, headers = _get(live_daemon, "/metrics")
    assert code == 200 and int(headers["Process-Start-Time-Unix"]) > 0
    series = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.split(" ")
            series[name] = float(value)
            assert f"# TYPE {name} " in text and f"# HELP {name} " in text
    assert series["llamacpp:tokens_predicted_total"] >= 2 and series["llamacpp:n_decode_total"] > 0
    assert series["llamacpp:prompt_tokens_total"] > 0 and series["llamacpp:requests_processing"] == 0
    assert {"llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
            "llamacpp:prompt_tokens_cached_total"} <= set(series)
