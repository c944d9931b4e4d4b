"""A decode step's attention inputs in one kernel: q and k RMS-normed per head and rotated, the new
key and value stored in the cache.

Contract: ``decode_qk_prep(qkv [P, B, (Hq + 2 Hkv) Dh], q_norm [Dh], k_norm [Dh], cos [B, Dh/2],
sin [B, Dh/2], cache_k [L, N, S, Hkv, Dh], cache_v, layer, start, positions [B], eps) ->
(q' [B, Hq, Dh], cache_k', cache_v')``, where the sum over P of ``qkv`` is q, k and v side by
side (the projection's split-K partial sums, ``qgemv_many(..., partials=True)``, added here
rather than by a launch of their own), ``q' = apply_rope(rms_norm(q, q_norm, eps), cos, sin,
neox=True)`` and the caches equal to the inputs except position ``positions[b]`` of slot
``start + b`` of the layer, which holds the same transform of k (and v as it is), stored in the
caches' dtype, for ``0 <= positions[b] < S`` (others are padding and write nothing). NeoX
rotation over the whole head (Qwen3's rope); the cache buffers are updated in place
(input/output aliases, donated by the step).

Why: in XLA these are six small kernels a layer between the q/k/v projection and decode
attention (the partial sums and norms' reductions, the rotation's concatenation, two
dynamic-update-slices and a slice), each ~1.1-1.8 us of an ~96 us layer on the H200 (trace of 2026-12-04,
``benchmarks/gpu_2026-12-04-s10/trace-call1``), mostly the card's launch-to-launch gap.

How: a Pallas kernel (Triton lowering) on a grid ``(B, Hkv, G + 1)``, G = Hq / Hkv: program
(b, h, j < G) normalises and rotates query head h G + j, program (b, h, G) kv head h's key, and
stores the key and value rows into the cache; each head as its two halves (the rotation's
pairs), every store through a ``pl.ANY`` ref. One head a program: with one program per kv head
doing its G query heads in turn, the kernel took 4.6 us a layer on the H100 (4 programs,
benchmarks/gpu_2026-12-05-s16/trace). Rounding: the same float32 operations as the reference, except the mean
square, which sums the two halves separately, and the partial sums, added in order (last bits
only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
__all__ = ["cache_qk_prep", "check_prep", "decode_qk_prep", "head_halves", "normed_rotated", "serves"]


def serves(head_dim: int, n_rot: int) -> bool:
    """Whether the kernel takes heads of this size and rotation: the whole head rotated, and a
    half a power of two (a Triton block)."""
    half = head_dim // 2
    return n_rot == head_dim and head_dim % 2 == 0 and half & (half - 1) == 0


def normed_rotated(x0, x1, w_ref, cos, sin, eps: float):
    """One head's halves ``[Dh/2]`` each: RMS-normed, scaled by the norm weight, NeoX-rotated."""
    half = x0.shape[0]
    mean_sq = (jnp.sum(x0 * x0) + jnp.sum(x1 * x1)) / (2 * half)
    scale = 1.0 / jnp.sqrt(mean_sq + jnp.float32(eps))
    y0 = (x0 * scale) * w_ref[pl.ds(0, half)].astype(F32)
    y1 = (x1 * scale) * w_ref[pl.ds(half, half)].astype(F32)
    return y0 * cos - y1 * sin, y0 * sin + y1 * cos


def head_halves(qkv_ref, half: int, h):
    """Head h of q|k|v (h counts Dh-wide heads from q's first) from ``qkv_ref [P, width]``, its P
    partial sums added in order: two float32 ``[Dh/2]``."""
    parts = [[qkv_ref[s, pl.ds(h * 2 * half + i * half, half)].astype(F32) for i in range(2)]
             for s in range(qkv_ref.shape[0])]
    return [functools.reduce(lambda a, b: a + b, [p[i] for p in parts]) for i in range(2)]


