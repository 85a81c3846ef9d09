"""The one ctypes loader of the package: our native additions.

Two product libraries, one place:

* ``libostinato.so`` (built next to ``libllama.so``): the chat shim (``ostinato_chat_*``) and the
  sampler; :func:`lib` returns it with every function's argtypes/restype declared, :func:`fn` one
  function (other modules may add declarations through :func:`declare`).
* the expert engine (``ostinato_experts_*``), part of libllama because the patched llama.cpp calls
  it, reached through llama-cpp-python's own handle of that library: :func:`llama_fn`. Its loader
  config is a process-global that the next model load reads; only :func:`load_model`,
  :func:`check_experts_config` and :func:`experts_switch` set it, under one lock, and clear it
  before they return, so the placement travels with the load parameters and no other code
  touches the global.

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

c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p
c_int = ctypes.c_int


class NativeError(RuntimeError):
    """libostinato.so cannot be loaded (engine not built) or lacks a symbol (stale build)."""


class ExpertEngineError(RuntimeError):
    """The native expert engine is missing (stale build) or refused a configuration."""


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
    "ostinato_experts_switch": ([_C], ctypes.c_int),
    "ostinato_experts_active": ([], ctypes.c_int),
    "ostinato_experts_last_error": ([], _C),
    "ostinato_experts_set_threshold": ([ctypes.c_int64], ctypes.c_int),
    "ostinato_experts_force_path": ([_C], ctypes.c_int),
    "ostinato_experts_set_timing": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_overlap": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_decode_graph": ([ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_cpu_threads": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_cpu_kernel": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_cpu_prefetch": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_cpu_spins": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_cpu_claims": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_cpu_row_pairs": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_decode_prefetch": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_decode_prefetch_blocks": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_borrow": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_views": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_copy_2d": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_whole_slots": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_resident_path": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_upload_cpu_share": ([ctypes.c_double], ctypes.c_int),
    "ostinato_experts_set_hybrid_rows": ([ctypes.c_int], ctypes.c_int),
    "ostinato_experts_set_cpu_split": ([ctypes.c_double, ctypes.c_double, ctypes.c_double], ctypes.c_int),
    "ostinato_hybrid_split": ([ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_int, ctypes.c_double,
                               ctypes.c_double, ctypes.c_double], ctypes.c_int),
    "ostinato_experts_set_prefetch": ([ctypes.c_int], ctypes.c_int),
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


def load_model(path: Path | str, mparams: Any, experts_config: Optional[dict[str, Any]] = None
               ) -> tuple[Any, bool, str]:
    """Load a model with the expert engine's placement ``experts_config`` (None: stock placement):
    ``ostinato_model_load(path, mparams, config)``, which passes the placement with the load call
    (as llama.cpp passes ``tensor_buft_overrides``), so no process-global is left set.

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
        f.argtypes = [ctypes.c_char_p, llama_cpp.llama_model_params, ctypes.c_char_p]
        f.restype = llama_cpp.llama_model_p_ctypes   # a pointer (llama_model_p is only a type hint)
        _llama_bound["ostinato_model_load"] = f
    model = f(str(path).encode(), mparams, json.dumps(experts_config).encode())
    return model, experts_active(), experts_error()


def experts_switch(config: dict[str, Any]) -> None:
    """Rebuild the loaded model's expert pool with ``config`` (the swap of a residency set, at a
    request boundary). Raises ExpertEngineError; the old set then stays in use."""
    if llama_fn("ostinato_experts_switch")(json.dumps(config).encode()) != 0:
        raise ExpertEngineError(experts_error())


def set_prefill_threshold(np_tokens: int) -> None:
    """Set Np: forward passes of >= Np tokens take the upload path. Raises ValueError if < 1."""
    if llama_fn("ostinato_experts_set_threshold")(int(np_tokens)) != 0:
        raise ValueError(f"prefill threshold must be >= 1, got {np_tokens}")


def force_path(path: str) -> None:
    """Force prefill passes onto one path: "split", "upload", or "auto" (by Np). Raises ValueError."""
    if llama_fn("ostinato_experts_force_path")(path.encode()) != 0:
        raise ValueError(f"path must be auto, split or upload, got {path!r}")


