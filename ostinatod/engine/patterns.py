"""The cost of a request's grammar, judged before any of it is built (pure functions).

Why: llama.cpp's grammar sampler keeps one parse stack for every way the text so far can be split
among the grammar's open repetitions, and advances all of them on every candidate token. A regex
``pattern`` of many adjacent repeated alternations (``(a|b|c)*`` 32 times) makes that work grow
with the number of ways: 32 groups kept one native call busy for 13 s and 64 for minutes. Nested repetitions (``((a|b)*)*``) and deep nesting grow it the same way, and a counted
repetition ``x{0,100000}`` is expanded by llama.cpp into that many copies of ``x``. An ``enum``
is one alternation of all its values and its text goes into the prompt: it is counted by values.

:func:`regex_cost` and :func:`gbnf_cost` measure a regex pattern (JSON schema ``pattern``) and a
GBNF grammar by the same four figures (:class:`Cost`); :func:`check_request_grammar` applies the
limits (:class:`GrammarLimits`, from the settings) to a request's tools, response schema and
grammar and raises EngineError 400 ``grammar_too_complex`` naming the parameter and the limit.
Patterns llama.cpp cannot enforce (it would accept any string) are refused with 400
``invalid_request`` the same way on every route.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    from ..settings import Settings

from .types import EngineError


@dataclass(frozen=True)
class Cost:
    """Figures of one pattern or grammar.

    ``depth``: deepest nesting of groups. ``ambiguity``: the most alternatives within one run of
    adjacent variable-count items (``*``, ``+``, ``?``, ``{m,n}`` with m < n) of one sequence,
    each item counting 1 + its alternatives (``[abc]*`` 2, ``(a|b|c)*`` 4): the ways the
    sampler's stacks multiply. Measured on the tiny test model (16 tokens, 2-core machine):
    ``[abc]*`` 12 times (24) 0.9 s, 24 times 5.4 s, 32 times 21 s; ``(a|b|c)*`` 6 times (24)
    1.1 s, 12 times 6.0 s, 16 times 15.4 s; nesting alone stays cheap (16 deep: 0.5 s). ``star_height``: variable-count repetitions
    nested in one another. ``expansion``: grammar elements once counted repetitions are expanded
    (``x{3}`` is three copies of ``x``)."""

    depth: int = 0
    ambiguity: int = 0
    star_height: int = 0
    expansion: int = 0


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds of :func:`check_request_grammar` (settings of the same names)."""

    max_pattern_depth: int = 16
    max_pattern_ambiguity: int = 24
    max_pattern_star_height: int = 3
    max_pattern_expansion: int = 4096
    max_pattern_length: int = 2048


@dataclass
class _Item:
    alts: int = 1         # alternatives it offers at one position
    variable: bool = False
    height: int = 0
    expansion: int = 1


class _Frame:
    """One group being parsed: its finished branches and the sequence being read."""

    def __init__(self) -> None:
        self.seq: list[_Item] = []
        self.branches: list[list[_Item]] = []

    def close_branch(self, acc: dict[str, int]) -> None:
        run = 0
        for it in self.seq:
            run = run + 1 + it.alts if it.variable else 0
            acc["ambiguity"] = max(acc["ambiguity"], run)
        self.branches.append(self.seq)
        self.seq = []

    def as_item(self) -> _Item:
        items = [it for b in self.branches for it in b]
        return _Item(alts=sum(max([it.alts for it in b] or [1]) for b in self.branches) or 1,
                     height=max([it.height for it in items] or [0]),
                     expansion=1 + sum(it.expansion for it in items))


_QUANT = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")


def _quantify(item: _Item, lo: int, hi: Optional[int]) -> _Item:
    """``item`` repeated ``lo`` to ``hi`` times (None: unbounded), as llama.cpp expands it."""
    variable = hi is None or hi > lo
    copies = max(1, hi if hi is not None else lo + 1)
    return _Item(alts=item.alts, variable=variable, height=item.height + (1 if variable else 0),
                 expansion=item.expansion * copies)


