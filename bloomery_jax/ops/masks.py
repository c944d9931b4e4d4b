"""Attention masks over a KV cache whose slot ``s`` holds the key of position ``s``.

Sliding-window attention (Gemma 2/3 local layers, llama.cpp's ``LLAMA_SWA_TYPE_STANDARD``): a
query at position ``p`` sees the keys at positions ``s`` with ``s <= p`` and ``p - s < window``,
i.e. the last ``window`` positions including its own. llama.cpp masks the pair when
``p - s >= n_swa``; Hugging Face's ``sliding_window`` has the same meaning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .attention import causal_mask


def sliding_window_mask(q_pos: jax.Array, kv_len: jax.Array, n_slots: int, window: int) -> jax.Array:
    """bool ``[B, T, S]``: may the query at ``q_pos[b, t]`` see slot ``s`` under a sliding window.

    Args:
      q_pos: int32 ``[B, T]`` query positions.
      kv_len: int32 ``[B]`` filled slots per sequence (after this step's writes).
      n_slots: S, the cache length.
      window: how many positions (the query's own included) a query sees; ``<= 0`` means no
        window, the plain causal mask.
    Returns:
      bool ``[B, T, S]``; every query with ``0 <= q_pos < kv_len`` sees at least its own slot.
    """
    mask = causal_mask(q_pos, kv_len, n_slots)  # [B, T, S]
    if window <= 0:
        return mask
    s = jnp.arange(n_slots, dtype=jnp.int32)  # [S]
    near = (q_pos[:, :, None].astype(jnp.int32) - s[None, None, :]) < window  # [B, T, S]
    return mask & near