def set_timing(on: bool) -> None:
    """Timing mode: GPU-branch times per forward pass (``gpu_branch_ms``, ``gpu_timed``) at the cost
    of one GPU sync per MoE layer. Off while serving (the branches then overlap); on for calibration.
    CPU-branch and upload times are measured in both modes."""
    llama_fn("ostinato_experts_set_timing")(1 if on else 0)


def set_overlap(on: bool) -> None:
    """Decode overlap on/off (docs/design.md, native engine item 5): with it the CPU branch of a layer runs while the GPU
    branch computes; without it the CPU branch runs first, saving one host round trip per layer.
    Which is faster depends on the machine; ``ostinato calibrate`` measures both."""
    llama_fn("ostinato_experts_set_overlap")(1 if on else 0)


def set_decode_graph(on: Optional[bool], max_tokens: int = 0) -> None:
    """Decode graph (paper Sec. 3.4; docs/engine.md "Decode graph"): forward passes of at most
    ``max_tokens`` tokens (0 keeps the current value, 64 at start) that are decode steps or split-path
    prefills run with the route op on the GPU, the CPU branch on a resident thread pool fed through
    mapped host memory, and a wait kernel joining the branches, so that the pass is one CUDA graph.
    ``None``: on when a pool is on a GPU; ``True`` also on a CPU build (tests). Raises ValueError
    for a max_tokens outside 0..4096. Takes effect at the next graph build."""
    mode = -1 if on is None else int(bool(on))
    if llama_fn("ostinato_experts_set_decode_graph")(mode, int(max_tokens)) != 0:
        raise ValueError(f"decode graph max_tokens must be 0..4096, got {max_tokens}")


def set_borrow(on: bool) -> None:
    """Borrowed decode memory (docs/engine.md "Borrowed decode memory"): during decode
    the upload path's staging slots hold the cold experts the CPU branch computed most lately
    (decaying count), promoted at token boundaries and handed back before a pass that takes the
    upload path. On by default."""
    llama_fn("ostinato_experts_set_borrow")(1 if on else 0)


def set_views(on: bool) -> None:
    """Per-layer pool views (docs/engine.md "Pool views"): split and upload passes of 9
    tokens or more compute the GPU routes over views of the layer's own pool slots (and the staging
    slots), with -1 for the routes of the other branch, so that the GPU's grouped matrix product
    scans one layer's experts rather than the whole size class. On by default; off only for
    measurements. Takes effect at the next graph build."""
    llama_fn("ostinato_experts_set_views")(1 if on else 0)


def set_copy_2d(on: bool) -> None:
    """Upload-path copies (docs/engine.md "Whole-expert copies"): on, an expert's up,
    gate and down matrices (a run of consecutive experts: theirs) go in one 2D copy where they sit at
    one pitch in host memory and in the pool, which llama.cpp's files and the pool layout give; off,
    one copy per matrix. The bytes are the same; the copy engine moves them faster in fewer, larger
    transfers (docs/benchmarks/runs/2026-12-01-h2d-h200.json); a CPU pool copies the same rows one by one. On by
    default; off only for measurements. Takes effect at the next copy."""
    llama_fn("ostinato_experts_set_copy_2d")(1 if on else 0)


def set_whole_slots(on: bool) -> None:
    """Whole-expert slots (docs/engine.md "Whole-expert copies"): pools built after this call (the
    next model load or residency switch) give each size class whose weight matrices hold the same
    bytes per expert slots that hold an expert's matrices next to each other (the class tensors
    strided by a whole slot), so that an upload copy's pitch is one matrix, within the GPU's 2D copy
    limit at any pool size. Same memory, same computation. The native default is off; the daemon
    sets it at every load from the setting ``pool_whole_expert_slots`` (on by default)."""
    llama_fn("ostinato_experts_set_whole_slots")(1 if on else 0)


def set_resident_path(on: bool) -> None:
    """All-resident layers (docs/engine.md "All-resident layers"): a layer whose experts are all in
    the pool (its hot slots then hold them in expert order) computes as stock does, over tensors on
    those slots with the router's ids, on every path and pass size: no route op, no host round trip; a
    count op at the end of the graph counts its routes on the pool's device, read back at each stats
    call. On by default; off only for measurements (such layers then take the route op like any
    other). Takes effect at the next graph build."""
    llama_fn("ostinato_experts_set_resident_path")(1 if on else 0)


