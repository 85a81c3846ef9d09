"""Loading a model in the engine worker: the file check, the expert runtime, llama.cpp's model and
context, the chat templates; and freeing them again.

:func:`load_model` is the one place that turns settings into llama.cpp's model and context
parameters. A foreign or truncated file is refused before llama.cpp sees it (it would crash the
worker); a residency set the expert engine refuses is an error, other expert-engine failures under
``experts = "auto"`` fall back to stock placement and keep serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import psutil

from ..hardware import default_threads, probe_gpus
from ..residency.model import ModelFileError, ModelInfo, check_model_file
from ..residency.sets import ResidencyError
from ..settings import Settings
from . import chat, native
from .context_fit import ContextFit, fit_context
from .native import ExpertEngineError
from .prefill_plan import SMALL_UBATCH, UbatchChoice, choose_ubatch
from ..residency.planner import DEFAULT_MARGIN_MB, estimate_gpu_need
from .infill import FimTokens
from .prefix_cache import prefix_cache_budget
from .runtime import ExpertRuntime
from .types import EngineError

log = logging.getLogger("ostinatod.engine")


def inspect_gguf(path: Path) -> ModelInfo:
    """Validate ``path`` as a complete GGUF file and describe it (:func:`check_model_file`).

    Raises EngineError("model_not_loaded", status 503) if the file is missing, not a GGUF, damaged,
    or truncated (tensor data extends beyond the end of the file).
    """
    try:
        return check_model_file(path)
    except ModelFileError as e:
        raise EngineError("model_not_loaded", str(e), 503) from e


@dataclass
class Loaded:
    """What :func:`load_model` made: llama.cpp's ``model``, ``ctx``, ``mem`` and ``vocab``, the
    expert runtime ``rt`` (None: stock placement), the ``templates``, the file's ``gguf``
    description, the context per slot ``n_ctx_slot`` and the ``n_slots``; ``n_ctx_reason`` says why
    the context is below the ``n_ctx`` setting for lack of memory (None: it is not); ``ubatch`` the
    context's ubatch and why (:mod:`.prefill_plan`)."""

    gguf: ModelInfo
    model: Any
    ctx: Any
    mem: Any
    vocab: Any
    rt: Any
    templates: Any
    n_ctx_slot: int
    n_slots: int
    n_ctx_reason: Optional[str] = None
    ubatch: Optional[UbatchChoice] = None


_LOG_ERROR, _LOG_CONT = 4, 5  # ggml_log_level values (ggml.h; llama-cpp-python maps them off by one)
_log_capture: dict[str, Any] = {"lines": None, "error": False, "cb": None, "served": None}


def restate_context_line(text: bytes, served: Optional[tuple[int, int]]) -> Optional[bytes]:
    """llama.cpp's context-creation line ``text`` as it should be logged while a context of
    ``served`` = (tokens per slot, slots) is created: its lines about ``n_ctx_seq`` count the KV
    cache the slots share, not a slot's context, so they are replaced by one that states both
    (the ``> n_ctx_train`` warning is dropped: a slot's context never exceeds the training one).
    None: drop the line; other lines are returned as they are."""
    if served is None or b"n_ctx_seq" not in text:
        return text
    if b"n_ctx_train" in text:
        return None
    n_slot, n_slots = served
    return (f"llama_context: serving {n_slot} tokens per slot; the {n_slots} slots share one KV cache "
            f"(llama.cpp's n_ctx_seq = {n_slot * n_slots})\n").encode()


