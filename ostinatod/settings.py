"""The one settings model: every knob lives here once, with its default and description.

Sources, highest priority first: explicit overrides (CLI flags), environment ``OSTINATO_<FIELD>``
(upper case), the TOML file ``<config dir>/settings.toml``, then the defaults below.
``ostinatod --help`` and docs/settings.md are generated from this model
(:func:`settings_markdown`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .paths import get_paths
from .errors import MessageError




def _number_types(annotation: Any) -> tuple:
    """The number types (int, float) an annotation admits, Optional[...] and Annotated[...] included."""
    import typing

    args = typing.get_args(annotation) or (annotation,)
    args = [typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in args]
    return tuple(a for a in args if a in (int, float))


def _reject_bool_numbers(cls: Any, v: Any, info: Any) -> Any:
    """Field validator of every settings model: pydantic takes true for 1 in a number field
    (`port = true` would bind port 1); ValueError there."""
    if isinstance(v, bool) and _number_types(cls.model_fields[info.field_name].annotation):
        raise ValueError("a number is needed, not true/false")
    return v

class EngineTuning(BaseModel):
    """The engine options a user sets as they are (part of ``[engine]``; the engine's
    :class:`ostinatod.engine.options.EngineOptions` takes these fields from here, in this order: the
    native struct ``ostinato_engine_options`` lists them first, in the same order)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decode_borrow: bool = Field(True, description="Borrowed decode memory: during decode the "
                                "upload path's staging slots hold the cold experts the CPU branch "
                                "computed most lately; handed back before each long prefill.")
    upload_copy_2d: bool = Field(True, description="Long prefills on a GPU pool: each cold expert's "
                                 "weight matrices reach the GPU in one 2D copy rather than one copy "
                                 "per matrix (same bytes, fewer and larger transfers), where the "
                                 "pool's pitch is within the device's maximum (pools of under 2 GiB "
                                 "per class tensor; docs/engine.md, \"Whole-expert copies\"). Off only "
                                 "for measurements.")
    pool_whole_expert_slots: bool = Field(True, description="Expert pool layout: each slot holds "
                                          "its expert's weight matrices next to each other, so that "
                                          "a long prefill's upload copies take one transfer per "
                                          "expert at any pool size (docs/engine.md, \"Whole-expert "
                                          "copies\"). Same memory and computation. Off only for "
                                          "measurements (the layout with one tensor per matrix).")
    upload_cpu_share: float = Field(0.0, ge=-1.0, le=1.0, description="Hybrid upload passes: the "
                                    "share (0..1) of a long prefill's cold experts, those with the "
                                    "fewest routes, that a CPU branch computes while the others are "
                                    "uploaded; -1: adapted per layer. 0 (default): the cost model's "
                                    "split (prefill_cpu_split) decides instead. Measurements only.")
    decode_prefetch_experts: Union[Annotated[int, Field(ge=0, le=16)], Literal["auto"]] = Field(
        2, description="Decode prefetch: in each decode step a layer predicts the next layer's routes "
        "(that layer's router on its own input) and copies up to this many of the predicted cold "
        "experts to the GPU while it computes; their routes then run on the GPU instead of the CPU "
        "branch. The choice depends on the model's computation only, so runs repeat exactly. 0: off. "
        "auto: the count whose copies fit in one layer's GPU time, from the calibration (largest "
        "expert / pinned bandwidth against G per layer; 2 without a calibration of this model; bench "
        "variant ostinato-dprefetch-auto). Needs prefill_prefetch_depth 2 (its staging regions; "
        "docs/engine.md, \"Decode prefetch\").")
    decode_prefetch_copy_blocks: int = Field(8, ge=1, le=1024, description="Decode prefetch: "
                                             "blocks of 512 threads of the GPU kernel that copies the "
                                             "staged experts over PCIe, beside the decode step's own "
                                             "kernels. On the H200, 8 copied as fast as 32 and the step's "
                                             "own kernels ran ~11 us per layer faster beside them (bench "
                                             "variants ostinato-copy2, -copy4, -copy32; docs/engine.md, "
                                             "\"Decode timeline\").")
    cpu_branch_kernel: bool = Field(True, description="The decode graph's CPU branch computes a "
                                    "layer's cold experts with its own kernel (ggml-cpu's dot products "
                                    "row by row, each expert read once, on a thread team that spins "
                                    "while a pass runs; bitwise what ggml computes) instead of ggml's "
                                    "graph compute. Off only for measurements (docs/engine.md, "
                                    "\"CPU branch kernel\").")
    cpu_branch_prefetch_rows: int = Field(0, ge=0, le=64, description="The CPU branch kernel "
                                          "prefetches the weight row this many rows ahead of the one it "
                                          "computes (software prefetch; 0: off, the hardware prefetcher "
                                          "alone). Changes when bytes are fetched, never what is computed. "
                                          "Not yet measured on the GPU machine: `ostinato bench cpu-branch "
                                          "--prefetch-rows 0,2,4` and the bench variant "
                                          "ostinato-cpu-prefetch compare (docs/engine.md, \"CPU branch "
                                          "kernel\").")
    cpu_branch_row_pairs: Literal["off", "avx2", "avx512"] = Field(
        "off", description="The CPU branch kernel's dot products: off (ggml-cpu's vec_dot row by row), "
        "or two weight rows per pass in two AVX2 registers or one AVX-512 register, bitwise what vec_dot "
        "gives (each type, q4_0, q8_0, q4_K, q5_K, q6_K, is checked against it on this machine at first "
        "use and left to vec_dot if one bit differs; a CPU without AVX-512 takes AVX2; left out while "
        "cpu_branch_prefetch_rows > 0). Measured on the H200 host, both made decode slower (CPU "
        "branch 3.05 against 1.70 ms per step with avx512, 1.38 against 1.17 with avx2): bench "
        "variants ostinato-pairs-avx2, ostinato-pairs-avx512 (docs/engine.md, \"Row pairs\").")
    cpu_branch_spins: int = Field(256, ge=0, le=1 << 30, description="Pauses (x86 PAUSE, ~40 ns on "
                                  "the H200 host's Xeon) a waiting thread of the CPU branch's team spins "
                                  "before it yields on every further try. More keeps the team on its "
                                  "cores between layers (on the H200 host's `ostinato bench cpu-branch` "
                                  "never yielding took 4 Qwen3.5 experts from 226 to 154 us on 15 "
                                  "threads) but costs whole time slices when more threads than cores "
                                  "want to run (one run there took 10 ms). In the engine 32768 (bench "
                                  "variant ostinato-cpu-spin) starved the decode step: a wait passed "
                                  "20 s and the decode graph turned itself off; keep the default "
                                  "(docs/engine.md, \"CPU branch kernel\").")
    cpu_branch_claims: bool = Field(True, description="How the CPU branch's team takes a layer's "
                                    "work: on (a claim board: the threads that are on a core take its "
                                    "chunks of weight rows one at a time and the one completing a "
                                    "phase opens the next, so a layer never waits for a thread the "
                                    "scheduler took off its core) or off (every thread in every phase, "
                                    "a barrier after each: the form before; bench variant "
                                    "ostinato-barriers). The same arithmetic either way "
                                    "(docs/engine.md, \"CPU branch kernel\").")

    @field_validator("upload_cpu_share")
    @classmethod
    def _share_or_adapted(cls, v: float) -> float:
        if not (0.0 <= v <= 1.0 or v == -1.0):
            raise ValueError("upload_cpu_share is a share 0..1, or -1 (adapted)")
        return v


