"""Prefill attention over a KV cache: many query tokens per sequence, causal, grouped kv heads.

Contract: ``prefill_attention(q [B, T, Hq, Dh], k [R, S, Hkv, Dh], v [R, S, Hkv, Dh], q_pos [B, T],
kv_len [B], scale, rows=None) -> float32 [B, T, Hq, Dh]``: query ``(b, t)`` attends to the slots
``s <= q_pos[b, t]`` with ``s < kv_len[b]`` of cache row ``rows[b]`` (default ``rows = arange(B)``,
R = B), and equals ``ops.attention.gqa_attention`` with ``ops.attention.causal_mask(q_pos, kv_len,
S)``; query head h reads kv head ``h // (Hq / Hkv)``. A query that sees no slot gets zeros (the
engine's padding rows). As in ``pallas.attention``, ``rows`` lets a model hand over its whole cache
buffer (``[L * N, S, Hkv, Dh]``, leading axes merged) with ``rows = layer * N + slot``.

How (flash attention): a Pallas kernel (Triton lowering) on a grid ``(B, Hq, T / block_t)``.
Program (b, h, i) holds ``block_t`` queries of head h, walks the row's slots ``block_s`` at a time
only up to the block's last visible slot (causal: later blocks of the prompt walk further), and
keeps per query a running max, a running sum of exponentials and a weighted sum of values
(online softmax), so the ``[T, S]`` score matrix is never formed. Both products run on the
tensor cores at ``precision`` (default three TF32 passes: errors as f32's, as the prefill MoE
kernel; the interpreter computes at f32 HIGHEST).

Rounding differs from the reference's only in summation order and the products' algorithm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .attention import cache_rows
from .moe_gemm import GEMM_ALGORITHMS

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]
_NN = (((1,), (0,)), ((), ()))  # [M, K] x [K, N] -> [M, N]
__all__ = ["cache_prefill_attention", "prefill_attention"]


def _kernel(len_ref, row_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, *, group_size: int, block_s: int,
            n_slots: int, scale: float, algorithm):
    # len_ref, row_ref [1] i32; pos_ref [BT] i32; q_ref, o_ref [BT, Dh]; k_ref, v_ref [R, S, Hkv, Dh] (whole)
    row, head = row_ref[0], pl.program_id(1) // group_size  # the kv head of this query head
    pos = pos_ref[...]  # [BT]
    kv_len = jnp.minimum(len_ref[0], n_slots)
    last = jnp.minimum(jnp.max(pos) + 1, kv_len)  # slots any query of the block may see
    n_blocks = jnp.maximum((last + block_s - 1) // block_s, 0)
    q = q_ref[...].astype(F32) * scale  # [BT, Dh]
    bt, dh = q.shape

    def body(j, carry):
        m, l, acc = carry
        slots = j * block_s + jnp.arange(block_s)  # [BS]
        in_row = slots < kv_len
        k = plgpu.load(k_ref.at[row, pl.ds(j * block_s, block_s), head, :], mask=in_row[:, None], other=0.0)
        v = plgpu.load(v_ref.at[row, pl.ds(j * block_s, block_s), head, :], mask=in_row[:, None], other=0.0)
        s = jax.lax.dot_general(q, k.astype(F32), _NT, precision=algorithm, preferred_element_type=F32)  # [BT, BS]
        seen = (slots[None, :] <= pos[:, None]) & in_row[None, :]
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [BT]
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a query that has seen nothing yet stays at zeros
        alpha = jnp.exp(m - base)
        p = jnp.exp(s - base[:, None])  # [BT, BS]
        pv = jax.lax.dot_general(p, v.astype(F32), _NN, precision=algorithm, preferred_element_type=F32)  # [BT, Dh]
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (jnp.full((bt,), -jnp.inf, F32), jnp.zeros((bt,), F32), jnp.zeros((bt, dh), F32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


@functools.partial(jax.jit, static_argnames=("scale", "block_t", "block_s", "precision", "num_warps", "num_stages",
                                             "interpret"))
def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_len: jax.Array, scale: float,
                      rows: jax.Array | None = None, *, block_t: int = 64, block_s: int = 64,
                      precision: str = "tf32x3", num_warps: int = 4, num_stages: int = 2,
                      interpret: bool = False) -> jax.Array:
    """Causal softmax attention of T query tokens per sequence over its cache row.

    Args:
      q: float ``[B, T, Hq, Dh]`` (normed and rotated).
      k, v: float ``[R, S, Hkv, Dh]``: cache rows (one layer's, or a whole multi-layer cache with
        its leading axes merged).
      q_pos: int32 ``[B, T]``: each query's position; it sees slots ``s <= q_pos``.
      kv_len: int32 ``[B]``: filled slots of each row after this step's writes.
      scale: multiplies the scores.
      rows: int32 ``[B]``, the cache row of each sequence (not checked on the card); None: row b.
      block_t, block_s: queries a program holds, slots a loop step reads (powers of two >= 16).
      precision: the products' algorithm (``pallas.moe_gemm``'s names; the interpreter uses HIGHEST).
      num_warps, num_stages: Triton launch parameters.
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[B, T, Hq, Dh]``.
    """
    B, T, Hq, Dh = q.shape
    R, S, Hkv, _ = k.shape
    if rows is None:
        rows = jnp.arange(B, dtype=jnp.int32)
        if R != B:
            raise ValueError(f"prefill_attention: without rows, k/v must have B = {B} rows, got {R}")
    if (Hq % Hkv or k.shape != v.shape or k.shape[3] != Dh or q_pos.shape != (B, T) or kv_len.shape != (B,)
            or jnp.shape(rows) != (B,)):
        raise ValueError(f"prefill_attention: q [B, T, Hq, Dh], k/v [R, S, Hkv, Dh] with Hkv dividing Hq, q_pos "
                         f"[B, T], kv_len and rows [B]; got {q.shape}, {k.shape}, {v.shape}, {q_pos.shape}, "
                         f"{kv_len.shape}, {jnp.shape(rows)}")
    if precision not in GEMM_ALGORITHMS:
        raise ValueError(f"prefill_attention: precision {precision!r} is not one of {sorted(GEMM_ALGORITHMS)}")
    if k.size >= 2 ** 31:  # the kernel's offsets are int32
        raise ValueError(f"prefill_attention: a cache of {k.size} elements is over the kernel's 2^31")
    pad = -T % block_t  # whole query blocks: padded queries see nothing (position -1) and are cut off
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    kernel = functools.partial(_kernel, group_size=Hq // Hkv, block_s=block_s, n_slots=S, scale=float(scale),
                               algorithm=jax.lax.Precision.HIGHEST if interpret else GEMM_ALGORITHMS[precision])
    per_seq = pl.BlockSpec((1,), lambda b, h, i: (b,))
    heads = pl.BlockSpec((None, block_t, None, Dh), lambda b, h, i: (b, i, h, 0))  # [BT, Dh]: head h
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qp.shape, F32),
        grid=(B, Hq, (T + pad) // block_t),
        in_specs=[per_seq, per_seq, pl.BlockSpec((None, block_t), lambda b, h, i: (b, i)), heads,
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],  # whole: rows read in-kernel
        out_specs=heads,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="prefill_attention",
    )(kv_len.astype(jnp.int32), jnp.asarray(rows, jnp.int32), pos, qp, k, v)
    return out[:, :T]


def cache_prefill_attention(k: jax.Array, v: jax.Array, layer: int, start, q: jax.Array, positions: jax.Array,
                            lengths: jax.Array, scale: float, *, interpret: bool = False) -> jax.Array:
    """:func:`prefill_attention` of a step's B sequences over a whole cache buffer, nothing sliced out.

    Args:
      k, v: ``[L, N, S, Hkv, Dh]``: the cache of L layers and N slots (any float dtype).
      layer: the layer attended to.
      start: int32 scalar (may be traced): sequence b is slot ``start + b``.
      q: ``[B, T, Hq, Dh]``; positions: int32 ``[B, T]``; lengths: int32 ``[B]``, the slots' filled
        positions after this step's writes.
    Returns:
      float32 ``[B, T, Hq, Dh]``.
    """
    k_rows, v_rows, rows = cache_rows(k, v, layer, start, q.shape[0])
    return prefill_attention(q, k_rows, v_rows, positions, lengths, scale, rows, interpret=interpret)
