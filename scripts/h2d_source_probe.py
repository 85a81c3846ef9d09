"""H2D copy rate by kind of pinned host memory (development aid, GPU machine).

The upload path copies cold experts from host memory that is pinned one of two ways: llama.cpp's
mmap of the GGUF file, registered with cudaHostRegister (4 KiB page-cache pages; what the engine does
by default), or a pinned allocation (cudaHostAlloc, what llama.cpp's CUDA_Host buffers are when the
weights are not mmap-ed). Same pattern for each source as scripts/h2d_2d_probe.py (a layer's three
expert tensors adjacent, 44 distinct experts per layer, 16 layers = 1.87 GB per pass; one copy per
matrix or one 2D copy per expert), also from anonymous memory (malloc, registered). Copies queued
behind a GPU sleep; CUDA events. Prints one JSON object."""
import ctypes
import json
import mmap
import os

import cupy as cp
import numpy as np
import torch

M = 884_736
NE, LAYERS, PER_LAYER, SLOTS = 128, 16, 44, 160
SIZE = LAYERS * 3 * NE * M
H2D = cp.cuda.runtime.memcpyHostToDevice
dev = cp.empty(3 * SLOTS * M, dtype=cp.uint8)
dp = dev.data.ptr
gen = torch.Generator().manual_seed(0)
picks = [sorted(torch.randperm(NE, generator=gen)[:PER_LAYER].tolist()) for _ in range(LAYERS)]


def timed(issue, hp):
    s = torch.cuda.current_stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    a.record(s)
    issue(hp, s.cuda_stream)
    b.record(s)
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def three_1d(hp, sp):
    for l, ids in enumerate(picks):
        for slot, e in enumerate(ids):
            for t in range(3):
                cp.cuda.runtime.memcpyAsync(dp + (t * SLOTS + slot) * M, hp + ((l * 3 + t) * NE + e) * M, M, H2D, sp)


def one_2d(hp, sp):
    for l, ids in enumerate(picks):
        for slot, e in enumerate(ids):
            cp.cuda.runtime.memcpy2DAsync(dp + slot * M, SLOTS * M, hp + (l * 3 * NE + e) * M, NE * M, M, 3, H2D, sp)


def measure(hp):
    out = {}
    for name, fn in (("three_1d", three_1d), ("one_2d", one_2d)):
        ms = min(timed(fn, hp) for _ in range(3))
        out[name] = {"ms": round(ms, 2), "gbps": round(LAYERS * PER_LAYER * 3 * M / ms / 1e6, 1)}
    return out


res = {"bytes_per_pass": LAYERS * PER_LAYER * 3 * M}
# cudaHostAlloc (torch's pinned allocator)
pinned = torch.empty(SIZE, dtype=torch.uint8).pin_memory()
res["host_alloc"] = measure(pinned.data_ptr())
print(json.dumps(res), flush=True)
del pinned


def register(addr):
    # ggml's flags (cudaHostRegisterPortable | cudaHostRegisterReadOnly), else Portable alone
    try:
        cp.cuda.runtime.hostRegister(addr, SIZE, 1 | 8)
    except cp.cuda.runtime.CUDARuntimeError:
        cp.cuda.runtime.hostRegister(addr, SIZE, 1)
# a file's mmap, registered (what the engine pins today)
path = "/tmp/h2d_source_probe.bin"
with open(path, "wb") as f:
    chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    for _ in range(SIZE // len(chunk) + 1):
        f.write(chunk)
fd = os.open(path, os.O_RDWR)
mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
register(addr)
res["mmap_registered"] = measure(addr)
print(json.dumps(res), flush=True)
cp.cuda.runtime.hostUnregister(addr)
os.close(fd)
os.remove(path)
# anonymous memory, registered
anon = np.ones(SIZE, dtype=np.uint8)
register(anon.ctypes.data)
res["anon_registered"] = measure(anon.ctypes.data)
cp.cuda.runtime.hostUnregister(anon.ctypes.data)
print(json.dumps(res))