class EngineSettings(EngineTuning):
    """The ``[engine]`` table of settings.toml (env ``OSTINATO_ENGINE__<FIELD>``): the expert engine's
    tuning. The fields below are inputs that :func:`ostinatod.engine.options.resolve_options` combines
    with the calibration and the hardware (unset: the calibration's choice)."""

    decode_overlap: Optional[bool] = Field(None, description="Decode overlap: the CPU branch of a "
                                           "layer runs while its GPU branch computes (true), or first "
                                           "with one host round trip fewer (false). Default: the "
                                           "faster one measured by the calibration, else true.")
    decode_threads: Optional[int] = Field(None, ge=1, description="CPU threads for one-token decode "
                                          "steps with the expert engine (prefill keeps n_threads). "
                                          "Default: the calibration's fastest, else n_threads.")
    decode_graph: Optional[bool] = Field(None, description="Decode graph: decode steps and short "
                                         "split-path prefills run as one CUDA graph per GPU (route op "
                                         "on the GPU, CPU branch on a resident thread pool). Default: "
                                         "on when the expert pool is on a GPU; false turns it off.")
    prefill_cpu_split: bool = Field(False, description="Experimental (off: slower and not stable on "
                                    "the H200 runs, docs/engine.md \"Pool views and the hybrid upload pass\"): the "
                                    "prefill after a tool output uses the CPU as a second path: per layer, "
                                    "the cold experts with the fewest routes are computed by the CPU "
                                    "branch's own kernel while the others are uploaded, as many as the cost "
                                    "model (the calibration's CPU-branch bandwidth and pinned host->GPU "
                                    "bandwidth) says finish no later than those uploads. Needs a calibration "
                                    "or load probe and a pool on a GPU; false (default) uploads every cold "
                                    "expert. A non-zero upload_cpu_share replaces it (measurements).")
    prefill_prefetch: bool = Field(True, description="Prefetch for long prefills: the next layers' "
                                   "routers applied to this layer's input predict their experts, whose "
                                   "copies then start early (prefill_prefetch_depth layers ahead). Adds "
                                   "staging regions to the pool (the planner reserves them). Measured "
                                   "on the H200 (one layer ahead): TTFT "
                                   "after a tool output 0.149 s against 0.201 s without "
                                   "(docs/benchmarks/runs/2026-11-30-engines-h200-L48-ab).")
    prefill_prefetch_depth: int = Field(2, ge=1, le=2, description="Layers ahead the prefill "
                                        "prefetch predicts: 1 (the next layer) or 2 (the next two; a "
                                        "layer's predicted set is the union of both predictions, and "
                                        "its copies may start two layers early). The pool gets "
                                        "depth + 1 staging regions (the planner reserves them). "
                                        "Measured on the H200 at a 45% pool, one run: TTFT after a "
                                        "tool output 0.146 s at depth 2 against 0.153 s at depth 1, "
                                        "but 127.8 against 126.4 ms per such prefill in the engine "
                                        "(3.5% more bytes copied, fewer misses): no clear winner "
                                        "(docs/benchmarks/runs/"
                                        "2026-12-01-engines-h200-16c-L48-prefetch2-headline).")

    _no_bool_numbers = field_validator("*", mode="before")(_reject_bool_numbers)