class _Parser:
    """Shared walk of regex and GBNF text: atoms, groups, alternation, quantifiers."""

    def __init__(self, limit_depth: int):
        self.limit_depth = limit_depth  # stop descending (the text is refused anyway)
        self.acc = {"depth": 0, "ambiguity": 0}
        self.stack = [_Frame()]

    def atom(self) -> None:
        self.stack[-1].seq.append(_Item())

    def open(self) -> bool:
        self.stack.append(_Frame())
        self.acc["depth"] = max(self.acc["depth"], len(self.stack) - 1)
        return len(self.stack) - 1 <= self.limit_depth

    def close(self) -> None:
        if len(self.stack) == 1:
            return  # unbalanced: llama.cpp's parser refuses it; nothing to count
        f = self.stack.pop()
        f.close_branch(self.acc)
        self.stack[-1].seq.append(f.as_item())

    def bar(self) -> None:
        self.stack[-1].close_branch(self.acc)

    def quant(self, lo: int, hi: Optional[int]) -> None:
        seq = self.stack[-1].seq
        if seq:
            seq[-1] = _quantify(seq[-1], lo, hi)

    def counted(self, text: str, i: int) -> int:
        """Parse ``{m}``, ``{m,}``, ``{m,n}`` at ``text[i]``; returns the index after it (or
        ``i + 1`` when it is not a quantifier: a literal brace)."""
        m = _QUANT.match(text, i)
        if not m:
            self.atom()
            return i + 1
        lo = int(m.group(1) or 0)
        hi: Optional[int] = lo if not m.group(2) else (int(m.group(3)) if m.group(3) else None)
        self.quant(lo, hi)
        return m.end()

    def finish(self) -> Cost:
        while len(self.stack) > 1:
            self.close()
        top = self.stack[0]
        top.close_branch(self.acc)
        it = top.as_item()
        return Cost(depth=self.acc["depth"], ambiguity=self.acc["ambiguity"], star_height=it.height,
                    expansion=it.expansion - 1)


def _skip_class(text: str, i: int) -> int:
    """Index after the character class that opens at ``text[i] == '['``."""
    i += 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def regex_cost(pattern: str, limit_depth: int = 1000) -> Cost:
    """The :class:`Cost` of a JSON schema regex ``pattern`` (ECMAScript syntax as llama.cpp's
    converter reads it). Never raises: a malformed pattern is measured as far as it goes.
    Nesting deeper than ``limit_depth`` is not descended into (its depth is reported)."""
    p = _Parser(limit_depth)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            p.atom()
            i += 2
        elif c == "[":
            p.atom()
            i = _skip_class(pattern, i)
        elif c == "(":
            if not p.open():
                break
            i += 3 if pattern.startswith("?:", i + 1) else 1
        elif c == ")":
            p.close()
            i += 1
        elif c == "|":
            p.bar()
            i += 1
        elif c in "*+?":
            if c != "?" or not (i > 0 and pattern[i - 1] in "*+}"):  # not a lazy marker
                p.quant(0 if c != "+" else 1, 1 if c == "?" else None)
            i += 1
        elif c == "{":
            i = p.counted(pattern, i)
        elif c in "^$":
            i += 1
        else:
            p.atom()
            i += 1
    return p.finish()


_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.M)


def gbnf_cost(gbnf: str, limit_depth: int = 1000) -> Cost:
    """The :class:`Cost` of a GBNF grammar: the worst figure of any of its rules (each rule body
    measured as a regex is; a rule reference is one atom). Never raises."""
    worst = Cost()
    starts = [m.end() for m in _RULE.finditer(gbnf)] or [0]
    ends = [m.start() for m in _RULE.finditer(gbnf)][1:] + [len(gbnf)]
    for a, b in zip(starts, ends):
        c = _rule_cost(gbnf[a:b], limit_depth)
        worst = Cost(max(worst.depth, c.depth), max(worst.ambiguity, c.ambiguity),
                     max(worst.star_height, c.star_height), max(worst.expansion, c.expansion))
    return worst


