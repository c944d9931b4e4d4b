"""Synthetic GGUF models for tests: random weights of a real architecture plus a real tokenizer.

    from bloomery_jax.synth import synthesize
    report = synthesize("m.gguf", arch="qwen3moe", qtype="Q4_K_M", seed=0, twin_path="m.f32.gguf")

Modules: ``core`` (the generic writer), one plug-in per architecture (``qwen3moe``), ``policy``
(ggml type per tensor), ``weights`` (init and route skew), ``blocks`` (random quant blocks, the
fast path), ``writer`` (streaming GGUF output), ``vocab`` (the tokenizer), ``report``.
CLI: ``python -m bloomery_jax.synth --help``.
"""

from .core import synthesize
from .report import SynthReport

__all__ = ["synthesize", "SynthReport"]
