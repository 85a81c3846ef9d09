"""The engine worker: owns the model, its KV slots and the generation loop.

Runs on llama-cpp-python's low-level ctypes bindings (``import llama_cpp``) plus our chat shim. One
thread calls :meth:`Worker.run` (the loop); any thread calls :meth:`Worker.submit` /
:meth:`Worker.cancel`; events are delivered through the ``emit`` callback given with each request
(called on the loop thread, must not block).

Scheduling (DESIGN.md "Scheduling for agent sessions"):

- ``n_slots`` KV sequences in one unified KV cache of ``n_slots * n_ctx`` cells; each request may use
  ``n_ctx`` tokens (prompt + output).
- A new request takes the free slot whose cached tokens share the longest common prefix with its
  prompt. If that match covers less than ``SAME_SESSION_SHARE`` of the slot's tokens (another
  conversation) while another slot is free, the prefix is copied (``llama_memory_seq_cp``: cells are
  shared, no data copied) into the least recently used free slot instead, so a side request never
  evicts the main session's cache. Only the tail beyond the match is dropped; each turn prefills
  only its new tokens.
- Every step builds one batch: one token for each generating slot (batched decode across slots) and
  then prefill chunks of waiting slots up to ``n_batch`` tokens.

Residency sets (which experts are hot) are swapped on this loop, at request boundaries only, i.e.
when no generation is in progress (:meth:`Worker.switch_residency`; DESIGN.md "Planning"):

- an explicit switch (control API, background re-plan) is queued; the loop runs it as soon as no
  request is generating and admits no new request while it waits, so it cannot be starved;
- the automatic per-workload swap (setting ``residency_auto_switch``): before a request is admitted
  while no other request is generating, if its workload differs from the workload of the active set
  (or the active set is that workload's planned file and the file was re-planned since) and a
  planned set ``<data>/residency/<fingerprint>/<workload>.json`` exists, that set is swapped in
  first and the request's "start" event carries ``residency_switch`` (the swap's facts). A set the
  engine refuses (malformed, another model's) is skipped, said once in ``residency_switch_skipped``
  of the start event, and not tried again until its file changes. A request that arrives while
  another one generates runs with the current set; it is never held back for a swap.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..settings import Settings
from ..hardware import physical_cores
from ..paths import residency_file
from ..residency.model import ModelFileError, ModelInfo, check_model_file
from .types import EngineError, EngineEvent, GenRequest

log = logging.getLogger("ostinatod.engine")

Emit = Callable[[EngineEvent], None]

# A request continues a slot's conversation in place when it matches at least this share of the
# slot's cached tokens (a re-rendered last turn differs only at the tail); below it the slot is kept
# for its own conversation and the common prefix is shared into another slot.
SAME_SESSION_SHARE = 0.75


# --------------------------------------------------------------------------------------------------
# GGUF checks (before llama.cpp sees the file: a foreign or truncated file must not crash the worker)
# --------------------------------------------------------------------------------------------------

def inspect_gguf(path: Path) -> ModelInfo:
    """Validate ``path`` as a complete GGUF file and describe it (:func:`check_model_file`).

    Raises EngineError("model_not_loaded", status 503) if the file is missing, not a GGUF, damaged,
    or truncated (tensor data extends beyond the end of the file).
    """
    try:
        return check_model_file(path)
    except ModelFileError as e:
        raise EngineError("model_not_loaded", str(e), 503) from e


# --------------------------------------------------------------------------------------------------
# requests and slots
# --------------------------------------------------------------------------------------------------

@dataclass
class Slot:
    """One KV sequence: ``tokens`` are exactly the tokens whose KV is in the cache (positions 0..n-1)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    task: Optional["Task"] = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Utf8Text:
    """Incremental UTF-8 decoding of token pieces: bytes of an unfinished character are held back."""

    def __init__(self) -> None:
        self.buf = b""
        self.text = ""

    def add(self, piece: bytes) -> None:
        self.buf += piece
        # decode the longest valid prefix; at most 3 trailing bytes can be an unfinished character
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                s = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.text += s
            self.buf = self.buf[cut:]
            return
        if len(self.buf) > 8:  # not UTF-8 at all: keep the text flowing
            self.text += self.buf.decode("utf-8", errors="replace")
            self.buf = b""

    def flush(self) -> str:
        if self.buf:
            self.text += self.buf.decode("utf-8", errors="replace")
            self.buf = b""
        return self.text


@dataclass
class Task:
    """A request in the worker: its prompt, sampler, parser and progress."""

    req: GenRequest
    emit: Emit
    t_arrival: float
    prompt: list[int] = field(default_factory=list)
    rendered: Any = None
    parser: Any = None
    sampler: Any = None  # common_sampler * (native shim)
    slot: Optional[Slot] = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: Optional[int] = None  # sampled, not yet in the KV cache
    n_cached: int = 0
    n_gen: int = 0
    stops: list[str] = field(default_factory=list)
    text: _Utf8Text = field(default_factory=_Utf8Text)
    t_prefill_start: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    cancelled: bool = False
    finished: bool = False
    special_ids: set = field(default_factory=set)
    residency_switch: Optional[dict[str, Any]] = None  # set swapped in right before this request
    residency_skipped: Optional[str] = None  # why its workload's planned set was not swapped in


