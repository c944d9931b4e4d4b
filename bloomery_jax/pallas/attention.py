"""Decode attention over a KV cache: one query token per sequence, grouped kv heads, split over the cache.

Contract: ``decode_attention(q [B, Hq, Dh], k [B, S, Hkv, Dh], v [B, S, Hkv, Dh], visible [B], scale)
-> float32 [B, Hq, Dh]`` equals ``ops.attention.gqa_attention`` of one query token whose mask is
the prefix ``s < visible[b]`` of the cache (causal decode: ``visible = min(q_pos + 1, kv_len)``);
query head h reads kv head ``h // (Hq / Hkv)``. A row with ``visible = 0`` gives zeros (the
reference gives NaN there; such rows are padding the engine discards).

How (split-K decode, as flash-decoding does): a Pallas kernel (Triton lowering) on a grid
``(B, Hkv, S / split)``. Program (b, h, j) reads the G = Hq / Hkv query heads of kv head h and
walks its ``split`` slots of the cache ``block_s`` at a time (only up to ``visible``), keeping
per head a running max, a running sum of exponentials and a weighted sum of values (online
softmax); slots past ``visible`` or past S are masked. The partial results of the splits are
combined in jnp with the usual rescaling. The products are plain f32 multiply-adds on the CUDA
cores: a decode step reads each cached value once, so the kernel is bound by the cache's bytes.

Rounding differs from the reference's dot + softmax only in summation order (f32 throughout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
__all__ = ["decode_attention"]


def _kernel(vis_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref, *, groups: int, block_s: int, split: int,
            n_slots: int, scale: float):
    # vis_ref [1] i32; q_ref [G, Dh]; k_ref, v_ref [S, Dh] (the whole cache of one kv head);
    # m_ref, l_ref [1, 1, G, 1]; o_ref [1, 1, G, Dh]: this split's partial results
    j = pl.program_id(2)
    start = j * split
    visible = jnp.minimum(vis_ref[0], n_slots)
    n_blocks = jnp.clip((visible - start + block_s - 1) // block_s, 0, split // block_s)
    qs = [q_ref[g, :].astype(F32) * scale for g in range(groups)]  # G x [Dh], scaled once
    dh = qs[0].shape[0]

    def body(i, carry):
        ms, ls, accs = carry
        rows = start + i * block_s + jnp.arange(block_s)  # [BS] slots of this block
        valid = rows < visible
        k = plgpu.load(k_ref.at[pl.ds(start + i * block_s, block_s), :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(start + i * block_s, block_s), :], mask=valid[:, None], other=0.0)
        k, v = k.astype(F32), v.astype(F32)  # [BS, Dh]
        out = ([], [], [])
        for g in range(groups):
            s = jnp.where(valid, jnp.sum(k * qs[g][None, :], axis=1), -jnp.inf)  # [BS] scores
            m_new = jnp.maximum(ms[g], jnp.max(s))
            alpha = jnp.exp(ms[g] - m_new)  # rescales what came before (0 at the first block)
            p = jnp.exp(s - m_new)  # [BS]
            out[0].append(m_new)
            out[1].append(ls[g] * alpha + jnp.sum(p))
            out[2].append(accs[g] * alpha + jnp.sum(p[:, None] * v, axis=0))
        return tuple(tuple(o) for o in out)

    init = (tuple(jnp.full((), -jnp.inf, F32) for _ in range(groups)), tuple(jnp.zeros((), F32) for _ in range(groups)),
            tuple(jnp.zeros((dh,), F32) for _ in range(groups)))
    ms, ls, accs = jax.lax.fori_loop(0, n_blocks, body, init)
    for g in range(groups):
        m_ref[0, 0, g, :] = jnp.full((1,), ms[g], F32)
        l_ref[0, 0, g, :] = jnp.full((1,), ls[g], F32)
        o_ref[0, 0, g, :] = accs[g]


@functools.partial(jax.jit, static_argnames=("scale", "block_s", "split", "num_warps", "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float, *,
                     block_s: int = 64, split: int = 512, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """Softmax attention of one query token per sequence over the first ``visible[b]`` cache slots.

    Args:
      q: float ``[B, Hq, Dh]`` (normed and rotated).
      k, v: float ``[B, S, Hkv, Dh]``: the cache of one layer.
      visible: int32 ``[B]``: slots 0..visible-1 are attended to.
      scale: multiplies the scores.
      block_s: cache slots per loop step; split: slots per program (a multiple of block_s).
      num_warps: Triton warps per program.
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[B, Hq, Dh]``.
    """
    B, Hq, Dh = q.shape
    _, S, Hkv, _ = k.shape
    if Hq % Hkv or k.shape != v.shape or k.shape[0] != B or k.shape[3] != Dh or visible.shape != (B,):
        raise ValueError(f"decode_attention: q [B, Hq, Dh], k/v [B, S, Hkv, Dh] with Hkv dividing Hq and "
                         f"visible [B]; got {q.shape}, {k.shape}, {v.shape}, {visible.shape}")
    if split % block_s:
        raise ValueError(f"decode_attention: split {split} is not a multiple of block_s {block_s}")
    G = Hq // Hkv
    n_splits = pl.cdiv(S, split)
    kernel = functools.partial(_kernel, groups=G, block_s=block_s, split=split, n_slots=S, scale=float(scale))
    cache_spec = pl.BlockSpec((None, S, None, Dh), lambda b, h, j: (b, 0, h, 0))  # kernel sees [S, Dh]
    part = lambda last: pl.BlockSpec((1, 1, G, last), lambda b, h, j: (b, j, h, 0))
    m, l, o = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, n_splits, Hq, 1), F32), jax.ShapeDtypeStruct((B, n_splits, Hq, 1), F32),
                   jax.ShapeDtypeStruct((B, n_splits, Hq, Dh), F32)),
        grid=(B, Hkv, n_splits),
        in_specs=[pl.BlockSpec((1,), lambda b, h, j: (b,)),
                  pl.BlockSpec((None, G, Dh), lambda b, h, j: (b, h, 0)),  # [G, Dh]: the query heads of kv head h
                  cache_spec, cache_spec],
        out_specs=(part(1), part(1), part(Dh)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(visible.astype(jnp.int32), q, k, v)
    # combine the splits: rescale each to the overall max (empty splits have m = -inf, l = 0)
    m_all = jnp.max(m, axis=1, keepdims=True)  # [B, 1, Hq, 1]
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)  # [B, splits, Hq, 1]
    num = jnp.sum(o * w, axis=1)  # [B, Hq, Dh]
    den = jnp.sum(l * w, axis=1)  # [B, Hq, 1]
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
