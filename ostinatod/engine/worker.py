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
(``prefill_chunk_target_s``: their tokens come between the chunks of a long prompt). Around it:
:mod:`.loading` (model, context, expert runtime), :mod:`.sampling` (the sampler of a request),
:mod:`.text` (UTF-8 hold-back, stop strings on new text only) and :mod:`.switcher` (residency-set
swaps at request boundaries; docs/design.md "Planning").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from ..residency.model import ModelInfo
from ..settings import Settings
from . import determinism, grammar, limits, loading, logprobs, patterns, sampling
from .protocol import Op
from .prefix_cache import (PrefixCache, make_prefix_cache, restore_checkpoint, rewind_to_checkpoint,
                           save_slot_checkpoint, save_state, use_host_cache)
from .slots import Slot, choose_slot
from .task import Emit, Task
from .switcher import ResidencySwitcher, SwitchDone
from .text import StopScanner, merge_deltas, settle_tool_calls
from .events import DeltaEvent, EngineEvent, ErrorEvent, ProgressEvent, StartEvent
from .types import DEMO_NOTICE, EngineError, GenRequest

log = logging.getLogger("ostinatod.engine")
# Slots' states go to disk only after the loop has been idle this long (s): copying a slot's KV out
# of the GPU takes tens to hundreds of ms on a large model, and an agent's next turn usually comes
# within seconds of its last (its tool ran); a clean shutdown writes them anyway.
PERSIST_IDLE_S = 20.0

