"""ctypes loader of ``libostinato.so`` (our native additions, built next to ``libllama.so``).

One loader for the whole package: :func:`lib` returns the loaded library with every function's
argtypes/restype declared. The chat shim functions (``ostinato_chat_*``) are declared here; the
native-engine code adds its own declarations through :func:`declare` (additive, one place).

Strings returned by the library (``char *``) are owned by it: use :func:`take_json`, which copies and
frees them. Errors: :class:`NativeError` when the library or a symbol is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional

c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p
c_int = ctypes.c_int


class NativeError(RuntimeError):
    """libostinato.so cannot be loaded (engine not built) or lacks a symbol (stale build)."""


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None

# name -> (argtypes, restype); applied on load. Other modules add entries with declare().
_DECLS: dict[str, tuple[list[Any], Any]] = {
    "ostinato_native_version": ([], c_char_p),
    "ostinato_last_error": ([], c_char_p),
    "ostinato_string_free": ([c_void_p], None),
    "ostinato_chat_init": ([c_void_p, c_char_p], c_void_p),
    "ostinato_chat_free": ([c_void_p], None),
    "ostinato_chat_info": ([c_void_p], c_void_p),
    "ostinato_chat_apply": ([c_void_p, c_char_p], c_void_p),
    "ostinato_chat_grammar_sampler": ([c_void_p, c_char_p], c_void_p),
    "ostinato_chat_parser_new": ([c_char_p, c_char_p], c_void_p),
    "ostinato_chat_parser_free": ([c_void_p], None),
    "ostinato_chat_parser_feed": ([c_void_p, c_char_p, c_int], c_void_p),
    "ostinato_n_cpu_moe_overrides": ([c_int], c_void_p),
    "ostinato_sampler_new": ([c_void_p, c_char_p, c_char_p], c_void_p),
    "ostinato_sampler_sample": ([c_void_p, c_void_p, ctypes.c_int32], ctypes.c_int32),
    "ostinato_sampler_free": ([c_void_p], None),
}


def lib_dir() -> Path:
    """Directory holding libllama.so and libostinato.so (the installed ``llama_cpp`` package's lib/).

    Raises NativeError if llama_cpp is not installed.
    """
    try:
        import llama_cpp  # noqa: F401  (loads libllama/libggml first so our lib's deps resolve)
    except Exception as e:  # ImportError, OSError from a broken build
        raise NativeError(f"llama_cpp is not importable ({e}); run 'ostinato build'") from e
    return Path(llama_cpp.__file__).resolve().parent / "lib"


def _apply(lib: ctypes.CDLL, name: str, argtypes: list[Any], restype: Any) -> None:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return  # optional symbol of a part not built yet; callers check has()
    fn.argtypes = argtypes
    fn.restype = restype


def lib() -> ctypes.CDLL:
    """The loaded libostinato.so (loaded once per process). Raises NativeError."""
    global _lib
    with _lock:
        if _lib is None:
            d = lib_dir()
            # OSTINATO_NATIVE_LIB: a libostinato.so built by hand (native development only)
            path = Path(os.environ.get("OSTINATO_NATIVE_LIB") or d / "libostinato.so")
            if not path.exists():
                raise NativeError(f"{path} not found: the native engine was built without native/ "
                                  "additions; run 'ostinato build'")
            try:
                loaded = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise NativeError(f"cannot load {path}: {e}") from e
            for name, (args, res) in _DECLS.items():
                _apply(loaded, name, args, res)
            _lib = loaded
        return _lib


def declare(name: str, argtypes: list[Any], restype: Any) -> None:
    """Register the signature of a libostinato function (applied now if already loaded)."""
    with _lock:
        _DECLS[name] = (argtypes, restype)
        if _lib is not None:
            _apply(_lib, name, argtypes, restype)


def has(name: str) -> bool:
    """True if the loaded library exports ``name`` (False when not built or not loadable)."""
    try:
        return hasattr(lib(), name)
    except NativeError:
        return False


def fn(name: str) -> Callable[..., Any]:
    """The function ``name`` of libostinato. Raises NativeError if the build lacks it."""
    f = getattr(lib(), name, None)
    if f is None:
        raise NativeError(f"libostinato.so lacks {name}: rebuild with 'ostinato build'")
    return f


def take_string(ptr: Optional[int]) -> Optional[str]:
    """Copy a library-owned ``char *`` into a str and free it (None for NULL)."""
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8", errors="replace")
    finally:
        fn("ostinato_string_free")(ptr)


def take_json(ptr: Optional[int]) -> dict[str, Any]:
    """Copy, free and JSON-decode a library-owned ``char *`` (NULL -> an error dict)."""
    s = take_string(ptr)
    if s is None:
        return {"error": {"type": "native_error", "message": "native call returned NULL"}}
    return json.loads(s)


def last_error() -> str:
    """The last handle-constructor error on this thread ("" if none)."""
    raw = fn("ostinato_last_error")()
    return raw.decode("utf-8", errors="replace") if raw else ""


def version() -> str:
    """Version string of the native additions."""
    return fn("ostinato_native_version")().decode()
