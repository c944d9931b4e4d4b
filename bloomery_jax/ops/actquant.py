"""Optional emulation of ggml's CPU activation rounding before quantized matmuls.

llama.cpp's CPU backend never multiplies a quantized weight by float32 activations: it first
converts each activation row to the weight type's ``vec_dot_type`` (``type_traits_cpu`` in
ggml-cpu.c) and takes integer dot products. The exact reference path (``act_rounding="none"``)
skips that; ``"ggml-cpu"`` rounds the activations the same way, so our logits on a quantized
file can be compared with llama.cpp's tightly instead of only by KL divergence. The integer
dot products themselves equal the float32 product of the rounded values up to float32 rounding.

Roundings (per row of K inputs, blocks along K):
  * K-quants and IQ4_XS → Q8_K, blocks of 256: ``iscale = -127 / x[argmax |x|]`` (float32),
    ``q = min(127, rint(iscale * x))``, value ``q * (1 / iscale)``.
  * Q4_0/Q5_0/Q8_0/IQ4_NL (Q8_0) and Q4_1/Q5_1 (Q8_1), blocks of 32:
    ``q = rint(x * 127 / amax)``, value ``q * f16(amax / 127)``.
  * F16 → float16, BF16 → bfloat16 (round to nearest even); F32 → unchanged.

``"ggml-cuda"`` is what llama.cpp's CUDA backend does before its quantized matmuls (mmvq, mmq):
every activation row becomes Q8_1 blocks of 32 whatever the weight's block type: ``d = amax /
127`` (float32), ``q = roundf(x / d)`` (half away from zero), value ``q * f16(d)`` (the block
stores d as f16). Float weights see x unchanged. :func:`quantize_q8_1` gives the integers
themselves, for the kernels that take integer dot products (``pallas.qgemv_q8``).

``"q8-decode"`` rounds only where the decode GEMV takes integer dot products (``pallas.qgemv_q8``
rounds its own input to these Q8_1 blocks): every other product, prefill's among them, sees x
unchanged (``kernels=pallas-q8-bf16``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as T

ACT_ROUNDINGS = ("none", "ggml-cpu", "ggml-cuda", "q8-decode")

_Q8_K_TYPES = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS})
_Q8_0_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL})
_FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})


def _blocks(x: jax.Array, size: int) -> jax.Array:
    if x.shape[-1] % size:
        raise ValueError(f"activation rows of {x.shape[-1]} are not a multiple of {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)  # [..., K/size, size]


def _q8_k(x: jax.Array) -> jax.Array:
    b = _blocks(x, 256)
    idx = jnp.argmax(jnp.abs(b), axis=-1, keepdims=True)  # first element of largest |x|, as ggml's scan
    signed_max = jnp.take_along_axis(b, idx, axis=-1)  # [..., K/256, 1]
    nonzero = signed_max != 0
    iscale = jnp.where(nonzero, jnp.float32(-127.0) / jnp.where(nonzero, signed_max, 1), 0)
    q = jnp.minimum(jnp.round(iscale * b), 127)  # jnp.round is half-to-even, like ggml's nearest_int
    d = jnp.where(nonzero, 1 / jnp.where(nonzero, iscale, 1), 0)
    return (q * d).reshape(x.shape)


def _q8_0(x: jax.Array) -> jax.Array:
    b = _blocks(x, 32)
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)  # [..., K/32, 1]
    nonzero = amax != 0
    inv = jnp.where(nonzero, jnp.float32(127.0) / jnp.where(nonzero, amax, 1), 0)
    d16 = (amax / jnp.float32(127.0)).astype(jnp.float16).astype(jnp.float32)  # the block stores d as f16
    return (jnp.round(b * inv) * d16).reshape(x.shape)


def _round_half_away(v: jax.Array) -> jax.Array:
    """C's roundf: to nearest, halves away from zero (jnp.round takes halves to even)."""
    t = jnp.trunc(v)
    return jnp.where(jnp.abs(v - t) == 0.5, t + jnp.sign(v), jnp.round(v))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q8Act:
    """Activation rows as llama.cpp's CUDA Q8_1 blocks of 32, laid out for integer dot products."""

    qs: jax.Array  # int32 [..., K/4]: the int8 quants, four a word, little-endian, element order
    d: jax.Array  # float32 [..., K/32]: each block's scale, already rounded to f16
    sums: jax.Array  # int32 [..., K/16]: sum of the quants of each half block (mins, Q6_K's -32)

    def values(self) -> jax.Array:
        """The float32 activations these blocks stand for, ``q * d``: ``[..., K]``."""
        q = q8_1_ints(self.qs)  # [..., K/32, 32]
        return (q.astype(jnp.float32) * self.d[..., None]).reshape(*q.shape[:-2], -1)


