"""Decode-step probe (GPU machine, development): ms per decode step of one model under several
placements, in one process, with the low-level llama.cpp API (no daemon, no HTTP, no sampling).

    python3 scripts/decode_probe.py MODEL.gguf [--fracs 1.0,0.45] [--steps 64] [--threads N]

Placements: ``stock-all-gpu`` (every layer and expert on GPU 0), then per hot fraction f the expert
engine with a random f of each layer's experts in the pool, with the decode graph on and off; at
f = 1 also with the all-resident path off (every layer through the route op). Each run also times
prefills of ``--prefill`` tokens (upload path: Np 16). Prints one JSON object (ms/step mean and
median, prefill ms median, hot-route share, CPU-branch ms per step). A development aid to see where
the time goes; the figures to report come from ``ostinato bench engines``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--fracs", default="1.0,0.45")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--device", type=int, default=0, help="the pool's GPU (-1: a CPU pool, for a dry run)")
    a = ap.parse_args()

    import llama_cpp

    from ostinatod.engine import native
    from ostinatod.engine.placement import experts_config
    from ostinatod.residency.sets import model_block

    m = model_block(a.model)
    n_layer, n_expert = m["n_layer"], m["n_expert"]
    llama_cpp.llama_backend_init()
    threads = a.threads or 8

    def run(hot, graph, resident=True):
        cfg = None if hot is None else experts_config(hot, device=a.device, prefill_threshold=16)
        if hot is not None:
            native.set_decode_graph(graph)
            native.set_resident_path(resident)
            native.set_cpu_threads(threads)
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 999 if a.device >= 0 else 0
        mp.use_extra_bufts = False   # the same CPU kernels in every run
        model, _, _ = native.load_model(a.model, mp, cfg)  # the placement for this load only
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 1024, 512, 512
        cp.n_threads = cp.n_threads_batch = threads
        ctx = llama_cpp.llama_init_from_model(model, cp)
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        batch = llama_cpp.llama_batch_init(512, 0, 1)

        def decode(toks, pos0):
            batch.n_tokens = len(toks)
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if i == len(toks) - 1 else 0
            assert llama_cpp.llama_decode(ctx, batch) == 0
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))

        rng_p = np.random.default_rng(3)
        pre = []
        for i in range(4):   # prefills of a fresh context: the after-tool case's upload path
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            toks = rng_p.integers(100, 20000, a.prefill).tolist()
            t0 = time.perf_counter()
            decode(toks, 0)
            pre.append((time.perf_counter() - t0) * 1000)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        prompt = rng_p.integers(100, 20000, 32).tolist()
        logits = decode(prompt, 0)
        if hot is not None:
            native.llama_fn("ostinato_experts_reset_stats")()
        times, pos = [], len(prompt)
        for _ in range(a.steps):
            tok = int(np.argmax(logits))
            t0 = time.perf_counter()
            logits = decode([tok], pos)
            times.append((time.perf_counter() - t0) * 1000)
            pos += 1
        out = {"ms_mean": statistics.mean(times[8:]), "ms_median": statistics.median(times[8:]),
               "prefill_ms_median": statistics.median(pre[1:])}
        if hot is not None:
            st = native.experts_json("ostinato_experts_stats", 0)
            out["hot_route_share"] = round(st["hot_route_share"], 4)
            out["cpu_branch_ms_per_step"] = st["cpu_branch_ms"] / max(1, st["passes"])
            out["decode_graph_passes"] = sum(p.get("decode_graph", False) for p in st["last_passes"])
            out["info_decode_graph"] = native.experts_json("ostinato_experts_info").get("decode_graph")
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
        return out

    res = {"model": a.model, "steps": a.steps, "threads": threads, "prefill_tokens": a.prefill,
           "stock-all-gpu": run(None, None)}
    rng = np.random.default_rng(1)
    for f in [float(x) for x in a.fracs.split(",")]:
        hot = {il: sorted(rng.choice(n_expert, max(1, round(f * n_expert)), replace=False).tolist())
               for il in range(n_layer)}
        for graph in (True, False):
            res[f"ostinato-{f}-graph-{'on' if graph else 'off'}"] = run(hot, graph)
        if f >= 1.0:
            res[f"ostinato-{f}-graph-on-resident-off"] = run(hot, True, resident=False)
        print(json.dumps(res), flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