def set_upload_cpu_share(share: Optional[float]) -> None:
    """Hybrid upload passes (docs/engine.md "Pool views and the hybrid upload pass"): the share 0..1 of
    a pass's distinct cold experts that a CPU branch computes while the others are uploaded (the ones
    with the fewest routes go to the CPU). 0 (the default) builds upload passes without a CPU
    branch: measured on the H200 (48 layers, 354-token prefills) the CPU branch of a long pass cost
    more than the copies it saved. ``None``: adapted per layer so that the CPU branch and the copies
    end together (0 for a pool without an upload stream, i.e. on the CPU). Raises ValueError
    outside 0..1."""
    v = -1.0 if share is None else float(share)
    if llama_fn("ostinato_experts_set_upload_cpu_share")(v) != 0:
        raise ValueError(f"upload CPU share must be within 0..1, got {share}")


def set_hybrid_rows(rows: int) -> None:
    """Most tokens (1..4096, default 64) the CPU branch of a hybrid upload pass takes: it runs over
    the tokens that have its routes only, gathered into that many rows (a cold expert whose tokens
    would not fit is uploaded instead). Raises ValueError outside 1..4096. Next graph build."""
    if llama_fn("ostinato_experts_set_hybrid_rows")(int(rows)) != 0:
        raise ValueError(f"hybrid rows must be within 1..4096, got {rows}")


def set_cpu_split(split: Optional[dict[str, float]]) -> None:
    """The cost-model split of upload passes between the CPU branch and the uploads (docs/engine.md
    "The prefill's CPU share"): ``split`` = {"alpha_us", "cpu_gbps", "h2d_gbps"}
    (the CPU branch's fixed cost per layer and bandwidth at the prefill's thread count, the pinned
    host->GPU bandwidth; :func:`ostinatod.residency.cost.cpu_split_params`), or None (off: upload
    passes without a CPU branch). A fixed or adapted :func:`set_upload_cpu_share` other than 0 takes
    precedence. Next graph build. Raises ValueError for negative or non-finite values."""
    a, c, h = (0.0, 0.0, 0.0) if split is None else (float(split["alpha_us"]), float(split["cpu_gbps"]),
                                                   float(split["h2d_gbps"]))
    if llama_fn("ostinato_experts_set_cpu_split")(a, c, h) != 0:
        raise ValueError(f"CPU split needs alpha >= 0 and both bandwidths > 0, got {split}")


def hybrid_split(routes: Sequence[int], n_upload: int, alpha_us: float, beta_us: float,
                 upload_us: float) -> int:
    """The split rule alone (native ``ost_split_experts``, for tests): of cold experts with
    ``routes`` (ascending, the order the CPU takes them), how many the CPU branch takes so that
    max(alpha + beta * their routes, upload_us * (n_upload - taken)) is least (us)."""
    arr = (ctypes.c_int32 * max(1, len(routes)))(*[int(r) for r in routes])
    return int(llama_fn("ostinato_hybrid_split")(arr, len(routes), int(n_upload), float(alpha_us),
                                                 float(beta_us), float(upload_us)))


def set_prefetch(depth: int | bool) -> None:
    """Prefetch depth for upload passes with pool views (docs/engine.md "Prefetch"): at each layer
    the routers of the next ``depth`` layers (0 = off, 1 or 2; True = 1) applied to this layer's input
    predict their routes, and the copies of their predicted cold experts start after this layer's own
    on a stream of their own, so that they run while this layer's staged routes and the next layers'
    attention compute. The pool gets depth + 1 staging regions (layer il stages in region
    il % (depth + 1)). Off in the native engine until set; the runtime sets the settings'
    (``prefill_prefetch``, ``prefill_prefetch_depth``). Takes effect at the next load or residency
    switch. Raises ValueError outside 0..2."""
    if llama_fn("ostinato_experts_set_prefetch")(int(depth)) != 0:
        raise ValueError(f"prefetch depth must be within 0..2, got {depth}")


def set_cpu_threads(n: int) -> None:
    """Threads of the decode graph's CPU-branch pool (0: the physical cores). A change takes effect at
    the next forward pass (the pool is made anew then); call it between passes."""
    llama_fn("ostinato_experts_set_cpu_threads")(max(0, int(n)))


def set_cpu_kernel(on: bool) -> None:
    """The decode graph's CPU branch on its own kernel (True, the runtime's default from the setting
    ``cpu_branch_kernel``) or on ggml's graph compute (False; measurements). The native default is on.
    Takes effect at the next graph build (a change marks the cached graphs stale)."""
    llama_fn("ostinato_experts_set_cpu_kernel")(1 if on else 0)