# Settings that lived at the top level before the [engine] table: still read there (env and file),
# moved into it with one warning naming the new place.
ENGINE_KEYS = tuple(EngineSettings.model_fields)

class Settings(BaseSettings):
    """Ostinato daemon settings (file + env ``OSTINATO_*``)."""

    model_config = SettingsConfigDict(env_prefix="OSTINATO_", env_nested_delimiter="__", extra="forbid",
                                      validate_assignment=True)

    # --- HTTP front end -------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the HTTP API binds. Keep 127.0.0.1 unless an "
                      "agent runs in a container (OpenHands): then e.g. 0.0.0.0 together with api_key.")
    port: int = Field(8385, ge=0, le=65535, description="TCP port of the HTTP API (0 picks a free one).")
    api_key: Optional[str] = Field(None, description="If set, every /v1 request must carry it as "
                                   "'Authorization: Bearer KEY' or 'x-api-key: KEY'. Give it in the "
                                   "environment (OSTINATO_API_KEY), settings.toml or api_key_file, "
                                   "never on the command line (other users can read process arguments).")
    api_key_file: Optional[Path] = Field(None, description="File holding the API key (first line); "
                                         "it must not be readable by group or others (chmod 600).")
    http_max_connections: int = Field(512, ge=1, description="HTTP connections open at once; more "
                                      "are closed at once (each holds a file descriptor).")
    http_header_timeout_s: float = Field(10.0, ge=0, description="A connection whose request "
                                         "headers are not complete within this many seconds of its "
                                         "start, or of a later request's first bytes, is closed "
                                         "(slow or half-open clients; 0: no limit).")
    http_body_timeout_s: float = Field(60.0, gt=0, description="A request body must arrive within "
                                       "this many seconds, else 408 request_timeout.")
    http_body_min_rate: int = Field(1024, ge=0, description="A request body must arrive at this many "
                                    "bytes per second at least, measured from 2 s after its "
                                    "headers, else 408 request_timeout and the connection is closed; "
                                    "at the connection cap the bodies furthest behind this rate are "
                                    "closed first (0: no minimum).")
    http_keepalive_timeout_s: float = Field(15.0, gt=0, description="A kept-alive connection "
                                            "idle this many seconds after its last answer is closed "
                                            "(clients reconnect; idle connections cannot hold the "
                                            "connection cap).")
    cors: bool = Field(False, description="Answer CORS preflight requests and accept any Origin "
                       "header (browser clients). Needs api_key: without one a start is refused "
                       "(any web page could use the model) unless allow_cors_without_key.")
    allow_cors_without_key: bool = Field(False, description="Start with cors = true and no api_key "
                                         "(any web page the user opens can call the model and read "
                                         "its answers).")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names accepted in the "
                                     "Host and Origin headers besides IP addresses, loopback names, "
                                     "host.docker.internal and the bound address ('*' accepts any). "
                                     "Other names get 403: this blocks DNS rebinding.")
    allow_open_bind: bool = Field(False, description="Start even when 'host' is not a loopback "
                                  "address and no api_key is set (anyone who can reach the port can "
                                  "use the model). Without it such a start is refused.")

    # --- model ----------------------------------------------------------------------------
    model: Optional[Path] = Field(None, description="GGUF file to serve. Unset: a generated demo MoE "
                                  "model with random weights (created on first start).")
    model_alias: Optional[str] = Field(None, description="Name under which the model is listed by "
                                       "/v1/models (default: the file name without .gguf).")
    any_model_name: bool = Field(False, description="Serve a request whatever model name it gives, "
                                 "as llama-server does (scripts and tools written for it send names "
                                 "such as gpt-3.5-turbo). Off: a name that is not the served model's "
                                 "is answered 404 model_not_found.")
    chat_template: Optional[str] = Field(None, description="Jinja chat template overriding the "
                                         "GGUF's own (a file path or the template text).")
    demo_shape: Literal["tiny", "small"] = Field("small", description="Shape of the generated demo "
                                                 "model: 'tiny' (CI-sized) or 'small'.")
    demo_max_tokens: int = Field(48, ge=0, description="With the generated demo model (random "
                                 "weights, served when no model is set): an answer ends, as a finished "
                                 "turn, after this many tokens whatever the client asked, so agents "
                                 "complete their turns. 0: no cap.")
    demo_end_bias: float = Field(8.0, ge=0, le=100, description="With the generated demo model: "
                                 "logit bias added to its end-of-turn token, so answers end after a few "
                                 "words (random weights almost never choose it). 0: none.")

    # --- engine ---------------------------------------------------------------------------
    n_ctx: int = Field(131072, ge=256, description="Context length per slot in tokens. The default is "
                       "what agents assume when not told (128K-131K; Claude Code's compact window is at "
                       "least 100K). Clamped to the model's training context, and lowered (logged, "
                       "reported by /v1/models) when the KV cache of n_slots such contexts does not fit "
                       "in the memory the model and its expert pool leave.")
    n_slots: int = Field(2, ge=1, le=16, description="KV sequences kept at once. The main agent "
                         "session and its side requests (titles, subagents) each keep their prefix.")
    cache_ram_mb: Optional[int] = Field(None, ge=0, description="Host-memory prefix cache (MiB): a "
                                        "slot's KV state is kept in RAM when another conversation takes "
                                        "the slot and put back when its session returns (like "
                                        "llama-server's --cache-ram). Unset: 1/8 of the RAM, at most "
                                        "8192; 0: off.")
    cache_disk_mb: int = Field(4096, ge=0, description="Prefix cache on disk (MiB, under the state dir's "
                               "prefix-cache/): the states of the host-memory cache, of slots idle for 20 s and "
                               "of every slot at shutdown are written there in the background, keyed by "
                               "the model file and the exact "
                               "token prefix, so an agent session's prefix is reused after the daemon "
                               "restarts. 0: off.")
    n_batch: int = Field(2048, ge=32, le=65536, description="Logical batch size for prefill (tokens).")
    n_ubatch: int = Field(0, ge=0, le=65536, description="Physical batch (ubatch) size for prefill (tokens): the "
                          "tokens of one forward pass. 0: chosen at load: with an expert pool on a GPU the largest "
                          "of 512-4096 (up to n_batch) whose compute buffers fit beside the KV cache, since every "
                          "pass uploads its cold experts once; else 512.")
    n_threads: Optional[int] = Field(None, ge=1, description="CPU threads for the CPU branch and "
                                     "host-side compute (default: one per CPU of cpu_set's choice).")
    cpu_set: Optional[str] = Field(None, description="CPUs of the engine worker: a Linux cpulist "
                                   "('0-15,32-47': pinned to those), 'all' (every physical core, not "
                                   "pinned) or unset/'auto': on a host with several NUMA nodes the "
                                   "physical cores of the node(s) the GPUs hang on, pinned; with one "
                                   "node its physical cores, not pinned. The choice is logged and kept "
                                   "in the hardware profile (host.cpu_placement).")
    n_gpu_layers: int = Field(-1, description="Layers whose dense weights and KV cache go to the GPU "
                              "(-1: all that fit; 0: CPU only).")
    flash_attn: Optional[bool] = Field(None, description="Force flash attention on/off (default: auto).")
    n_cpu_moe: int = Field(0, ge=0, description="Keep the expert tensors of the first N layers in host "
                           "memory (llama.cpp's --n-cpu-moe; the 'stock' baseline of the benchmarks).")
    engine_mode: Literal["subprocess", "inprocess"] = Field("subprocess", description="Run the "
                                                           "engine worker in a supervised subprocess "
                                                           "(survives crashes) or in-process.")
    worker_ping_timeout_s: float = Field(10.0, ge=0, description="Liveness check of the engine "
                                         "worker process: one that does not answer a ping within "
                                         "this many seconds (stopped, wedged) is killed and "
                                         "restarted (0: no check).")
    deterministic: bool = Field(False, description="Reproducible greedy outputs (evaluations): one "
                                "sequence per forward pass, prompt chunks at fixed positions, the last "
                                "prompt token alone, cached prefixes reused by whole chunks only. "
                                "Costs throughput with several clients; see docs/reliability.md.")
    max_tokens_default: int = Field(4096, ge=1, description="Output tokens when a request sets none.")
    max_schema_nodes: int = Field(8000, ge=1, description="A request's tool definitions and "
                                  "response schema may hold at most this many JSON objects and arrays; "
                                  "more is refused with 400 schema_too_large.")
    max_schema_properties: int = Field(256, ge=1, description="An object in a request's tool "
                                       "definitions or response schema may have at most this many "
                                       "properties; more is refused with 400 schema_too_large (the "
                                       "grammar of one object costs far more than linear in them: "
                                       "1,000 take about 8 s).")
    max_pattern_depth: int = Field(16, ge=1, description="Groups in a regex pattern (JSON schema "
                                   "'pattern' of tools and response formats) or a GBNF grammar may nest "
                                   "this deep; deeper is refused with 400 grammar_too_complex.")
    max_pattern_ambiguity: int = Field(24, ge=1, description="Adjacent repetitions in one sequence of "
                                       "a pattern or grammar, each counting 1 + its alternatives "
                                       "([abc]* 2, (a|b|c)* 4): the grammar sampler's work per token "
                                       "grows steeply with it (64 adjacent (a|b|c)* stall it for "
                                       "minutes); more is refused with 400 grammar_too_complex.")
    max_pattern_star_height: int = Field(3, ge=1, description="Repetitions nested in one another in a "
                                         "pattern or grammar; more is refused with 400 "
                                         "grammar_too_complex.")
    max_pattern_expansion: int = Field(4096, ge=1, description="Grammar elements of a pattern (or of "
                                       "one grammar rule) once counted repetitions x{m,n} are expanded; "
                                       "more is refused with 400 grammar_too_complex.")
    max_pattern_length: int = Field(2048, ge=1, description="Characters of one regex pattern; longer "
                                    "is refused with 400 grammar_too_complex.")
    grammar_token_timeout_s: float = Field(2.0, gt=0, description="Sampling one token under a "
                                           "request's grammar may take this many seconds; a request "
                                           "over it ends with the error grammar_too_slow and the engine "
                                           "goes on serving the others.")
    engine_stall_timeout_s: float = Field(15.0, ge=0, description="One step of the engine loop "
                                          "(a forward pass, sampling a token) may take this many "
                                          "seconds; past it the request in that step fails with "
                                          "engine_stalled, the worker is restarted and the other "
                                          "requests run again (0: no bound). /health says 'stalled' "
                                          "after a third of it.")
    prefill_chunk_target_s: float = Field(0.5, gt=0, description="While other requests generate, a "
                                          "long prompt is prefilled in chunks sized so that one step "
                                          "takes about this long (their tokens come between the "
                                          "chunks); alone it is prefilled one ubatch per step "
                                          "(smaller only where one would take half of "
                                          "engine_stall_timeout_s).")
    template_timeout_s: float = Field(5.0, gt=0, description="Rendering a request's chat template, "
                                      "grammar and prompt tokens may take this many seconds; longer is "
                                      "refused with 400 template_timeout (other requests are served "
                                      "meanwhile).")
    temperature: float = Field(0.8, ge=0, le=2, description="Sampling temperature of requests that "
                               "set none (0: greedy).")
    top_p: float = Field(0.95, ge=0, le=1, description="Top-p (nucleus) sampling of requests that set "
                         "none (1: off).")
    top_k: int = Field(40, ge=0, description="Top-k sampling of requests that set none (0: off).")
    min_p: float = Field(0.05, ge=0, le=1, description="Min-p sampling of requests that set none "
                         "(0: off).")
    seed: Optional[int] = Field(None, ge=0, le=0xFFFFFFFF, description="Sampling seed of requests "
                                "that set none (llama-server's --seed). Unset: a random seed for each "
                                "request.")

    # --- experts (Ostinato paths) ---------------------------------------------------------
    experts: Literal["auto", "ostinato", "stock"] = Field("auto", description="'ostinato': resident "
                                                          "expert pool with split/upload paths; 'stock': "
                                                          "llama.cpp's own placement; 'auto': ostinato "
                                                          "for supported MoE architectures.")
    residency: Optional[Path] = Field(None, description="Residency set file to load (default: the "
                                      "planned set for the model and workload, if any).")
    expert_budget_frac: Optional[float] = Field(None, gt=0, le=1, description="Fraction of expert "
                                                "bytes the expert pool may hold (emulates a smaller "
                                                "card). Default: what free GPU memory allows.")
    expert_budget_mb: Optional[int] = Field(None, ge=0, description="Expert pool budget in MiB per "
                                            "GPU (overrides expert_budget_frac).")
    prefill_threshold: Optional[int] = Field(None, ge=1, description="Np: forward passes with at "
                                             "least this many tokens take the upload path. Default: "
                                             "from the calibration in the hardware profile.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="The expert engine's "
                                   "tuning: the [engine] table (see the engine.* rows).")
    workload_default: str = Field("coding", description="Workload of requests that name none and "
                                  "come from no known client.")
    max_workloads: int = Field(16, ge=1, description="Workload names learnt from requests "
                               "(x-ostinato-workload, a model's @suffix, known clients) besides "
                               "workload_default; each gets routing traces and a residency set. "
                               "Requests naming further ones are served as workload_default (logged "
                               "once).")
    residency_auto_switch: bool = Field(True, description="Swap residency sets by themselves at "
                                        "request boundaries: to the planned set of a request's "
                                        "workload when it differs from the active set's, and to a "
                                        "re-planned set of the active workload. Off: sets change "
                                        "only on an explicit switch (control API, TUI key w).")
    replan_idle_s: int = Field(300, ge=0, description="Re-plan residency sets in the background "
                               "after the daemon has been idle this many seconds and a workload's "
                               "traces have moved (0: never).")
    replan_growth: float = Field(0.25, gt=0, description="A workload's traces have moved when they "
                                 "hold this fraction more routes than its residency set was planned "
                                 "from (0.25: 25% more).")

    # --- scheduling / prompts -------------------------------------------------------------
    neutralize_volatile: bool = Field(True, description="Blank per-request volatile lines (Claude "
                                      "Code's x-anthropic-billing-header) in system prompts so "
                                      "the prefix cache survives between turns.")

    # --- logging --------------------------------------------------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    recent_requests: int = Field(200, ge=1, description="Requests kept for the control API's "
                                 "recent-requests list.")

    _no_bool_numbers = field_validator("*", mode="before")(_reject_bool_numbers)

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError("api_key is empty: set a key, or leave it unset to run without one")
        return v

    @model_validator(mode="before")
    @classmethod
    def _old_engine_keys(cls, data: Any) -> Any:
        # a file, env var or override using a key from before the [engine] table keeps working
        if not isinstance(data, dict):
            return data
        old = [k for k in data if k in ENGINE_KEYS]
        if not old:
            return data
        data = dict(data)
        eng = data.get("engine") or {}
        eng = dict(eng) if isinstance(eng, dict) else eng.model_dump(exclude_unset=True)
        for k in old:
            v = data.pop(k)
            eng.setdefault(k, v)   # the [engine] table's own value wins
        data["engine"] = eng
        import logging

        logging.getLogger("ostinatod.settings").warning(
            "settings %s moved to the [engine] table (settings.toml: [engine] %s = ...; env: "
            "OSTINATO_ENGINE__<NAME>); read from the old place", ", ".join(old), old[0])
        return data

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _OldEngineEnv(settings_cls), _TomlSource(settings_cls))


