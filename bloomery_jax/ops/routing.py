"""Softmax top-k expert routing with renormalised weights (Qwen3-MoE, Mixtral style).

As llama.cpp's ``build_moe_ffn`` with softmax gating and ``norm_w``: softmax over all
experts, pick the k largest probabilities, divide them by their sum (clamped below at
6.103515625e-5, the smallest normal f16, as llama.cpp does to avoid dividing by zero).

The margin between the k-th and (k+1)-th router logit is returned too: where it is tiny, a
rounding difference between two implementations can swap the chosen expert, so
comparisons against another engine exclude such near-ties.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WEIGHT_SUM_MIN = 6.103515625e-5


def route_topk(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Choose k experts per token.

    Args:
      router_logits: float32 ``[N, E]`` (N tokens, E experts).
      k: experts per token.
    Returns:
      experts: int32 ``[N, k]``, best first.
      weights: float32 ``[N, k]``, summing to 1 per token.
      margin: float32 ``[N]``: k-th minus (k+1)-th largest logit (+inf when k == E).
    """
    n_exp = router_logits.shape[-1]
    if not 0 < k <= n_exp:
        raise ValueError(f"cannot route to {k} of {n_exp} experts")
    logits = router_logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)  # [N, E]
    top_p, experts = jax.lax.top_k(probs, k)  # [N, k]
    total = jnp.maximum(jnp.sum(top_p, axis=-1, keepdims=True), jnp.float32(WEIGHT_SUM_MIN))
    weights = top_p / total
    if k < n_exp:
        top_l, _ = jax.lax.top_k(logits, k + 1)  # [N, k+1]
        margin = top_l[:, k - 1] - top_l[:, k]
    else:
        margin = jnp.full(logits.shape[:-1], jnp.inf, jnp.float32)
    return experts.astype(jnp.int32), weights, margin