def q8_1_ints(words: jax.Array) -> jax.Array:
    """int32 [..., K/4] words -> int32 [..., K/32, 32] signed bytes in element order."""
    b = (words[..., None] << jnp.array([24, 16, 8, 0], jnp.int32)) >> 24  # [..., K/4, 4] sign-extended
    return b.reshape(*words.shape[:-1], -1, 32)


def quantize_q8_1(x: jax.Array) -> Q8Act:
    """float ``[..., K]`` (K a multiple of 32) -> :class:`Q8Act`, rounding as llama.cpp's CUDA
    ``quantize_q8_1``."""
    b = _blocks(x.astype(jnp.float32), 32)  # [..., K/32, 32]
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    # the barrier keeps XLA from rewriting x / (amax / 127) into (x * 127) / amax, which rounds
    # differently (as the rope angles, ops/rope.py): llama.cpp divides by the rounded d
    d = jax.lax.optimization_barrier(amax / jnp.float32(127.0))
    q = jnp.where(amax == 0, 0.0, _round_half_away(b / jnp.where(amax == 0, 1.0, d))).astype(jnp.int32)
    u8 = (q & 0xFF).reshape(*q.shape[:-2], -1, 4)  # [..., K/4, 4] bytes
    qs = jnp.sum(u8 << jnp.array([0, 8, 16, 24], jnp.int32), axis=-1, dtype=jnp.int32)  # disjoint bytes: sum == OR
    sums = jnp.sum(q.reshape(*q.shape[:-1], 2, 16), axis=-1).reshape(*q.shape[:-2], -1)  # [..., K/16]
    d16 = d[..., 0].astype(jnp.float16).astype(jnp.float32)
    return Q8Act(qs, d16, sums)


def round_activations(x: jax.Array, weight_qtype, mode: str = "none") -> jax.Array:
    """``x`` as the matmul with a weight of ``weight_qtype`` sees it under ``mode``.

    Args:
      x: float32 ``[..., K]`` activations.
      weight_qtype: the ggml type of the weight it multiplies.
      mode: ``"none"`` (exact reference), ``"ggml-cpu"``, ``"ggml-cuda"`` or ``"q8-decode"`` (x
        unchanged here: only the integer-dot GEMVs round, inside themselves).
    Returns:
      float32 ``[..., K]``.
    """
    if mode not in ACT_ROUNDINGS:
        raise ValueError(f"unknown activation rounding {mode!r} (have: {', '.join(ACT_ROUNDINGS)})")
    if mode in ("none", "q8-decode"):
        return x
    qtype = T(weight_qtype)
    x = x.astype(jnp.float32)
    if mode == "ggml-cuda":
        return quantize_q8_1(x).values() if qtype not in _FLOAT_TYPES else x
    if qtype in _Q8_K_TYPES:
        return _q8_k(x)
    if qtype in _Q8_0_TYPES:
        return _q8_0(x)
    if qtype == T.F16:
        return x.astype(jnp.float16).astype(jnp.float32)
    if qtype == T.BF16:
        return x.astype(jnp.bfloat16).astype(jnp.float32)
    return x