def _capturing_callback() -> Any:
    """A llama.cpp log callback that keeps the ERROR lines while a load is captured and passes
    every line on to llama-cpp-python's own callback (made once; kept referenced)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    import llama_cpp._logger as llog  # lazy: the native engine, loaded only where it runs

    if _log_capture["cb"] is None:
        @llama_cpp.llama_log_callback
        def cb(level: int, text: bytes, user_data: Any) -> None:
            said = restate_context_line(text, _log_capture["served"])
            if said is None:
                return
            text = said
            lines = _log_capture["lines"]
            if level != _LOG_CONT:
                _log_capture["error"] = level == _LOG_ERROR
            if lines is not None and _log_capture["error"]:
                lines.append(text.decode("utf-8", "replace"))
            llog.llama_log_callback(level, text, user_data)
        _log_capture["cb"] = cb
    return _log_capture["cb"]


@contextlib.contextmanager
def log_errors_captured() -> Iterator[list[str]]:
    """Collect llama.cpp's ERROR log lines while the block runs (yields the list they go to);
    one capture at a time (the log callback is the process's)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    with _capture_lock:
        lines: list[str] = []
        llama_cpp.llama_log_set(_capturing_callback(), None)
        _log_capture["lines"] = lines
        try:
            yield lines
        finally:
            _log_capture["lines"] = None


_capture_lock = threading.RLock()


def llama_reason(lines: list[str]) -> str:
    """llama.cpp's reason for refusing a model, from its ERROR log lines: the text after
    "error loading model: " where there is one, else the lines joined ("" without any)."""
    text = "".join(lines)
    for line in text.splitlines():
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip()
    return "; ".join(x.strip() for x in text.splitlines() if x.strip())[:500]


def _load_weights(rt: Any, model_path: Path, mparams: Any) -> Any:
    """llama.cpp's model (through the expert runtime when there is one). Raises EngineError
    ("model_not_loaded") naming llama.cpp's reason when it refuses the file."""
    with log_errors_captured() as lines:
        try:
            if rt is not None:
                model = rt.load(model_path, mparams)
            else:
                model, _, _ = native.load_model(model_path, mparams)
        except ExpertEngineError as e:
            raise EngineError("model_not_loaded", f"expert runtime: {e}", 503) from e
    if not model:
        reason = llama_reason(lines) or "no reason given (see the engine log)"
        raise EngineError("model_not_loaded", f"llama.cpp refused {model_path.name}: {reason}", 503)
    return model


def _expert_runtime(settings: Settings, model_path: Path) -> Any:
    try:
        return ExpertRuntime.prepare(model_path, settings)
    except EngineError:
        raise
    except Exception as e:
        # a wrong residency set, or experts="ostinato" that cannot be honoured, is refused;
        # any other failure under experts="auto" falls back to stock placement and keeps serving
        if isinstance(e, (ResidencyError, ExpertEngineError)) or settings.experts != "auto":
            raise EngineError("model_not_loaded", f"expert runtime: {e}", 503) from e
        log.exception("expert runtime failed, serving with stock placement: %s", e)
        return None


def compute_bytes(gguf: ModelInfo, n_ubatch: int) -> int:
    """One forward pass's compute buffers at ``n_ubatch`` tokens (the planner's estimate)."""
    return int(estimate_gpu_need(gguf, [], 0, n_ubatch=n_ubatch, last=True)["compute"])


def context_ubatch(settings: Settings, gguf: ModelInfo, rt: Any, fit: ContextFit, on_gpu: bool) -> UbatchChoice:
    """The context's ubatch (:func:`.prefill_plan.choose_ubatch`): uploads to save where the expert
    pool is on a GPU and holds fewer than all of the model's routed experts."""
    uploads = False
    if rt is not None and on_gpu and getattr(rt, "device", -1) >= 0:
        total = sum(1 for b in gguf.expert_bytes if b) * gguf.n_expert
        try:
            hot = int(rt.info().get("hot_experts") or 0)
        except Exception:  # the pool's layout is informative here, never fatal
            hot = 0
        uploads = hot < total
    return choose_ubatch(settings.n_ubatch, settings.n_batch, uploads, fit.left_bytes,
                         lambda u: compute_bytes(gguf, u))


def served_context(settings: Settings, gguf: ModelInfo, n_ctx_train: int, n_slots: int, *,
                   on_gpu: bool) -> ContextFit:
    """The context per slot to serve (:func:`.context_fit.fit_context`), measured after the model
    load: the KV cache goes where the layers went, so the memory is the GPUs' free memory (NVML,
    summed over the GPUs: the layers and their KV are split over them) when ``on_gpu``, else the
    host's available memory. Kept free: one ubatch's compute buffers
    (:func:`..residency.planner.estimate_gpu_need`'s figure) and the planner's margin, and on the
    host also the prefix cache's budget. NVML missing on a GPU build: the setting is served as is."""
    reserve = compute_bytes(gguf, min(settings.n_ubatch or SMALL_UBATCH, settings.n_batch)) + DEFAULT_MARGIN_MB * (1 << 20)
    if on_gpu:
        gpus = probe_gpus()
        free = sum(int(g["memory_free_bytes"]) for g in gpus) if gpus else None
        where = "GPU memory"
    else:
        free = int(psutil.virtual_memory().available)
        reserve += prefix_cache_budget(settings)
        where = "host memory"
    return fit_context(settings.n_ctx, n_ctx_train, n_slots, gguf.kv_bytes_per_token, free, reserve, where)


def load_model(settings: Settings, model_path: Path) -> Loaded:
    """Validate and load the model, create the context and the chat templates.

    Raises EngineError("model_not_loaded") with a clear message on any failure (nothing is left
    allocated then).
    """
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    try:
        import llama_cpp._logger as llog  # lazy: the native engine, loaded only where it runs
        llog.set_verbose(settings.log_level == "DEBUG")
    except Exception:  # pragma: no cover - logging only
        pass
    gguf = inspect_gguf(model_path)
    llama_cpp.llama_backend_init()
    rt = _expert_runtime(settings, model_path)

    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = settings.n_gpu_layers if settings.n_gpu_layers >= 0 else 999
    n_cpu_moe = int(getattr(settings, "n_cpu_moe", 0) or 0)
    if n_cpu_moe > 0:
        mparams.tensor_buft_overrides = native.fn("ostinato_n_cpu_moe_overrides")(n_cpu_moe)
    model = _load_weights(rt, model_path, mparams)
    vocab = llama_cpp.llama_model_get_vocab(model)

    n_slots = settings.n_slots
    fit = served_context(settings, gguf, llama_cpp.llama_model_n_ctx_train(model), n_slots,
                         on_gpu=native.has_gpu() and mparams.n_gpu_layers > 0)
    if fit.reason:
        log.warning("context: serving %d tokens per slot, not the %d asked: %s (set n_ctx or n_slots "
                    "lower to choose, or free memory)", fit.n_ctx, fit.asked, fit.reason)
    n_ctx_slot = max(64, fit.n_ctx)
    n_batch = settings.n_batch
    ub = context_ubatch(settings, gguf, rt, fit, on_gpu=native.has_gpu() and mparams.n_gpu_layers > 0)
    log.info("prefill: ubatch %d tokens (%s)", ub.ubatch, ub.reason)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx_slot * n_slots
    cparams.n_batch = n_batch
    cparams.n_ubatch = ub.ubatch
    cparams.n_seq_max = n_slots
    # shared prefix cells across slots (seq_cp is metadata only); deterministic: a stream per slot,
    # so no slot's cells or attention span depend on the others (determinism.py)
    cparams.kv_unified = not settings.deterministic
    threads = settings.n_threads or default_threads(getattr(settings, "cpu_set", None))
    if rt is not None and rt.batch_threads:
        threads = rt.batch_threads  # leaves the decode graph's pool its cores
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    if rt is not None:
        # one-token steps: the CPU branch is small (or on the decode graph's own pool)
        cparams.n_threads = rt.context_decode_threads(threads, mparams.n_gpu_layers)
        rt.context_threads = (int(cparams.n_threads), int(threads))
        rt.follows_graph = cparams.n_threads == 1 and threads > 1
    if settings.flash_attn is not None:
        cparams.flash_attn_type = 1 if settings.flash_attn else 0
    cparams.no_perf = True
    _log_capture["served"] = (n_ctx_slot, n_slots)  # restated in llama.cpp's n_ctx_seq lines
    llama_cpp.llama_log_set(_capturing_callback(), None)
    try:
        ctx = llama_cpp.llama_init_from_model(model, cparams)
    finally:
        _log_capture["served"] = None
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise EngineError("model_not_loaded", f"could not create a context of {cparams.n_ctx} tokens "
                          "(out of memory? lower n_ctx or n_slots)", 503)
    override = settings.chat_template
    if override and Path(override).is_file():
        override = Path(override).read_text()
    try:
        templates = chat.ChatTemplates(int(model), override)
    except EngineError as e:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
        raise EngineError("model_not_loaded", f"chat template: {e.message}", 503) from e
    log.info("model loaded: %s (%s, %d layers, %d experts, n_ctx %d per slot x %d slots)",
             model_path.name, gguf.arch or "unknown", gguf.n_layer, gguf.n_expert, n_ctx_slot, n_slots)
    if gguf.is_demo:
        log.warning("the served model is a generated demo model with RANDOM weights: its output is "
                    "meaningless (set 'model' to a real GGUF)")
    return Loaded(gguf=gguf, model=model, ctx=ctx, mem=llama_cpp.llama_get_memory(ctx), vocab=vocab,
                  rt=rt, templates=templates, n_ctx_slot=n_ctx_slot, n_slots=n_slots,
                  n_ctx_reason=fit.reason, ubatch=ub)


def free_model(templates: Any, rt: Any, batch: Any, ctx: Any, model: Any) -> None:
    """Free what :func:`load_model` made (and the worker's batch); any of them may be None."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs

    if templates is not None:
        templates.close()
    if rt is not None:
        try:
            rt.close()
        except Exception:
            log.exception("expert runtime close failed")
    if batch is not None:
        llama_cpp.llama_batch_free(batch)
    if ctx:
        llama_cpp.llama_free(ctx)
    if model:
        llama_cpp.llama_model_free(model)


def tokenize(vocab: Any, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """Tokens of ``text`` (special tokens parsed unless ``parse_special`` is false). Thread-safe
    (the vocab is read-only)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    data = text.encode("utf-8")
    n_max = len(data) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:
        n_max = -n
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    return list(buf[:n])


def piece(vocab: Any, token: int, special: bool = False) -> bytes:
    """Bytes of one token (``special``: render control tokens too)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]


def max_piece_bytes(vocab: Any) -> int:
    """Bytes of the longest token text of the vocabulary, control tokens included (one pass over
    it at load; a bound of how much text one token can stand for)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    return max((len(piece(vocab, t, special=True)) for t in range(n)), default=1) or 1


def preserved_ids(vocab: Any, rendered: Any) -> set:
    """Ids of the rendered prompt's preserved special tokens (streamed as text, e.g. tool-call
    tags the chat parser needs); empty for raw prompts."""
    ids: set = set()
    if rendered is None:
        return ids
    for s in rendered.preserved_tokens:
        toks = tokenize(vocab, s, add_special=False)
        if len(toks) == 1:
            ids.add(toks[0])
    return ids


def model_facts(settings: Settings, model_path: Path, g: Any, model: Any, templates: Any,
                n_ctx_slot: int, expert_engine: bool, n_slots: int, max_piece: int = 0,
                n_ctx_reason: Optional[str] = None) -> dict[str, Any]:
    """The loaded model's facts (see EngineClient.info); ``n_ctx_reason``: why the context per slot
    is below the setting (:class:`Loaded`)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    tinfo = templates.info if templates else {}
    return {"name": settings.model_alias or model_path.stem, "path": str(model_path),
            "arch": (g.arch or "unknown") if g else None, "n_ctx": n_ctx_slot,
            "n_ctx_reason": n_ctx_reason,
            "n_ctx_train": llama_cpp.llama_model_n_ctx_train(model) if model else None,
            "n_params": llama_cpp.llama_model_n_params(model) if model else None,
            "n_vocab": llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)) if model else None,
            "size_bytes": g.size_bytes if g else None, "is_demo": bool(g and g.is_demo),
            "n_expert": g.n_expert if g else 0, "n_expert_used": g.n_expert_used if g else 0,
            "n_layer": g.n_layer if g else 0, "experts_mode": "ostinato" if expert_engine else "stock",
            "n_slots": n_slots, "supports_thinking": bool(tinfo.get("supports_thinking")),
            "max_piece_bytes": max_piece,
            "chat_template_caps": tinfo.get("caps", {}),
            "chat_template": tinfo.get("source") or "",
            "bos_token": _token_text(model, "bos"), "eos_token": _token_text(model, "eos"),
            "eog_tokens": _eog_tokens(model), "infill": _has_fim(model), "ftype": _ftype(model)}


def _token_text(model: Any, which: str) -> str:
    """The text of the model's BOS or EOS token ("" without one)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    if not model:
        return ""
    vocab = llama_cpp.llama_model_get_vocab(model)
    tok = llama_cpp.llama_vocab_bos(vocab) if which == "bos" else llama_cpp.llama_vocab_eos(vocab)
    return piece(vocab, tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""


def _ftype(model: Any) -> str:
    """llama.cpp's name of the file's type (``Q4_K - Medium``, ``BF16``, ...; "" without a model)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    if not model:
        return ""
    name = llama_cpp.llama_ftype_name(llama_cpp.llama_model_ftype(model))
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name or "")


def _eog_tokens(model: Any) -> list[int]:
    """The ids of the vocabulary's end-of-generation tokens (what ``ignore_eos`` bans; about 0.1 s
    for a 150K vocabulary)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    if not model:
        return []
    vocab = llama_cpp.llama_model_get_vocab(model)
    return [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def _has_fim(model: Any) -> bool:
    """True when the vocabulary has the FIM prefix, suffix and middle tokens (/infill)."""
    import llama_cpp  # lazy: the native engine, loaded only where it runs
    return bool(model) and not FimTokens.of_vocab(llama_cpp.llama_model_get_vocab(model)).missing()
