"""H2D copy rate of the upload path's pattern (development aid, GPU machine): many copies of one
expert matrix of the 48-layer Qwen3-30B-A3B shape at Q4_0 (884,736 bytes) or of a whole expert
(3 x that) from pinned host memory at scattered offsets, on one or two streams, against one large
copy. The copies are queued behind a GPU sleep so that the timing (CUDA events) is the copy engine's,
not the host's issue rate. Prints one JSON object (GB/s, ms)."""
import json

import torch

N = 6 << 30
TOTAL = 5_600_000_000   # about one 354-token prefill's uploads at a 45% pool (bench JSON mean_counts)
src = torch.empty(N, dtype=torch.uint8).pin_memory()
dst = torch.empty(N, dtype=torch.uint8, device="cuda")
gen = torch.Generator().manual_seed(0)


def timed(copies, streams=1):
    ss = [torch.cuda.Stream() for _ in range(streams)]
    gate = torch.cuda.Event()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(3_000_000_000)   # ~1.5 s: every copy is queued before the first runs
    gate.record()
    for s in ss:
        s.wait_event(gate)
    a.record(ss[0])
    for s in ss[1:]:
        s.wait_event(a)
    for i, (o, d, n) in enumerate(copies):
        with torch.cuda.stream(ss[i % streams]):
            dst[d:d + n].copy_(src[o:o + n], non_blocking=True)
    for s in ss[1:]:
        ss[0].wait_stream(s)
    b.record(ss[0])
    torch.cuda.synchronize()
    return a.elapsed_time(b)


out = {}
for _ in range(2):
    ms = timed([(0, 0, TOTAL)])
out["one_copy_gbps"] = round(TOTAL / ms / 1e6, 1)
for chunk in (884_736, 3 * 884_736):
    n = TOTAL // chunk
    slots = torch.randperm(N // chunk, generator=gen)[:n].tolist()
    copies = [(slots[i] * chunk, i * chunk, chunk) for i in range(n)]
    for streams in (1, 2):
        for _ in range(2):
            ms = timed(copies, streams)
        out[f"chunk_{chunk}_streams_{streams}"] = {"copies": n, "ms": round(ms, 1),
                                                   "gbps": round(n * chunk / ms / 1e6, 1)}
print(json.dumps(out))
