"""Decode attention over a KV cache: one query token per sequence, grouped kv heads, split over the cache.

Contract: ``decode_attention(q [B, Hq, Dh], k [R, S, Hkv, Dh], v [R, S, Hkv, Dh], visible [B], scale,
rows=None) -> float32 [B, Hq, Dh]``: query ``b`` attends to the prefix ``s < visible[b]`` of cache
row ``rows[b]`` (default ``rows = arange(B)``, R = B), and equals ``ops.attention.gqa_attention``
of one query token over that row with that mask (causal decode: ``visible = min(q_pos + 1,
kv_len)``); query head h reads kv head ``h // (Hq / Hkv)``. A row with ``visible = 0`` gives
zeros (the reference gives NaN there; such rows are padding the engine discards). ``rows`` lets
a model hand over its whole cache buffer, ``[L, N, S, Hkv, Dh]`` reshaped to ``[L * N, S, Hkv,
Dh]`` (free), with ``rows = layer * N + slot``: nothing is sliced out of it first, and only the
visible slots are read.

How (split-K decode, as flash-decoding does): a Pallas kernel (Triton lowering) on a grid
``(B, Hq / P, splits)``. Program (b, h, j) takes P query heads (``heads_per_program``, a
divisor of G = Hq / Hkv; all P read the same kv head) and walks the j-th of ``splits`` equal
shares of the *visible* prefix of cache row ``rows[b]`` (each share a whole number of
``block_s`` blocks, sized at run time from ``visible``), ``block_s`` slots at a time, keeping
per head a running max, a running sum of exponentials and a weighted sum of values (online
softmax); slots past ``visible`` or past S are masked. Sharing out the visible prefix, not the
cache's S slots, keeps every program busy at any length: with shares of S, a 640-token context
in a 4,096-slot cache gave two of eight splits all the work, 8 blocks one after another each.
P = 1 is the default: with P = G each program ran the G heads' score, softmax and value sums
one after another, and on the H200 a step of one sequence was
B x Hkv = 4 programs taking ~34 us a layer (benchmarks/gpu_2026-12-04-s9, trace-call2), against
~7 us for XLA's attention. Programs of one head read their kv head G times over, from L2 while
the G programs of a head run together. The partial results of
the splits are combined in jnp with the usual rescaling. The products are plain f32
multiply-adds on the CUDA cores: a decode step reads each cached value once, so the kernel is
bound by the cache's bytes.

Rounding differs from the reference's dot + softmax only in summation order (f32 throughout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
__all__ = ["cache_decode_attention", "cache_rows", "decode_attention"]


def _kernel(vis_ref, row_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref, *, groups: int, group_size: int,
            block_s: int, splits: int, n_slots: int, scale: float):
    # vis_ref, row_ref [1] i32; q_ref [P, Dh] (P = groups query heads); k_ref, v_ref [R, S, Hkv, Dh]
    # (the whole cache, unblocked); m_ref, l_ref [1, 1, P, 1]; o_ref [1, 1, P, Dh]: this split's partials
    row, head = row_ref[0], pl.program_id(1) * groups // group_size  # the kv head of these query heads
    j = pl.program_id(2)
    visible = jnp.minimum(vis_ref[0], n_slots)
    share = (visible + splits * block_s - 1) // (splits * block_s)  # blocks each split walks (at most)
    start = j * share * block_s
    n_blocks = jnp.clip((visible - start + block_s - 1) // block_s, 0, share)
    qs = [q_ref[g, :].astype(F32) * scale for g in range(groups)]  # G x [Dh], scaled once
    dh = qs[0].shape[0]

    def body(i, carry):
        ms, ls, accs = carry
        rows = start + i * block_s + jnp.arange(block_s)  # [BS] slots of this block
        valid = rows < visible
        slots = pl.ds(start + i * block_s, block_s)
        k = plgpu.load(k_ref.at[row, slots, head, :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[row, slots, head, :], mask=valid[:, None], other=0.0)
        k, v = k.astype(F32), v.astype(F32)  # [BS, Dh]
        out = ([], [], [])
        for g in range(groups):
            s = jnp.where(valid, jnp.sum(k * qs[g][None, :], axis=1), -jnp.inf)  # [BS] scores
            m, l, (acc,) = softmax_step(ms[g], ls[g], (accs[g],), s, (v,))
            for o, value in zip(out, (m, l, acc)):
                o.append(value)
        return tuple(tuple(o) for o in out)

    init = (tuple(jnp.full((), -jnp.inf, F32) for _ in range(groups)), tuple(jnp.zeros((), F32) for _ in range(groups)),
            tuple(jnp.zeros((dh,), F32) for _ in range(groups)))
    ms, ls, accs = jax.lax.fori_loop(0, n_blocks, body, init)
    for g in range(groups):
        m_ref[0, 0, g, :] = jnp.full((1,), ms[g], F32)
        l_ref[0, 0, g, :] = jnp.full((1,), ls[g], F32)
        o_ref[0, 0, g, :] = accs[g]


def softmax_step(m, l, accs, s, vs):
    """One block of the online softmax: the running max ``m`` and sum of exponentials ``l``
    (scalars) and weighted sums of values ``accs`` (a tuple of ``[n]`` parts, e.g. a head's
    halves) after scores ``s [BS]`` and the values' parts ``vs`` (``[BS, n]`` each). Each
    block needs a finite score: ``m`` may start at -inf, ``max(s)`` may not be."""
    m_new = jnp.maximum(m, jnp.max(s))
    alpha = jnp.exp(m - m_new)  # rescales what came before (0 at the first block)
    p = jnp.exp(s - m_new)  # [BS]
    return m_new, l * alpha + jnp.sum(p), tuple(a * alpha + jnp.sum(p[:, None] * v, axis=0) for a, v in zip(accs, vs))


def default_splits(n_slots: int, block_s: int = 64) -> int:
    """Programs a query head's cache row is shared out to: 16, more for long caches (so that a
    share of a full cache is at most 512 slots), never more than the row has blocks."""
    return max(1, min(pl.cdiv(n_slots, block_s), max(16, pl.cdiv(n_slots, 512))))


@functools.partial(jax.jit, static_argnames=("scale", "block_s", "splits", "heads_per_program", "num_warps",
                                             "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float,
                     rows: jax.Array | None = None, *, block_s: int = 64, splits: int | None = None,
                     heads_per_program: int = 1, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """Softmax attention of one query token per sequence over the first ``visible[b]`` cache slots.

    Args:
      q: float ``[B, Hq, Dh]`` (normed and rotated).
      k, v: float ``[R, S, Hkv, Dh]``: cache rows (one layer's cache of B sequences, or a whole
        multi-layer cache with its leading axes merged).
      visible: int32 ``[B]``: slots 0..visible-1 are attended to.
      scale: multiplies the scores.
      rows: int32 ``[B]``, the cache row of each query (in ``[0, R)``; not checked on the card);
        None: row b, with R == B.
      block_s: cache slots per loop step.
      splits: programs per query head along the cache, each walking an equal share of the
        visible prefix (None: :func:`default_splits`).
      heads_per_program: query heads a program serves, a divisor of Hq / Hkv.
      num_warps: Triton warps per program.
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[B, Hq, Dh]``.
    """
    B, Hq, Dh = q.shape
    R, S, Hkv, _ = k.shape
    if rows is None:
        rows = jnp.arange(B, dtype=jnp.int32)
        if R != B:
            raise ValueError(f"decode_attention: without rows, k/v must have B = {B} rows, got {R}")
    if (Hq % Hkv or k.shape != v.shape or k.shape[3] != Dh or visible.shape != (B,)
            or jnp.shape(rows) != (B,)):
        raise ValueError(f"decode_attention: q [B, Hq, Dh], k/v [R, S, Hkv, Dh] with Hkv dividing Hq, "
                         f"visible and rows [B]; got {q.shape}, {k.shape}, {v.shape}, {visible.shape}, "
                         f"{jnp.shape(rows)}")
    n_splits = default_splits(S, block_s) if splits is None else splits
    if n_splits < 1:
        raise ValueError(f"decode_attention: splits must be >= 1, got {splits}")
    G = Hq // Hkv
    P = heads_per_program
    if P < 1 or G % P:
        raise ValueError(f"decode_attention: heads_per_program {P} must divide the {G} query heads of a kv head")
    kernel = functools.partial(_kernel, groups=P, group_size=G, block_s=block_s, splits=n_splits, n_slots=S,
                               scale=float(scale))
    part = lambda last: pl.BlockSpec((1, 1, P, last), lambda b, h, j: (b, j, h, 0))
    per_query = pl.BlockSpec((1,), lambda b, h, j: (b,))
    m, l, o = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, n_splits, Hq, 1), F32), jax.ShapeDtypeStruct((B, n_splits, Hq, 1), F32),
                   jax.ShapeDtypeStruct((B, n_splits, Hq, Dh), F32)),
        grid=(B, Hq // P, n_splits),
        in_specs=[per_query, per_query,
                  pl.BlockSpec((None, P, Dh), lambda b, h, j: (b, h, 0)),  # [P, Dh]: query heads h*P..
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],  # whole: row read in-kernel
        out_specs=(part(1), part(1), part(Dh)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(visible.astype(jnp.int32), jnp.asarray(rows, jnp.int32), q, k, v)
    # combine the splits: rescale each to the overall max (empty splits have m = -inf, l = 0)
    m_all = jnp.max(m, axis=1, keepdims=True)  # [B, 1, Hq, 1]
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)  # [B, splits, Hq, 1]
    num = jnp.sum(o * w, axis=1)  # [B, Hq, Dh]
    den = jnp.sum(l * w, axis=1)  # [B, Hq, 1]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def cache_rows(k: jax.Array, v: jax.Array, layer: int, start, batch: int):
    """A whole cache buffer ``[L, N, S, Hkv, Dh]`` as the kernels' rows ``[L * N, S, Hkv, Dh]``
    (merged leading axes: a view, not a copy) and the rows of ``batch`` sequences in slots
    ``start..`` of ``layer``: ``(k rows, v rows, int32 [batch])``."""
    L, N, S, Hkv, Dh = k.shape
    rows = layer * N + jnp.asarray(start, jnp.int32) + jnp.arange(batch, dtype=jnp.int32)
    return k.reshape(L * N, S, Hkv, Dh), v.reshape(L * N, S, Hkv, Dh), rows


def cache_decode_attention(k: jax.Array, v: jax.Array, layer: int, start, q: jax.Array, positions: jax.Array,
                           lengths: jax.Array, scale: float, *, interpret: bool = False) -> jax.Array:
    """:func:`decode_attention` of a step's B queries over a whole cache buffer, nothing sliced out.

    Args:
      k, v: ``[L, N, S, Hkv, Dh]``: the cache of L layers and N slots (any float dtype).
      layer: the layer attended to.
      start: int32 scalar (may be traced): query b reads slot ``start + b``.
      q: ``[B, Hq, Dh]``; positions: int32 ``[B]``, each query's position (outside ``[0, S)``:
        padding, which gets zeros); lengths: int32 ``[B]``, the slots' filled positions after
        this step's writes.
    Returns:
      float32 ``[B, Hq, Dh]``: query b over slots ``s <= positions[b]`` and ``s < lengths[b]``.
    """
    L, N, S, Hkv, Dh = k.shape
    if k.size >= 2 ** 31:  # the kernel's offsets are int32
        raise ValueError(f"cache_decode_attention: a cache of {k.size} elements a buffer is over the kernel's "
                         f"2^31 (L {L} x slots {N} x positions {S} x {Hkv} x {Dh}); use attention='xla'")
    k_rows, v_rows, rows = cache_rows(k, v, layer, start, q.shape[0])
    valid = (positions >= 0) & (positions < S)
    visible = jnp.where(valid, jnp.minimum(positions + 1, lengths), 0).astype(jnp.int32)
    return decode_attention(q, k_rows, v_rows, visible, scale, rows, interpret=interpret)
