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

With ``slot_table`` (``placement.Placement.slot_of``, int32 ``[L, E]``, -1 = host) and ``layer``
it also returns what the card's expert kernels read, ``CardRoute(slots, weights)``: each pick's
card slot (0 where the expert is on the host) and its weight (0 there), which the step otherwise
forms in a kernel of its own (``ops.experts.placed_moe_swiglu``'s lookup).

How: a Pallas kernel (Triton lowering) per block of tokens holds the block's logits (experts
padded to a power of two with -inf), takes the maximum and the sum of exponentials, then picks
k + 1 times the largest remaining logit and masks it out.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..ops.routing import WEIGHT_SUM_MIN

F32 = jnp.float32
__all__ = ["CardRoute", "route_topk"]


class CardRoute(NamedTuple):
    """The card's share of a routing: per pick, its expert's card slot (0 for a host expert) and
    its weight (0 for a host expert), so a host pair adds nothing on the card."""

    slots: jax.Array  # int32 [N, k]
    weights: jax.Array  # float32 [N, k]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(l_ref, *refs, k: int, n_exp: int, placed: bool):
    # l_ref [TN, Ep] logits (padding -inf); placed: t_ref [1, Ep] the layer's slots (padding -1);
    # e_ref, w_ref [TN, Kp]; m_ref [TN]; placed: s_ref, c_ref [TN, Kp] card slots and weights
    if placed:
        t_ref, e_ref, w_ref, m_ref, s_ref, c_ref = refs
    else:
        e_ref, w_ref, m_ref = refs
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
    table = t_ref[...] if placed else None  # [1, Ep]
    slots = jnp.zeros((tn, kp), jnp.int32)
    for j in range(k):
        best = jnp.max(remaining, axis=1)  # [TN]
        pick = jnp.min(jnp.where(remaining == best[:, None], ids, ep), axis=1)  # lowest id among equals
        p = jnp.exp(best - top) / z
        experts = jnp.where(slot == j, pick[:, None], experts)
        if placed:  # the pick's card slot, -1 = host
            slots = jnp.where(slot == j, jnp.max(jnp.where(ids == pick[:, None], table, -1), axis=1)[:, None], slots)
        probs = jnp.where(slot == j, p[:, None], probs)
        total = total + p
        remaining = jnp.where(ids == pick[:, None], -jnp.inf, remaining)
        last = best
    weights = probs / jnp.maximum(total, WEIGHT_SUM_MIN)[:, None]
    e_ref[...] = experts
    w_ref[...] = weights
    m_ref[...] = last - jnp.max(remaining, axis=1) if k < n_exp else jnp.full((tn,), jnp.inf, F32)
    if placed:
        s_ref[...] = jnp.maximum(slots, 0)
        c_ref[...] = jnp.where(slots >= 0, weights, 0.0)


@functools.partial(jax.jit, static_argnames=("k", "layer", "block_tokens", "interpret"))
def route_topk(router_logits: jax.Array, k: int, slot_table: jax.Array | None = None, layer: int = 0, *,
               block_tokens: int = 16, interpret: bool = False):
    """Choose k experts per token (module docstring).

    Args:
      router_logits: float ``[N, E]``.
      k: experts per token, ``0 < k <= E``.
      slot_table: int32 ``[L, E]`` card slot of each expert, -1 = host; None: no CardRoute.
      layer: the row of ``slot_table`` this routing is for (static).
      block_tokens: tokens per program (rounded to a power of two, at most N's).
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      experts int32 ``[N, k]``, weights float32 ``[N, k]``, margin float32 ``[N]``; with
      ``slot_table`` also a :class:`CardRoute` of ``[N, k]`` arrays.
    """
    N, E = router_logits.shape
    if not 0 < k <= E:
        raise ValueError(f"cannot route to {k} of {E} experts")
    placed = slot_table is not None
    if placed and (slot_table.ndim != 2 or slot_table.shape[1] != E or not 0 <= layer < slot_table.shape[0]):
        raise ValueError(f"route_topk: slot_table must be [L, {E}] with layer in [0, L), got {slot_table.shape} "
                         f"and layer {layer}")
    tn = min(_pow2(block_tokens), _pow2(N))
    n_pad = pl.cdiv(N, tn) * tn
    ep, kp = _pow2(E), _pow2(k)
    logits = jnp.pad(router_logits.astype(F32), ((0, n_pad - N), (0, ep - E)), constant_values=-jnp.inf)
    logits = logits.at[N:].set(0.0)  # padding tokens: finite, discarded
    rows = lambda width: pl.BlockSpec((tn, width), lambda i: (i, 0))
    pick_shapes = (jax.ShapeDtypeStruct((n_pad, kp), jnp.int32), jax.ShapeDtypeStruct((n_pad, kp), F32))
    out_shape = (*pick_shapes, jax.ShapeDtypeStruct((n_pad,), F32)) + (pick_shapes if placed else ())
    out_specs = (rows(kp), rows(kp), pl.BlockSpec((tn,), lambda i: (i,))) + ((rows(kp), rows(kp)) if placed else ())
    operands, in_specs = [logits], [rows(ep)]
    if placed:  # the whole table goes in (a slice of it would be a copy kernel of its own); one row is read
        table = slot_table.astype(jnp.int32)
        if ep != E:
            table = jnp.pad(table, ((0, 0), (0, ep - E)), constant_values=-1)
        operands.append(table)
        in_specs.append(pl.BlockSpec((1, ep), lambda i: (layer, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, k=k, n_exp=E, placed=placed),
        out_shape=out_shape,
        grid=(n_pad // tn,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="route_topk",
    )(*operands)
    experts, weights, margin = out[0][:N, :k], out[1][:N, :k], out[2][:N]
    if not placed:
        return experts, weights, margin
    return experts, weights, margin, CardRoute(out[3][:N, :k], out[4][:N, :k])