def _kernel(start_ref, pos_ref, qkv_ref, qn_ref, kn_ref, cos_ref, sin_ref, ck_in, cv_in, q_ref, ck_ref, cv_ref,
            *, groups: int, n_kv: int, layer: int, n_rows: int, n_slots: int, eps: float):
    # start_ref, pos_ref [1]; qkv_ref [P, (Hq + 2 Hkv) Dh]: partial sums of this sequence's q|k|v;
    # qn_ref, kn_ref [Dh]; cos_ref, sin_ref [Dh/2]; q_ref [B, Hq, Dh] (whole);
    # ck_ref, cv_ref [L*N, S, Hkv, Dh] (the whole caches, aliased to ck_in, cv_in)
    del ck_in, cv_in  # the same buffers as ck_ref, cv_ref
    half = cos_ref.shape[0]
    seq, head, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # read outside pl.when (interpreter)
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    cos, sin = cos_ref[...].astype(F32), sin_ref[...].astype(F32)

    halves = functools.partial(head_halves, qkv_ref, half)

    @pl.when(j < groups)  # query head head * G + j
    def _():
        q = head * groups + j
        a, b = normed_rotated(*halves(q), qn_ref, cos, sin, eps)
        plgpu.store(q_ref.at[seq, q, lo], a)
        plgpu.store(q_ref.at[seq, q, hi], b)

    pos = pos_ref[0]
    row = layer * n_rows + start_ref[0] + seq
    n_q = n_kv * groups

    @pl.when((j == groups) & (pos >= 0) & (pos < n_slots))  # the kv head's key and value
    def _():
        k0, k1 = normed_rotated(*halves(n_q + head), kn_ref, cos, sin, eps)
        v0, v1 = halves(n_q + n_kv + head)
        for ref, first, second in ((ck_ref, k0, k1), (cv_ref, v0, v1)):
            plgpu.store(ref.at[row, pos, head, lo], first.astype(ref.dtype))
            plgpu.store(ref.at[row, pos, head, hi], second.astype(ref.dtype))


