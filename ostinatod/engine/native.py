"""The one ctypes loader of the package: our native additions.

Two product libraries, one place:

* ``libostinato.so`` (built next to ``libllama.so``): the chat shim (``ostinato_chat_*``) and the
  sampler; :func:`lib` returns it with every function's argtypes/restype declared, :func:`fn` one
  function (other modules may add declarations through :func:`declare`).
* the expert engine (``ostinato_experts_*``), part of libllama because the patched llama.cpp calls
  it, reached through llama-cpp-python's own handle of that library: :func:`llama_fn`. The
  placement and the engine's options (:class:`.options.EngineOptions`) travel with the load
  (:func:`load_model`) and a switch (:func:`experts_switch`); :func:`reconfigure` changes the
  options between passes.

Beside them, :func:`side_lib` loads the bench and test libraries (libostinato_cpubench: the CPU-branch
benchmark, :func:`cpu_branch_bench`; libostinato_optest: the op-level tests of the patches).

Strings returned by the library (``char *``) are owned by it: use :func:`take_json`, which copies and
frees them. Errors: :class:`NativeError` when the library or a symbol is missing.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import MessageError
from .options import EngineOptions, EngineOptionsC, c_struct, from_c

c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p
c_int = ctypes.c_int


class NativeError(MessageError, RuntimeError):
    """libostinato.so cannot be loaded (engine not built) or lacks a symbol (stale build)."""

    code, status = "native_unavailable", 500


class ExpertEngineError(MessageError, RuntimeError):
    """The native expert engine is missing (stale build) or refused a configuration."""

    code, status = "expert_engine_error", 500


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


_side: dict[str, ctypes.CDLL] = {}


def side_lib(name: str) -> ctypes.CDLL:
    """A library of the native additions outside the product's two, installed beside them and
    loaded once per process on first use: ``"ostinato_cpubench"`` (the CPU-branch benchmark,
    native/bench) or ``"ostinato_optest"`` (the op-level tests of the patches, native/tests). Each
    links the libllama and ggml that ``llama_cpp`` has loaded, so it runs on the same engine. The
    caller sets the argtypes/restype of what it calls. Raises NativeError when the library is not
    there (a build older than the split) or cannot be loaded."""
    with _lock:
        loaded = _side.get(name)
        if loaded is None:
            path = lib_dir() / f"lib{name}.so"
            if not path.exists():
                raise NativeError(f"{path} not found: rebuild with 'ostinato build'")
            try:
                loaded = ctypes.CDLL(str(path))
            except OSError as e:
                raise NativeError(f"cannot load {path}: {e}") from e
            _side[name] = loaded
        return loaded


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


# --- the expert engine in libllama ---------------------------------------------------------------

_C = ctypes.c_char_p
_LLAMA_DECLS: dict[str, tuple[list[Any], Any]] = {
    "ostinato_experts_check": ([_C], ctypes.c_int),
    "ostinato_experts_switch": ([_C, ctypes.POINTER(EngineOptionsC)], ctypes.c_int),
    "ostinato_experts_active": ([], ctypes.c_int),
    "ostinato_experts_last_error": ([], _C),
    "ostinato_hybrid_split": ([ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_int, ctypes.c_double,
                               ctypes.c_double, ctypes.c_double], ctypes.c_int),
    "ostinato_engine_options_default": ([ctypes.POINTER(EngineOptionsC)], None),
    "ostinato_engine_options_size": ([], ctypes.c_int),
    "ostinato_experts_options": ([ctypes.POINTER(EngineOptionsC)], ctypes.c_int),
    "ostinato_experts_reconfigure": ([ctypes.POINTER(EngineOptionsC)], ctypes.c_int),
    "ostinato_experts_info": ([], _C),
    "ostinato_experts_stats": ([ctypes.c_int], _C),
    "ostinato_experts_take_request_stats": ([], _C),
    "ostinato_experts_reset_stats": ([], None),
}
_llama_bound: dict[str, Any] = {}


def llama_fn(name: str) -> Callable[..., Any]:
    """The expert-engine function ``name`` of libllama. Raises ExpertEngineError when llama_cpp is
    not importable or the build lacks the expert engine."""
    f = _llama_bound.get(name)
    if f is not None:
        return f
    try:
        from llama_cpp import llama_cpp as _ll
        f = getattr(_ll._lib, name)
    except ImportError as e:
        raise ExpertEngineError(f"llama_cpp is not importable ({e}); run 'ostinato build'") from e
    except AttributeError:
        raise ExpertEngineError(f"libllama lacks {name}: the native engine was built without "
                                "the expert engine; run 'ostinato build'") from None
    f.argtypes, f.restype = _LLAMA_DECLS[name]
    _llama_bound[name] = f
    return f


def experts_available() -> bool:
    """True if the installed native engine has the expert engine (``ostinato build`` done)."""
    try:
        llama_fn("ostinato_experts_check")
        return True
    except ExpertEngineError:
        return False


def experts_error() -> str:
    """The expert engine's last error ("" if none)."""
    return (llama_fn("ostinato_experts_last_error")() or b"").decode(errors="replace")