SETTINGS_MAX_BYTES = 1 << 20  # a settings file is a few KiB; a bigger one is a mistake


class SettingsError(MessageError, ValueError):
    """Settings that cannot be used; the message is one line naming the file, key or cause."""

    code, status = "invalid_settings", 400




class _OldEngineEnv(PydanticBaseSettingsSource):
    """``OSTINATO_<NAME>`` of an engine setting from before the [engine] table (now
    ``OSTINATO_ENGINE__<NAME>``): read as before; :meth:`Settings._old_engine_keys` moves it."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        import os

        return {k: os.environ[f"OSTINATO_{k.upper()}"] for k in ENGINE_KEYS if f"OSTINATO_{k.upper()}" in os.environ}


class _TomlSource(PydanticBaseSettingsSource):
    """Reads ``settings.toml`` from the config dir (missing file: no values). A syntax error or an
    unknown key (a typo such as ``apikey``) raises SettingsError naming it."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = get_paths().settings_file
        if not path.exists():
            return {}
        if not path.is_file():  # a device (/dev/zero) or a folder would be read forever or fail
            raise SettingsError(f"{path}: not a regular file")
        try:
            with open(path, "rb") as f:
                raw = f.read(SETTINGS_MAX_BYTES + 1)
            if len(raw) > SETTINGS_MAX_BYTES:
                raise SettingsError(f"{path}: larger than {SETTINGS_MAX_BYTES} bytes; not a settings file")
            data = tomllib.loads(raw.decode("utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"{path}: not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise SettingsError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except RecursionError:
            raise SettingsError(f"{path}: nests too deeply to be a settings file") from None
        except OSError as e:
            raise SettingsError(f"{path}: cannot be read: {e.strerror or e}") from None
        unknown = [k for k in data if k not in self.settings_cls.model_fields and k not in ENGINE_KEYS]
        if unknown:
            import difflib

            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, list(self.settings_cls.model_fields), n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise SettingsError(f"{path}: unknown setting{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(hints)}")
        return data


def read_api_key_file(path: Path) -> str:
    """The API key in ``path`` (first line). Raises SettingsError when the file is missing, empty
    or readable by group or others (it must be chmod 600)."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as e:
        raise SettingsError(f"api_key_file {p}: cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if mode & 0o077:
        raise SettingsError(f"api_key_file {p}: readable by others (mode {mode & 0o777:o}); chmod 600 it")
    key = (text.splitlines() or [""])[0].strip()
    if not key:
        raise SettingsError(f"api_key_file {p}: empty")
    return key


def load_settings(**overrides: Any) -> Settings:
    """Build the settings from overrides > env > file > defaults. Invalid values raise
    ValidationError; an unreadable or unknown-keyed settings.toml or a bad api_key_file raise
    SettingsError. ``api_key_file`` fills ``api_key`` when no key is given otherwise."""
    s = Settings(**{k: v for k, v in overrides.items() if v is not None})
    if s.api_key_file is not None and not s.api_key:
        s = s.model_copy(update={"api_key": read_api_key_file(s.api_key_file)})
    return s


def settings_markdown() -> str:
    """Markdown table of all settings (docs/settings.md is generated from this)."""
    rows = ["| setting | env | default | description |", "|---|---|---|---|"]
    for name, f in Settings.model_fields.items():
        if name == "engine":   # the [engine] table: a row per field
            for ename, ef in EngineSettings.model_fields.items():
                default = ef.get_default(call_default_factory=True)
                default = default if default is not None else "(unset)"
                rows.append(f"| `engine.{ename}` | `OSTINATO_ENGINE__{ename.upper()}` | `{default}` | "
                            f"{ef.description} |")
            continue
        default = f.get_default(call_default_factory=True)
        default = default if default is not None else "(unset)"
        rows.append(f"| `{name}` | `OSTINATO_{name.upper()}` | `{default}` | {f.description} |")
    return "\n".join(rows) + "\n"