# workload names that may name a residency file (the HTTP header is free text)
_WORKLOAD_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

SwitchDone = Callable[[Optional[dict[str, Any]], Optional[EngineError]], None]

# A queued explicit switch waits for the running requests at most this long (s); then it is refused
# (409 residency_busy) and new requests are admitted again, so one endless generation cannot hold
# the daemon behind a switch.
SWITCH_WAIT_S = 30.0


# --------------------------------------------------------------------------------------------------
# the worker
# --------------------------------------------------------------------------------------------------

class Worker:
    """Model + slots + generation loop (see module docstring).

    ``load()`` raises EngineError on a bad model file; afterwards :meth:`run` serves until
    :meth:`shutdown`. All llama.cpp calls happen on the thread that runs :meth:`run` (and the one
    that called :meth:`load`, before :meth:`run` starts).
    """

    def __init__(self, settings: Settings, model_path: Optional[Path] = None):
        self.settings = settings
        self.model_path = Path(model_path or settings.model or "")
        self.model = None
        self.ctx = None
        self.vocab = None
        self.templates = None
        self.rt = None  # ExpertRuntime, if the native engine provides one
        self.traces = None  # TraceRecorder of the expert runtime's per-request route counts
        self.gguf: Optional[ModelInfo] = None
        self.n_ctx_slot = 0
        self.n_batch = settings.n_batch
        self.slots: list[Slot] = []
        self._inbox: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self._waiting: list[Task] = []
        self._active: list[Task] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards counters read by stats()
        self._batch = None
        self._counters = {"requests": 0, "requests_ok": 0, "requests_error": 0, "requests_cancelled": 0,
                          "prompt_tokens": 0, "cached_tokens": 0, "prefilled_tokens": 0,
                          "generated_tokens": 0, "decode_calls": 0}
        # residency sets: the active one, queued explicit switches, the history of swaps
        self._active_set: dict[str, Any] = {}  # {"workload", "path", "key", "hot_experts", "pool_bytes"}
        self._switches: list[tuple[Path, str, SwitchDone]] = []
        self._switch_queued_at = 0.0  # monotonic time the oldest queued switch arrived
        self._switch_count = 0
        self._last_switch: Optional[dict[str, Any]] = None
        self._failed_sets: set = set()  # (path, mtime_ns, size) of planned sets an auto swap refused

    # ---- loading --------------------------------------------------------------------------------

    def load(self) -> None:
        """Validate and load the model, create the context and the chat templates.

        Raises EngineError("model_not_loaded") with a clear message on any failure.
        """
        import llama_cpp
        from . import chat

        try:
            import llama_cpp._logger as llog
            llog.set_verbose(self.settings.log_level == "DEBUG")
        except Exception:  # pragma: no cover - logging only
            pass
        self.gguf = inspect_gguf(self.model_path)
        llama_cpp.llama_backend_init()

        rt = None
        try:
            from . import experts  # owned by the native-engine work; optional
        except ImportError:
            experts = None
        if experts is not None:
            refuse = tuple(c for c in (getattr(experts, "ResidencyError", None),
                                       getattr(experts, "ExpertEngineError", None)) if c)
            try:
                rt = experts.ExpertRuntime.prepare(self.model_path, self.settings)
            except EngineError:
                raise
            except Exception as e:
                # a wrong residency set, or experts="ostinato" that cannot be honoured, is refused;
                # any other failure under experts="auto" falls back to stock placement and keeps serving
                if isinstance(e, refuse) or self.settings.experts != "auto":
                    raise EngineError("model_not_loaded", f"expert runtime: {e}", 503) from e
                log.exception("expert runtime failed, serving with stock placement: %s", e)
                rt = None
        self.rt = rt
        if rt is not None:
            from ..residency.traces import TraceRecorder  # routing traces per model and workload (planner input)
            self.traces = TraceRecorder(rt.model)

        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = self.settings.n_gpu_layers if self.settings.n_gpu_layers >= 0 else 999
        n_cpu_moe = int(getattr(self.settings, "n_cpu_moe", 0) or 0)
        if n_cpu_moe > 0:
            from . import native
            mparams.tensor_buft_overrides = native.fn("ostinato_n_cpu_moe_overrides")(n_cpu_moe)
        if rt is not None:
            rt.adjust_model_params(mparams)
        model = llama_cpp.llama_model_load_from_file(str(self.model_path).encode(), mparams)
        if not model:
            raise EngineError("model_not_loaded", f"llama.cpp could not load {self.model_path} (see the "
                              "engine log for the reason)", 503)
        self.model = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)

        n_ctx_train = llama_cpp.llama_model_n_ctx_train(model) or self.settings.n_ctx
        self.n_ctx_slot = max(64, min(self.settings.n_ctx, n_ctx_train))
        n_slots = self.settings.n_slots
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = self.n_ctx_slot * n_slots
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(self.settings.n_ubatch, self.n_batch)
        cparams.n_seq_max = n_slots
        cparams.kv_unified = True  # shared prefix cells across slots (seq_cp is metadata only)
        threads = self.settings.n_threads or physical_cores()
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if rt is not None and rt.decode_threads:
            # one-token steps: the expert engine's CPU branch is small, fewer threads can be faster
            cparams.n_threads = min(rt.decode_threads, threads)
        if self.settings.flash_attn is not None:
            cparams.flash_attn_type = 1 if self.settings.flash_attn else 0
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            self.model = None
            raise EngineError("model_not_loaded", f"could not create a context of {cparams.n_ctx} tokens "
                              "(out of memory? lower n_ctx or n_slots)", 503)
        self.ctx = ctx
        self.mem = llama_cpp.llama_get_memory(ctx)
        if rt is not None:
            rt.attach(model, ctx)
            self._note_active_set(rt.residency.path if rt.residency else None,
                                  rt.residency.workload if rt.residency else None)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.slots = [Slot(i) for i in range(n_slots)]
        override = self.settings.chat_template
        if override and Path(override).is_file():
            override = Path(override).read_text()
        try:
            self.templates = chat.ChatTemplates(int(model), override)
        except EngineError as e:
            raise EngineError("model_not_loaded", f"chat template: {e.message}", 503) from e
        log.info("model loaded: %s (%s, %d layers, %d experts, n_ctx %d per slot x %d slots)",
                 self.model_path.name, self.gguf.arch or "unknown", self.gguf.n_layer, self.gguf.n_expert,
                 self.n_ctx_slot, n_slots)
        if self.gguf.is_demo:
            log.warning("the served model is a generated demo model with RANDOM weights: its output is "
                        "meaningless (set 'model' to a real GGUF)")

    def close(self) -> None:
        """Free the context, model and native objects (call on the loop thread or after it ended)."""
        import llama_cpp
        if self.templates is not None:
            self.templates.close()
            self.templates = None
        if self.traces is not None:
            self.traces.close()
            self.traces = None
        if self.rt is not None:
            try:
                self.rt.close()
            except Exception:
                log.exception("expert runtime close failed")
            self.rt = None
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    # ---- model facts ----------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Loaded model facts (see EngineClient.info)."""
        import llama_cpp
        g = self.gguf
        tinfo = self.templates.info if self.templates else {}
        mode = "stock"
        if self.rt is not None:
            mode = "ostinato"
        return {"name": self.settings.model_alias or self.model_path.stem, "path": str(self.model_path),
                "arch": (g.arch or "unknown") if g else None, "n_ctx": self.n_ctx_slot,
                "n_ctx_train": llama_cpp.llama_model_n_ctx_train(self.model) if self.model else None,
                "n_params": llama_cpp.llama_model_n_params(self.model) if self.model else None,
                "size_bytes": g.size_bytes if g else None, "is_demo": bool(g and g.is_demo),
                "n_expert": g.n_expert if g else 0, "n_expert_used": g.n_expert_used if g else 0,
                "n_layer": g.n_layer if g else 0, "experts_mode": mode, "n_slots": len(self.slots),
                "supports_thinking": bool(tinfo.get("supports_thinking")),
                "chat_template_caps": tinfo.get("caps", {})}

    def stats(self) -> dict[str, Any]:
        """Counters, slot states and the expert runtime's stats (merged under "experts")."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
        out["slots"] = [{"id": s.id, "n_tokens": len(s.tokens), "busy": s.task is not None,
                         "last_used": s.last_used} for s in self.slots]
        out["waiting"] = len(self._waiting)
        out["active"] = len(self._active)
        if self.rt is not None:
            try:
                out["experts"] = self.rt.stats()
            except Exception as e:
                out["experts"] = {"error": str(e)}
            out["experts"].update(self.residency_state())
        return out

    def residency_state(self) -> dict[str, Any]:
        """The active residency set and the swaps so far: ``{"workload" (of the active set; None
        without one), "residency" (its path or None), "hot_experts", "pool_bytes", "switches"
        (count since load), "last_switch" (see :meth:`switch_residency`, or None), "auto_switch"
        (the setting), "pools" (per device: ``{gpu, device, bytes, hot_experts}``, or None)}``."""
        a = self._active_set
        return {"workload": a.get("workload"), "residency": a.get("path"),
                "hot_experts": a.get("hot_experts"), "pool_bytes": a.get("pool_bytes"),
                "pools": a.get("pools"),
                "switches": self._switch_count, "last_switch": self._last_switch,
                "auto_switch": bool(self.settings.residency_auto_switch)}

    # ---- tokens ---------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens of ``text`` (special tokens parsed). Thread-safe (vocab is read-only)."""
        import llama_cpp
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, True)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, True)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """Bytes of one token (``special``: render control tokens too)."""
        import llama_cpp
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def render(self, req: GenRequest) -> tuple[list[int], Any]:
        """Prompt tokens of ``req`` and the rendered chat prompt (None for raw prompts).

        Raises EngineError("invalid_request" | "template_error").
        """
        if req.messages is not None:
            rendered = self.templates.render(req.messages, req.tools, req.tool_choice,
                                             req.parallel_tool_calls, req.enable_thinking,
                                             req.json_schema)
            return self.tokenize(rendered.prompt), rendered
        if req.prompt is not None:
            return self.tokenize(req.prompt), None
        raise EngineError("invalid_request", "request has neither messages nor prompt")

    def count_tokens(self, req: GenRequest) -> int:
        """Tokens of the rendered prompt of ``req``."""
        return len(self.render(req)[0])

    # ---- public request API (any thread) --------------------------------------------------------

    def submit(self, req: GenRequest, emit: Emit) -> None:
        """Queue ``req``; its events go to ``emit`` (called on the loop thread)."""
        self._inbox.put(("submit", Task(req=req, emit=emit, t_arrival=time.monotonic())))

    def cancel(self, req_id: str) -> None:
        """Stop request ``req_id`` (no further events, the slot keeps what was decoded)."""
        self._inbox.put(("cancel", req_id))

    def switch_residency(self, path: Path, done: SwitchDone, reason: str = "control") -> None:
        """Queue a swap of the residency set to the file ``path`` (any thread).

        The loop runs it at the next request boundary (no request generating; new requests wait
        for it) and then calls ``done(info, None)`` on the loop thread, with ``info`` =
        ``{"seconds" (float, the swap incl. reading the file), "workload" (the set's), "path",
        "previous_workload", "hot_experts" (int), "pool_bytes" (int), "reason", "at" (Unix time)}``;
        or ``done(None, EngineError)``: ``residency_unavailable`` (409: the model runs without the
        expert engine, the message says why), ``residency_refused`` (400: unreadable, malformed or
        another model's set), ``residency_switch_failed`` (500: the native engine refused it) or
        ``engine_stopped`` (503). On error the previous set stays active.
        """
        self._inbox.put(("switch", (Path(path), reason, done)))

    def flush_traces(self) -> None:
        """Write the routing counts recorded since the last flush to the trace files (any thread;
        the planner reads the files)."""
        if self.traces is not None:
            self.traces.flush()

    def shutdown(self) -> None:
        """Make :meth:`run` return; in-flight requests end with an error event."""
        self._stop.set()
        self._inbox.put(("wake", None))

    # ---- loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`shutdown`. Never raises for a request's fault."""
        try:
            while not self._stop.is_set():
                busy = bool(self._active)
                self._drain_inbox(block=not busy)
                if self._stop.is_set():
                    break
                if self._switches and not self._active:
                    self._run_switches()
                elif self._switches and time.monotonic() - self._switch_queued_at > SWITCH_WAIT_S:
                    self._refuse_switches()
                if not self._switches:  # a queued switch waits for the running requests only
                    self._admit()
                if self._active:
                    self._step()
        finally:
            for t in self._waiting + self._active:
                self._fail(t, "engine_stopped", "the engine stopped", 503)
            self._waiting.clear()
            self._active.clear()
            for _, _, done in self._switches:
                self._reply(done, None, EngineError("engine_stopped", "the engine stopped", 503))
            self._switches.clear()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, val = item
            if kind == "submit":
                self._prepare(val)
            elif kind == "switch":
                err = self._precheck_switch(val[0])
                if err is not None:  # refused at once: nothing to wait for
                    self._reply(val[2], None, err)
                else:
                    if not self._switches:
                        self._switch_queued_at = time.monotonic()
                    self._switches.append(val)
            elif kind == "cancel":
                for t in self._waiting + self._active:
                    if t.req.id == val and not t.finished:
                        t.cancelled = True
                self._reap_cancelled()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _reap_cancelled(self) -> None:
        for t in [t for t in self._waiting if t.cancelled]:
            self._waiting.remove(t)
            self._finish_bookkeeping(t, cancelled=True)
        for t in [t for t in self._active if t.cancelled]:
            self._active.remove(t)
            self._release(t)
            self._finish_bookkeeping(t, cancelled=True)

    def _prepare(self, t: Task) -> None:
        """Render, tokenise and check a new request; queue it for a slot."""
        req = t.req
        with self._lock:
            self._counters["requests"] += 1
        try:
            if req.max_tokens is None or req.max_tokens < 1:
                raise EngineError("invalid_request", "max_tokens must be >= 1")
            t.prompt, t.rendered = self.render(req)
            if not t.prompt:
                raise EngineError("invalid_request", "the prompt is empty")
            n_prompt = len(t.prompt)
            if n_prompt >= self.n_ctx_slot:
                raise EngineError("context_length_exceeded",
                                  f"the prompt has {n_prompt} tokens; the context holds {self.n_ctx_slot} "
                                  "tokens per slot (prompt + at least one output token)", 400)
            if n_prompt + req.max_tokens > self.n_ctx_slot:
                # agents ask for far more output than they need (Claude Code: 32000): generate up to
                # the end of the context and finish with "length" rather than refuse the turn
                log.info("request %s: max_tokens %d clamped to the %d tokens left in the context",
                         req.id, req.max_tokens, self.n_ctx_slot - n_prompt)
                req.max_tokens = self.n_ctx_slot - n_prompt
            t.stops = [] if req.ignore_eos else [s for s in (req.stop or []) if s]
            if t.rendered is not None and not req.ignore_eos:
                t.stops += [s for s in t.rendered.additional_stops if s and s not in t.stops]
            t.special_ids = self._preserved_ids(t.rendered)
            from . import chat
            if t.rendered is not None:
                parse_tools = bool(req.tools) and req.tool_choice != "none"
                t.parser = chat.ChatParser(t.rendered, parse_tool_calls=parse_tools)
            t.sampler = self._make_sampler(req, t.rendered)
        except EngineError as e:
            self._fail(t, e.code, e.message, e.status)
            return
        except Exception as e:  # a bug must not take down the loop
            log.exception("request %s: preparation failed", req.id)
            self._fail(t, "internal_error", f"request preparation failed: {e}", 500)
            return
        self._waiting.append(t)

    def _preserved_ids(self, rendered: Any) -> set:
        ids = set()
        if rendered is None:
            return ids
        for s in rendered.preserved_tokens:
            toks = self.tokenize(s, add_special=False)
            if len(toks) == 1:
                ids.add(toks[0])
        return ids

    def _make_sampler(self, req: GenRequest, rendered: Any) -> Any:
        """llama.cpp's common_sampler through the shim (grammar, penalties-free chain, EOG ban under
        ignore_eos). Raises EngineError("invalid_request") if e.g. the grammar does not compile."""
        import json as _json

        from . import native
        params = {"temperature": float(req.temperature if req.temperature is not None else 0.8),
                  "top_k": int(req.top_k or 0), "top_p": float(req.top_p if req.top_p is not None else 1.0),
                  "min_p": float(req.min_p or 0.0), "ignore_eos": bool(req.ignore_eos),
                  "json_schema": req.json_schema is not None,
                  "logit_bias": [[int(k), float(v)] for k, v in (req.logit_bias or {}).items()]}
        if req.seed is not None:
            params["seed"] = int(req.seed) & 0xFFFFFFFF
        raw = rendered.raw.encode() if rendered is not None else None
        smpl = native.fn("ostinato_sampler_new")(int(self.model), _json.dumps(params).encode(), raw)
        if not smpl:
            raise EngineError("invalid_request", native.last_error() or "could not create the sampler")
        return smpl

    # ---- residency sets (loop thread) -----------------------------------------------------------

    def _note_active_set(self, path: Optional[Path], workload: Optional[str]) -> None:
        """Remember the active set (file identity for the re-plan check, pool facts for stats)."""
        key = None
        if path is not None:
            try:
                st = Path(path).stat()
                key = (str(path), st.st_mtime_ns, st.st_size)
            except OSError:
                pass
        hot = pool = pools = None
        if self.rt is not None:
            try:
                inf = self.rt.info()
                hot, pool = inf.get("hot_experts"), inf.get("pool_bytes")
                pools = [{k: p.get(k) for k in ("gpu", "device", "bytes", "hot_experts")}
                         for p in inf.get("pools") or []]
            except Exception as e:  # stats only
                log.debug("expert info: %s", e)
        self._active_set = {"workload": workload or None, "path": str(path) if path else None,
                            "key": key, "hot_experts": hot, "pool_bytes": pool, "pools": pools}

    def _no_engine_reason(self) -> str:
        from . import experts
        g = self.gguf
        if self.settings.experts == "stock":
            why = "the model was loaded with stock llama.cpp placement (experts = 'stock')"
        elif g is not None and g.n_expert <= 0:
            why = f"{self.model_path.name} is a dense model (no routed experts)"
        elif g is not None and g.arch not in experts.SUPPORTED_ARCHS:
            why = f"architecture {g.arch} is not supported by the expert engine (runs stock)"
        else:
            why = "the expert engine is not active for this model (see the engine log: not built, or it failed at load)"
        return (f"cannot swap residency sets: {why}. The expert pool can only be created while the model "
                "loads (routed experts kept in host memory, CPU weight repacking off), so load the model "
                "again with the expert engine (experts = 'auto' or 'ostinato', residency = PATH)")

    def _switch_now(self, path: Path, reason: str) -> dict[str, Any]:
        """Swap to the set in ``path`` now (loop thread, no request generating). Returns the info
        dict of :meth:`switch_residency`; raises EngineError (old set stays active)."""
        from .experts import ExpertEngineError
        from ..residency.sets import ResidencyError
        if self.rt is None:
            raise EngineError("residency_unavailable", self._no_engine_reason(), 409)
        prev = self._active_set.get("workload")
        try:
            secs = self.rt.switch(path)
        except ResidencyError as e:
            raise EngineError("residency_refused", f"{e} (the previous set stays active)", 400) from e
        except ExpertEngineError as e:
            raise EngineError("residency_switch_failed", f"the native engine refused the residency set "
                              f"{path}: {e} (the previous set stays active)", 500) from e
        res = self.rt.residency
        self._note_active_set(Path(path), res.workload if res else None)
        a = self._active_set
        info = {"seconds": round(secs, 6), "workload": a["workload"], "path": a["path"],
                "previous_workload": prev, "hot_experts": a["hot_experts"], "pool_bytes": a["pool_bytes"],
                "reason": reason, "at": time.time()}
        self._switch_count += 1
        self._last_switch = info
        log.info("residency set switched (%s) to %s (workload %s, was %s) in %.3f s: %s hot experts, "
                 "pool %s bytes", reason, a["path"], a["workload"], prev, secs, a["hot_experts"],
                 a["pool_bytes"])
        return info

    def _precheck_switch(self, path: Path) -> Optional[EngineError]:
        """The errors a switch to ``path`` would end with that need no idle engine to find: no
        expert engine, an unreadable or malformed file, another model's set. None if it may run."""
        from ..residency.sets import ResidencyError, read_residency
        if self.rt is None:
            return EngineError("residency_unavailable", self._no_engine_reason(), 409)
        try:
            read_residency(Path(path), self.rt.model)
        except ResidencyError as e:
            return EngineError("residency_refused", f"{e} (the previous set stays active)", 400)
        return None

    def _refuse_switches(self) -> None:
        """Refuse the queued switches that waited SWITCH_WAIT_S for the running requests."""
        pending, self._switches = self._switches, []
        n = len(self._active)
        for path, _, done in pending:
            log.warning("residency switch to %s refused: %d request(s) still generating after %.0f s",
                        path, n, SWITCH_WAIT_S)
            self._reply(done, None, EngineError(
                "residency_busy", f"{n} request(s) kept generating for {SWITCH_WAIT_S:.0f} s; the switch "
                "runs only between requests: try again when the daemon is idle (the previous set stays "
                "active)", 409))

    def _run_switches(self) -> None:
        """Run the queued explicit switches in order (the last one ends up active)."""
        pending, self._switches = self._switches, []
        for path, reason, done in pending:
            try:
                info = self._switch_now(path, reason)
            except EngineError as e:
                log.warning("residency switch to %s refused: %s", path, e.message)
                self._reply(done, None, e)
            except Exception as e:  # a bug must not take down the loop
                log.exception("residency switch to %s failed", path)
                self._reply(done, None, EngineError("internal_error", f"residency switch failed: {e}", 500))
            else:
                self._reply(done, info, None)

    @staticmethod
    def _reply(done: SwitchDone, info: Optional[dict[str, Any]], err: Optional[EngineError]) -> None:
        try:
            done(info, err)
        except Exception:
            log.exception("residency switch consumer failed")

    def _planned_set(self, workload: str) -> Optional[tuple[Path, tuple]]:
        """(path, file key) of the planned set of ``workload`` for this model, or None."""
        if self.rt is None or not _WORKLOAD_NAME.fullmatch(workload):
            return None
        path = residency_file(self.rt.model["fingerprint"], workload)
        try:
            st = path.stat()
        except OSError:
            return None
        return path, (str(path), st.st_mtime_ns, st.st_size)

    def _auto_switch(self, t: Task) -> None:
        """The automatic per-workload swap before ``t`` is admitted (see module docstring).
        Never fails the request: a refused set is logged once and skipped until its file changes."""
        if self.rt is None or not self.settings.residency_auto_switch:
            return
        workload = t.req.workload or self.settings.workload_default
        found = self._planned_set(workload)
        if found is None:
            return
        path, key = found
        a = self._active_set
        if a.get("workload") == workload and (a.get("path") != str(path) or a.get("key") == key):
            return  # the workload's set is active (a pinned file, or the planned file unchanged)
        if key in self._failed_sets:
            return
        try:
            t.residency_switch = self._switch_now(path, "auto")
        except EngineError as e:
            self._failed_sets.add(key)
            t.residency_skipped = f"automatic swap to the {workload} set skipped: {e.message}"
            log.warning("request %s: %s", t.req.id, t.residency_skipped)

    # ---- slots ----------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Give waiting requests (FIFO) a free slot, reusing the longest cached prefix."""
        import llama_cpp
        while self._waiting:
            free = [s for s in self.slots if s.task is None]
            if not free:
                return
            t = self._waiting.pop(0)
            if not self._active:  # a request boundary: nothing is generating
                self._auto_switch(t)
            matches = {s.id: _common_prefix(s.tokens, t.prompt) for s in free}
            best = max(free, key=lambda s: (matches[s.id], -s.last_used))
            target = best
            n_match = matches[best.id]
            if n_match < SAME_SESSION_SHARE * len(best.tokens) and len(free) > 1:
                # `best` holds another conversation that shares only a prefix with this one (a side
                # request, a subagent): keep it, and share the prefix into the least recently used free slot
                target = min(free, key=lambda s: s.last_used)
                if target is not best and matches[target.id] < n_match:
                    llama_cpp.llama_memory_seq_rm(self.mem, target.id, -1, -1)
                    llama_cpp.llama_memory_seq_cp(self.mem, best.id, target.id, 0, n_match)
                    target.tokens = best.tokens[:n_match]
                else:
                    n_match = matches[target.id]
            # at least one prompt token must be evaluated to get logits
            n_keep = min(n_match, len(t.prompt) - 1)
            if n_keep < len(target.tokens):
                if not llama_cpp.llama_memory_seq_rm(self.mem, target.id, n_keep, -1):
                    llama_cpp.llama_memory_seq_rm(self.mem, target.id, -1, -1)
                    n_keep = 0
                target.tokens = target.tokens[:n_keep]
            target.task = t
            target.last_used = time.monotonic()
            t.slot = target
            t.n_cached = n_keep
            t.pending = t.prompt[n_keep:]
            t.t_prefill_start = time.monotonic()
            with self._lock:
                self._counters["prompt_tokens"] += len(t.prompt)
                self._counters["cached_tokens"] += n_keep
            self._active.append(t)
            start = {"prompt_tokens": len(t.prompt), "cached_tokens": n_keep, "slot": target.id}
            if t.residency_switch is not None:
                start["residency_switch"] = t.residency_switch
            if t.residency_skipped is not None:
                start["residency_switch_skipped"] = t.residency_skipped
            self._emit(t, "start", start)

    def _release(self, t: Task) -> None:
        if t.slot is not None:
            t.slot.task = None
            t.slot.last_used = time.monotonic()
        if t.sampler is not None:
            from . import native
            native.fn("ostinato_sampler_free")(t.sampler)
            t.sampler = None
        if t.parser is not None:
            t.parser.close()
            t.parser = None

    # ---- one forward pass -----------------------------------------------------------------------

    def _step(self) -> None:
        import llama_cpp
        b = self._batch
        n = 0
        rows: list[tuple[Task, int]] = []  # (task, batch index whose logits it samples from)
        plan: list[tuple[Task, list[int]]] = []
        for t in self._active:
            if t.next_token is not None and n < self.n_batch:
                self._put(b, n, t.next_token, len(t.slot.tokens), t.slot.id, True)
                plan.append((t, [t.next_token]))
                rows.append((t, n))
                n += 1
        for t in self._active:
            if t.pending and n < self.n_batch:
                k = min(len(t.pending), self.n_batch - n)
                chunk = t.pending[:k]
                base = len(t.slot.tokens)
                last = k == len(t.pending)
                for j, tok in enumerate(chunk):
                    self._put(b, n + j, tok, base + j, t.slot.id, last and j == k - 1)
                if last:
                    rows.append((t, n + k - 1))
                plan.append((t, chunk))
                n += k
        if n == 0:
            return
        b.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, b)
        with self._lock:
            self._counters["decode_calls"] += 1
        if rc != 0:
            msg = f"llama_decode failed ({rc}{': KV cache full' if rc == 1 else ''})"
            for t, _ in plan:
                llama_cpp.llama_memory_seq_rm(self.mem, t.slot.id, -1, -1)
                t.slot.tokens = []
                if t in self._active:
                    self._active.remove(t)
                self._release(t)
                self._fail(t, "decode_failed", msg, 500)
            return
        for t, toks in plan:
            t.slot.tokens.extend(toks)
            if t.next_token is not None and toks == [t.next_token] and not t.pending:
                t.next_token = None
            elif t.pending:
                t.pending = t.pending[len(toks):]
                with self._lock:
                    self._counters["prefilled_tokens"] += len(toks)
        from . import native
        sample = native.fn("ostinato_sampler_sample")
        for t, idx in rows:
            if t.finished or t.cancelled:
                continue
            tok = sample(t.sampler, self.ctx, idx)
            if tok < 0:
                self._end(t, None, error=("sampling_failed", native.last_error() or "sampling failed"))
                continue
            self._on_token(t, tok)
        for t in [t for t in self._active if t.finished]:
            self._active.remove(t)

    @staticmethod
    def _put(b: Any, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        b.token[i] = tok
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = 1 if logits else 0

    # ---- tokens out -----------------------------------------------------------------------------

    def _on_token(self, t: Task, tok: int) -> None:
        import llama_cpp
        now = time.monotonic()
        if t.n_gen == 0:
            t.t_first = now
        t.t_last = now
        req = t.req
        if not req.ignore_eos and llama_cpp.llama_vocab_is_eog(self.vocab, tok):
            self._end(t, "stop")
            return
        t.n_gen += 1
        with self._lock:
            self._counters["generated_tokens"] += 1
        t.text.add(self.piece(tok, special=tok in t.special_ids))
        text = t.text.text
        if t.stops:
            cut = _find_stop(text, t.stops)
            if cut is not None:
                t.text.text = text[:cut]
                t.text.buf = b""
                self._end(t, "stop")
                return
        self._stream(t, final=False)
        if t.n_gen >= req.max_tokens:
            self._end(t, "length")
            return
        if len(t.slot.tokens) + 1 >= self.n_ctx_slot:
            self._end(t, "length")
            return
        t.next_token = tok

    def _stream(self, t: Task, final: bool) -> None:
        text = t.text.text
        if not final and t.stops:
            text = text[:len(text) - _partial_stop_len(text, t.stops)]
        if t.parser is None:
            sent = getattr(t, "_sent", 0)
            if len(text) > sent:
                self._emit(t, "delta", {"content": text[sent:]})
                t._sent = len(text)  # type: ignore[attr-defined]
            return
        res = t.parser.feed(text, final=final)
        if res.diffs:
            self._emit(t, "delta", _merge_deltas(res.diffs))
        if final and res.parse_error:
            log.info("request %s: output did not match the %s format, kept as text (%s)", t.req.id,
                     t.rendered.format_name if t.rendered else "?", res.parse_error[:200])

    def _end(self, t: Task, reason: Optional[str], error: Optional[tuple[str, str]] = None) -> None:
        """Finish ``t``: final parse, done (or error) event, slot released."""
        from . import chat
        t.finished = True
        t.next_token = None
        if error is not None:
            self._release(t)
            self._fail(t, error[0], error[1], 500)
            return
        t.text.flush()
        message: dict[str, Any]
        if t.parser is not None:
            try:
                self._stream(t, final=True)
                message = chat.openai_message(t.parser.message)
            except Exception as e:  # never fail a request because of model output
                log.warning("request %s: final parse failed: %s", t.req.id, e)
                message = {"role": "assistant", "content": t.text.text}
        else:
            self._stream(t, final=True)
            message = {"role": "assistant", "content": t.text.text}
        if message.get("tool_calls") and reason == "stop":
            reason = "tool_calls"
        now = time.monotonic()
        ttft = (t.t_first - t.t_arrival) if t.t_first else None
        tpot = ((t.t_last - t.t_first) / (t.n_gen - 1)) if t.n_gen > 1 else None
        data: dict[str, Any] = {
            "finish_reason": reason, "message": message,
            "usage": {"prompt_tokens": len(t.prompt), "completion_tokens": t.n_gen,
                      "cached_tokens": t.n_cached, "prefilled_tokens": len(t.prompt) - t.n_cached},
            "timings": {"ttft_s": ttft, "tpot_s": tpot,
                        "prefill_s": (t.t_first - t.t_prefill_start) if t.t_first else None,
                        "decode_s": (t.t_last - t.t_first) if t.t_first else None,
                        "total_s": now - t.t_arrival, "queue_s": t.t_prefill_start - t.t_arrival},
            "text": t.text.text, "slot": t.slot.id if t.slot else None,
        }
        if self.rt is not None:
            try:
                data["experts"] = self.rt.take_request_stats()
            except Exception as e:
                data["experts"] = {"error": str(e)}
            if self.traces is not None:
                self.traces.record_done(t.req.workload or self.settings.workload_default, data,
                                        n_tools=len(t.req.tools or []))
        self._release(t)
        with self._lock:
            self._counters["requests_ok"] += 1
        self._emit(t, "done", data)

    def _finish_bookkeeping(self, t: Task, cancelled: bool) -> None:
        t.finished = True
        if cancelled:
            with self._lock:
                self._counters["requests_cancelled"] += 1
            self._emit(t, "error", {"code": "cancelled", "message": "request cancelled", "status": 499})

    def _fail(self, t: Task, code: str, message: str, status: int) -> None:
        t.finished = True
        with self._lock:
            self._counters["requests_error"] += 1
        self._emit(t, "error", {"code": code, "message": message, "status": status})

    def _emit(self, t: Task, typ: str, data: dict[str, Any]) -> None:
        try:
            t.emit(EngineEvent(typ, data))  # type: ignore[arg-type]
        except Exception:
            log.exception("request %s: event consumer failed", t.req.id)


def _find_stop(text: str, stops: list[str]) -> Optional[int]:
    """Index where the earliest stop string starts in ``text``, or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string (held back
    from streaming until it is known not to be a stop)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n


def _merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in deltas:
        if "content" in d:
            out["content"] = out.get("content", "") + d["content"]
        if "reasoning" in d:
            out["reasoning"] = out.get("reasoning", "") + d["reasoning"]
        if "tool_calls" in d:
            out.setdefault("tool_calls", []).extend(d["tool_calls"])
    return out
