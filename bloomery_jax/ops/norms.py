"""RMSNorm in ggml's order of operations.

ggml (``ggml_compute_forward_rms_norm_f32`` followed by ``ggml_mul``) computes, per row,
``mean = sum(x*x) / n``, ``scale = 1 / sqrt(mean + eps)``, ``y = x * scale`` and only then
multiplies by the weight. Doing the same steps in the same order keeps us within a few ulp
of llama.cpp; folding ``weight * scale`` first would differ by a rounding at every element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMS-normalise the last axis of ``x`` and scale by ``weight``.

    Args:
      x: float ``[..., D]``; computed in float32 whatever its dtype.
      weight: ``[D]``.
      eps: added to the mean of squares (``attention.layer_norm_rms_epsilon``).
    Returns:
      float32 ``[..., D]``.
    """
    x = x.astype(jnp.float32)
    mean_sq = jnp.mean(x * x, axis=-1, keepdims=True)  # [..., 1]
    scale = 1.0 / jnp.sqrt(mean_sq + jnp.float32(eps))
    return (x * scale) * weight.astype(jnp.float32)
