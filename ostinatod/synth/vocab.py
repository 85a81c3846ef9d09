"""The tokenizer of the synthetic models (Qwen2's vocabulary from ggml-vocab-qwen2.gguf) and the
class of every token (code-like, prose-like, other) that their routing depends on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

import gguf

from ..paths import get_paths, install_data_dir
from .shapes import (ADDED_TOKENS, COARSE_OF, IDENT, LLAMA_CPP_PYTHON_VERSION, MISC, NAME, NUMBER,
                     SYNTAX, SynthError, VOCAB_NAME, WORD)


# --------------------------------------------------------------------------------------------
# vocabulary


def vocab_candidates() -> list[Path]:
    """Where :func:`find_vocab` looks for ggml-vocab-qwen2.gguf, in order."""
    cands: list[Path] = []
    env = os.environ.get("OSTINATO_VOCAB")
    if env:
        cands.append(Path(env).expanduser())
    data_dirs = [get_paths().data]
    if os.environ.get("OSTINATO_HOME"):  # tests isolate the data dir; the build's copy is elsewhere
        saved = os.environ.pop("OSTINATO_HOME")
        try:
            data_dirs.append(get_paths().data)
        finally:
            os.environ["OSTINATO_HOME"] = saved
    cands.append(install_data_dir() / "vocab" / VOCAB_NAME)
    for d in data_dirs:
        cands.append(d / "native" / "vocab" / VOCAB_NAME)
        cands.append(d / "native" / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor"
                     / "llama.cpp" / "models" / VOCAB_NAME)
    return cands


def find_vocab() -> Path:
    """Path of the qwen2 tokenizer vocabulary GGUF.

    Order: ``OSTINATO_VOCAB``, ``<sys.prefix>/share/ostinato/vocab/`` (kept with the installed
    package by ``ostinato build``, whichever user starts the daemon), ``<data>/native/vocab/``, the
    extracted sdist under ``<data>/native/src/`` (also for the default data dir when
    ``OSTINATO_HOME`` is set).
    Raises SynthError naming the places tried.
    """
    cands = vocab_candidates()
    for c in cands:
        if c.is_file():
            return c
    raise SynthError("tokenizer vocabulary " + VOCAB_NAME + " not found; run 'ostinato build' "
                     "(it keeps a copy) or set OSTINATO_VOCAB. Tried:\n  " +
                     "\n  ".join(str(c) for c in cands))


def load_tokenizer(vocab: Path | None = None) -> dict:
    """The tokenizer keys of the vocabulary GGUF, with Qwen3's added tokens named.

    Returns {"model", "pre", "tokens": [str], "token_type": [int], "merges": [str],
    "classes": [int]} (classes of the named tokens, :func:`token_classes`). Parsing the
    GGUF with ``gguf.GGUFReader`` takes ~10 s, so the result is cached as JSON next to the vocab
    (or in ``<data>/native/vocab/``) keyed by the vocab file's size and mtime.
    """
    vocab = vocab or find_vocab()
    st = vocab.stat()
    key = f"{st.st_size}-{int(st.st_mtime)}-{_CLASSIFIER_VERSION}"
    cache_dirs = [vocab.parent, get_paths().native_dir / "vocab"]
    for d in cache_dirs:
        c = d / (vocab.stem + ".tokenizer.json")
        if c.is_file():
            try:
                data = json.loads(c.read_text())
                if data.get("key") == key:
                    return data
            except (OSError, ValueError):
                pass
    r = gguf.GGUFReader(vocab)

    def field(name: str):
        f = r.fields.get(name)
        if f is None:
            raise SynthError(f"{vocab}: missing {name}")
        return f.contents()

    data = {"key": key, "model": field("tokenizer.ggml.model"), "pre": field("tokenizer.ggml.pre"),
            "tokens": list(field("tokenizer.ggml.tokens")),
            "token_type": [int(t) for t in field("tokenizer.ggml.token_type")],
            "merges": list(field("tokenizer.ggml.merges"))}
    data["classes"] = token_classes(*named_tokens(data)).tolist()
    for d in cache_dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / (vocab.stem + f".tokenizer.json.{os.getpid()}")
            tmp.write_text(json.dumps(data))
            tmp.replace(d / (vocab.stem + ".tokenizer.json"))
            break
        except OSError:
            continue
    return data


def named_tokens(tok: dict) -> tuple[list[str], list[int]]:
    """Tokens and types with Qwen3's added tokens put in place of the [PAD] placeholders."""
    tokens, types = list(tok["tokens"]), list(tok["token_type"])
    if len(tokens) > max(ADDED_TOKENS):
        for i, (text, ttype) in ADDED_TOKENS.items():
            if tokens[i].startswith("[PAD") or tokens[i] == text:
                tokens[i], types[i] = text, ttype
    return tokens, types


