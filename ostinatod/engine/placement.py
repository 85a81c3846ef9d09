"""Layer placement of the expert engine: the placement config of a load, the GPU of every layer,
and llama.cpp's ``tensor_split`` that puts each layer's dense weights on the GPU of its pool.

Pure functions (numpy only); tested without GPUs through :func:`simulate_layer_split`.
"""

from __future__ import annotations

import bisect
from typing import Any, Optional

import numpy as np

from ..residency.sets import ResidencyError, ResidencySet


def experts_config(hot: dict[int, list[int]], *, device: int = -1, prefill_threshold: int = 512,
                   force_path: str = "auto", layer_device: Optional[dict[int, int]] = None
                   ) -> dict[str, Any]:
    """The expert engine's placement for a model load (:func:`ostinatod.engine.native.load_model`)
    or a swap (:func:`ostinatod.engine.native.experts_switch`), as the native engine reads it.

    ``hot`` is {layer: hot expert ids}. ``device``: GPU index of the pool (-1: a CPU pool, as on
    CPU-only builds). ``layer_device`` (several GPUs): {layer: GPU index}; one pool per GPU in use,
    layers not named go to ``device``. Empty/None: one pool on ``device`` (the one-GPU config). On a
    GPU build the load then fails unless each layer's dense weights sit on its GPU (see
    :func:`tensor_split_for`); on a CPU build every pool is a CPU buffer.
    """
    cfg: dict[str, Any] = {"hot": {str(k): list(map(int, v)) for k, v in hot.items()},
                           "device": int(device), "prefill_threshold": int(prefill_threshold),
                           "force_path": force_path}
    if layer_device:  # absent for a one-GPU config: the native engine then takes today's path
        cfg["layer_device"] = {str(k): int(v) for k, v in sorted(layer_device.items())}
    return cfg


def check_devices(devices: list[int], n_gpus: int, where: str = "") -> None:
    """Refuse a residency set naming a GPU this machine does not have: ``devices`` (the set's GPU
    indexes, :attr:`ResidencySet.devices`) must be below ``n_gpus``, the GPUs llama.cpp sees
    (:func:`ostinatod.engine.native.gpu_count`; counted as the native engine counts them). With no
    GPU (a CPU build, ``n_gpus`` 0) every pool is a CPU buffer and any index is accepted: that is
    how CI runs the several-GPU code. Raises ResidencyError naming the GPUs that exist."""
    missing = [d for d in devices if d >= n_gpus] if n_gpus > 0 else []
    if missing:
        have = "GPU 0" if n_gpus == 1 else f"GPUs 0..{n_gpus - 1}"
        raise ResidencyError(f"{where}the residency set names GPU {', '.join(map(str, missing))}, but this "
                             f"machine has {n_gpus} GPU{'s' if n_gpus > 1 else ''} ({have})")


def full_layer_devices(res: ResidencySet, n_layer: int) -> list[int]:
    """GPU index of each layer 0..n_layer-1 for a residency set (from its ``gpus`` entries).

    A layer named by no entry takes the GPU of the layer before it (the first named layer's GPU for
    leading ones). Raises ResidencyError unless the GPUs hold contiguous layer ranges in ascending
    GPU order: that is the only placement llama.cpp's layer split (split_mode LAYER) can give the
    dense weights, and each layer's pool must be on its dense weights' GPU.
    """
    named = res.layer_devices()
    if not named:
        d = res.devices[0] if res.devices else 0
        return [d] * n_layer
    cur = named[min(named)]
    out = []
    for il in range(n_layer):
        cur = named.get(il, cur)
        out.append(cur)
    for il in range(1, n_layer):
        if out[il] < out[il - 1]:
            raise ResidencyError(
                f"{res.path or 'residency set'}: layer {il} is on GPU {out[il]} after layer {il - 1} on "
                f"GPU {out[il - 1]}: each GPU must hold one contiguous layer range, in GPU order "
                "(llama.cpp's layer split); plan the set again with 'ostinato plan'")
    return out


def tensor_split_for(layer_dev: list[int], n_devices: int, n_gpu_layers: int = -1) -> list[float]:
    """llama.cpp ``tensor_split`` (``n_devices`` floats, sum 1) with which its layer split
    (split_mode LAYER) puts layer ``il`` on GPU ``layer_dev[il]`` (the output layer on the last
    GPU that has layers).

    Mirrors ``llama_model::load_tensors``: with ``n_gpu_layers`` g (-1 = all, i.e. n_layer + 1,
    the output counted), layers ``il >= start = max(n_layer + 1 - g, 0)`` go to GPU
    ``upper_bound(cumsum(split) / sum, (il - start) / act)`` with ``act = min(g, n_layer + 1)``;
    layers below ``start`` stay on the CPU (their entry is ignored). Each split point is put half a
    layer before the next GPU's first layer, so float rounding cannot move a boundary. Raises
    ValueError when the layers are not contiguous ranges in ascending GPU order or a GPU index is
    outside ``0..n_devices-1``. :func:`simulate_layer_split` is the check.
    """
    n = len(layer_dev)
    g = n + 1 if n_gpu_layers < 0 else int(n_gpu_layers)
    start, act = max(n + 1 - g, 0), min(g, n + 1)
    gl = list(layer_dev[start:])
    if any(not 0 <= d < n_devices for d in gl):
        raise ValueError(f"layer GPUs {sorted(set(gl))} outside 0..{n_devices - 1}")
    if any(b < a for a, b in zip(gl, gl[1:])):
        raise ValueError("each GPU must hold one contiguous layer range, in GPU order")
    if act <= 0 or not gl:
        return [0.0] * n_devices
    last = gl[-1]
    points = []
    for d in range(n_devices):
        if d >= last:
            points.append(1.0)
            continue
        b = next(i for i, x in enumerate(gl) if x > d)  # first GPU layer (offset) beyond GPU d
        points.append(max(0.0, (b - 0.5) / act))
    return [points[0]] + [points[i] - points[i - 1] for i in range(1, n_devices)]


def simulate_layer_split(tensor_split: list[float], n_layer: int, n_gpu_layers: int = -1) -> list[int]:
    """Device index per layer 0..n_layer (the last entry is the output layer; -1 = CPU) as
    llama.cpp's layer split computes it from ``tensor_split`` (float32, as in C++), for checking
    :func:`tensor_split_for` without GPUs."""
    nd = len(tensor_split)
    g = n_layer + 1 if n_gpu_layers < 0 else int(n_gpu_layers)
    start, act = max(n_layer + 1 - g, 0), min(g, n_layer + 1)
    splits = np.zeros(nd, dtype=np.float32)
    acc = np.float32(0)
    for i, x in enumerate(tensor_split):
        acc = np.float32(acc + np.float32(x))
        splits[i] = acc
    splits = [float(x) for x in (splits / acc).astype(np.float32)]
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= act:
            out.append(-1)
        else:
            x = np.float32(il - start) / np.float32(act)
            out.append(min(bisect.bisect_right(splits, float(x)), nd - 1))
    return out
