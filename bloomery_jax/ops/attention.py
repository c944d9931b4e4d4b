"""Grouped-query attention over a KV cache: the plain jnp reference.

Contract: queries at positions ``q_pos`` attend to the cache slots ``s`` with
``s <= q_pos`` and ``s < kv_len`` (the cache stores the key of position ``p`` in slot ``p``).
Scores and softmax are float32; query head ``h`` reads kv head ``h // (Hq / Hkv)``, the way
ggml broadcasts ``K`` over the query heads in ``ggml_mul_mat``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def causal_mask(q_pos: jax.Array, kv_len: jax.Array, n_slots: int) -> jax.Array:
    """bool ``[B, T, S]``: may the query at ``q_pos[b, t]`` see slot ``s``.

    Args:
      q_pos: int32 ``[B, T]`` query positions.
      kv_len: int32 ``[B]`` filled slots per sequence (after this step's writes).
      n_slots: S, the cache length.
    """
    s = jnp.arange(n_slots, dtype=jnp.int32)  # [S]
    return (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < kv_len[:, None, None])


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Masked softmax attention with grouped kv heads.

    Args:
      q: float32 ``[B, T, Hq, Dh]`` (already normed and rotated).
      k, v: float32 ``[B, S, Hkv, Dh]``: the cache of one layer.
      mask: bool ``[B, T, S]`` from :func:`causal_mask`; every query must see at least one slot.
      scale: multiplies the scores (``1 / sqrt(Dh)`` for Qwen3).
    Returns:
      float32 ``[B, T, Hq, Dh]``.
    """
    B, T, Hq, Dh = q.shape
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} kv heads")
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, Dh)  # [B, T, Hkv, G, Dh]: head h = kv * G + g
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=HIGHEST) * jnp.float32(scale)  # [B, Hkv, G, T, S]
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=HIGHEST)  # [B, T, Hkv, G, Dh]
    return out.reshape(B, T, Hq, Dh)
