"""How peaked a synthetic model's next-token distributions are, by our own forward pass.

Contract: :func:`mean_max_prob` loads a file with ``models.loader.load_model``, runs the
architecture's ``forward`` over a few seeded random tokens of one sequence, and returns the
mean over positions of the largest softmax probability (uniform would be 1/V).
"""

from __future__ import annotations

import numpy as np


def mean_max_prob(path, n_positions: int = 16, seed: int = 0) -> float:
    """Mean over ``n_positions`` positions of max_v p(v | prefix), from our forward pass.

    Args:
      path: a GGUF file of a registered architecture.
      n_positions: length of the random token sequence.
      seed: picks the tokens.
    Returns:
      the mean max-probability, a float in (0, 1].
    """
    import jax
    import jax.numpy as jnp

    from ..models.loader import load_model

    model = load_model(path)
    n_vocab = model.cfg.n_vocab
    tokens = np.random.default_rng(seed).integers(0, n_vocab, (1, n_positions)).astype(np.int32)  # [B=1, T]
    positions = np.arange(n_positions, dtype=np.int32)[None]  # [1, T]
    cache = model.init_cache(1, n_positions)
    logits, _, _ = model.module.forward(model.params, model.cfg, tokens, positions, cache)  # [1, T, V]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return float(jnp.mean(jnp.max(probs, axis=-1)))
