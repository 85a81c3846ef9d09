"""H2D rate of the upload path's 2D copies by destination pitch (development aid, GPU machine).

One 2D copy per expert (height 3: up, gate, down; 884,736 bytes each; host pitch 128 x that, as
llama.cpp's file layout gives), 44 experts per layer x 16 layers (1.87 GB per pass), into device
memory whose three rows are `dpitch` bytes apart: the pool's class tensors put them one tensor size
apart (about 2.45 GB at a 45% pool on the 48-layer Qwen3-30B-A3B shape at Q4_0). Against one copy
per matrix. Copies queued behind a GPU sleep; CUDA events. Prints one JSON object."""
import json

import cupy as cp
import torch

M = 884_736
NE, LAYERS, PER_LAYER = 128, 16, 44
H2D = cp.cuda.runtime.memcpyHostToDevice
host = torch.empty(LAYERS * 3 * NE * M, dtype=torch.uint8).pin_memory()
hp = host.data_ptr()
gen = torch.Generator().manual_seed(0)
picks = [sorted(torch.randperm(NE, generator=gen)[:PER_LAYER].tolist()) for _ in range(LAYERS)]
total = LAYERS * PER_LAYER * 3 * M


def timed(issue):
    s = torch.cuda.current_stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    a.record(s)
    issue(s.cuda_stream)
    b.record(s)
    torch.cuda.synchronize()
    return a.elapsed_time(b)


out = {"bytes_per_pass": total, "max_pitch": cp.cuda.runtime.deviceGetAttribute(11, 0)}  # 11: cudaDevAttrMaxPitch
for dpitch in (160 * M, 1 << 30, (1 << 31) - (1 << 22), (1 << 31) + (1 << 22), 2_450_000_000 // M * M):
    dev = cp.empty(2 * dpitch + PER_LAYER * M, dtype=cp.uint8)
    dp = dev.data.ptr

    def one_2d(sp):
        for l, ids in enumerate(picks):
            for slot, e in enumerate(ids):
                cp.cuda.runtime.memcpy2DAsync(dp + slot * M, dpitch, hp + (l * 3 * NE + e) * M, NE * M, M, 3, H2D, sp)

    def three_1d(sp):
        for l, ids in enumerate(picks):
            for slot, e in enumerate(ids):
                for t in range(3):
                    cp.cuda.runtime.memcpyAsync(dp + t * dpitch + slot * M, hp + ((l * 3 + t) * NE + e) * M, M, H2D, sp)

    row = {}
    for name, fn in (("one_2d", one_2d), ("three_1d", three_1d)):
        try:
            ms = min(timed(fn) for _ in range(3))
            row[name] = {"ms": round(ms, 2), "gbps": round(total / ms / 1e6, 1)}
        except cp.cuda.runtime.CUDARuntimeError as e:
            row[name] = {"error": str(e)}
    out[f"dpitch_{dpitch}"] = row
    print(json.dumps(out), flush=True)
    del dev