def _rule_cost(body: str, limit_depth: int) -> Cost:
    p = _Parser(limit_depth)
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            j = i + 1
            while j < n and body[j] != '"':
                j += 2 if body[j] == "\\" else 1
            p.atom()
            i = j + 1
        elif c == "[":
            p.atom()
            i = _skip_class(body, i)
        elif c == "#":
            j = body.find("\n", i)
            i = n if j < 0 else j + 1
        elif c == "(":
            if not p.open():
                break
            i += 1
        elif c == ")":
            p.close()
            i += 1
        elif c == "|":
            p.bar()
            i += 1
        elif c in "*+?":
            p.quant(0 if c != "+" else 1, 1 if c == "?" else None)
            i += 1
        elif c == "{":
            i = p.counted(body, i)
        elif c.isspace():
            i += 1
        else:
            j = i
            while j < n and (body[j].isalnum() or body[j] in "_-."):
                j += 1
            p.atom()
            i = max(j, i + 1)
    return p.finish()


def _over(cost: Cost, lim: GrammarLimits) -> Optional[str]:
    """What of ``cost`` is over ``lim`` (a phrase naming the limit), or None."""
    if cost.depth > lim.max_pattern_depth:
        return f"groups nested {cost.depth} deep (limit max_pattern_depth = {lim.max_pattern_depth})"
    if cost.star_height > lim.max_pattern_star_height:
        return (f"repetitions nested {cost.star_height} deep (limit max_pattern_star_height = "
                f"{lim.max_pattern_star_height})")
    if cost.ambiguity > lim.max_pattern_ambiguity:
        return (f"{cost.ambiguity} alternatives under adjacent repetitions (limit "
                f"max_pattern_ambiguity = {lim.max_pattern_ambiguity})")
    if cost.expansion > lim.max_pattern_expansion:
        return (f"{cost.expansion} grammar elements once its counted repetitions are expanded (limit "
                f"max_pattern_expansion = {lim.max_pattern_expansion})")
    return None


def check_pattern(pattern: str, where: str, lim: GrammarLimits) -> None:
    """Raise EngineError 400 when the regex ``pattern`` (found at parameter ``where``) is too
    costly (``grammar_too_complex``) or one llama.cpp cannot enforce (``invalid_request``: not
    anchored with ``^`` and ``$``, lookaround, named groups, flags; llama.cpp would accept any
    string in its place). The error's ``extra`` holds ``param``."""
    extra = {"param": where}
    if len(pattern) > lim.max_pattern_length:
        raise EngineError("grammar_too_complex", f"{where}: the pattern is {len(pattern)} characters "
                          f"(limit max_pattern_length = {lim.max_pattern_length})", 400, extra)
    why = _over(regex_cost(pattern, lim.max_pattern_depth), lim)
    if why:
        raise EngineError("grammar_too_complex", f"{where}: the pattern's grammar would be too costly "
                          f"to sample: {why}; simplify the pattern", 400, extra)
    unsupported = unenforceable(pattern)
    if unsupported:
        raise EngineError("invalid_request", f"{where}: the JSON schema cannot be enforced: pattern "
                          f"{pattern} is not supported ({unsupported}); llama.cpp's grammar would accept "
                          "any string in its place", 400, extra)


_REGEX_ESCAPES = set("^$.[]()|{}*+?")   # \\x of these is the character itself (llama.cpp)
_GBNF_ESCAPES = {"x": 2, "u": 4, "U": 8, **{c: 0 for c in 'trn\\"[]-'}}  # kept by the grammar
_HEX = set("0123456789abcdefABCDEF")


def _escape_len(p: str, i: int) -> int:
    """Length of the escape ``p[i:]`` (``\\``...) llama.cpp's grammar keeps, 0 if none."""
    n_hex = _GBNF_ESCAPES.get(p[i + 1]) if i + 1 < len(p) else None
    if n_hex is None or i + 2 + n_hex > len(p) or not set(p[i + 2:i + 2 + n_hex]) <= _HEX:
        return 0
    return 2 + n_hex


