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

``router_logits(x, norm, eps, w)`` gives the logits a decode step routes by,
``rms_norm(x, norm, eps) @ w.T``, in one launch: on the GPU the norm's reduction, its multiply
and the router's product were three XLA kernels a layer (~4.9 us of a ~84 us layer on the H100,
benchmarks/gpu_2026-12-05-s16/trace). Program j forms the normed rows of x itself
(``qgemv._NormedRows``: ggml's order of operations) and the logits of experts
``j*block_e ..`` by walking D in chunks. With ``rounded=True`` it also rounds the normed rows to
Q8_1 blocks (``ops.actquant.Q8Act``, what the experts' integer-dot gate/up launch reads) in
programs of their own after the logits' (up to ``ROUND_BLOCKS`` blocks each), which run beside
them: the gate/up launch would norm and round them again in each of its hundreds of programs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..ops.actquant import Q8Act
from ..ops.routing import WEIGHT_SUM_MIN
from .qgemv import _NormedRows
from .qgemv_q8 import round_blocks

F32 = jnp.float32
LOGITS_MAX_ROWS = 8  # rows of x router_logits unrolls (a decode step's tokens)
# router_logits' launch: experts a program and warps (none better at 1-8 of each on an H100,
# benchmarks/gpu_2026-12-07-s29/call1)
LOGITS_BLOCK_E, LOGITS_WARPS = 4, 4
LOGITS_CHUNK = 256  # router_logits walks D in chunks of at most this many columns
ROUND_BLOCKS = 64  # Q8_1 blocks a rounding program of router_logits(..., rounded=True) rounds at most
__all__ = ["CardRoute", "route_topk", "router_logits", "router_logits_rounds", "router_logits_serves"]


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
        # a decode step's one or two rows of 128 logits fit one warp: its k + 1 rounds of max and
        # min reduce by shuffles, with no shared-memory round trip between warps
        compiler_params=plgpu.CompilerParams(num_warps=1 if tn * ep <= 256 else 4, num_stages=1),
        interpret=interpret,
        name="route_topk",
    )(*operands)
    experts, weights, margin = out[0][:N, :k], out[1][:N, :k], out[2][:N]
    if not placed:
        return experts, weights, margin
    return experts, weights, margin, CardRoute(out[3][:N, :k], out[4][:N, :k])


def _logits_chunk(d: int, largest: int = 256) -> int:
    """The D chunk router_logits walks: the largest power of two <= ``largest`` dividing D (0: none >= 16)."""
    c = largest
    while c >= 16 and d % c:
        c //= 2
    return c if c >= 16 else 0


def router_logits_serves(n_rows: int, w) -> bool:
    """``router_logits`` takes these: at most LOGITS_MAX_ROWS rows, a float32 ``[E, D]`` router
    weight held as a plain array, E a multiple of 4 and D of 16."""
    return (1 <= n_rows <= LOGITS_MAX_ROWS and isinstance(w, jax.Array) and w.dtype == F32 and w.ndim == 2
            and w.shape[0] % 4 == 0 and _logits_chunk(w.shape[1]) > 0)


def _logits_kernel(x_ref, n_ref, w_ref, *refs, eps: float, chunk: int, logit_programs: int, bpp: int,
                   interpret: bool):
    # x_ref [N, D] rows of x; n_ref [D] the norm weight; w_ref [BE, D] router rows; refs: o_ref
    # [N, BE], or with bpp (blocks a rounding program rounds) xb_ref [N, D/32, 32] and nb_ref
    # [D/32, 32] (x and the norm as blocks) first, then o_ref and the Q8Act's qs [N, D/32, 8],
    # d [N, D/32] and sums [N, D/32, 2]
    n_rows, d = x_ref.shape
    xn = _NormedRows(x_ref, n_ref, eps, n_rows)
    if not bpp:
        _logits(xn, w_ref, refs[0], n_rows, d, chunk)
        return
    xb_ref, nb_ref, o_ref, qs_ref, d_ref, sums_ref = refs
    j = pl.program_id(0)

    @pl.when(j < logit_programs)
    def _():
        _logits(xn, w_ref, o_ref, n_rows, d, chunk)

    @pl.when(j >= logit_programs)  # the programs after the logits' round the normed rows beside them
    def _():
        blocks = pl.ds(pl.multiple_of((j - logit_programs) * bpp, bpp), bpp)
        half = jax.lax.broadcasted_iota(jnp.int32, (bpp, 2), 1)
        src = xn.on(xb_ref, nb_ref)
        for r in range(n_rows):
            b = round_blocks(src, r, blocks, interpret)
            qs_ref[r, blocks, :] = b.words
            d_ref[r, blocks] = jnp.max(b.d, axis=1)  # [bpp]: the same value in each of a block's words
            sums_ref[r, blocks, :] = jnp.where(half == 0, b.lo, b.hi)


def _logits(xn, w_ref, o_ref, n_rows: int, d: int, chunk: int) -> None:
    """This program's logits: its router rows times the normed rows, walking D in chunks."""
    be = w_ref.shape[0]

    def step(c, accs):
        cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        w = w_ref[:, cols]  # [BE, chunk]
        return tuple(acc + w * xn[b, cols][None, :] for b, acc in enumerate(accs))

    accs = jax.lax.fori_loop(0, d // chunk, step, tuple(jnp.zeros((be, chunk), F32) for _ in range(n_rows)))
    for b, acc in enumerate(accs):
        o_ref[b, :] = jnp.sum(acc, axis=1)


@functools.partial(jax.jit, static_argnames=("eps", "block_e", "num_warps", "chunk", "rounded", "interpret"))
def router_logits(x: jax.Array, norm: jax.Array, eps: float, w: jax.Array, *, block_e: int = LOGITS_BLOCK_E,
                  num_warps: int = LOGITS_WARPS, chunk: int = LOGITS_CHUNK, rounded: bool = False,
                  interpret: bool = False):
    """``ops.norms.rms_norm(x, norm, eps) @ w.T`` in one launch (module docstring).

    Each logit sums D products in chunks of ``c`` columns (one accumulator element a column),
    then the chunk's columns: the sum order differs from a plain dot, so logits agree to
    ~(D / c + c) * 2^-24 * sum_d |xn_d w_d|, and the normed row to a few ulps (c: the largest
    power of two <= ``chunk`` dividing D).

    Args:
      x: float ``[N, D]``, N <= LOGITS_MAX_ROWS.
      norm: float ``[D]``, the RMS-norm weight; eps its epsilon.
      w: float32 ``[E, D]``, the router weight (``router_logits_serves``).
      block_e: experts a program (a power of two dividing E; lowered until it does).
      num_warps: warps a program.
      chunk: columns a loop step reads at most (D itself: the program's rows in one read).
      rounded: also return the normed rows as Q8_1 blocks (``router_logits_rounds`` says
        whether a shape allows it): ``ops.actquant.quantize_q8_1(rms_norm(x, norm, eps))``, up
        to the normed row's last bits (a quant where a value lies within them of a rounding half).
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[N, E]``; with ``rounded``, and a :class:`Q8Act` of ``[N, D]``.
    """
    if x.ndim != 2 or not router_logits_serves(x.shape[0], w) or w.shape[1] != x.shape[1] or norm.shape != (x.shape[1],):
        raise ValueError(f"router_logits: needs x [N<={LOGITS_MAX_ROWS}, D], norm [D] and a float32 router "
                         f"[E, D] (E a multiple of 4, D of 16), got {x.shape}, {norm.shape} and {w.shape} {w.dtype}")
    n_rows, d = x.shape
    n_exp = w.shape[0]
    while n_exp % block_e:
        block_e //= 2
    if rounded and not router_logits_rounds(x.shape, w):  # serves() held above: the rows are not whole blocks
        raise ValueError(f"router_logits: rows of {d} are not Q8_1 blocks of 32 (router_logits_rounds)")
    programs = n_exp // block_e
    nb = d // 32
    bpp = min(nb & -nb, ROUND_BLOCKS) if rounded else 0  # a power of two dividing the blocks
    last = programs - 1  # the rounding programs' (unused) router and logit blocks
    whole = lambda *shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    operands = [x.astype(F32), norm.astype(F32), w]
    in_specs = [whole(n_rows, d), whole(d), pl.BlockSpec((block_e, d), lambda j: (jnp.minimum(j, last), 0))]
    out_shape = [jax.ShapeDtypeStruct((n_rows, n_exp), F32)]
    out_specs = [pl.BlockSpec((n_rows, block_e), lambda j: (0, jnp.minimum(j, last)))]
    if bpp:  # x and the norm again as [D/32, 32] blocks; each rounding program writes its blocks of the whole Q8Act
        operands += [operands[0].reshape(n_rows, nb, 32), operands[1].reshape(nb, 32)]
        in_specs += [whole(n_rows, nb, 32), whole(nb, 32)]
        out_shape += [jax.ShapeDtypeStruct((n_rows, nb, 8), jnp.int32), jax.ShapeDtypeStruct((n_rows, nb), F32),
                      jax.ShapeDtypeStruct((n_rows, nb, 2), jnp.int32)]
        out_specs += [whole(n_rows, nb, 8), whole(n_rows, nb), whole(n_rows, nb, 2)]
    out = pl.pallas_call(
        functools.partial(_logits_kernel, eps=float(eps), chunk=_logits_chunk(d, chunk), logit_programs=programs, bpp=bpp,
                          interpret=interpret),
        out_shape=out_shape,
        grid=(programs + (nb // bpp if bpp else 0),),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="router_logits",
    )(*operands)
    if not bpp:
        return out[0]
    logits, qs, dq, sums = out
    return logits, Q8Act(qs.reshape(n_rows, d // 4), dq, sums.reshape(n_rows, d // 16))


def router_logits_rounds(x_shape: tuple, w) -> bool:
    """``router_logits(..., rounded=True)`` takes x of this shape and this router weight."""
    return router_logits_serves(x_shape[0], w) and w.shape[1] % 32 == 0
