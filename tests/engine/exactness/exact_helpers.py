"""Exactness of the Ostinato expert paths against stock llama.cpp (same build), on the CPU: the
harness of the tests in tests/engine/exactness/ (test_exact_*.py import their fixtures from here).

Tiny synthetic qwen3moe and deepseek2 models (ostinatod.synth) with a residency set that makes about half of the experts hot:
greedy generation after a prompt on each path (decode; split path, n < Np; upload path, n >= Np via
a small forced Np) must give the same tokens as stock llama.cpp with all experts in host memory.
On a CPU-only build the pool is a CPU buffer: this still exercises the index tables, zero slots,
skipped routes and the sum of both branches. Max |delta logit| per path is printed (pytest -s).
The fixtures ``moe`` and ``stock`` are session-wide (the stock reference is generated once per
architecture whichever test module asks first); the shared Ostinato runner is freed after each module.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from ostinatod.engine import native, placement  # noqa: E402
from ostinatod.engine.options import split_fields  # noqa: E402
from ostinatod.residency.sets import model_block  # noqa: E402
from ostinatod.settings import EngineSettings  # noqa: E402

if not native.experts_available():  # pragma: no cover - stale build
    pytest.skip("native engine built without the expert engine (run 'ostinato build')",
                allow_module_level=True)

PROMPT_LEN, N_NEW = 24, 8
# OSTINATO_TEST_GPU=1 (GPU machine only): dense layers on GPU 0 in both runs; the stock reference
# keeps every routed expert in host memory (n_cpu_moe = all layers), Ostinato puts its pool on GPU 0.
# Hot experts then run CUDA kernels (activations quantised to q8_1) where the reference runs the CPU's
# (q8_0), so logits get a tolerance there; the greedy tokens must still be identical.
GPU = os.environ.get("OSTINATO_TEST_GPU") == "1"
# GPUs of the machine for the two-pool load test (OSTINATO_TEST_GPUS=2 on a machine with >= 2 GPUs)
N_GPUS = int(os.environ.get("OSTINATO_TEST_GPUS", "1"))
TOL = 0.25 if GPU else 1e-3


ARCHS = ("qwen3moe", "deepseek2", "gpt-oss")
# the daemon's pool layout (setting pool_whole_expert_slots); the native library's own default is off
WHOLE_SLOTS = EngineSettings.model_fields["pool_whole_expert_slots"].default


# The options of the shared runners' engine and of the next Runner load: the library's defaults with
# the daemon's pool layout; _opt changes both (a test's options then hold for the pools it builds, by
# a load or a switch, as for the engine running now).
_NEXT = [native.library_options().with_(pool_whole_expert_slots=WHOLE_SLOTS)]


def _opt(**changes):
    """Change the engine's options (native.reconfigure, when an engine is active) and those of the
    next Runner load. ValueError (pydantic's) for a value EngineOptions refuses."""
    _NEXT[0] = _NEXT[0].with_(**changes)
    if native.experts_active():
        native.configure(**changes)


@pytest.fixture(autouse=True)
def _daemon_pool_layout():
    """Every test builds its pools with the daemon's layout, and with the prefill and decode
    prefetch off (the native defaults) unless it turns them on: the shared runners' engine keeps its
    options from test to test, so without this a test's layout and paths would depend on the tests
    that ran before it (a GPU failure of the decode prefetch on deepseek4 showed only after a
    runtime test had left it on)."""
    _opt(pool_whole_expert_slots=WHOLE_SLOTS, prefetch_depth=0, decode_prefetch_experts=0)
    yield


def _moe_layers(arch, n_layer):
    """MoE layer ids of a synthetic model (deepseek2 starts with dense layers). Taken from the
    writer's shape rather than the GGUF: parsing a 150k-token vocabulary takes seconds."""
    from ostinatod.synth.shapes import SHAPES
    first = SHAPES["tiny"].n_layer_dense_lead if arch == "deepseek2" else 0
    return list(range(first, n_layer))


@pytest.fixture(scope="session", params=ARCHS)
def moe(request):
    """(path, model block, MoE layer ids) of a tiny synthetic model per architecture (q8_0 experts)."""
    from ostinatod.synth.writer import synthetic_model

    from conftest import CACHE
    CACHE.mkdir(parents=True, exist_ok=True)
    p = synthetic_model(CACHE, arch=request.param, shape="tiny")
    m = model_block(p)
    return p, m, _moe_layers(m["arch"], m["n_layer"])


def half_hot(moe, seed=1):
    """Half of each MoE layer's experts hot (a fixed random choice): {layer: expert ids}."""
    rng = np.random.default_rng(seed)
    n = moe[1]["n_expert"]
    return {il: sorted(rng.choice(n, n // 2, replace=False).tolist()) for il in moe[2]}


class Runner:
    """Loads the model with the low-level API and generates greedily; returns tokens and logits."""

    def __init__(self, path, hot=None, prefill_threshold=512, force="auto", all_logits=False, rt=None,
                 tensor_split=None, cb_eval=None):
        # all_logits: every token is an output, so llama.cpp does not prune the last layer to the
        # output rows and every MoE layer sees every token of the pass
        # rt: an ExpertRuntime from prepare() (it configured the loader; the runner loads and attaches)
        # tensor_split (GPU, stock reference): llama.cpp's layer split with these weights
        # cb_eval: a llama_cpp.ggml_backend_sched_eval_callback, called for every node in compute order
        self.all_logits = all_logits
        llama_cpp.llama_backend_init()
        cfg = None  # the placement passed with the load (None: stock)
        if rt is None and hot is not None:
            cfg = placement.experts_config(hot, device=0 if GPU else -1,
                                           prefill_threshold=prefill_threshold, force_path=force)
        mp = llama_cpp.llama_model_default_params()
        # stock reference: everything in host memory; with a config the patched loader keeps the
        # routed experts in host memory and (GPU) puts the pool and the dense layers on the GPU
        mp.n_gpu_layers = 999 if GPU else 0
        if GPU and hot is None:
            mp.tensor_buft_overrides = native.fn("ostinato_n_cpu_moe_overrides")(999)
        mp.use_extra_bufts = False  # both runs: same CPU kernels (see ExpertRuntime.adjust_model_params)
        if tensor_split is not None:
            import ctypes
            self._ts = (ctypes.c_float * len(tensor_split))(*tensor_split)
            mp.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
            mp.tensor_split = ctypes.cast(self._ts, ctypes.POINTER(ctypes.c_float))
        if rt is not None:
            self.model = rt.load(path, mp)  # adjusts mp, loads with its placement, checks the pool
        else:
            self.model, _, _ = native.load_model(path, mp, cfg, _NEXT[0] if cfg else None)
        assert self.model, "model load failed"
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 64, 32, 32
        cp.n_threads = cp.n_threads_batch = 1  # spinning thread barriers crawl on a busy 2-core CI box
        if cb_eval is not None:
            self._cb_eval = cb_eval  # kept alive with the context
            cp.cb_eval = cb_eval
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(32, 0, 1)

    def _decode(self, toks, pos0):
        b = self.batch
        b.n_tokens = len(toks)
        for i, t in enumerate(toks):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (self.all_logits or i == len(toks) - 1) else 0
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def generate(self, prompt, n_new):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        logits = [self._decode(prompt, 0)]
        out = []
        pos = len(prompt)
        for _ in range(n_new):
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            logits.append(self._decode([tok], pos))
            pos += 1
        return out, np.stack(logits)

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def _prompt(n, seed=3):
    return np.random.default_rng(seed).integers(100, 20000, n).tolist()


_STOCK: dict = {}  # model path -> the stock reference (one per architecture for the whole session)


@pytest.fixture(scope="session")
def stock(moe):
    """{prompt length: (greedy tokens, logits)} of stock llama.cpp, all experts in host memory."""
    # each test module imports this fixture (one definition per module): computed once all the same
    if moe[0] not in _STOCK:
        drop_ost()
        r = Runner(moe[0])
        try:
            assert not native.experts_active()
            _STOCK[moe[0]] = {n: r.generate(_prompt(n), N_NEW) for n in (PROMPT_LEN, 4)}
        finally:
            r.close()
    return _STOCK[moe[0]]


def _stats(with_counts=0):
    return json.loads(native.llama_fn("ostinato_experts_stats")(with_counts).decode())


# One Ostinato-loaded model at a time (the engine is process-global): tests share it and change
# Np, the forced path and the residency set at run time, which also tests those switches.
_OST: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _free_shared_runner():
    yield
    drop_ost()


def ost_runner(moe):
    """The shared Ostinato runner of this architecture (half of the experts hot, Np = 512)."""
    arch = moe[1]["arch"]
    if arch not in _OST:
        drop_ost()
        _OST[arch] = Runner(moe[0], hot=half_hot(moe), prefill_threshold=512)
    return _OST[arch]


def drop_ost():
    """Free the shared runner (before a test loads a model of its own)."""
    for r in _OST.values():
        r.close()
    _OST.clear()


def _switch(hot, layer_device=None):
    cfg = {"hot": {str(k): v for k, v in hot.items()}, "device": 0 if GPU else -1}
    if layer_device:
        cfg["layer_device"] = {str(k): v for k, v in layer_device.items()}
    native.experts_switch(cfg)  # raises ExpertEngineError with the native error


def _every_path_matches(r, ref_toks, decode_prefetch=0):
    """Greedy tokens of runner ``r`` equal ``ref_toks`` on the split path, the upload path (Np 8),
    the upload path with the cost model's CPU share (its CPU part on the CPU branch's kernel where
    the graph matches) and the decode graph, with both branches doing work in each; with
    ``decode_prefetch`` > 0 also the decode graph with that many experts staged per layer (the pool
    needs prefetch depth 2 at its build). Restores Np, the split and the graph and decode prefetch
    settings. Returns the stats of the last pass."""
    split = {"alpha_us": 0.0, "cpu_gbps": 10.0, "h2d_gbps": 10.0}
    passes = [(512, None, None, 0), (8, None, None, 0), (8, None, split, 0), (512, True, None, 0)]
    if decode_prefetch:
        passes.append((512, True, None, decode_prefetch))
    try:
        for np_tokens, graph, cpu_split, dpf in passes:
            _opt(prefill_threshold=np_tokens)
            _opt(decode_graph=graph)
            _opt(**split_fields(cpu_split))
            _opt(decode_prefetch_experts=dpf)
            native.llama_fn("ostinato_experts_reset_stats")()
            toks, _ = r.generate(_prompt(PROMPT_LEN), N_NEW)
            st = _stats()
            assert toks == ref_toks, (np_tokens, graph, cpu_split, dpf)
            assert 0 < st["hot_routes"] < st["routes"], st   # both branches did work
        return st
    finally:
        _opt(decode_prefetch_experts=0)
        _opt(**split_fields(None))
        _opt(decode_graph=None)
        _opt(prefill_threshold=512)
