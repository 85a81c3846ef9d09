"""The engine worker: owns the model, its KV slots and the generation loop.

Runs on llama-cpp-python's low-level ctypes bindings (``import llama_cpp``) plus our chat shim. One
thread calls :meth:`Worker.run` (the loop); any thread calls :meth:`Worker.submit` /
:meth:`Worker.cancel`; events are delivered through the ``emit`` callback given with each request
(called on the loop thread, must not block).

The loop is shaped like llama-server's ``update_slots``: each step admits waiting requests into
free KV slots (:func:`.slots.choose_slot`: the longest cached prefix, without evicting another
conversation), then builds one batch: one token for each generating slot (batched decode across
slots) and then prefill chunks of waiting slots, one ubatch (``n_ubatch`` tokens) per step so that
a cancelled request stops between ubatches, and fewer while other slots generate
(``prefill_chunk_target_s``: their tokens come between the chunks of a long prompt). The class is cut
along its seams: :mod:`.worker_admit` (slot choice, host/disk prefix caches, checkpoints, the
``start`` event), :mod:`.worker_step` (the batched forward pass, sampling and the streaming of
output events) and :mod:`.worker_prompt` (rendering, tokens and the off-loop calls). Around it:
:mod:`.loading` (model, context, expert runtime), :mod:`.sampling` (the sampler of a request),
:mod:`.text` (UTF-8 hold-back, stop strings on new text only) and :mod:`.switcher` (residency-set
swaps at request boundaries; docs/design.md "Planning").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from ..residency.model import ModelInfo
from ..settings import Settings
from . import grammar, loading, sampling
from .protocol import Op
from .prefix_cache import PrefixCache, make_prefix_cache
from .slots import Slot
from .step_timing import StepClock
from .task import Emit, Task
from .worker_admit import AdmitMixin
from .worker_prompt import PromptMixin
from .worker_step import StepMixin
from .switcher import ResidencySwitcher, SwitchDone
from .text import StopScanner
from .types import EngineError, GenRequest

log = logging.getLogger("ostinatod.engine")
# Slots' states go to disk only after the loop has been idle this long (s): copying a slot's KV out
# of the GPU takes tens to hundreds of ms on a large model, and an agent's next turn usually comes
# within seconds of its last (its tool ran); a clean shutdown writes them anyway.
PERSIST_IDLE_S = 20.0

PREPARE_THREADS = 4  # requests rendered at once, off the loop (a slow one leaves the others theirs)
_PREPARED = "prepared"  # inbox kind: a task back from its preparation thread

class Worker(PromptMixin, AdmitMixin, StepMixin):
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
        self.mem = None
        self.vocab = None
        self.templates = None
        self.rt = None  # ExpertRuntime, if the native engine provides one
        self.traces = None  # TraceRecorder of the expert runtime's per-request route counts
        self.gguf: Optional[ModelInfo] = None
        self.n_ctx_slot = 0
        self.n_ctx_reason: Optional[str] = None  # why n_ctx_slot is below the setting (memory)
        self.n_batch = settings.n_batch
        self.n_prefill_step = max(1, min(settings.n_batch, settings.n_ubatch or 512))  # prompt tokens per step (the context's ubatch once loaded)
        self.ubatch_reason = "set" if settings.n_ubatch else "not loaded"
        self.deterministic = settings.deterministic
        self._det_valid: dict[int, int] = {}  # slot id -> prefix computed by whole aligned chunks
        self._turn = 0
        self.slots: list[Slot] = []
        self._inbox: "queue.Queue[tuple[Op, Any]]" = queue.Queue()
        self._waiting: list[Task] = []
        self._preparing: list[Task] = []  # being rendered on the prepare threads (not yet waiting)
        self._prep_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="ostinato-prepare")
        self.max_piece_bytes = 1  # the vocabulary's longest token text (limits.check_text_fits)
        self.n_vocab = 0  # logits per row
        self._active: list[Task] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards counters read by stats()
        self._batch = None
        self._counters = {"requests": 0, "requests_ok": 0, "requests_error": 0, "requests_cancelled": 0,
                          "prompt_tokens": 0, "cached_tokens": 0, "prefilled_tokens": 0,
                          "generated_tokens": 0, "decode_calls": 0, "busy_slot_steps": 0,
                          "slot_checkpoints": 0, "checkpoint_rewinds": 0}
        self.switcher = ResidencySwitcher(self)
        self.pcache: Optional[PrefixCache] = None  # host-memory prefix cache (settings.cache_ram_mb)
        self.dcache: Any = None  # its states on disk (settings.cache_disk_mb; .disk_cache)
        self._persisted: dict[int, int] = {}  # slot id -> tokens of its state last written to disk
        self.uncuttable = False  # the memory cannot drop a suffix (recurrent/hybrid): checkpoints
        # progress of the loop, read by the liveness check from another thread (progress()):
        # forward passes so far, and (what, since, request ids) of the native call running now
        self.steps = 0
        self._s_per_prefill_token = 0.0  # measured cost of a prompt token in a forward pass (EMA)
        self._s_step_base = 0.0  # measured cost of a step without prompt tokens (EMA)
        self._render_starts: dict[object, float] = {}  # running renders' start times (under _lock)
        self._busy: Optional[tuple[str, float, tuple[str, ...]]] = None
        self.clock = StepClock()  # wall-clock parts of the steps (step_timing.py; stats "step_timing")
        self._delta_write_ns = 0  # time spent writing delta events (ns, cumulative)

    # ---- loading --------------------------------------------------------------------------------

    def load(self, probe_np: bool = True) -> None:
        """Validate and load the model, create the context and the chat templates
        (:func:`.loading.load_model`). Raises EngineError("model_not_loaded") on any failure.

        With ``probe_np``, where nothing gave the prefill threshold Np (no setting, calibration or
        earlier probe of this model) and the pool is on a GPU, Np is measured before serving
        (:meth:`probe_np`); the calibration itself loads with ``probe_np=False``."""
        import llama_cpp

        m = loading.load_model(self.settings, self.model_path)
        self.gguf, self.model, self.ctx, self.mem, self.vocab = m.gguf, m.model, m.ctx, m.mem, m.vocab
        self.rt, self.templates, self.n_ctx_slot = m.rt, m.templates, m.n_ctx_slot
        self.n_ctx_reason = m.n_ctx_reason
        if m.ubatch is not None:   # one forward pass of prefill per step: the context's ubatch
            self.n_prefill_step = max(1, min(self.n_batch, m.ubatch.ubatch))
            self.ubatch_reason = m.ubatch.reason
        if self.rt is not None:
            from ..residency.traces import TraceRecorder  # routing traces per model and workload
            self.traces = TraceRecorder(self.rt.model)
            res = self.rt.residency
            self.switcher.note_active(res.path if res else None, res.workload if res else None)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.slots = [Slot(i) for i in range(m.n_slots)]
        self.pcache = make_prefix_cache(self.settings)
        self.dcache = self._disk_cache()
        self.max_piece_bytes = loading.max_piece_bytes(self.vocab)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        # recurrent or hybrid attention (qwen35moe's linear-attention layers): the memory cannot drop
        # a suffix, so prefix reuse goes through whole-state checkpoints (docs/engine.md)
        self.uncuttable = bool(llama_cpp.llama_model_is_recurrent(self.model)
                               or llama_cpp.llama_model_is_hybrid(self.model))
        if probe_np and self.rt is not None and self.rt.wants_np_probe():
            self.probe_np()

    def probe_np(self) -> Optional[int]:
        """Measure Np on this model and machine (:func:`.np_probe.probe_np`, ~1 s), serve with it
        and store it in the hardware profile for the next loads of this model
        (:func:`..residency.calibration.store_prefill_probe`). A failure is logged and leaves Np
        as it was (returns None); else returns the new Np."""
        from ..residency.calibration import store_prefill_probe
        from .np_probe import probe_np

        try:
            res = probe_np(self)
        except Exception as e:  # noqa: BLE001 - serving with the default Np beats not serving
            log.warning("experts: Np probe failed (%s: %s); serving with Np = %d", type(e).__name__, e,
                        self.rt.prefill_threshold)
            return None
        self.rt.set_prefill_threshold(res["np_tokens"], "probe")
        log.info("experts: Np = %d measured at load in %.2f s (%s)", res["np_tokens"], res["seconds"],
                 ", ".join(f"{p['path']} {p['n']}: {p['total_ms']:.1f} ms" for p in res["points"]))
        try:
            store_prefill_probe(res, self.rt.model)
        except OSError as e:
            log.warning("experts: the measured Np was not stored in the hardware profile: %s", e)
        self.rt.apply_cpu_split(self.settings)   # from the probe's CPU-branch bandwidth
        return res["np_tokens"]

    def close(self) -> None:
        """Free the context, model and native objects (call on the loop thread or after it ended)."""
        # a render still running on a prepare thread uses the templates and the vocabulary
        self._prep_pool.shutdown(wait=True, cancel_futures=True)
        if self.traces is not None:
            self.traces.close()
            self.traces = None
        loading.free_model(self.templates, self.rt, self._batch, self.ctx, self.model)
        self.templates = self.rt = self._batch = self.ctx = self.model = None

    # ---- model facts ----------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Loaded model facts (see EngineClient.info)."""
        return loading.model_facts(self.settings, self.model_path, self.gguf, self.model,
                                   self.templates, self.n_ctx_slot, self.rt is not None, len(self.slots),
                                   self.max_piece_bytes, self.n_ctx_reason)

    def progress(self) -> dict[str, Any]:
        """What the loop is doing, for the liveness check (any thread, never waits): ``{"steps"
        (forward passes so far), "busy": None or {"what" ("forward pass" | "sampling"), "for_s"
        (seconds inside that one native call so far), "requests" (ids of the requests in it)}}``."""
        busy = self._busy  # one read: the loop replaces the tuple, never changes it
        out: dict[str, Any] = {"steps": self.steps, "busy": None}
        if busy is not None:
            out["busy"] = {"what": busy[0], "for_s": round(time.monotonic() - busy[1], 3),
                           "requests": list(busy[2])}
        return out

    def stats(self) -> dict[str, Any]:
        """Counters, slot states, the steps' wall-clock parts (``step_timing``:
        :meth:`.step_timing.StepClock.snapshot`, ms) and the expert runtime's stats (merged under
        "experts")."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
        out["slots"] = [{"id": s.id, "n_tokens": len(s.tokens), "busy": s.task is not None,
                         "last_used": s.last_used} for s in self.slots]
        if self.pcache is not None:
            out["host_cache"] = self.pcache.stats()
        if self.dcache is not None:
            out["disk_cache"] = self.dcache.stats()
        out["waiting"] = len(self._waiting)
        out["active"] = len(self._active)
        out["ubatch"] = {"tokens": self.n_prefill_step, "reason": self.ubatch_reason}
        out["step_timing"] = self.clock.snapshot()
        if self.rt is not None:
            try:
                out["experts"] = self.rt.stats()
            except Exception as e:
                out["experts"] = {"error": str(e)}
            res = self.residency_state()
            if out["experts"].get("pools"):   # the live per-pool figures (with their hot-route share)
                res.pop("pools", None)
            out["experts"].update(res)
        return out

    def residency_state(self) -> dict[str, Any]:
        """The active residency set and the swaps so far: ``{"workload" (of the active set; None
        without one), "residency" (its path or None), "hot_experts", "pool_bytes", "switches"
        (count since load), "last_switch" (see :meth:`switch_residency`, or None), "auto_switch"
        (the setting), "pools" (per device: ``{gpu, device, bytes, hot_experts}``, or None),
        "prefill" (the engine's prefill options: pool views, hybrid CPU share, prefetch; or None)}``."""
        return self.switcher.state()

    # ---- public request API (any thread) --------------------------------------------------------

    def submit(self, req: GenRequest, emit: Emit) -> None:
        """Queue ``req``; its events go to ``emit`` (called on the loop thread)."""
        self._inbox.put((Op.GENERATE, Task(req=req, emit=emit, t_arrival=time.monotonic())))

    def cancel(self, req_id: str) -> None:
        """Stop request ``req_id`` (no further events, the slot keeps what was decoded)."""
        self._inbox.put((Op.CANCEL, req_id))

    def switch_residency(self, path: Path, done: SwitchDone, reason: str = "control") -> None:
        """Queue a swap of the residency set to the file ``path`` (any thread).

        The loop runs it at the next request boundary (no request generating; new requests wait
        for it) and then calls ``done(info, None)`` on the loop thread, with ``info`` =
        ``{"seconds" (float, the swap; the file is read once, when the switch is queued),
        "workload" (the set's), "path", "previous_workload", "hot_experts" (int), "pool_bytes" (int), "reason", "at" (Unix time)}``;
        or ``done(None, EngineError)``: ``residency_unavailable`` (409: the model runs without the
        expert engine, the message says why), ``residency_refused`` (400: unreadable, malformed or
        another model's set), ``residency_switch_failed`` (500: the native engine refused it) or
        ``engine_stopped`` (503). On error the previous set stays active.
        """
        self._inbox.put((Op.SWITCH_RESIDENCY, (Path(path), reason, done)))

    def flush_traces(self) -> None:
        """Write the routing counts recorded since the last flush to the trace files (any thread;
        the planner reads the files)."""
        if self.traces is not None:
            self.traces.flush()

    def shutdown(self) -> None:
        """Make :meth:`run` return; in-flight requests end with an error event."""
        self._stop.set()
        self._inbox.put((Op.SHUTDOWN, None))

    # ---- loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`shutdown`. Never raises for a request's fault."""
        idle_since: Optional[float] = None
        try:
            while not self._stop.is_set():
                busy = bool(self._active)
                if not busy:
                    self.clock.idle()  # no next step follows the last one at once
                if busy or self._waiting or self._preparing:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= PERSIST_IDLE_S:
                    self.persist_slots()  # idle a while: the slots' states go to disk
                self._drain_inbox(block=not busy)
                if self._stop.is_set():
                    break
                sw = self.switcher
                if sw.queued and not self._active:
                    sw.run_queued()
                elif sw.overdue():
                    sw.refuse_queued(len(self._active))
                if not sw.queued:  # a queued switch waits for the running requests only
                    self._admit()
                if self._active:
                    self._step()
                self._expire_preparing()
        finally:
            for t in self._waiting + self._active + [t for t in self._preparing if not t.finished]:
                self._fail(t, "engine_stopped", "the engine stopped", 503)
            self._waiting.clear()
            self._active.clear()
            self.switcher.stop()
            if self.dcache is not None:
                try:
                    self.persist_slots(idle_only=False)
                finally:
                    self.dcache.close()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, val = item
            if kind is Op.GENERATE:
                self._start_prepare(val)
            elif kind == _PREPARED:
                self._prepared(val)
            elif kind is Op.SWITCH_RESIDENCY:
                self.switcher.queue(*val)
            elif kind is Op.CANCEL:
                for t in self._preparing:
                    if t.req.id == val and not t.finished:
                        self._finish_bookkeeping(t, cancelled=True)
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

    def _start_prepare(self, t: Task) -> None:
        """Hand a new request to a prepare thread (:meth:`_prepare`); the loop goes on serving."""
        with self._lock:
            self._counters["requests"] += 1
        self._preparing.append(t)
        try:
            self._prep_pool.submit(self._prepare, t)
        except RuntimeError:  # the pool is shut down: the worker is stopping
            self._preparing.remove(t)
            self._fail(t, "engine_stopped", "the engine stopped", 503)

    def _prepared(self, t: Task) -> None:
        """A task back from :meth:`_prepare`: queued for a slot, or failed with its error; one
        that was cancelled or timed out meanwhile only frees what was made for it."""
        if t in self._preparing:
            self._preparing.remove(t)
        if t.finished:
            self._release(t)
        elif t.prep_error is not None:
            self._release(t)
            self._fail(t, *t.prep_error)
        else:
            self._waiting.append(t)

    def _expire_preparing(self) -> None:
        """Fail (400 ``template_timeout``) requests whose preparation has run longer than
        ``template_timeout_s``; their thread's result is dropped when it comes."""
        limit = self.settings.template_timeout_s
        now = time.monotonic()
        for t in self._preparing:
            if not t.finished and t.t_render and now - t.t_render > limit:
                e = self._timeout_error(self._loaded([t.t_render]))
                log.warning("request %s: %s", t.req.id, e.message)
                self._fail(t, e.code, e.message, e.status)

    def _prepare(self, t: Task) -> None:
        """On a prepare thread: render, tokenise and check a new request, build its sampler and
        parser; then hand it back to the loop (:meth:`_prepared`), with ``prep_error`` set when it
        cannot be served."""
        t.t_render = time.monotonic()
        key = object()
        with self._lock:
            self._render_starts[key] = t.t_render
        try:
            self._prepare_task(t)
        except EngineError as e:
            t.prep_error = (e.code, e.message, e.status, e.extra)
        except Exception as e:  # noqa: BLE001 - never takes down the worker
            # the HTTP layer has validated the request's shape; what still fails here is content
            # the template or tokenizer cannot take (a message of an unforeseen shape): the
            # client's request, answered 400 (traceback at DEBUG for the rare daemon bug)
            log.warning("request %s: cannot be prepared: %r", t.req.id, e)
            log.debug("request %s: preparation traceback", t.req.id, exc_info=True)
            t.prep_error = ("invalid_request", f"request cannot be prepared: {e}", 400, {})
        finally:
            with self._lock:
                self._render_starts.pop(key, None)
        self._inbox.put((_PREPARED, t))

    def _prepare_task(self, t: Task) -> None:
        req = t.req
        if req.max_tokens is None or req.max_tokens < 0:
            raise EngineError("invalid_request", "max_tokens must be >= 0")
        if req.demo and not req.ignore_eos:
            sampling.demo_choice(req)
        self.check_grammar_cost(req)  # before the schema's grammar is built
        if req.grammar is not None:
            grammar.check_grammar(self.vocab, req.grammar)
        elif req.json_schema is not None and req.messages is None:  # no template makes its grammar
            req.grammar = grammar.schema_grammar(req.json_schema)
        t.prompt, t.rendered = self.render(req)
        if not t.prompt:
            raise EngineError("invalid_request", "the prompt is empty")
        n_prompt = len(t.prompt)
        if n_prompt >= self.n_ctx_slot:
            # Anthropic's own wording (Claude Code compacts the conversation on it)
            raise EngineError("context_length_exceeded",
                              f"prompt is too long: {n_prompt} tokens > {self.n_ctx_slot - 1} maximum "
                              f"(the context holds {self.n_ctx_slot} tokens per slot: prompt + at "
                              "least one output token)", 400,
                              {"n_prompt_tokens": n_prompt, "n_ctx": self.n_ctx_slot})
        if n_prompt + req.max_tokens > self.n_ctx_slot:
            # agents ask for far more output than they need (Claude Code: 32000): generate up to
            # the end of the context and finish with "length" rather than refuse the turn
            log.info("request %s: max_tokens %d clamped to the %d tokens left in the context",
                     req.id, req.max_tokens, self.n_ctx_slot - n_prompt)
            req.max_tokens = self.n_ctx_slot - n_prompt
        if req.demo and not req.ignore_eos:
            t.demo_cap = sampling.demo_turn(req, self.vocab, self.settings)
        stops = [] if req.ignore_eos else [s for s in (req.stop or []) if s]
        if t.rendered is not None and not req.ignore_eos:
            stops += [s for s in t.rendered.additional_stops if s and s not in stops]
        t.stops = StopScanner(stops)
        t.special_ids = loading.preserved_ids(self.vocab, t.rendered)
        if t.rendered is not None:
            t.parser = self.chat_parser(req, t.rendered)
        t.sampler = sampling.make_sampler(self.model, req, t.rendered, self.settings)

