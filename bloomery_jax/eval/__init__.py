"""Evaluation tools every correctness claim rests on: logits files, perplexity, KL divergence.

    python -m bloomery_jax.eval logits --model M.gguf --tokens 1,2,3 --out logits.npy
    python -m bloomery_jax.eval perplexity --model M.gguf --text-file F [--ctx 512] [--kl-base base.npz]

``runner.sequence_logits`` (logits of every position), ``perplexity`` (llama-perplexity's
chunking and the base-logits file format) and ``metrics`` (perplexity, KL statistics) are
the library side of the CLI in ``__main__``.
"""

from .metrics import kl_report, perplexity
from .perplexity import load_base, run_perplexity, save_base
from .runner import sequence_logits

__all__ = ["sequence_logits", "run_perplexity", "save_base", "load_base", "kl_report", "perplexity"]
