"""Chat templates and output parsing through llama.cpp's ``common/chat`` (our native shim).

:class:`ChatTemplates` renders OpenAI-shaped messages with the model's own chat template (Jinja,
tool-call grammar, stop words); :class:`ChatParser` parses the generated text — reasoning, content and
tool calls, also partially while streaming — and yields OpenAI-style diffs. Nothing here parses model
output itself: the PEG parsers and template handlers are llama.cpp's.

Errors: :class:`~ostinatod.engine.types.EngineError` with code ``invalid_request`` (bad messages,
tools, tool_choice) or ``template_error`` (the template failed to render).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from . import native
from .patterns import schema_patterns
from .types import EngineError

log = logging.getLogger("ostinatod.engine")


@dataclass
class RenderedPrompt:
    """Result of applying the chat template (fields of llama.cpp's ``common_chat_params``).

    ``raw`` is the shim's JSON result, needed to build the grammar sampler and the parser.
    ``grammar_lazy`` grammars only constrain output after one of ``grammar_triggers`` appears.
    ``sampler_raw``, when set, is the apply result the sampler takes instead of ``raw`` (a forced
    tool call: :func:`forced_call_result`).
    """

    prompt: str
    format_name: str
    grammar: str
    grammar_lazy: bool
    additional_stops: list[str]
    preserved_tokens: list[str]
    generation_prompt: str
    supports_thinking: bool
    raw: str = field(repr=False)
    sampler_raw: Optional[str] = field(default=None, repr=False)

    @classmethod
    def from_result(cls, res: dict[str, Any]) -> "RenderedPrompt":
        return cls(prompt=res["prompt"], format_name=res.get("format_name", ""),
                   grammar=res.get("grammar", ""), grammar_lazy=bool(res.get("grammar_lazy")),
                   additional_stops=list(res.get("additional_stops") or []),
                   preserved_tokens=list(res.get("preserved_tokens") or []),
                   generation_prompt=res.get("generation_prompt", ""),
                   supports_thinking=bool(res.get("supports_thinking")), raw=json.dumps(res))


def _text_of_parts(parts: list[Any]) -> list[dict[str, str]]:
    out = []
    for p in parts:
        if isinstance(p, str):
            out.append({"type": "text", "text": p})
        elif isinstance(p, dict) and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif isinstance(p, dict) and p.get("type") in ("image_url", "image", "input_image"):
            out.append({"type": "text", "text": "[image omitted]"})  # text-only models
        else:
            raise EngineError("invalid_request", f"unsupported content part: {json.dumps(p)[:200]}")
    return out


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages in the exact shape common/chat accepts: ``None`` fields dropped,
    non-text parts rejected, tool call ``type`` defaulted, dict arguments serialised.

    Raises EngineError("invalid_request") for shapes that cannot be rendered.
    """
    if not isinstance(messages, list) or not messages:
        raise EngineError("invalid_request", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise EngineError("invalid_request", f"messages[{i}] must be an object with a 'role'")
        n: dict[str, Any] = {"role": m["role"]}
        content = m.get("content")
        if isinstance(content, list):
            n["content"] = _text_of_parts(content)
        elif content is None:
            n["content"] = ""
        elif isinstance(content, str):
            n["content"] = content
        else:
            raise EngineError("invalid_request", f"messages[{i}].content must be a string or a list")
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fnc = (tc or {}).get("function") or {}
                if not isinstance(fnc.get("name"), str):
                    raise EngineError("invalid_request", f"messages[{i}] has a tool call without a name")
                args = fnc.get("arguments")
                if args is None or (isinstance(args, str) and not args.strip()):
                    args = "{}"  # a call without arguments ("" from some clients), as the Responses API reads it
                elif not isinstance(args, str):
                    args = json.dumps(args)
                call = {"type": "function", "function": {"name": fnc["name"], "arguments": args}}
                if tc.get("id"):
                    call["id"] = str(tc["id"])
                calls.append(call)
            n["tool_calls"] = calls
        for key in ("reasoning_content", "tool_call_id", "name"):
            if isinstance(m.get(key), str):
                n[key] = m[key]
        out.append(n)
    return out


def normalize_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI function tools in the shape common/chat accepts: the ``type`` wrapper added, a ``null``
    description or parameters left out (real clients send them; common/chat refuses nulls)."""
    out = []
    for t in tools:
        t = t if "type" in t else {"type": "function", "function": t}
        fn = t.get("function")
        if isinstance(fn, dict) and any(fn.get(k, 0) is None for k in ("description", "parameters")):
            t = dict(t, function={k: v for k, v in fn.items() if v is not None})
        out.append(t)
    return out


# The root that common/chat gives a lazy call grammar of the Hermes/Qwen-style formats: one call
# block or several ("tool-calls ::= (tool-call? space)+"), whatever parallel_tool_calls says.
_LAZY_CALL_ROOT = "root ::= tool-call | tool-calls"


def call_root(grammar: str, parallel: bool) -> str:
    """``grammar`` (a lazy call grammar) with its root made exactly one call block, or with
    ``parallel`` one or more (never none). Grammars of another shape are returned unchanged."""
    lines = grammar.splitlines()
    if _LAZY_CALL_ROOT not in lines or not any(ln.startswith("tool-call ::=") for ln in lines):
        return grammar
    root = "root ::= tool-call" + (" (space tool-call)*" if parallel else "")
    return "\n".join(root if ln == _LAZY_CALL_ROOT else ln for ln in lines) + "\n"


def forced_call_result(auto: dict[str, Any], parallel: bool = True) -> Optional[dict[str, Any]]:
    """The sampler's apply result for a forced tool call ("required" or a named tool), made from the
    "auto" result of the same request, or None when the format has no lazy call grammar.

    common/chat's "required" grammar lets free text come before the call (``content until the
    call marker``), so a model that never writes the marker writes prose until ``max_tokens``. Its
    lazy "auto" grammar is rooted at the call rules themselves (the marker first); applied from the
    first output token (not lazy, no triggers, no generation prompt to replay: that grammar does
    not start with it), the answer is a call and nothing before it."""
    if not auto.get("grammar") or not auto.get("grammar_lazy"):
        return None
    return dict(auto, grammar=call_root(auto["grammar"], parallel), grammar_lazy=False,
                grammar_triggers=[], generation_prompt="")


def thinking_left_open(res: dict[str, Any]) -> bool:
    """True when the rendered generation prompt ends inside an opened reasoning block (the model's
    answer starts as reasoning, so a call cannot come first)."""
    tag = (res.get("thinking_start_tag") or "").strip()
    return bool(tag) and (res.get("generation_prompt") or "").rstrip().endswith(tag)


_INCOMPLETE_SCHEMA = "JSON schema conversion was incomplete: "


@contextlib.contextmanager
def stderr_captured():
    """Capture what native code writes to file descriptor 2 (llama.cpp reports an incomplete
    schema conversion and a grammar's parse error only there); yields a function returning it.
    The text is written on to the real stderr afterwards. One capture at a time (fd 2 is the
    process's)."""
    with _STDERR_LOCK:
        with _fd2_captured() as said:
            yield said


_STDERR_LOCK = threading.Lock()

# common_log's level numbers (llama.cpp common/log.h): only errors pass while model output is parsed
_COMMON_LOG_ERROR = 1


@contextlib.contextmanager
def model_output_unlogged():
    """While the block runs, llama.cpp's common log drops its warnings: a final parse that does not
    match the format makes ``common_chat_peg_parse`` print the model's raw output at warning level
    on stderr, which docs/api.md keeps to debug level (the worker logs the parse error at debug).
    The threshold is common_log's global; a no-op where the library does not export it."""
    try:
        thold = ctypes.c_int.in_dll(native.lib(), "common_log_verbosity_thold")
    except (ValueError, OSError, AttributeError):
        yield
        return
    old = thold.value
    thold.value = min(old, _COMMON_LOG_ERROR)
    try:
        yield
    finally:
        thold.value = old


@contextlib.contextmanager
def _fd2_captured():
    sys.stderr.flush()
    saved = os.dup(2)
    buf = tempfile.TemporaryFile()
    text: list[str] = []
    try:
        os.dup2(buf.fileno(), 2)
        yield lambda: "".join(text)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        buf.seek(0)
        data = buf.read().decode("utf-8", "replace")
        buf.close()
        text.append(data)
        if data:
            sys.stderr.write(data)


def _refuse_incomplete_schema(said: str, schema: Any) -> None:
    """EngineError 400 when llama.cpp could not enforce a part of the response's JSON schema or,
    ``schema`` a list, of the tools' parameters (a regex ``pattern`` it cannot express as a
    grammar is otherwise replaced by "any string")."""
    for line in said.splitlines():
        if _INCOMPLETE_SCHEMA in line:
            what = line.split(_INCOMPLETE_SCHEMA, 1)[1].strip()
            where = "tools" if isinstance(schema, list) else "response_format"
            raise EngineError("invalid_request", f"{where}: the JSON schema cannot be enforced: "
                              f"{what.replace(', accepting any string', '')}", 400, {"param": where})


class _NativeHandle:
    """Owner of one libostinato handle ``_h``, freed by the function named ``_free_fn`` on
    :meth:`close` (idempotent) or, as a fallback, when garbage-collected."""

    _free_fn = ""
    _h = None

    def close(self) -> None:
        """Free the native object (idempotent)."""
        if getattr(self, "_h", None):
            native.fn(self._free_fn)(self._h)
            self._h = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class ChatTemplates(_NativeHandle):
    """The chat templates of a loaded model (``llama_model *``), via ``ostinato_chat_init``.

    ``template_override``: Jinja source replacing the GGUF's template. Raises EngineError
    ("template_error") if the template does not parse, NativeError if the shim is not built.
    """

    _free_fn = "ostinato_chat_free"

    def __init__(self, model_ptr: int, template_override: Optional[str] = None):
        self._fn_apply = native.fn("ostinato_chat_apply")
        h = native.fn("ostinato_chat_init")(model_ptr, template_override.encode() if template_override else None)
        if not h:
            raise EngineError("template_error", native.last_error() or "chat template init failed", 500)
        self._h = h
        self.info = native.take_json(native.fn("ostinato_chat_info")(h))

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None,
               tool_choice: Any = None, parallel_tool_calls: bool = True,
               enable_thinking: Optional[bool] = None, json_schema: Optional[dict[str, Any]] = None,
               add_generation_prompt: bool = True) -> RenderedPrompt:
        """Apply the template. ``tool_choice``: "auto" | "none" | "required" | {"type": "function",
        "function": {"name": N}} (a named tool: a call of it is required). The prompt does not
        depend on the choice: every tool is shown as with "auto", so a forced turn keeps the
        conversation's cached prefix; the choice only constrains the grammar.

        Raises EngineError("invalid_request" | "template_error").
        """
        last = messages[-1] if isinstance(messages, list) and messages else None
        if (add_generation_prompt and len(messages) > 1 and isinstance(last, dict)
                and last.get("role") == "assistant" and not last.get("tool_calls")
                and isinstance(last.get("content"), str) and last["content"]):
            # a final assistant message is continued, not closed (prefill, as the Anthropic API
            # and llama-server do): the turns before it, the generation prompt, then its text
            r = self.render(messages[:-1], tools, tool_choice, parallel_tool_calls, enable_thinking,
                            json_schema, add_generation_prompt=True)
            r.prompt += last["content"]
            return r
        tools = list(tools or [])
        shown = tools
        choice = tool_choice if tool_choice is not None else "auto"
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") or choice.get("name")
            named = [t for t in tools if (t.get("function") or {}).get("name") == name]
            if not named:
                raise EngineError("invalid_request", f"tool_choice names unknown tool {name!r}")
            tools, choice = named, "required"
        if choice not in ("auto", "none", "required"):
            raise EngineError("invalid_request", f"invalid tool_choice {choice!r}")
        if choice == "required" and not tools:
            raise EngineError("invalid_request", "tool_choice 'required' needs at least one tool")
        req: dict[str, Any] = {"messages": normalize_messages(messages), "tool_choice": choice,
                               "parallel_tool_calls": bool(parallel_tool_calls),
                               "add_generation_prompt": add_generation_prompt,
                               "enable_thinking": True if enable_thinking is None else bool(enable_thinking)}
        if tools:
            req["tools"] = normalize_tools(tools)
        if json_schema is not None:
            req["json_schema"] = json_schema
        # llama.cpp reports a schema it cannot enforce only on stderr: watched where a schema asks
        # for a pattern (tools' parameters too: their calls are grammar-constrained)
        watched = json_schema if json_schema is not None else (
            req["tools"] if any(True for t in tools for _ in schema_patterns(t, "")) else None)
        try:
            res = self._apply(req, watched)
        except EngineError as e:
            if tools:
                self._blame_tool(req, e)
            raise
        if choice != "required" or json_schema is not None:
            if res.get("grammar_lazy") and not parallel_tool_calls:  # at most one call
                res["grammar"] = call_root(res["grammar"], False)
            return RenderedPrompt.from_result(res)
        if thinking_left_open(res):  # a forced call comes first: no reasoning block before it
            req["enable_thinking"] = False
            res = self._apply(req, None)
        forced = forced_call_result(self._apply(dict(req, tool_choice="auto"), None), bool(parallel_tool_calls))
        out = RenderedPrompt.from_result(res)
        out.sampler_raw = json.dumps(forced) if forced is not None else None
        # the prompt of "auto" with every tool: the same tokens as the conversation's other turns
        out.prompt = self._apply(dict(req, tools=normalize_tools(shown), tool_choice="auto"), None)["prompt"]
        return out

    def _blame_tool(self, req: dict[str, Any], err: EngineError) -> None:
        """When one of ``req``'s tools alone makes the template fail (a schema llama.cpp cannot use,
        e.g. a ``$ref`` to a missing ``$defs`` entry), raise ``err`` again naming that tool by index
        and name, with the JSON pointer llama.cpp gave, and ``param`` ``tools.<index>``; returns
        when no single tool fails (the error is elsewhere). Only runs on the error path."""
        for i, tool in enumerate(req.get("tools") or []):
            try:
                self._apply(dict(req, tools=[tool], tool_choice="auto"), None)
            except EngineError as e:
                why = e.message.split("generation failed: ", 1)[-1]
                name = (tool.get("function") or {}).get("name") or tool.get("name")
                raise EngineError(e.code, f"tools[{i}] ({name!r}): its parameters schema cannot be used: "
                                  f"{why}", e.status, {"param": f"tools.{i}"}) from err

    def _apply(self, req: dict[str, Any], json_schema: Any) -> dict[str, Any]:
        """The shim's apply result of one request dict; with ``json_schema`` (the response schema,
        or the tools whose schemas hold a pattern) llama.cpp's stderr is watched for parts it
        cannot enforce. Raises EngineError."""
        if self._h is None:
            raise EngineError("model_not_loaded", "chat templates are closed", 503)
        if json_schema is not None:
            with stderr_captured() as said:
                res = native.take_json(self._fn_apply(self._h, json.dumps(req).encode()))
            _refuse_incomplete_schema(said(), json_schema)
        else:
            res = native.take_json(self._fn_apply(self._h, json.dumps(req).encode()))
        if "error" in res:
            err = res["error"]
            # rendering fails on what the request holds (tools, messages): the client's input
            raise EngineError(err.get("type", "template_error"), err.get("message", "template error"), 400)
        return res


@dataclass
class ParseResult:
    """One parse of the text so far: the message and the diffs since the previous parse."""

    message: dict[str, Any]
    diffs: list[dict[str, Any]]
    parse_error: Optional[str] = None


def trigger_spacing(rendered: Optional[RenderedPrompt]) -> list[tuple[str, str]]:
    """(marker, whitespace) pairs of the format's word triggers that end in whitespace, e.g.
    ``("<tool_call>", "\\n")`` for Hermes/Qwen: llama.cpp's parser expects the trigger as written,
    the model family's own servers (vLLM's hermes parser, older llama-server) accept the marker
    followed by any whitespace or none."""
    out = []
    for v in trigger_words(rendered):
        if v.strip() and v != v.rstrip():
            marker = v.rstrip()
            out.append((marker, v[len(marker):]))
    return out


def format_markers(rendered: Optional[RenderedPrompt]) -> list[str]:
    """The markup strings of the rendered format that are never text: its preserved tokens and
    trigger words (``<tool_call>``, ``</tool_call>``, ...), longest first; the reasoning tags are
    left alone (reasoning is parsed apart from calls)."""
    if rendered is None:
        return []
    res = json.loads(rendered.raw)
    keep = {(res.get("thinking_start_tag") or "").strip()} | {t.strip() for t in res.get("thinking_end_tags") or []}
    words = [w.strip() for w in trigger_words(rendered)]
    found = {m for m in list(rendered.preserved_tokens) + words if m and m.strip() and m.strip() not in keep}
    return sorted(found, key=len, reverse=True)


def trigger_words(rendered: Optional[RenderedPrompt]) -> list[str]:
    """The word triggers of the rendered format's call grammar (the text that opens a call, e.g.
    ``"<tool_call>\\n"``), as written."""
    if rendered is None:
        return []
    return [t["value"] for t in json.loads(rendered.raw).get("grammar_triggers") or []
            if isinstance(t, dict) and t.get("type") == "word" and isinstance(t.get("value"), str)]


def respace_triggers(text: str, spaced: list[tuple[str, str]]) -> str:
    """``text`` with each marker of :func:`trigger_spacing` followed by exactly the trigger's
    whitespace (``<tool_call>{`` and ``<tool_call>  {`` become ``<tool_call>\\n{``); whitespace after
    a marker at the very end is held back until the next character arrives, so the result only
    grows at its end as ``text`` grows (streamed diffs stay consistent)."""
    for marker, ws in spaced:
        if marker not in text:
            continue
        parts = text.split(marker)
        out = [parts[0]]
        for p in parts[1:]:
            rest = p.lstrip()
            out.append(ws + rest if rest else "")
        text = marker.join(out)
    return text


class ChatParser(_NativeHandle):
    """Incremental parser of one generation (reasoning / content / tool calls).

    Feed the whole text generated so far; :meth:`feed` returns the diffs since the last call as
    engine delta dicts. ``final=True`` on the last call: a text that does not match the format
    becomes plain content (``parse_error`` set), never an exception.
    """

    _free_fn = "ostinato_chat_parser_free"

    def __init__(self, rendered: Optional[RenderedPrompt], parse_tool_calls: bool = True):
        raw = rendered.raw if rendered is not None else json.dumps({"format": 0})
        opts = json.dumps({"parse_tool_calls": parse_tool_calls, "reasoning": True})
        self._feed = native.fn("ostinato_chat_parser_feed")
        h = native.fn("ostinato_chat_parser_new")(raw.encode(), opts.encode())
        if not h:
            raise EngineError("template_error", native.last_error() or "chat parser init failed", 500)
        self._h = h
        self._spaced = trigger_spacing(rendered)
        self._markers = format_markers(rendered)
        self._openers = [w.strip() for w in trigger_words(rendered) if w.strip()]
        self.message: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_content": "",
                                        "tool_calls": []}
        self._sent: set[int] = set()  # tool call indexes whose id/name were emitted

    def feed(self, text_so_far: str, final: bool = False) -> ParseResult:
        """Parse ``text_so_far``; returns the message and the diffs as engine ``delta`` payloads
        (``{"content"}``, ``{"reasoning"}``, ``{"tool_calls": [{"index", "id", "name", "arguments"}]}``).

        A final text that does not match the format (``parse_error`` set) keeps what parsed: the
        calls before the broken markup stay calls and the text before it stays content; the broken
        markup itself is dropped (:meth:`_salvage`), never returned as text."""
        text_so_far = respace_triggers(text_so_far, self._spaced)
        with model_output_unlogged():
            res = native.take_json(self._feed(self._h, text_so_far.encode("utf-8", errors="replace"),
                                              0 if final else 1))
        if "error" in res:
            # only when even the fallback failed: keep the text as content
            self.message = {"role": "assistant", "content": text_so_far, "reasoning_content": "",
                            "tool_calls": []}
            return ParseResult(self.message, [], res["error"].get("message"))
        self.message = res["msg"]
        if final and res.get("parse_error"):
            log.debug("model output that does not match the %s format: %r", "chat", text_so_far[:2000])
            with model_output_unlogged():
                self.message = self._salvage(text_so_far)
        calls = self.message.get("tool_calls", [])
        deltas: list[dict[str, Any]] = []

        def header(i: int, args: str) -> None:
            deltas.append({"tool_calls": [{"index": i, "id": calls[i]["id"], "name": calls[i]["name"],
                                           "arguments": args}]})
            self._sent.add(i)

        # like llama-server: a tool call's id/name go out once the name is complete (its arguments
        # started, a later call began, or the text ended), then only argument diffs follow
        for d in res.get("diffs", []):
            if d.get("reasoning_content_delta"):
                deltas.append({"reasoning": d["reasoning_content_delta"]})
            if d.get("content_delta"):
                deltas.append({"content": d["content_delta"]})
            i = d.get("tool_call_index")
            if i is None or i >= len(calls):
                continue
            for j in range(i):
                if j not in self._sent and calls[j]["name"]:
                    header(j, "")
            args = (d.get("tool_call_delta") or {}).get("arguments", "")
            if i in self._sent:
                if args:
                    deltas.append({"tool_calls": [{"index": i, "id": None, "name": None, "arguments": args}]})
            elif args or final:
                header(i, args)
        if final:
            for j in range(len(calls)):
                if j not in self._sent and calls[j]["name"]:
                    header(j, "")
        return ParseResult(self.message, deltas, res.get("parse_error"))

    def _salvage(self, text: str) -> dict[str, Any]:
        """The message of a final ``text`` that does not parse: the longest part before one of
        the format's call openers that parses (its calls and content), then the text of the rest
        up to its first call opener, without the format's markers; from that opener on the output
        is a broken call, dropped (logged at debug)."""
        msg: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
        cut = 0
        starts = sorted({i for m in self._openers for i in _find_all(text, m)}, reverse=True)
        for k in starts:
            res = native.take_json(self._feed(self._h, text[:k].encode("utf-8", errors="replace"), 0))
            if "error" not in res and not res.get("parse_error"):
                msg, cut = dict(res["msg"]), k
                break
        rest = text[cut:]
        opened = [i for i in (rest.find(m) for m in self._openers) if i >= 0]
        if opened:
            log.debug("broken call markup dropped from the output: %r", rest[min(opened):][:300])
            rest = rest[:min(opened)]
        for marker in self._markers:
            rest = rest.replace(marker, "")
        content = msg.get("content") or ""
        msg["content"] = (content + ("\n" if content and rest.strip() else "") + rest.strip()).strip()
        return msg


def _find_all(text: str, sub: str) -> list[int]:
    """Every index where ``sub`` starts in ``text``."""
    out, i = [], text.find(sub)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out


def openai_message(msg: dict[str, Any]) -> dict[str, Any]:
    """The shim's parsed message in OpenAI shape (``tool_calls`` with type/function, None content
    when empty and there are tool calls)."""
    calls = [{"id": tc["id"], "type": "function",
              "function": {"name": tc["name"], "arguments": tc["arguments"]}}
             for tc in msg.get("tool_calls", [])]
    out: dict[str, Any] = {"role": "assistant",
                           "content": msg.get("content") or (None if calls else "")}
    if msg.get("reasoning_content"):
        out["reasoning_content"] = msg["reasoning_content"]
    if calls:
        out["tool_calls"] = calls
    return out


def parser_for(templates: ChatTemplates, req: Any, rendered: RenderedPrompt) -> ChatParser:
    """The output parser of a chat request (a GenRequest) rendered as ``rendered``. With
    ``tool_choice`` "none" the tools stay in the prompt (docs/api.md: the cached prefix does not
    change with tool_choice) and a call the model makes anyway is parsed with the "auto" format, to
    be dropped (:func:`.text.settle_tool_calls`), never raw markup in the content."""
    if req.tools and req.tool_choice == "none":
        rendered = templates.render(req.messages, req.tools, "auto", req.parallel_tool_calls,
                                    req.enable_thinking, req.json_schema)
    return ChatParser(rendered, parse_tool_calls=bool(req.tools))
