"""Prometheus metrics of the HTTP front end, plus the engine's own counters flattened.

Built on ``prometheus_client`` with one registry per daemon state (tests run several daemons in
one process). Request metrics are updated by the front end after each request; the engine's
counters (slots, expert-path counts, hot-route share, ...) are whatever ``EngineClient.stats()``
returns, flattened into gauges named ``ostinato_engine_<path_of_keys>`` at scrape time.
llama-server's ``llamacpp:*`` series are made from the same counters (:func:`llamacpp_text`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.stats import EngineStats
from ..hardware import gpu_memory

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; agents see TTFT from tens of ms (cached prefix) to minutes (cold 64K prefill).
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Seconds per output token; 5 ms (GPU) .. 1 s (big model on CPU).
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


def flatten(d: Any, prefix: str = "") -> Iterable[tuple[str, float]]:
    """Yield ``(name, value)`` for every number in a nested dict/list (``a_b_0_c``).

    Booleans become 0/1; strings and None are skipped (they are not Prometheus samples). Names are
    sanitised to ``[a-zA-Z0-9_]``.
    """
    if isinstance(d, bool):
        yield prefix, float(d)
    elif isinstance(d, (int, float)):
        if not (isinstance(d, float) and math.isnan(d)):
            yield prefix, float(d)
    elif isinstance(d, dict):
        for k, v in d.items():
            key = re.sub(r"[^a-zA-Z0-9_]", "_", str(k))
            yield from flatten(v, f"{prefix}_{key}" if prefix else key)
    elif isinstance(d, (list, tuple)) and len(d) <= 64:  # long lists (per-expert counts) are not metrics
        for i, v in enumerate(d):
            yield from flatten(v, f"{prefix}_{i}" if prefix else str(i))


# per expert pool (one per GPU): (metric, key in the engine's ``pools`` entry, help)
_POOL_GAUGES = (("ostinato_pool_bytes", "bytes", "Bytes of the expert pool on this GPU"),
                ("ostinato_pool_hot_experts", "hot_experts", "Hot experts resident in the pool"),
                ("ostinato_pool_routes", "routes", "Routes of the pool's layers since the counters' reset"),
                ("ostinato_pool_hot_route_share", "hot_route_share",
                 "Share of the pool's layers' routes computed from resident experts (0..1)"))


def pool_families(pools: Any, gpus: list[dict[str, Any]]) -> Iterable[GaugeMetricFamily]:
    """Per-GPU gauges labelled ``gpu`` (the CUDA index of the pool, or NVML's for memory):
    ``ostinato_pool_*`` from the engine's ``pools`` (``[{gpu, device, bytes, hot_experts, routes,
    hot_route_share}]``, None without the expert engine) and ``ostinato_gpu_memory_{used,total}_bytes``
    from :func:`ostinatod.hardware.gpu_memory` (``[]`` without NVML). The flattened
    ``ostinato_engine_experts_pools_<i>_*`` keep the same figures by list position."""
    for metric, key, doc in _POOL_GAUGES if isinstance(pools, list) and pools else ():
        g = GaugeMetricFamily(metric, doc, labels=["gpu", "device"])
        for p in pools:
            v = p.get(key) if isinstance(p, dict) else None
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                g.add_metric([str(p.get("gpu")), str(p.get("device"))], float(v))
        yield g
    for metric, key in (("ostinato_gpu_memory_used_bytes", "used_bytes"),
                        ("ostinato_gpu_memory_total_bytes", "total_bytes")) if gpus else ():
        g = GaugeMetricFamily(metric, "GPU memory (NVML), all processes", labels=["gpu", "name"])
        for d in gpus:
            g.add_metric([str(d.get("index")), str(d.get("name"))], float(d.get(key) or 0))
        yield g


class _EngineCollector(Collector):
    """Exposes the last engine stats snapshot (set by :meth:`Metrics.set_engine_stats`)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}
        self.stall: dict[str, Any] | None = None  # the supervisor's stall record, None when not stalled

    def collect(self):
        st = self.stall
        g = GaugeMetricFamily("ostinato_engine_stalled", "1 while the engine loop is stalled in one "
                              "native call (labels: what, and the request ids in it)",
                              labels=["what", "request_id"])
        if isinstance(st, dict):
            for rid in st.get("requests") or ["-"]:
                g.add_metric([str(st.get("what")), str(rid)], 1.0)
        else:
            g.add_metric(["-", "-"], 0.0)
        yield g
        if isinstance(st, dict):
            s = GaugeMetricFamily("ostinato_engine_stall_seconds", "Seconds the engine loop has been "
                                  "inside the stalled call")
            s.add_metric([], float(st.get("for_s") or 0))
            yield s
        ex = self.snapshot.get("experts")
        if isinstance(ex, dict) and "workload" in ex:
            g = GaugeMetricFamily("ostinato_residency_active", "1 for the workload of the active "
                                  "residency set (none: no set, all experts cold)", labels=["workload"])
            g.add_metric([str(ex.get("workload") or "none")], 1.0)
            yield g
        yield from pool_families(ex.get("pools") if isinstance(ex, dict) else None, gpu_memory())
        seen = set()
        for name, value in flatten(self.snapshot):
            full = "ostinato_engine_" + name
            if full in seen:
                continue
            seen.add(full)
            g = GaugeMetricFamily(full, "engine counter (EngineClient.stats())")
            g.add_metric([], value)
            yield g