PREFILL_MIN_CHUNK = 32  # prompt tokens a step carries at least (chunks smaller waste passes)
PREPARE_THREADS = 4  # requests rendered at once, off the loop (a slow one leaves the others theirs)
_PREPARED = "prepared"  # inbox kind: a task back from its preparation thread

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

    def _disk_cache(self) -> Any:
        """The prefix cache on disk for this model and context (None: off, or it cannot be used)."""
        from ..paths import get_paths
        from .disk_cache import DiskPrefixCache, model_key
        from .prefix_cache import MIN_TOKENS
        if not self.settings.cache_disk_mb or self.deterministic or self.uncuttable_model():
            return None
        try:
            key = model_key(Path(self.model_path), self.n_ctx_slot,
                            f"{getattr(self.settings, 'cache_type_k', '')}/{getattr(self.settings, 'cache_type_v', '')}")
            return DiskPrefixCache(get_paths().state / "prefix-cache", self.settings.cache_disk_mb * 2 ** 20,
                                   key, MIN_TOKENS)
        except OSError as e:
            log.warning("prefix cache on disk off: %s", e)
            return None

    def uncuttable_model(self) -> bool:
        """Recurrent or hybrid memory (its states are checkpoints; not kept on disk)."""
        import llama_cpp
        return bool(llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(self.model))

    def persist_slots(self, idle_only: bool = True) -> int:
        """Write the KV state of each slot that holds at least MIN_TOKENS tokens not yet on disk
        (loop thread; the file is written in the background). Returns the states queued."""
        if self.dcache is None:
            return 0
        n = 0
        for s in self.slots:
            if (idle_only and s.task is not None) or len(s.tokens) < self.dcache.min_tokens:
                continue
            if self._persisted.get(s.id) == len(s.tokens) or self.dcache.covered(s.tokens):
                continue
            data = save_state(self.ctx, s.id)
            if data is not None:
                self.dcache.save(s.tokens, data)
                self._persisted[s.id] = len(s.tokens)
                n += 1
        return n

    def _restore_from_disk(self, prompt: list[int], target: Any, c: Any) -> tuple[Any, int]:
        """Put the disk's state that shares the longest prefix with ``prompt`` into ``target`` when
        it holds more of it than the choice ``c`` keeps; returns the (new) choice and the tokens
        restored."""
        from .prefix_cache import restore_state
        from .slots import SlotChoice
        hit = self.dcache.best(prompt)
        if hit is None or min(hit[1], len(prompt) - 1) <= c.n_keep:
            return c, 0
        entry, n = hit
        n = min(n, len(prompt) - 1)
        data = self.dcache.load(entry)
        if data is None:
            return c, 0
        import ctypes
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if not restore_state(self.ctx, self.mem, target, buf):
            log.warning("prefix cache on disk: %s could not be put back; prefilling", entry.path.name)
            return SlotChoice(target=target.id, n_keep=0), 0
        target.tokens = list(entry.tokens)
        self._persisted[target.id] = len(entry.tokens)
        log.info("prefix cache on disk: %d prompt tokens restored into slot %d", n, target.id)
        return SlotChoice(target=target.id, n_keep=n), n

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
        """Counters, slot states and the expert runtime's stats (merged under "experts")."""
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

    # ---- tokens ---------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Tokens of ``text`` (special tokens parsed). Thread-safe (vocab is read-only)."""
        return loading.tokenize(self.vocab, text, add_special)

    def piece(self, token: int, special: bool = False) -> bytes:
        """Bytes of one token (``special``: render control tokens too)."""
        return loading.piece(self.vocab, token, special)

    def render(self, req: GenRequest) -> tuple[list[int], Any]:
        """Prompt tokens of ``req`` and the rendered chat prompt (None for raw prompts).

        Size bounds come first (:mod:`.limits`): too many schema nodes, or more text than the
        context can hold whatever its tokenization, are refused before any rendering or
        tokenizing. Raises EngineError("invalid_request" | "template_error" | "schema_too_large"
        | "context_length_exceeded").
        """
        self.check_grammar_cost(req, with_grammar=False)
        limits.check_text_fits(limits.message_text_bytes(req.messages, req.prompt), self.max_piece_bytes,
                               self.n_ctx_slot)
        if req.infill is not None:
            return self.infill_prompt(req), None
        if req.prompt_tokens is not None:
            return self.mixed_prompt(req.prompt_tokens), None
        if req.messages is not None:
            rendered = self.templates.render(req.messages, req.tools, req.tool_choice,
                                             req.parallel_tool_calls, req.enable_thinking,
                                             req.json_schema)
            text = rendered.prompt
        elif req.prompt is not None:
            text, rendered = req.prompt, None
        else:
            raise EngineError("invalid_request", "request has neither messages nor prompt")
        limits.check_text_fits(len(text.encode("utf-8", "replace")), self.max_piece_bytes, self.n_ctx_slot)
        return self.tokenize(text), rendered

    def mixed_prompt(self, pieces: list[Any]) -> list[int]:
        """Prompt tokens of token ids and texts in order (a text's special tokens parsed, the
        vocabulary's BOS only before a leading text). Raises EngineError 400 for an id outside the
        vocabulary or ``context_length_exceeded`` for text that cannot fit."""
        limits.check_text_fits(sum(len(p.encode("utf-8", "replace")) for p in pieces if isinstance(p, str)),
                               self.max_piece_bytes, self.n_ctx_slot)
        out: list[int] = []
        for i, p in enumerate(pieces):
            if isinstance(p, str):
                out += self.tokenize(p, add_special=i == 0)
            elif not 0 <= int(p) < self.n_vocab:
                raise EngineError("invalid_request", f"token id {p} is outside the vocabulary (0..{self.n_vocab - 1})")
            else:
                out.append(int(p))
        return out

    def check_grammar_cost(self, req: GenRequest, with_grammar: bool = True) -> None:
        """Refuse a request whose grammar work is too large before any of it is done: the size of
        its tool definitions and response schema (:func:`.limits.check_schema_size`) and the cost
        of its regex patterns and, ``with_grammar``, of its own GBNF ``grammar``
        (:func:`.patterns.check_request_grammar`). Raises EngineError 400 ``schema_too_large``,
        ``grammar_too_complex`` or ``invalid_request`` (a pattern llama.cpp cannot enforce)."""
        limits.check_schema_size(req.tools, req.json_schema, self.settings.max_schema_nodes,
                                 self.settings.max_schema_properties)
        patterns.check_request_grammar(req.tools, req.json_schema, req.grammar if with_grammar else None,
                                       patterns.limits_of(self.settings))

    def infill_prompt(self, req: GenRequest) -> list[int]:
        """Prompt tokens of a fill-in-the-middle request (:mod:`.infill`). Raises EngineError 400
        ``infill_not_supported`` (no FIM tokens) or ``context_length_exceeded``."""
        from . import infill
        f = req.infill or {}
        texts = [f.get("input_prefix"), f.get("input_suffix"), f.get("prompt")]
        texts += [c.get("text") for c in f.get("input_extra") or []]
        limits.check_text_fits(sum(len(t) for t in texts if isinstance(t, str)), self.max_piece_bytes,
                               self.n_ctx_slot)
        return infill.infill_tokens(infill.FimTokens.of_vocab(self.vocab),
                                    lambda text: loading.tokenize(self.vocab, text, False, parse_special=False),
                                    str(f.get("input_prefix") or ""), str(f.get("input_suffix") or ""),
                                    list(f.get("input_extra") or []), str(f.get("prompt") or ""),
                                    self.n_batch, req.max_tokens, self.n_ctx_slot)

    def tokenize_content(self, content: Any, add_special: bool = False, parse_special: bool = True,
                         with_pieces: bool = False) -> list[Any]:
        """llama-server's /tokenize: the tokens of ``content`` (a string, or a list of strings and
        token ids, the ids kept as they are); with ``with_pieces`` ``[{"id", "piece"}]`` where a
        piece that is not UTF-8 is its list of byte values. Any thread."""
        parts = content if isinstance(content, list) else [content]
        toks: list[int] = []
        for i, p in enumerate(parts):
            if isinstance(p, str):
                toks += loading.tokenize(self.vocab, p, add_special and i == 0, parse_special=parse_special)
            else:
                toks.append(int(p))
        if not with_pieces:
            return toks
        out = []
        for t in toks:
            b = self.piece(t, special=True)
            try:
                out.append({"id": t, "piece": b.decode("utf-8")})
            except UnicodeDecodeError:
                out.append({"id": t, "piece": list(b)})
        return out

    def detokenize(self, tokens: list[int]) -> str:
        """llama-server's /detokenize: the text of ``tokens`` (special tokens rendered; bytes that
        are not UTF-8 replaced). Raises EngineError 400 for an id outside the vocabulary."""
        bad = [t for t in tokens if not 0 <= int(t) < self.n_vocab]
        if bad:
            raise EngineError("invalid_request", f"token id {bad[0]} is not in the vocabulary "
                              f"(0..{self.n_vocab - 1})")
        return b"".join(self.piece(int(t), special=True) for t in tokens).decode("utf-8", "replace")

    def apply_template(self, req: GenRequest) -> str:
        """The prompt text the chat template makes of ``req`` (llama-server's /apply-template), on
        a prepare thread within ``template_timeout_s``. Raises EngineError as :meth:`render`."""
        def text() -> str:
            self.check_grammar_cost(req, with_grammar=False)
            return self.templates.render(req.messages or [], req.tools, req.tool_choice,
                                         req.parallel_tool_calls, req.enable_thinking,
                                         req.json_schema).prompt
        box: list = []
        fut = self._prep_pool.submit(self._rendering, box, text)
        try:
            return fut.result(timeout=self.settings.template_timeout_s)
        except FutureTimeout:
            raise self._timeout_error(self._loaded(box)) from None

    def chat_parser(self, req: GenRequest, rendered: Any) -> Any:
        """The output parser of a chat request (:func:`.chat.parser_for`)."""
        from . import chat
        return chat.parser_for(self.templates, req, rendered)

    def count_tokens(self, req: GenRequest) -> int:
        """Tokens of the rendered prompt of ``req`` (any thread but the loop's). Rendered on a
        prepare thread within ``template_timeout_s``; raises EngineError as :meth:`render` does,
        or ``template_timeout`` (400)."""
        box: list = []
        fut = self._prep_pool.submit(self._rendering, box, self.render, req)
        try:
            return len(fut.result(timeout=self.settings.template_timeout_s)[0])
        except FutureTimeout:
            raise self._timeout_error(self._loaded(box)) from None

    def _rendering(self, box: list, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a prepare thread, its start time in ``_render_starts`` (and appended
        to ``box``) while it runs: the load a timeout is judged by (:meth:`_loaded`)."""
        key = object()
        t0 = time.monotonic()
        box.append(t0)
        with self._lock:
            self._render_starts[key] = t0
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._render_starts.pop(key, None)

    def _loaded(self, box: list) -> bool:
        """Whether a render that timed out did so under load: it never got a prepare thread
        (``box`` empty), or another render, still within its own time limit, ran at the middle
        of its time (a render that had already timed out before is that client's, not load)."""
        if not box:
            return True
        limit = self.settings.template_timeout_s
        mid = box[0] + limit / 2
        with self._lock:
            starts = list(self._render_starts.values())
        return sum(1 for t0 in starts if t0 <= mid < t0 + limit) > 1  # itself and another

    def _timeout_error(self, loaded: bool = False) -> EngineError:
        """``template_timeout``: 400 when the request's own render is too slow, 503 (retry, the
        answer carries Retry-After) when ``loaded``: other renders ran beside it."""
        s = self.settings.template_timeout_s
        if loaded:
            return EngineError("template_timeout", f"rendering the request's chat template, grammar and "
                               f"prompt took longer than {s:g} s (limit template_timeout_s = {s:g}) while "
                               "the engine was rendering other requests; retry shortly", 503)
        return EngineError("template_timeout", f"rendering the request's chat template, grammar and "
                           f"prompt took longer than {s:g} s (limit template_timeout_s = {s:g}); send "
                           "fewer or smaller tools or a shorter prompt", 400)

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
                self.switcher.auto_switch(t)
            c = choose_slot(free, t.prompt, time.monotonic())
            if self.deterministic:  # a slot's stream holds only what it computed itself
                c = determinism.own_slot_only(c, self.slots[c.target].tokens, t.prompt)
            target = self.slots[c.target]
            restored = 0
            ck = target.checkpoint
            if (self.uncuttable and ck is not None and c.copy_from is None
                    and len(ck.tokens) < len(target.tokens) and c.n_keep < len(target.tokens)):
                # the slot is cut back: its recurrent state goes back to the end of its last prompt
                # (reused when the new prompt extends that prompt, as an agent's next turn does;
                # else the whole state saved for the host cache below is that boundary's)
                if rewind_to_checkpoint(self.ctx, self.mem, target):
                    c = replace(c, n_keep=min(c.n_keep, len(target.tokens)))
                    with self._lock:
                        self._counters["checkpoint_rewinds"] += 1
                else:
                    c = replace(c, n_keep=0)
            if self.pcache is not None and not self.deterministic:
                c, restored = use_host_cache(self.pcache, self.ctx, self.mem, t.prompt, target, c,
                                             whole=self.uncuttable, disk=self.dcache)
            if self.dcache is not None and c.copy_from is None and not restored:
                c, restored = self._restore_from_disk(t.prompt, target, c)
            if c.copy_from is not None:  # share the other conversation's prefix (cells, no copy)
                src = self.slots[c.copy_from]
                llama_cpp.llama_memory_seq_rm(self.mem, target.id, -1, -1)
                llama_cpp.llama_memory_seq_cp(self.mem, src.id, target.id, 0, c.n_copy)
                target.tokens = src.tokens[:c.n_copy]
                target.checkpoint = None
            n_keep = c.n_keep
            if self.deterministic:
                valid = self._det_valid.get(c.copy_from if c.copy_from is not None else target.id, 0)
                n_keep = determinism.aligned_keep(n_keep, valid, self.n_prefill_step)
                self._det_valid[target.id] = n_keep
            if n_keep < len(target.tokens):
                if llama_cpp.llama_memory_seq_rm(self.mem, target.id, n_keep, -1):
                    target.tokens = target.tokens[:n_keep]
                else:   # recurrent/hybrid memory: back to the latest checkpoint within the prefix
                    n_keep = restore_checkpoint(self.pcache, self.ctx, self.mem, t.prompt, target, n_keep)
                    restored = max(restored, n_keep)
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
            self._emit(t, StartEvent(len(t.prompt), n_keep, target.id, restored or None,
                                     t.residency_switch, t.residency_skipped))
            self._progress(t)

    def _progress(self, t: Task) -> None:
        """The ``progress`` event of a request that asked for it (``return_progress``): prompt
        tokens, cached, processed so far (cached + prefilled), ms since its prefill began."""
        if t.req.return_progress:
            self._emit(t, ProgressEvent(len(t.prompt), t.n_cached, len(t.prompt) - len(t.pending),
                                        round((time.monotonic() - t.t_prefill_start) * 1000, 3)))

    def _release(self, t: Task) -> None:
        if t.slot is not None:
            t.slot.task = None
            t.slot.last_used = time.monotonic()
        if t.sampler is not None:
            sampling.free_sampler(t.sampler)
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
        active = self._active
        if self.deterministic:  # one sequence per forward pass, slots take turns (determinism.py)
            self._turn = (self._turn + 1) % len(active)
            active = [active[self._turn]]
        for t in active:
            if t.next_token is not None and n < self.n_batch:
                self._put(b, n, t.next_token, len(t.slot.tokens), t.slot.id, True)
                plan.append((t, [t.next_token]))
                rows.append((t, n))
                n += 1
        # prefill: at most one ubatch of prompt tokens per step (the forward pass llama_decode
        # would cut anyway), so a cancel (client gone) is seen between ubatches, not after n_batch;
        # fewer while other slots generate, so that their next token is not held for long
        budget = n + self._prefill_budget(decoding=n > 0)
        # the shortest prompt first: a small request beside a huge prompt is not queued behind it
        # (stable: equal ones keep their order; deterministic mode keeps the slots' turns)
        prefilling = active if self.deterministic else sorted(active, key=lambda t: len(t.pending))
        for t in prefilling:
            if t.pending and n < budget and not (self.deterministic and n):
                k = min(len(t.pending), budget - n)
                if self.deterministic:
                    k = determinism.chunk_len(len(t.slot.tokens), len(t.pending), self.n_prefill_step)
                chunk = t.pending[:k]
                base = len(t.slot.tokens)
                last = k == len(t.pending)
                for j, tok in enumerate(chunk):
                    self._put(b, n + j, tok, base + j, t.slot.id, last and j == k - 1)
                if last:
                    rows.append((t, n + k - 1))
                plan.append((t, chunk))
                t.prefill_passes += 1
                n += k
        if n == 0:
            return
        b.n_tokens = n
        t0 = time.monotonic()
        self._busy = ("forward pass", t0, tuple(t.req.id for t, _ in plan))
        rc = llama_cpp.llama_decode(self.ctx, b)
        self._busy = None
        self.steps += 1
        if rc == 0:
            self._learn_step_cost(n - sum(1 for t, toks in plan if toks == [t.next_token] and not t.pending),
                                  time.monotonic() - t0)
        with self._lock:
            self._counters["decode_calls"] += 1
            self._counters["busy_slot_steps"] += len(plan)  # slots in this forward pass
        if rc != 0:
            msg = f"llama_decode failed ({rc}{': KV cache full' if rc == 1 else ''})"
            for t, _ in plan:
                llama_cpp.llama_memory_seq_rm(self.mem, t.slot.id, -1, -1)
                t.slot.tokens = []
                t.slot.checkpoint = None
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
                if self.deterministic:
                    pos = len(t.slot.tokens) - len(toks)
                    self._det_valid[t.slot.id] = determinism.extends_valid(
                        self._det_valid.get(t.slot.id, 0), pos, len(toks), self.n_prefill_step)
                t.pending = t.pending[len(toks):]
                with self._lock:
                    self._counters["prefilled_tokens"] += len(toks)
                self._progress(t)
                if (not t.pending and self.uncuttable and self.pcache is not None
                        and len(t.slot.tokens) >= self.pcache.min_tokens):
                    # the prompt's end is a message boundary: the next turn goes back to it
                    if save_slot_checkpoint(self.ctx, t.slot):
                        with self._lock:
                            self._counters["slot_checkpoints"] += 1
        for t, idx in rows:
            if t.finished or t.cancelled:
                continue
            if t.req.max_tokens == 0:  # prefill only (llama-server's n_predict 0): the prompt is cached
                t.t_first = t.t_last = time.monotonic()
                self._end(t, "length")
                continue
            t0 = time.monotonic()
            self._busy = ("sampling", t0, (t.req.id,))  # and the output parser, in _on_token
            try:
                tok = sampling.sample(t.sampler, self.ctx, idx)
                dt = time.monotonic() - t0
                if dt > self.settings.grammar_token_timeout_s and self._has_grammar(t):
                    self._grammar_too_slow(t, dt)
                elif tok < 0:
                    from . import native
                    self._end(t, None, error=("sampling_failed", native.last_error() or "sampling failed"))
                else:
                    self._on_token(t, tok, idx)
            finally:
                self._busy = None
        for t in [t for t in self._active if t.finished]:
            self._active.remove(t)

    def _learn_step_cost(self, n_prefill: int, seconds: float) -> None:
        """Update the step cost model ``seconds = base + per_token * n_prefill`` (moving averages):
        ``base`` from steps without prompt tokens (decode only: it grows with the context the
        batch attends over), ``per_token`` from the others, net of ``base``."""
        if n_prefill <= 0:
            self._s_step_base = seconds if not self._s_step_base else 0.7 * self._s_step_base + 0.3 * seconds
            return
        per = max(0.0, seconds - self._s_step_base) / n_prefill
        self._s_per_prefill_token = per if not self._s_per_prefill_token else \
            0.5 * self._s_per_prefill_token + 0.5 * per

    def _prefill_budget(self, decoding: bool) -> int:
        """Prompt tokens of the next step: one ubatch (``n_prefill_step``, the cost model's
        choice) unless that would make the step longer than its time target by the measured
        step cost (:meth:`_learn_step_cost`): ``prefill_chunk_target_s`` while other slots
        generate (their next token waits for the step), half of ``engine_stall_timeout_s``
        alone. At least :data:`PREFILL_MIN_CHUNK`; whole ubatches in ``deterministic`` mode."""
        full = self.n_prefill_step
        per = self._s_per_prefill_token
        if self.deterministic or per <= 0:
            return full
        # alone only a pass near the stall bound is cut (chunk boundaries change rounding)
        target = self.settings.prefill_chunk_target_s if decoding else self.settings.engine_stall_timeout_s / 2
        if target <= 0:
            return full
        room = target - (self._s_step_base if decoding else 0.0)
        return max(min(PREFILL_MIN_CHUNK, full), min(full, int(room / per)))

    @staticmethod
    def _has_grammar(t: Task) -> bool:
        """The request samples under a grammar (its own, a schema's or its tools')."""
        return bool(t.req.grammar or t.req.json_schema is not None
                    or (t.rendered is not None and getattr(t.rendered, "grammar", None)))

    def _grammar_too_slow(self, t: Task, seconds: float) -> None:
        """End ``t`` (400 ``grammar_too_slow``): one token under its grammar took ``seconds``,
        more than ``grammar_token_timeout_s``; the others are served on."""
        lim = self.settings.grammar_token_timeout_s
        msg = (f"sampling one token under the request's grammar took {seconds:.1f} s (limit "
               f"grammar_token_timeout_s = {lim:g}); simplify its patterns, schema or grammar")
        log.warning("request %s: %s", t.req.id, msg)
        t.finished = True
        t.next_token = None
        if t in self._active:
            self._active.remove(t)
        self._release(t)
        self._fail(t, "grammar_too_slow", msg, 400)

    @staticmethod
    def _put(b: Any, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        b.token[i] = tok
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = 1 if logits else 0

    # ---- tokens out -----------------------------------------------------------------------------

    def _logprob_entry(self, t: Task, tok: int, idx: int) -> dict[str, Any]:
        """The log-probability entry of ``tok``, sampled from batch row ``idx`` (:mod:`.logprobs`;
        the sampler copies the logits, they are still the model's)."""
        import llama_cpp
        import numpy as np
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
        lp, top = logprobs.log_softmax_pick(row, tok, t.req.logprobs or 0)
        return logprobs.entry(tok, lp, top, lambda i: self.piece(i, special=True))

    def _on_token(self, t: Task, tok: int, idx: int) -> None:
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
        if req.logprobs is not None:
            t.logprobs.append(self._logprob_entry(t, tok, idx))
        t.text.add(self.piece(tok, special=tok in t.special_ids))
        if t.stops:
            cut = t.stops.find(t.text.text)  # new text only
            if cut is not None:
                if t.stops.matched in (req.stop or []):
                    t.stop_sequence = t.stops.matched  # a client's stop string (not the template's)
                t.text.cut(cut)
                self._end(t, "stop")
                return
        self._stream(t, final=False)
        if t.n_gen >= req.max_tokens:
            self._end(t, "stop" if t.demo_cap else "length")
            return
        if len(t.slot.tokens) + 1 >= self.n_ctx_slot:
            self._end(t, "length")
            return
        t.next_token = tok

    def _stream(self, t: Task, final: bool) -> None:
        text = t.text.text
        if not final and t.stops:
            text = text[:len(text) - t.stops.partial_len(text)]
        if t.parser is None:
            if len(text) > t.sent:
                self._emit_delta(t, {"content": text[t.sent:]})
                t.sent = len(text)
            return
        res = t.parser.feed(text, final=final)
        if res.diffs:
            self._emit_delta(t, merge_deltas(res.diffs))
        if final and res.parse_error:  # the model's raw output: at debug level only
            log.debug("request %s: output did not match the %s format, the rest kept as text (%s)",
                      t.req.id, t.rendered.format_name if t.rendered else "?", res.parse_error[:200])

    def _emit_delta(self, t: Task, d: dict[str, Any]) -> None:
        if t.req.says_demo_notice() and not t.notice_sent:  # the demo model says what it is first
            d = dict(d, content=DEMO_NOTICE + (d.get("content") or ""))
            t.notice_sent = True
        if len(t.logprobs) > t.logprobs_sent:
            d = dict(d, logprobs=t.logprobs[t.logprobs_sent:])
            t.logprobs_sent = len(t.logprobs)
        self._emit(t, DeltaEvent(**d))

    def _end(self, t: Task, reason: Optional[str], error: Optional[tuple[str, str]] = None) -> None:
        """Finish ``t``: final parse, done (or error) event, slot released."""
        from . import chat
        t.finished = True
        t.next_token = None
        if t in self._active:  # before its done event: stats() never counts an answered request active
            self._active.remove(t)
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
        if t.req.says_demo_notice():
            if not t.notice_sent:
                self._emit_delta(t, {})
            message = dict(message, content=DEMO_NOTICE + (message.get("content") or ""))
        message, reason = settle_tool_calls(message, reason, t.req.tool_choice)
        done = t.done_event(reason, message, time.monotonic())
        done.prefill = {"passes": t.prefill_passes, "ubatch": self.n_prefill_step}
        done.stop_sequence = t.stop_sequence
        if self.rt is not None:
            try:
                done.experts = self.rt.take_request_stats()
            except Exception as e:
                done.experts = {"error": str(e)}
            self.rt.follow_decode_graph(self.ctx, done.experts)
            if self.traces is not None:
                self.traces.record_done(t.req.workload or self.settings.workload_default, done.to_data(),
                                        n_tools=len(t.req.tools or []))
        self._release(t)
        with self._lock:
            self._counters["requests_ok"] += 1
        self._emit(t, done)

    def _finish_bookkeeping(self, t: Task, cancelled: bool) -> None:
        t.finished = True
        if cancelled:
            with self._lock:
                self._counters["requests_cancelled"] += 1
            self._emit(t, ErrorEvent("cancelled", "request cancelled", 499))

    def _fail(self, t: Task, code: str, message: str, status: int,
              extra: Optional[dict[str, Any]] = None) -> None:
        t.finished = True
        with self._lock:
            self._counters["requests_error"] += 1
        self._emit(t, ErrorEvent(code, message, status, dict(extra or {})))

    def _emit(self, t: Task, ev: EngineEvent) -> None:
        try:
            t.emit(ev)
        except Exception:
            log.exception("request %s: event consumer failed", t.req.id)
