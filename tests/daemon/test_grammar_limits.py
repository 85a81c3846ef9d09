"""Grammar work is bounded before it starts: regex patterns, GBNF grammars and
enums are judged for cost (:mod:`ostinatod.engine.patterns`, :mod:`ostinatod.engine.limits`) and
refused with a 400 naming the parameter and the limit, the same way on every route. Pure parts
first, then the shared live daemon (real HTTP, subprocess worker)."""

from __future__ import annotations

import json

import pytest

from helpers import post
from ostinatod.engine import limits, patterns
from ostinatod.engine.patterns import GrammarLimits, gbnf_cost, regex_cost, unenforceable
from ostinatod.engine.types import EngineError

STALL_PATTERN = "^" + "(a|b|c)*" * 64 + "$"  # a 702-byte request that stalled the engine
SEMVER = (r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(?:-((?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-]"
          r"[0-9a-zA-Z-]*)(?:\.(?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+"
          r"(?:\.[0-9a-zA-Z-]+)*))?$")


# ---- pure: cost figures -------------------------------------------------------------------------

def test_regex_cost_counts_adjacent_repetitions_nesting_and_expansion():
    assert regex_cost(STALL_PATTERN).ambiguity == 64 * 4
    assert regex_cost("^" + "[abc]*" * 12 + "$").ambiguity == 24
    assert regex_cost("^[a-z]+(-[a-z]+)*$") == patterns.Cost(depth=1, ambiguity=4, star_height=2, expansion=6)
    assert regex_cost("^[0-9a-f]{8}-[0-9a-f]{4}$").ambiguity == 0   # fixed counts are not ambiguous
    assert regex_cost("^.{0,100000}$").expansion == 100000
    assert regex_cost("^" + "(" * 200 + "a" + ")" * 200 + "$", limit_depth=16).depth == 17
    assert regex_cost("^((a|b)*)*$").star_height == 2
    assert regex_cost("^a*?b$").ambiguity == 2  # a lazy marker is not another repetition
    # a run is broken by a fixed item, and alternation restarts it
    assert regex_cost("^[a-z]*x[a-z]*x[a-z]*$").ambiguity == 2
    assert regex_cost("^([a-z]*[0-9]*|[a-z]*)$").ambiguity == 4
    assert regex_cost("^((((a)))$").depth == 4  # malformed: measured as far as it goes, no raise


def test_gbnf_cost_takes_the_worst_rule():
    assert gbnf_cost("root ::= " + '("a"|"b"|"c")* ' * 64).ambiguity == 256
    json_gbnf = ('root ::= object\nvalue ::= object | array | string | number | ("true" | "false" | '
                 '"null") ws\nobject ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? '
                 '"}" ws\narray ::= "[" ws ( value ("," ws value)* )? "]" ws\nstring ::= "\\"" ( [^"\\\\] '
                 '| "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\\"" ws\nnumber ::= ("-"? ([0-9] | '
                 '[1-9] [0-9]{0,15})) ws\nws ::= | " " | "\\n" [ \\t]{0,20}  # comment (a|b)*\n')
    c = gbnf_cost(json_gbnf)
    assert c.ambiguity <= 6 and c.star_height <= 2 and c.depth <= 3


def test_unenforceable_mirrors_llama_cpp_reader():
    assert unenforceable("^[a-z]+$") is None
    assert unenforceable(r"^\.\x41[\-]{2,}a{,3}$") is None
    assert unenforceable(SEMVER) is None
    assert unenforceable("[a-z]+") == "not anchored with '^' and '$'"
    assert unenforceable(r"^\d+$") == r"unsupported escape: \d"
    assert unenforceable(r"^[\.]$") == r"unsupported escape in character class: \."
    assert unenforceable("^(?=a)b$") == "unsupported group syntax"
    assert unenforceable("^a^b$") == "anchor inside the pattern"
    assert unenforceable("^a{x}$") == "invalid counts in curly brackets"
    assert unenforceable("^a}$") == "unsupported character: }"


def test_check_request_grammar_names_the_parameter_and_the_limit():
    lim = GrammarLimits()
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": STALL_PATTERN}}}}}
    with pytest.raises(EngineError) as e:
        patterns.check_request_grammar([tool], None, None, lim)
    assert e.value.code == "grammar_too_complex" and e.value.status == 400
    assert e.value.extra["param"] == "tools[0] (f).parameters.properties.code.pattern"
    assert "max_pattern_ambiguity = 24" in e.value.message
    with pytest.raises(EngineError) as e:
        patterns.check_request_grammar(None, {"type": "string", "pattern": "^.{0,100000}$"}, None, lim)
    assert e.value.extra["param"] == "json_schema.pattern" and "max_pattern_expansion" in e.value.message
    with pytest.raises(EngineError) as e:
        patterns.check_request_grammar(None, {"items": [{"pattern": "[a-z]"}]}, None, lim)
    assert e.value.code == "invalid_request" and e.value.extra["param"] == "json_schema.items[0].pattern"
    with pytest.raises(EngineError) as e:
        patterns.check_request_grammar(None, None, "root ::= " + '("a"|"b")* ' * 20, lim)
    assert e.value.extra["param"] == "grammar"
    # enum values and defaults are values, not schemas; a sane pattern passes
    patterns.check_request_grammar(None, {"enum": [{"pattern": "x"}], "default": {"pattern": "y"},
                                          "properties": {"v": {"pattern": SEMVER}}}, None, lim)


def test_schema_size_counts_enum_values():
    enum_tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": list(range(20000))}}}}}
    n, _ = limits.schema_size([enum_tool], 8000)
    assert n == 8001  # capped: counting stops past the cap
    with pytest.raises(EngineError) as e:
        limits.check_schema_size([enum_tool], None, 8000, 256)
    assert e.value.code == "schema_too_large" and "enum" in e.value.message


# ---- live: the same rule on every route ---------------------------------------------------------

def _post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    return post(url + path, json.dumps(body).encode(), headers)


MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": STALL_PATTERN}}}
BAD_TOOL = {"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]+"}}}}}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "json_schema.properties.a.pattern"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "json_schema": SCHEMA},
     "json_schema.properties.a.pattern"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "json_schema": SCHEMA}, "json_schema.properties.a.pattern"),
    ("/completion", {"prompt": "x", "n_predict": 2, "grammar": "root ::= " + '("a"|"b"|"c")* ' * 64}, "grammar"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": SCHEMA}}}, "json_schema.properties.a.pattern"),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "tools": [BAD_TOOL]},
     "tools[0] (t).parameters.properties.s.pattern"),
])
def test_every_route_refuses_a_costly_or_unenforceable_pattern(live_daemon, path, body, param):
    code, r = _post(live_daemon.url, path, dict(body, model="tiny-qwen3moe"))
    assert code == 400, r
    assert r["error"]["code"] in ("grammar_too_complex", "invalid_request")
    assert r["error"]["param"] == param
    assert "max_pattern_ambiguity" in r["error"]["message"] or "not anchored" in r["error"]["message"]


def test_anthropic_tool_pattern_and_huge_enum_are_refused(live_daemon):
    tool = {"name": "t", "input_schema": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": STALL_PATTERN}}}}
    code, r = _post(live_daemon.url, "/v1/messages", {"model": "tiny-qwen3moe", "max_tokens": 2, "messages": MSGS,
                                                      "tools": [tool]})
    assert code == 400 and "grammar_too_complex" in r["error"]["message"]
    assert "max_pattern_ambiguity" in r["error"]["message"]
    enum_tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "enum": list(range(20000))}}}}}
    code, r = _post(live_daemon.url, "/v1/chat/completions", {"model": "tiny-qwen3moe", "max_tokens": 2, "messages": MSGS,
                                                              "tools": [enum_tool]})
    assert code == 400 and r["error"]["code"] == "schema_too_large"
    # a sane pattern on a tool is served
    ok = {"type": "function", "function": {"name": "v", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": SEMVER}}}}}
    code, r = _post(live_daemon.url, "/v1/chat/completions", {"model": "tiny-qwen3moe", "max_tokens": 2, "messages": MSGS,
                                                              "tools": [ok]})
    assert code == 200, r
