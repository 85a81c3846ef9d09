"""Ostinato: a desktop daemon serving MoE GGUF models to local agents.

The engine keeps the experts that agent sessions route to most resident on the GPUs and computes
them there in every forward pass (arXiv 2611.11533); see docs/design.md.
"""

__version__ = "0.1.0"
