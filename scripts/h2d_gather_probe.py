"""Zero-copy gather probe (development aid, GPU machine): a kernel that reads scattered 884,736-byte
chunks (one Q4_0 expert matrix of the Qwen3-30B-A3B shape) from pinned host memory over PCIe into
device memory, for several grid sizes, against cudaMemcpyAsync per chunk (the upload path today).
CUDA events; prints one JSON object (GB/s)."""
import json

import cupy as cp
import torch

N = 6 << 30
CHUNK = 884_736
TOTAL = 5_600_000_000
src = torch.empty(N, dtype=torch.uint8).pin_memory()
dst = cp.empty(N, dtype=cp.uint8)
n = TOTAL // CHUNK
slots = torch.randperm(N // CHUNK, generator=torch.Generator().manual_seed(0))[:n].tolist()
srcs = cp.asarray([src.data_ptr() + s * CHUNK for s in slots], dtype=cp.uint64)
dsts = cp.asarray([dst.data.ptr + i * CHUNK for i in range(n)], dtype=cp.uint64)
ker = cp.RawKernel(r'''
extern "C" __global__ void gather(const unsigned long long * srcs, const unsigned long long * dsts,
                                  long long chunk16, int n) {
    for (int c = blockIdx.x; c < n; c += gridDim.x) {
        const uint4 * s = (const uint4 *) srcs[c];
        uint4 * d = (uint4 *) dsts[c];
        for (long long i = threadIdx.x; i < chunk16; i += blockDim.x) d[i] = s[i];
    }
}''', "gather")
out = {}
for blocks, threads in ((66, 512), (132, 512), (264, 512), (528, 512), (1056, 256)):
    for _ in range(2):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        ker((blocks,), (threads,), (srcs, dsts, cp.int64(CHUNK // 16), cp.int32(n)))
        b.record(); b.synchronize()
        ms = cp.cuda.get_elapsed_time(a, b)
    out[f"gather_{blocks}x{threads}"] = {"ms": round(ms, 1), "gbps": round(n * CHUNK / ms / 1e6, 1)}
print(json.dumps(out))
