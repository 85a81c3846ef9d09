"""H2D copy rate of whole experts in llama.cpp's layout (development aid, GPU machine).

A layer's routed experts live in three host tensors (down, gate, up: each n_expert matrices of
884,736 bytes, Q4_0 of the 48-layer Qwen3-30B-A3B shape), adjacent in the GGUF file, so an expert's
three matrices sit at one pitch (n_expert x 884,736 bytes) from each other; the pool's three class
tensors are adjacent too (pitch: slots x 884,736 bytes). Copies 44 distinct experts per layer x 48
layers (about 5.6 GB, one 354-token prefill's uploads at a 45% pool) from pinned host memory:
  three_1d:   one cudaMemcpyAsync per matrix (the upload path today)
  one_2d:     one cudaMemcpy2DAsync per expert (width one matrix, height 3, the two pitches)
  runs_1d:    experts sorted by id into consecutive slots, one cudaMemcpyAsync per matrix per run of
              consecutive ids
  runs_2d:    the same, one cudaMemcpy2DAsync per run
queued behind a GPU sleep so that CUDA events time the copy engine. Prints one JSON object."""
import json

import cupy as cp
import torch

M = 884_736
NE, LAYERS, PER_LAYER, SLOTS = 128, 48, 44, 160
H2D = cp.cuda.runtime.memcpyHostToDevice
host = torch.empty(LAYERS * 3 * NE * M, dtype=torch.uint8).pin_memory()
dev = cp.empty(3 * SLOTS * M, dtype=cp.uint8)
hp, dp = host.data_ptr(), dev.data.ptr
gen = torch.Generator().manual_seed(0)
picks = [sorted(torch.randperm(NE, generator=gen)[:PER_LAYER].tolist()) for _ in range(LAYERS)]


def runs(ids):
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append((start, a - start + 1))
            start = b
    return out


def timed(issue):
    s = torch.cuda.current_stream()
    sp = s.cuda_stream
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(3_000_000_000)
    a.record(s)
    n = issue(sp)
    b.record(s)
    torch.cuda.synchronize()
    return a.elapsed_time(b), n


def three_1d(sp):
    n = 0
    for l, ids in enumerate(picks):
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(l)).tolist()
        for slot, j in enumerate(order):
            for t in range(3):
                cp.cuda.runtime.memcpyAsync(dp + (t * SLOTS + slot) * M, hp + ((l * 3 + t) * NE + ids[j]) * M,
                                            M, H2D, sp)
                n += 1
    return n


def sorted_copies(two_d, merge_runs):
    """Experts sorted by id into consecutive slots; one copy per run of consecutive ids (merge_runs)
    or per expert; per matrix (1D) or one 2D copy (height 3) for the three."""
    def issue(sp):
        n = 0
        for l, ids in enumerate(picks):
            slot = 0
            for e, r in (runs(ids) if merge_runs else [(e, 1) for e in ids]):
                if two_d:
                    cp.cuda.runtime.memcpy2DAsync(dp + slot * M, SLOTS * M, hp + (l * 3 * NE + e) * M, NE * M,
                                                  r * M, 3, H2D, sp)
                    n += 1
                else:
                    for t in range(3):
                        cp.cuda.runtime.memcpyAsync(dp + (t * SLOTS + slot) * M, hp + ((l * 3 + t) * NE + e) * M,
                                                    r * M, H2D, sp)
                        n += 1
                slot += r
        return n
    return issue


total = LAYERS * PER_LAYER * 3 * M
out = {"bytes": total}
for name, fn in (("three_1d", three_1d), ("one_2d", sorted_copies(True, False)),
                 ("runs_1d", sorted_copies(False, True)), ("runs_2d", sorted_copies(True, True))):
    for _ in range(2):
        ms, n = timed(fn)
    out[name] = {"copies": n, "ms": round(ms, 1), "gbps": round(total / ms / 1e6, 1)}
print(json.dumps(out))
