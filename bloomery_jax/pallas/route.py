"""Softmax top-k routing in one kernel: what ``ops.routing.route_topk`` computes with a softmax,
a sort and a gather (three to four kernels a layer on the GPU).

Contract: ``route_topk(router_logits [N, E], k) -> (experts int32 [N, k], weights float32 [N, k],
margin float32 [N])``, as ``ops.routing.route_topk``: the k experts of largest logit, best
first (equal logits: the lower id first, as ``jax.lax.top_k``); their softmax probabilities
divided by their sum (clamped below at ``WEIGHT_SUM_MIN``); the k-th minus the (k+1)-th largest
logit (+inf when k == E). The softmax is monotonic, so ranking logits ranks probabilities; the
reference ranks the rounded probabilities, so two logits within a rounding of each other may be
ordered differently (a near-tie, which ``margin`` flags). Weights match to a few ulps (the sums
run in another order).

How: a Pallas kernel (Triton lowering) per block of tokens holds the block's logits (experts
padded to a power of two with -inf), takes the maximum and the sum of exponentials, then picks
k + 1 times the largest remaining logit and masks it out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..ops.routing import WEIGHT_SUM_MIN

F32 = jnp.float32
__all__ = ["route_topk"]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(l_ref, e_ref, w_ref, m_ref, *, k: int, n_exp: int):
    # l_ref [TN, Ep] logits (padding -inf); e_ref, w_ref [TN, Kp]; m_ref [TN]
    logits = l_ref[...].astype(F32)
    tn, ep = logits.shape
    kp = e_ref.shape[1]
    ids = jax.lax.broadcasted_iota(jnp.int32, (tn, ep), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (tn, kp), 1)
    top = jnp.max(logits, axis=1)  # [TN]
    z = jnp.sum(jnp.exp(logits - top[:, None]), axis=1)  # [TN] softmax denominator
    experts = jnp.zeros((tn, kp), jnp.int32)
    probs = jnp.zeros((tn, kp), F32)
    total = jnp.zeros((tn,), F32)
    remaining, last = logits, top
    for j in range(k):
        best = jnp.max(remaining, axis=1)  # [TN]
        pick = jnp.min(jnp.where(remaining == best[:, None], ids, ep), axis=1)  # lowest id among equals
        p = jnp.exp(best - top) / z
        experts = jnp.where(slot == j, pick[:, None], experts)
        probs = jnp.where(slot == j, p[:, None], probs)
        total = total + p
        remaining = jnp.where(ids == pick[:, None], -jnp.inf, remaining)
        last = best
    e_ref[...] = experts
    w_ref[...] = probs / jnp.maximum(total, WEIGHT_SUM_MIN)[:, None]
    m_ref[...] = last - jnp.max(remaining, axis=1) if k < n_exp else jnp.full((tn,), jnp.inf, F32)


@functools.partial(jax.jit, static_argnames=("k", "block_tokens", "interpret"))
def route_topk(router_logits: jax.Array, k: int, *, block_tokens: int = 16,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Choose k experts per token (module docstring).

    Args:
      router_logits: float ``[N, E]``.
      k: experts per token, ``0 < k <= E``.
      block_tokens: tokens per program (rounded to a power of two, at most N's).
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      experts int32 ``[N, k]``, weights float32 ``[N, k]``, margin float32 ``[N]``.
    """
    N, E = router_logits.shape
    if not 0 < k <= E:
        raise ValueError(f"cannot route to {k} of {E} experts")
    tn = min(_pow2(block_tokens), _pow2(N))
    n_pad = pl.cdiv(N, tn) * tn
    ep, kp = _pow2(E), _pow2(k)
    logits = jnp.pad(router_logits.astype(F32), ((0, n_pad - N), (0, ep - E)), constant_values=-jnp.inf)
    logits = logits.at[N:].set(0.0)  # padding tokens: finite, discarded
    rows = lambda width: pl.BlockSpec((tn, width), lambda i: (i, 0))
    experts, weights, margin = pl.pallas_call(
        functools.partial(_kernel, k=k, n_exp=E),
        out_shape=(jax.ShapeDtypeStruct((n_pad, kp), jnp.int32), jax.ShapeDtypeStruct((n_pad, kp), F32),
                   jax.ShapeDtypeStruct((n_pad,), F32)),
        grid=(n_pad // tn,),
        in_specs=[rows(ep)],
        out_specs=(rows(kp), rows(kp), pl.BlockSpec((tn,), lambda i: (i,))),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="route_topk",
    )(logits)
    return experts[:N, :k], weights[:N, :k], margin[:N]