def set_cpu_prefetch(rows: int) -> None:
    """The CPU branch kernel's software prefetch distance in weight rows (0: off, the native
    default; setting ``cpu_branch_prefetch_rows``): while a thread computes row r of its chunk it
    prefetches row r + ``rows``. Process-wide, read once per phase of a run. Raises ValueError
    outside 0..64 (the engine's OST_PREFETCH_ROWS_MAX)."""
    if llama_fn("ostinato_experts_set_cpu_prefetch")(int(rows)) < 0:
        raise ValueError(f"CPU branch prefetch rows must be 0..64, got {rows}")


ROW_PAIRS = ("off", "avx2", "avx512")


def set_cpu_row_pairs(mode: str) -> str:
    """The CPU branch kernel's dot products (setting ``cpu_branch_row_pairs``): ``"off"`` (ggml-cpu's
    vec_dot row by row, the native default), ``"avx2"`` or ``"avx512"`` (two weight rows per pass in
    two 256-bit registers or one 512-bit one, bitwise vec_dot's: each type is checked against it on
    this machine at first use; a CPU without AVX-512 takes AVX2). Process-wide, read per chunk of
    rows; left out while the software prefetch is on (``set_cpu_prefetch`` > 0);
    ``info()["decode_graph"]["cpu_kernel"]["row_pairs"]`` says the mode (0/1/2), the set used and
    the types served. Returns the previous mode. Raises ValueError for another mode."""
    if mode not in ROW_PAIRS:
        raise ValueError(f"CPU branch row pairs must be one of {', '.join(ROW_PAIRS)}, got {mode!r}")
    return ROW_PAIRS[llama_fn("ostinato_experts_set_cpu_row_pairs")(ROW_PAIRS.index(mode))]


def set_cpu_spins(spins: int) -> int:
    """Pauses a waiting thread of the CPU branch's team spins before it yields on every further try
    (256: the native default; setting ``cpu_branch_spins``). Process-wide. Returns the previous count;
    raises ValueError for a negative one."""
    was = llama_fn("ostinato_experts_set_cpu_spins")(int(spins))
    if was < 0:
        raise ValueError(f"CPU branch spins must be >= 0, got {spins}")
    return was


def set_cpu_claims(on: bool) -> bool:
    """How the CPU branch's team takes a layer's work (setting ``cpu_branch_claims``): True (the
    default) on a claim board, where the threads that are on a core take its items (chunks of weight
    rows, routes' activations) one at a time and the thread completing a phase opens the next, so no
    phase waits for a thread the scheduler took off its core; False every thread in every phase with a
    barrier after each. Same arithmetic either way. Process-wide. Returns the previous mode."""
    return bool(llama_fn("ostinato_experts_set_cpu_claims")(1 if on else 0))


def set_decode_prefetch(max_experts: int) -> None:
    """Decode prefetch (docs/engine.md "Decode prefetch"): in a decode step each layer's route op
    predicts the next layer's routes (that layer's router on this layer's FFN input) and stages up to
    ``max_experts`` of the predicted cold experts on the GPU while this layer computes; their routes
    then run in the GPU branch instead of the CPU branch. 0 (the native default) turns it off; the
    runtime sets the setting ``decode_prefetch_experts``. Needs 3 staging regions (prefill prefetch
    depth 2, read at the pool build). Takes effect at the next pass; call between passes. Raises
    ValueError outside 0..16."""
    if llama_fn("ostinato_experts_set_decode_prefetch")(int(max_experts)) != 0:
        raise ValueError(f"decode prefetch experts must be within 0..16, got {max_experts}")


def set_decode_prefetch_blocks(blocks: int) -> None:
    """Blocks (of 512 threads) of decode prefetch's copy kernel on the GPU (setting
    ``decode_prefetch_copy_blocks``, native default 8): it copies the staged experts over PCIe beside
    the decode step's own kernels. ``info()["decode_graph"]["prefetch"]["copy_blocks"]`` says it. Takes
    effect at the next pass; call between passes. Raises ValueError outside 1..1024."""
    if llama_fn("ostinato_experts_set_decode_prefetch_blocks")(int(blocks)) != 0:
        raise ValueError(f"decode prefetch copy blocks must be within 1..1024, got {blocks}")


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
