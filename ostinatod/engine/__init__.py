"""The engine: native build, ctypes bindings, engine worker, scheduler and engine clients.

Layers above (HTTP front end, protocol adapters, control API) talk to it only through
:class:`ostinatod.engine.types.EngineClient` and the request/event types in that module.
"""


def _preload_libstdcxx() -> None:
    """Put libstdc++ into the process's global symbol scope before llama_cpp loads its libraries.

    llama-cpp-python loads libllama and the ggml backends with RTLD_GLOBAL. A CUDA build's
    libggml-cuda.so carries copies of some libstdc++ template instantiations (std::ostream
    inserters); when it precedes libstdc++ in the global scope, libllama's calls bind to those copies
    and crash (seen on the H200 machine: SIGSEGV in llama_model::print_info during the model load,
    and earlier in a library's static initialisers). Loading libstdc++ first restores the normal
    binding, as LD_PRELOAD=libstdc++.so.6 did there. No-op where it is not found (macOS: libc++).
    """
    import ctypes
    import ctypes.util
    import sys

    if "llama_cpp" in sys.modules or not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass


_preload_libstdcxx()