def experts_json(name: str, *args: Any) -> dict[str, Any]:
    """Call an expert-engine function that returns JSON (info, stats, take_request_stats)."""
    return json.loads(llama_fn(name)(*args).decode())


def experts_active() -> bool:
    """Whether the loaded model runs the expert engine (its pool was built)."""
    return bool(llama_fn("ostinato_experts_active")())


def check_experts_config(config: dict[str, Any]) -> None:
    """Let the native engine check ``config`` (see :func:`ostinatod.engine.placement.experts_config`)
    without loading anything. Raises ExpertEngineError naming the problem."""
    if llama_fn("ostinato_experts_check")(json.dumps(config).encode()) != 0:
        raise ExpertEngineError(experts_error())


def _opts_ptr(options: Optional[EngineOptions]) -> Any:
    return None if options is None else ctypes.byref(c_struct(options))


def load_model(path: Path | str, mparams: Any, experts_config: Optional[dict[str, Any]] = None,
               options: Optional[EngineOptions] = None) -> tuple[Any, bool, str]:
    """Load a model with the expert engine's placement ``experts_config`` (None: stock placement) and
    ``options`` (None: the library's defaults, :func:`library_options`):
    ``ostinato_model_load(path, mparams, config, options)``, which passes both with the load call
    (as llama.cpp passes ``tensor_buft_overrides``), so no process-global is left set; the engine
    holds the options. Np and the forced path the config names replace the options'.

    Returns (model pointer or NULL, whether the expert engine is active for it, the engine's last
    error). Raises ExpertEngineError when the native engine refuses the config (nothing loaded).
    """
    import llama_cpp

    if experts_config is None:
        return llama_cpp.llama_model_load_from_file(str(path).encode(), mparams), False, ""
    check_experts_config(experts_config)
    f = _llama_bound.get("ostinato_model_load")
    if f is None:
        f = getattr(llama_cpp.llama_cpp._lib, "ostinato_model_load", None)
        if f is None:
            raise ExpertEngineError("libllama lacks ostinato_model_load: run 'ostinato build'")
        f.argtypes = [ctypes.c_char_p, llama_cpp.llama_model_params, ctypes.c_char_p,
                      ctypes.POINTER(EngineOptionsC)]
        f.restype = llama_cpp.llama_model_p_ctypes   # a pointer (llama_model_p is only a type hint)
        _llama_bound["ostinato_model_load"] = f
    model = f(str(path).encode(), mparams, json.dumps(experts_config).encode(), _opts_ptr(options))
    return model, experts_active(), experts_error()


def experts_switch(config: dict[str, Any], options: Optional[EngineOptions] = None) -> None:
    """Rebuild the loaded model's expert pool with ``config`` (the swap of a residency set, at a
    request boundary) and ``options`` (None: the engine's current ones; the pool's layout fields,
    prefetch depth and whole-expert slots, take effect here). Raises ExpertEngineError; the old set
    and options then stay in use."""
    if llama_fn("ostinato_experts_switch")(json.dumps(config).encode(), _opts_ptr(options)) != 0:
        raise ExpertEngineError(experts_error())


def library_options() -> EngineOptions:
    """The native library's default options (what a load without options gets). Raises
    ExpertEngineError when the build lacks them or the struct's size differs from
    :class:`.options.EngineOptionsC` (a stale build)."""
    size = llama_fn("ostinato_engine_options_size")()
    if size != ctypes.sizeof(EngineOptionsC):
        raise ExpertEngineError(f"the native engine's options are {size} bytes, EngineOptions' C form "
                                f"{ctypes.sizeof(EngineOptionsC)}: rebuild with 'ostinato build'")
    st = EngineOptionsC()
    llama_fn("ostinato_engine_options_default")(ctypes.byref(st))
    return from_c(st)


def engine_options() -> EngineOptions:
    """The active engine's options. Raises ExpertEngineError without an active engine."""
    st = EngineOptionsC()
    if llama_fn("ostinato_experts_options")(ctypes.byref(st)) != 0:
        raise ExpertEngineError(experts_error())
    return from_c(st)


