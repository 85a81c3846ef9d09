"""The residency domain: pure Python (numpy, gguf), no llama_cpp, no aiohttp, no engine or server.

- :mod:`.model`: one description of a GGUF model (validation, fingerprint, MoE shape, one cache);
- :mod:`.sets`: residency-set files (``ostinato-residency/1``);
- :mod:`.traces`: routing traces per model and workload (``ostinato-trace/1``);
- :mod:`.planner`: which experts stay resident on each GPU (``ostinato plan``);
- :mod:`.cost`: the paper's cost model, its fits and the prefill switch point;
- :mod:`.calibration`: the stored calibration record (read by the engine);
- :mod:`.gguf_header`: the fast GGUF header reader behind :mod:`.model`.

File locations come from :mod:`ostinatod.paths` (``residency_file``, ``trace_file``).
"""