def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level BPE maps each byte to a printable code point; this inverts that map.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cps = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            cps.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, cps)}


_BYTE_DECODER = _byte_decoder()
_CLASSIFIER_VERSION = 2  # bump when classify_token changes (invalidates the tokenizer cache)
_CODE_CHARS = set("{}[]()<>;=+*/%&|^~\\@#$_`:")
_CODE_WORDS = {"def", "return", "import", "from", "class", "self", "if", "elif", "else", "for",
               "while", "in", "not", "and", "or", "None", "True", "False", "try", "except",
               "raise", "with", "as", "lambda", "yield", "assert", "pass", "const", "let", "var",
               "function", "int", "str", "float", "bool", "dict", "list", "void", "null",
               "true", "false", "struct", "fn", "pub", "impl", "println", "printf", "print",
               "args", "kwargs", "init", "len", "range", "cls", "np", "os", "sys", "json", "git",
               "diff", "cd", "ls", "grep", "sed", "cat", "echo", "py", "txt", "src", "tests",
               "test", "assert", "async", "await", "export", "module", "package", "typeof"}


def token_text(token: str) -> str:
    """Decoded text of a byte-level BPE token (invalid UTF-8 is replaced)."""
    try:
        raw = bytes(_BYTE_DECODER[c] for c in token)
    except KeyError:
        return token
    return raw.decode("utf-8", errors="replace")


def classify_token(text: str, ttype: int = 1) -> int:
    """Fine class of a token's decoded text (index into :data:`FINE_NAMES`):
    SYNTAX (brackets, operators, indentation), IDENT (code keywords, snake_case / camelCase
    identifiers, dotted names), WORD (lower-case words, prose punctuation, a lone space), NAME
    (capitalised words), NUMBER (digits), MISC (non-ASCII, special tokens, single letters).
    :data:`COARSE_OF` maps them to CODE / PROSE / OTHER."""
    if ttype != 1:
        return MISC
    s = text
    core = s.strip()
    if not core:
        # indentation and line breaks are code-like; a lone space is prose
        return SYNTAX if ("\n" in s or "\t" in s or len(s) >= 2) else WORD
    if core.isascii() and core.replace("_", "").isalnum() and any(c.isalpha() for c in core):
        if "_" in core or core in _CODE_WORDS or any(a.islower() and b.isupper() for a, b in zip(core, core[1:])):
            return IDENT  # snake_case, keyword, camelCase
        if not core.isalpha():
            return IDENT  # letters mixed with digits: v2, utf8, x86
        if len(core) < 2:
            return MISC
        return NAME if core[0].isupper() else WORD
    if any(ch in _CODE_CHARS for ch in core):
        return SYNTAX
    if all(ch in ".,;!?'\"-" for ch in core):
        return WORD if core in (".", ",", "!", "?", "'", "\"", "-", "'s") else SYNTAX
    if core.isascii() and any(ch.isalpha() for ch in core) and "." in core:
        return IDENT  # file.ext, module.attr
    if core.isdigit():
        return NUMBER
    return MISC


def coarse_class(text: str, ttype: int = 1) -> int:
    """CODE, PROSE or OTHER for a token's decoded text (:func:`classify_token`, coarsened)."""
    return COARSE_OF[classify_token(text, ttype)]


def token_classes(tokens: list[str], types: list[int]) -> np.ndarray:
    """Fine class id (:func:`classify_token`) of every vocabulary token, shape (n_vocab,), int8."""
    return np.fromiter((classify_token(token_text(t), ty) for t, ty in zip(tokens, types)),
                       dtype=np.int8, count=len(tokens))