def reconfigure(options: EngineOptions) -> None:
    """Make ``options`` the active engine's (``ostinato_experts_reconfigure``; call between passes):
    the native engine decides what the change needs (cached graphs rebuilt, the decode graph made
    anew, the CPU branch's team set; the pool's layout waits for its next build). Raises
    ExpertEngineError without an active engine or for values it refuses."""
    if llama_fn("ostinato_experts_reconfigure")(ctypes.byref(c_struct(options))) != 0:
        raise ExpertEngineError(experts_error())


def configure(**changes: Any) -> EngineOptions:
    """:func:`reconfigure` with the active engine's options changed by ``changes`` (field names of
    :class:`.options.EngineOptions`); returns the options it had before (to restore them). Raises
    ValueError (pydantic's, naming the field) for a bad value, ExpertEngineError as reconfigure."""
    was = engine_options()
    reconfigure(was.with_(**changes))
    return was


def hybrid_split(routes: Sequence[int], n_upload: int, alpha_us: float, beta_us: float,
                 upload_us: float) -> int:
    """The split rule alone (native ``ost_split_experts``, for tests): of cold experts with
    ``routes`` (ascending, the order the CPU takes them), how many the CPU branch takes so that
    max(alpha + beta * their routes, upload_us * (n_upload - taken)) is least (us)."""
    arr = (ctypes.c_int32 * max(1, len(routes)))(*[int(r) for r in routes])
    return int(llama_fn("ostinato_hybrid_split")(arr, len(routes), int(n_upload), float(alpha_us),
                                                 float(beta_us), float(upload_us)))


def cpu_branch_bench(model: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The CPU branch alone on ``model``'s expert tensors (a llama_model pointer loaded in host memory
    with CPU repacking off): the engine's own kernel against llama.cpp's CPU ``mul_mat_id`` graph on
    the same tensors and inputs, bit for bit, per (experts, tokens, threads), and the host's read
    bandwidth per thread count (``ostinato_cpu_branch_bench`` of libostinato_cpubench,
    native/bench/cpu_branch_bench.cpp).
    ``args``: layer (-1: the first MoE layer), experts, tokens, threads (lists of ints), reps, ggml
    (bool), read_bw_bytes, flush_bytes (read before every timed run so that the experts come from
    memory, as in a decode step; default 256 MiB). Returns the JSON result: ``read_bw`` [{threads, ms, gbps}], ``rows``
    [{experts, tokens, threads, routes, bytes, kernel, kernel_ms, kernel_gbps, ggml_ms, ggml_gbps,
    bitwise_equal, max_abs_diff}], the layer's types and ``expert_bytes``. Raises ExpertEngineError
    with the native reason (a layer without experts, tensors not in host memory) or when the bench
    library is missing."""
    try:
        f = side_lib("ostinato_cpubench").ostinato_cpu_branch_bench
    except (NativeError, AttributeError) as e:
        raise ExpertEngineError(f"CPU-branch bench not available: {e}") from e
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_char_p
    raw = f(model, json.dumps(args).encode())
    out = json.loads(raw.decode())
    if "error" in out:
        raise ExpertEngineError(f"CPU-branch bench: {out['error']}")
    return out


def gpu_count() -> int:
    """GPU devices llama.cpp's backends see, counted as the expert engine counts a set's device
    indexes (``pool_device`` in native/src/expert_pool/pool.cpp); 0 on CPU builds or without llama_cpp."""
    try:
        from llama_cpp import llama_cpp as _ll
        lib_ = _ll._lib
        count, get, typ = lib_.ggml_backend_dev_count, lib_.ggml_backend_dev_get, lib_.ggml_backend_dev_type
    except (ImportError, AttributeError):
        return 0
    count.argtypes, count.restype = [], ctypes.c_size_t
    get.argtypes, get.restype = [ctypes.c_size_t], ctypes.c_void_p
    typ.argtypes, typ.restype = [ctypes.c_void_p], ctypes.c_int
    gpu = 1  # GGML_BACKEND_DEVICE_TYPE_GPU (ggml-backend.h: CPU 0, GPU 1, IGPU 2, ACCEL 3)
    return sum(1 for i in range(count()) if typ(get(i)) == gpu)


def has_gpu() -> bool:
    """Whether the installed llama.cpp can offload to a GPU (False on CPU builds or without it)."""
    try:
        import llama_cpp
        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:
        return False
