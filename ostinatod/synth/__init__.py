"""Synthetic MoE GGUF models: real llama.cpp architectures, a real tokenizer, random weights and
content-dependent, skewed expert routing (the demo model of the daemon, the tests, the benchmarks).

- :mod:`.shapes`: shapes, architectures, quant types, the routing knobs;
- :mod:`.vocab`: the tokenizer and the class of every token;
- :mod:`.quants`: quant recipes (type per tensor and layer) and random valid blocks of every type;
- :mod:`.tensors`: random quant blocks, the routing signal, the plans of qwen3moe, deepseek2, gpt-oss;
- :mod:`.archs`: the plans of glm4moe, minimax-m2, qwen35moe, deepseek4 and the registry ``PLANS``;
- :mod:`.writer`: :func:`~.writer.write_synthetic_moe` (the method is in its docstring);
- :mod:`.routing`: route counts and the routing report (``ostinato synth --report``).

The command line is :mod:`ostinatod.synth.cli`.
"""