def check_prep(name: str, qkv, q_norm, k_norm, cos, sin, cache_k, cache_v, positions) -> tuple[int, int, int, int]:
    """``(P, B, width, Hq)`` of ``decode_qk_prep``'s inputs (shapes as its Args say), or a
    ValueError from ``name`` naming what it cannot serve."""
    _, _, _, Hkv, Dh = cache_k.shape
    n_parts, B, width = qkv.shape if qkv.ndim == 3 else (0, 0, 0)
    Hq = width // Dh - 2 * Hkv
    if (not serves(Dh, Dh) or width % Dh or Hq < Hkv or Hq % Hkv or n_parts < 1 or cache_v.shape != cache_k.shape
            or q_norm.shape != (Dh,) or k_norm.shape != (Dh,) or cos.shape != (B, Dh // 2) or sin.shape != cos.shape
            or positions.shape != (B,)):
        raise ValueError(f"{name}: needs qkv [P, B, (Hq + 2 Hkv) Dh], norms [Dh], cos/sin [B, Dh/2], "
                         f"caches [L, N, S, Hkv, Dh], positions [B], Hkv dividing Hq, Dh/2 a power of two; got qkv "
                         f"{qkv.shape}, norms {q_norm.shape} {k_norm.shape}, cos {cos.shape}, "
                         f"caches {cache_k.shape} {cache_v.shape}, positions {positions.shape}")
    if cache_k.size >= 2 ** 31:  # the kernel's offsets are int32
        raise ValueError(f"{name}: a cache of {cache_k.size} elements is over the kernel's 2^31")
    if cache_k.dtype != cache_v.dtype:
        raise ValueError(f"{name}: the caches' dtypes differ: {cache_k.dtype}, {cache_v.dtype}")
    return n_parts, B, width, Hq


@functools.partial(jax.jit, static_argnames=("layer", "eps", "interpret"), donate_argnames=("cache_k", "cache_v"))
def decode_qk_prep(qkv: jax.Array, q_norm: jax.Array, k_norm: jax.Array, cos: jax.Array, sin: jax.Array,
                   cache_k: jax.Array, cache_v: jax.Array, layer: int, start, positions: jax.Array, *, eps: float,
                   interpret: bool = False):
    """Normed, rotated queries of one decode token per sequence, and the caches holding its key/value.

    Args:
      qkv: float ``[P, B, (Hq + 2 Hkv) Dh]``: P partial sums (P >= 1) of the projections' outputs
        q, k and v side by side (Hkv and Dh are the caches').
      q_norm, k_norm: ``[Dh]`` RMS-norm weights of a head.
      cos, sin: float32 ``[B, Dh/2]`` rotation tables of each sequence's position (``ops.rope``).
      cache_k, cache_v: ``[L, N, S, Hkv, Dh]`` (any float dtype; the same for both); donated.
      layer: the layer whose rows are written (static).
      start: int32 scalar (may be traced): sequence b is slot ``start + b`` (not checked on the card).
      positions: int32 ``[B]``, the token's slot; outside ``[0, S)``: nothing is stored.
      eps: the norms' epsilon.
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      (float32 ``[B, Hq, Dh]``, cache_k, cache_v) as in the module's contract.
    """
    L, N, S, Hkv, Dh = cache_k.shape
    n_parts, B, width, Hq = check_prep("decode_qk_prep", qkv, q_norm, k_norm, cos, sin, cache_k, cache_v, positions)
    G = Hq // Hkv
    flat = lambda a: a.reshape(L * N, S, Hkv, Dh)  # merges the leading axes: a view, not a copy  # noqa: E731
    whole = pl.BlockSpec(memory_space=pl.ANY)
    table = pl.BlockSpec((None, Dh // 2), lambda b, h, j: (b, 0))  # [Dh/2]
    norm = pl.BlockSpec((Dh,), lambda b, h, j: (0,))
    sums = pl.BlockSpec((n_parts, None, width), lambda b, h, j: (0, b, 0))  # [P, width]: sequence b's partials
    kernel = functools.partial(_kernel, groups=G, n_kv=Hkv, layer=int(layer), n_rows=N, n_slots=S, eps=float(eps))
    q_out, ck, cv = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, Hq, Dh), F32), jax.ShapeDtypeStruct((L * N, S, Hkv, Dh), cache_k.dtype),
                   jax.ShapeDtypeStruct((L * N, S, Hkv, Dh), cache_k.dtype)),
        grid=(B, Hkv, G + 1),
        in_specs=[pl.BlockSpec((1,), lambda b, h, j: (0,)), pl.BlockSpec((1,), lambda b, h, j: (b,)), sums, norm, norm,
                  table, table, whole, whole],
        out_specs=(whole, whole, whole),
        input_output_aliases={7: 1, 8: 2},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="decode_qk_prep",
    )(jnp.asarray(start, jnp.int32).reshape(1), positions.astype(jnp.int32), qkv, q_norm, k_norm, cos.astype(F32),
      sin.astype(F32), flat(cache_k), flat(cache_v))
    return q_out, ck.reshape(cache_k.shape), cv.reshape(cache_v.shape)


def cache_qk_prep(cache, layer: int, start, qkv: jax.Array, norms, rope, positions: jax.Array, *,
                  interpret: bool = False):
    """:func:`decode_qk_prep` on a cache object's ``k``, ``v`` buffers (``models.kv_cache.KVCache``,
    ``engine.cache.SlotCache``): ``norms = (q_norm, k_norm, eps)``, ``rope = (cos, sin)``.
    Returns (queries, the cache with the new buffers)."""
    q_norm, k_norm, eps = norms
    cos, sin = rope
    q, new_k, new_v = decode_qk_prep(qkv, q_norm, k_norm, cos, sin, cache.k, cache.v, layer, start, positions,
                                     eps=float(eps), interpret=interpret)
    return q, dataclasses.replace(cache, k=new_k, v=new_v)