def unenforceable(pattern: str) -> Optional[str]:
    """Why llama.cpp's JSON-schema converter cannot turn ``pattern`` into a grammar (it then
    accepts any string in its place), or None. Mirrors its reader: the pattern must be anchored
    with ``^`` and ``$`` and hold no anchor inside, no group syntax but ``(?:``, only the escapes
    its grammar keeps (``\\d``, ``\\w``, ``\\s`` are not among them), and well-formed counts."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        return "not anchored with '^' and '$'"
    p = pattern[1:-1]
    i, n = 0, len(p)
    while i < n:
        c = p[i]
        if c == "\\":
            if i + 1 < n and p[i + 1] in _REGEX_ESCAPES:
                i += 2
                continue
            k = _escape_len(p, i)
            if not k:
                return f"unsupported escape: {p[i:i + 2]}"
            i += k
        elif c == "[":
            i += 1
            while i < n and p[i] != "]":
                if p[i] == "\\":
                    k = _escape_len(p, i)
                    if not k:
                        return f"unsupported escape in character class: {p[i:i + 2]}"
                    i += k
                else:
                    i += 1
            i += 1
        elif c == "(":
            if p.startswith("?", i + 1) and not p.startswith("?:", i + 1):
                return "unsupported group syntax"
            i += 1
        elif c in "^$":
            return "anchor inside the pattern"
        elif c == "{":
            j = p.find("}", i)
            if j < 0:
                return "unterminated curly brackets"
            nums = p[i + 1:j].split(",")
            if len(nums) > 2 or not all(x.strip().isdigit() or (x == "" and len(nums) == 2) for x in nums):
                return "invalid counts in curly brackets"
            i = j + 1
        elif c in "]}":
            return f"unsupported character: {c}"
        else:
            i += 1
    return None


_NOT_SCHEMA = ("enum", "const", "default", "examples", "example")  # values, not schemas


def schema_patterns(schema: Any, where: str) -> Iterator[tuple[str, str]]:
    """``(path, pattern)`` of every string ``pattern`` keyword in the JSON schema ``schema``
    (walked without recursion; enum, const, default and examples values are not schemas)."""
    stack: list[tuple[Any, str]] = [(schema, where)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, dict):
            pat = v.get("pattern")
            if isinstance(pat, str):
                yield f"{path}.pattern", pat
            for k, x in v.items():
                if k not in _NOT_SCHEMA and isinstance(x, (dict, list)):
                    stack.append((x, f"{path}.{k}"))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{j}]") for j, x in enumerate(v) if isinstance(x, (dict, list)))


def tool_where(i: int, tool: Any) -> str:
    """How a tool's schema is named in an error: ``tools[i] (name).parameters``."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    name = (fn or tool or {}).get("name") if isinstance(fn or tool, dict) else None
    return f"tools[{i}]" + (f" ({name})" if isinstance(name, str) else "") + ".parameters"


def limits_of(settings: Settings) -> GrammarLimits:
    """The :class:`GrammarLimits` of a :class:`~ostinatod.settings.Settings`."""
    return GrammarLimits(settings.max_pattern_depth, settings.max_pattern_ambiguity,
                         settings.max_pattern_star_height, settings.max_pattern_expansion,
                         settings.max_pattern_length)


def check_request_grammar(tools: Optional[list[Any]], json_schema: Optional[Any],
                          gbnf: Optional[str], lim: GrammarLimits) -> None:
    """Apply :func:`check_pattern` to every pattern of the request's tool parameters and response
    schema, and the same cost limits to its GBNF ``grammar``. Raises EngineError 400 (see
    :func:`check_pattern`); ``param`` names ``tools[i] (name).parameters.…``,
    ``json_schema.…`` or ``grammar``."""
    for i, tool in enumerate(tools or []):
        if isinstance(tool, dict):
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            params = fn.get("parameters", fn.get("input_schema"))
            for where, pat in schema_patterns(params, tool_where(i, tool)):
                check_pattern(pat, where, lim)
    if json_schema is not None:
        for where, pat in schema_patterns(json_schema, "json_schema"):
            check_pattern(pat, where, lim)
    if gbnf is not None:
        why = _over(gbnf_cost(gbnf, lim.max_pattern_depth), lim)
        if why:
            raise EngineError("grammar_too_complex", f"grammar: too costly to sample: {why}; simplify "
                              "the grammar", 400, {"param": "grammar"})