def llamacpp_text(llama: dict[str, float], snapshot: dict[str, Any], n_ctx_slot: int) -> str:
    """llama-server's ``llamacpp:*`` series in the Prometheus text format, with its names, types
    and help lines (dashboards built for llama-server read these), made from our own counters:
    ``llama`` (the finished requests' totals, :meth:`Metrics.observe_request`), the engine's last
    stats ``snapshot`` (decode calls, running and waiting requests, slots) and the served context
    per slot (KV usage). Written as text: llama-server's counter names do not all end in
    ``_total``, which prometheus_client would impose."""
    slots = [x for x in snapshot.get("slots") or [] if isinstance(x, dict)]
    decode_calls = float(snapshot.get("decode_calls") or 0)
    ps, pt = llama["prompt_seconds"], llama["prompt_tokens"]
    gs, gt = llama["predicted_seconds"], llama["predicted_tokens"]
    kv = float(sum(int(x.get("n_tokens") or 0) for x in slots))
    counters = (
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", pt),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", llama["cached_tokens"]),
        ("prompt_seconds_total", "Total time spent processing prompts", ps),
        ("tokens_predicted_total", "Number of generation tokens processed", gt),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", gs),
        ("n_decode_total", "Total number of llama_decode() calls", decode_calls),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", llama["n_tokens_max"]),
        # no speculative decoding here: llama-server's series, always 0
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0.0),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target "
         "model", 0.0),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0.0))
    gauges = (
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", pt / ps if ps > 0 else 0.0),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", gt / gs if gs > 0 else 0.0),
        ("requests_processing", "Number of requests processing", float(snapshot.get("active") or 0)),
        ("requests_deferred", "Number of requests deferred", float(snapshot.get("waiting") or 0)),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         float(snapshot.get("busy_slot_steps") or 0) / decode_calls if decode_calls else 0.0),
        ("kv_cache_tokens", "KV cache tokens (all slots)", kv),
        ("kv_cache_usage_ratio", "KV cache usage (1 = full)",
         kv / (n_ctx_slot * len(slots)) if n_ctx_slot and slots else 0.0))
    out = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, doc, value in items:
            out += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {float(value)!r}"]
    return "\n".join(out) + "\n"


