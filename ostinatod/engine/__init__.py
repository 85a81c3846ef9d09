"""The engine: the worker process and its clients (docs/architecture.md has the map).

- clients (daemon side): :mod:`.client` (SubprocessEngine, InProcessEngine), :mod:`.protocol` (the
  worker pipe), :mod:`.types` (GenRequest, EngineError, EngineClient), :mod:`.events` (the typed events), :mod:`.stats` (typed stats and model facts), :mod:`.supervisor` (SubprocessEngine);
- the worker process: :mod:`.worker_main`, :mod:`.worker` (the loop), :mod:`.loading`,
  :mod:`.slots`, :mod:`.task`, :mod:`.text`, :mod:`.sampling`, :mod:`.switcher`, :mod:`.runtime`,
  :mod:`.placement`, :mod:`.chat`, :mod:`.native` (the one ctypes loader);
- :mod:`.calibrate` (``ostinato calibrate``: drives a Worker in its own process). The native build
  (``ostinato build``) is :mod:`ostinatod.build`: it runs before any engine exists.

Layers above (HTTP front end, protocol adapters, control API) talk to it only through
:class:`ostinatod.engine.types.EngineClient` and the request/event types in that module.
"""

import ctypes
import ctypes.util
import sys


def _preload_libstdcxx() -> None:
    """Put libstdc++ into the process's global symbol scope before llama_cpp loads its libraries.

    llama-cpp-python loads libllama and the ggml backends with RTLD_GLOBAL. A CUDA build's
    libggml-cuda.so carries copies of some libstdc++ template instantiations (std::ostream
    inserters); when it precedes libstdc++ in the global scope, libllama's calls bind to those copies
    and crash (seen on the H200 machine: SIGSEGV in llama_model::print_info during the model load,
    and earlier in a library's static initialisers). Loading libstdc++ first restores the normal
    binding, as LD_PRELOAD=libstdc++.so.6 did there. No-op where it is not found (macOS: libc++).
    """
    if "llama_cpp" in sys.modules or not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass


_preload_libstdcxx()
