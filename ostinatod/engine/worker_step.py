"""The worker's batched step: one forward pass of a token of each generating slot plus prefill chunks
(their size from the measured step cost), sampling, and the streaming of a request's output
(``delta`` events, stop strings, the final parse and the ``done``/``error`` event), and the wall-clock
parts of each step (:mod:`.step_timing`: the forward pass, sampling, a token's way out)."""

from __future__ import annotations

import logging
import time
from time import perf_counter_ns
from typing import Any, Optional

from . import determinism, logprobs, sampling
from .prefix_cache import save_slot_checkpoint
from .task import Task
from .text import merge_deltas, settle_tool_calls
from .events import DeltaEvent, EngineEvent, ErrorEvent
from .types import DEMO_NOTICE


log = logging.getLogger("ostinatod.engine")

PREFILL_MIN_CHUNK = 32  # prompt tokens a step carries at least (chunks smaller waste passes)


class StepMixin:
    """Forward-pass and output methods of :class:`.worker.Worker` (loop thread)."""

    # ---- one forward pass -----------------------------------------------------------------------

    def _step(self) -> None:
        import llama_cpp
        b = self._batch
        n = n_prompt = 0
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
                n_prompt += k
        if n == 0:
            return
        b.n_tokens = n
        clk = self.clock
        t0 = time.monotonic()
        self._busy = ("forward pass", t0, tuple(t.req.id for t, _ in plan))
        c0 = perf_counter_ns()
        clk.begin(c0)   # the step before this one ends here (step_timing: its wall)
        rc = llama_cpp.llama_decode(self.ctx, b)
        clk.called(c0, perf_counter_ns())
        self._busy = None
        self.steps += 1
        if rc == 0:
            self._learn_step_cost(n - sum(1 for t, toks in plan if toks == [t.next_token] and not t.pending),
                                  time.monotonic() - t0)
        with self._lock:
            self._counters["decode_calls"] += 1
            self._counters["busy_slot_steps"] += len(plan)  # slots in this forward pass
        if rc != 0:
            clk.drop()
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
        synced = False
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
                if not synced:   # the wait the sampler's first logits read would do here, timed apart
                    c0 = perf_counter_ns()
                    llama_cpp.llama_synchronize(self.ctx)
                    clk.logits(c0, perf_counter_ns())
                    synced = True
                c0, pipe0 = perf_counter_ns(), self._delta_write_ns
                tok = sampling.sample(t.sampler, self.ctx, idx)
                c1 = perf_counter_ns()
                dt = time.monotonic() - t0
                if dt > self.settings.grammar_token_timeout_s and self._has_grammar(t):
                    self._grammar_too_slow(t, dt)
                elif tok < 0:
                    from . import native
                    self._end(t, None, error=("sampling_failed", native.last_error() or "sampling failed"))
                else:
                    self._on_token(t, tok, idx)
                clk.token(c1 - c0, perf_counter_ns() - c1, self._delta_write_ns - pipe0)
            finally:
                self._busy = None
        for t in [t for t in self._active if t.finished]:
            self._active.remove(t)
        clk.end(n_prompt, n)

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
        ev = DeltaEvent(**d)
        c0 = perf_counter_ns()
        self._emit(t, ev)   # on the worker process: the JSON line written to the pipe
        self._delta_write_ns += perf_counter_ns() - c0

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