class Metrics:
    """Request counters, token counters and TTFT/TPOT histograms of one daemon.

    Labels: ``protocol`` (openai_chat, openai_completions, responses, anthropic), ``status``
    (ok, or the error code), ``reason`` of residency swaps (control, auto, replan). Times in seconds.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ostinato_requests", "Generation requests finished",
                                ["protocol", "status"], registry=r)
        self.in_flight = Gauge("ostinato_requests_in_flight", "Generation requests running",
                               registry=r)
        self.prompt_tokens = Counter("ostinato_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.cached_tokens = Counter("ostinato_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix (KV) cache", registry=r)
        self.prefilled_tokens = Counter("ostinato_prefilled_tokens",
                                        "Prompt tokens newly prefilled", registry=r)
        self.completion_tokens = Counter("ostinato_completion_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram("ostinato_ttft_seconds", "Time to first token", ["protocol"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ostinato_tpot_seconds", "Time per output token after the first",
                              ["protocol"], buckets=_TPOT_BUCKETS, registry=r)
        self.http_errors = Counter("ostinato_http_errors", "Requests answered with an error",
                                   ["protocol", "code"], registry=r)
        self.residency_switches = Counter("ostinato_residency_switches", "Residency-set swaps by "
                                          "reason (control, auto: a request's workload, replan)",
                                          ["reason"], registry=r)
        self.residency_last_switch = Gauge("ostinato_residency_last_switch_seconds",
                                           "Seconds the last residency-set swap took", registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)
        # totals of finished requests for the llamacpp:* series (seconds; tokens)
        self.llama = {"prompt_tokens": 0.0, "cached_tokens": 0.0, "prompt_seconds": 0.0,
                      "predicted_tokens": 0.0, "predicted_seconds": 0.0, "n_tokens_max": 0.0}
        self.n_ctx_slot = 0  # the served context per slot (KV usage); set at each scrape

    def observe_request(self, rec: dict[str, Any]) -> None:
        """Account one finished request record (see :class:`ostinatod.server.state.DaemonState`)."""
        proto = rec.get("protocol") or "unknown"
        self.requests.labels(proto, rec.get("status") or "ok").inc()
        for counter, key in ((self.prompt_tokens, "prompt_tokens"), (self.cached_tokens, "cached_tokens"),
                             (self.prefilled_tokens, "prefilled_tokens"),
                             (self.completion_tokens, "completion_tokens")):
            v = rec.get(key)
            if v:
                counter.inc(v)
        if rec.get("ttft_s") is not None:
            self.ttft.labels(proto).observe(rec["ttft_s"])
        if rec.get("tpot_s") is not None:
            self.tpot.labels(proto).observe(rec["tpot_s"])
        lm, n_out = self.llama, int(rec.get("completion_tokens") or 0)
        lm["prompt_tokens"] += int(rec.get("prefilled_tokens") or 0)
        lm["cached_tokens"] += int(rec.get("cached_tokens") or 0)
        lm["predicted_tokens"] += n_out
        lm["prompt_seconds"] += float(rec.get("ttft_s") or 0.0)  # prefill + the first token
        lm["predicted_seconds"] += float(rec.get("tpot_s") or 0.0) * max(0, n_out - 1)
        lm["n_tokens_max"] = max(lm["n_tokens_max"], float(int(rec.get("prompt_tokens") or 0) + n_out))

    def set_engine_stats(self, stats: Optional[EngineStats]) -> None:
        """Replace the engine snapshot exported at the next scrape (its counters flattened as
        the engine sent them)."""
        self._engine.snapshot = stats.wire if stats is not None else {}

    def set_stall(self, stall: dict[str, Any] | None) -> None:
        """The engine's stall record (``{"what", "for_s", "requests"}``) or None, exported as
        ``ostinato_engine_stalled`` at the next scrape."""
        self._engine.stall = stall

    def render(self) -> bytes:
        """Prometheus text exposition of everything (llama-server's ``llamacpp:*`` series last)."""
        return generate_latest(self.registry) + llamacpp_text(self.llama, self._engine.snapshot,
                                                              self.n_ctx_slot).encode()
