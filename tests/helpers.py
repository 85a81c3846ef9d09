"""Helpers shared by tests of several folders: a control server in a thread, metadata-only GGUF
writers, a JSON POST that returns the status and body whatever the status."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

from ostinatod.control.server import start_control_server


class ControlThread:
    """A control server for ``state_factory()`` in a background event loop (started/stopped by
    the caller). ``run(coro)`` executes a coroutine in that loop (e.g. to mutate the state)."""

    def __init__(self, state_factory):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.state = self.run(self._mk(state_factory))
        self.runner = self.run(start_control_server(self.state))
        self.socket = self.state.paths.control_socket

    async def _mk(self, factory):
        return factory()

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def recording_control_server() -> ControlThread:
    """A control server over a fresh DaemonState (settings from the environment) whose reload
    records the paths the API asked to load in ``.loads`` (the daemon sets reload; here the test
    reads what was asked) and names the model after the file. Stop it with ``.stop()``."""
    from ostinatod.server.state import DaemonState
    from ostinatod.settings import load_settings

    loads: list = []

    def factory():
        st = DaemonState(settings=load_settings())

        async def reload(path):
            loads.append(path)
            st.model_info = {"path": str(path), "name": Path(path).stem} if path else {}
        st.reload = reload
        return st
    t = ControlThread(factory)
    t.loads = loads
    return t


def write_tiny_gguf(path: Path) -> Path:
    """A minimal valid GGUF file (header + one tensor) written with the gguf package."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_moe_gguf(path: Path, n_layer: int = 6, n_expert: int = 16, k: int = 4, n_embd: int = 32,
                   n_ff: int = 16) -> Path:
    """A metadata-complete qwen3moe-shaped GGUF (no vocabulary, random tensors) that the planner
    and the fingerprint read in milliseconds. Not runnable by llama.cpp (no tokenizer)."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(path.stem)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(k)
    w.add_expert_feed_forward_length(n_ff)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.random((100, n_embd), dtype=np.float32))
    for l in range(n_layer):
        w.add_tensor(f"blk.{l}.attn_q.weight", rng.random((n_embd, n_embd), dtype=np.float32))
        w.add_tensor(f"blk.{l}.ffn_gate_inp.weight", rng.random((n_expert, n_embd), dtype=np.float32))
        for n in ("gate", "up"):
            w.add_tensor(f"blk.{l}.ffn_{n}_exps.weight",
                         rng.random((n_expert, n_ff, n_embd), dtype=np.float32).astype(np.float16))
        w.add_tensor(f"blk.{l}.ffn_down_exps.weight",
                     rng.random((n_expert, n_embd, n_ff), dtype=np.float32).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def post(url: str, body: bytes, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    """POST ``body`` (JSON bytes) to ``url``: the status and the decoded JSON answer, whatever the status."""
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
