"""Dequantization of ggml block formats in jnp, bit-exact with ``gguf.quants.dequantize``.

Every block function takes the raw bytes of whole blocks, uint8 ``[B, block_bytes]``, and
returns float32 ``[B, block_elems]``; all blocks are handled at once, so the functions trace
into a few fused elementwise ops inside a jitted step. The arithmetic follows ggml's
reference order (f16 scales widened to f32, then the same products and sums). The products
of an f16 scale with the small integer quants are exact in f32, so at most one rounding (the
final add of the min) happens, identically with or without FMA contraction: the results are
identical to gguf's, not just close, on the CPU and on the GPU.

This module holds the dispatch, the float types and the 32-element legacy formats; the
K-quants live in ``dequant_k`` and the IQ4 codebook formats in ``dequant_iq``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from . import dequant_iq, dequant_k
from .formats import SUPPORTED_TYPES, block_geometry
from .unpack import as_int8, bits_le, bytes_as, f16, nibbles


def _f32(q: jax.Array) -> jax.Array:
    return q.astype(jnp.float32)


def _q4_0(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | qs[16]: element j in the low nibble of byte j, j + 16 in the high one
    nb = blocks.shape[0]
    d = f16(blocks[:, 0:2])[:, None]
    q = nibbles(blocks[:, 2:18]).reshape(nb, 32).astype(jnp.int32) - 8
    return d * _f32(q)


def _q4_1(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | m (f16) | qs[16]  ->  d * q + m
    nb = blocks.shape[0]
    d, m = f16(blocks[:, 0:2])[:, None], f16(blocks[:, 2:4])[:, None]
    q = nibbles(blocks[:, 4:20]).reshape(nb, 32)
    return d * _f32(q) + m


def _q5_0(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | qh (32 fifth bits, little-endian) | qs[16] (low 4 bits)
    nb = blocks.shape[0]
    d = f16(blocks[:, 0:2])[:, None]
    q = nibbles(blocks[:, 6:22]).reshape(nb, 32) | (bits_le(blocks[:, 2:6]) << 4)
    return d * _f32(q.astype(jnp.int32) - 16)


def _q5_1(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | m (f16) | qh[4] | qs[16]  ->  d * q + m
    nb = blocks.shape[0]
    d, m = f16(blocks[:, 0:2])[:, None], f16(blocks[:, 2:4])[:, None]
    q = nibbles(blocks[:, 8:24]).reshape(nb, 32) | (bits_le(blocks[:, 4:8]) << 4)
    return d * _f32(q) + m


def _q8_0(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | qs[32] (int8)  ->  d * q
    d = f16(blocks[:, 0:2])[:, None]
    return d * _f32(as_int8(blocks[:, 2:34]))


_BLOCK_DEQUANT = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: dequant_k.q2_k,
    T.Q3_K: dequant_k.q3_k,
    T.Q4_K: dequant_k.q4_k,
    T.Q5_K: dequant_k.q5_k,
    T.Q6_K: dequant_k.q6_k,
    T.IQ4_NL: dequant_iq.iq4_nl,
    T.IQ4_XS: dequant_iq.iq4_xs,
}
assert set(_BLOCK_DEQUANT) | {T.F32, T.F16, T.BF16} == SUPPORTED_TYPES


def _ggml_type(qtype) -> T:
    try:
        qtype = T(qtype)
    except ValueError:
        raise ValueError(f"dequantize: {qtype!r} is not a ggml type id") from None
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"dequantize: ggml type {qtype.name} is not supported (supported: {names})")
    return qtype


def _float_values(data: jax.Array, qtype: T) -> jax.Array:
    """F32 / F16 / BF16 as f32; ``data`` is raw bytes (uint8) or the values' own dtype."""
    if qtype == T.F32:
        return bytes_as(data, jnp.float32) if data.dtype == jnp.uint8 else _f32(data)
    if qtype == T.F16:
        if data.dtype == jnp.uint8:
            data = bytes_as(data, jnp.float16)
        elif data.dtype == jnp.uint16:
            data = jax.lax.bitcast_convert_type(data, jnp.float16)
        return _f32(data)
    # BF16: its bits are the top half of an f32, so widening is a shift, exact for NaNs too
    if data.dtype == jnp.bfloat16:
        return _f32(data)
    bits16 = bytes_as(data, jnp.uint16) if data.dtype == jnp.uint8 else data.astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits16.astype(jnp.uint32) << 16, jnp.float32)


def dequantize(data: jax.Array, qtype, shape) -> jax.Array:
    """Values of a ggml tensor as float32 with logical ``shape``; jittable (qtype, shape static).

    Args:
      data: the file's bytes, uint8 ``[*shape[:-1], row_bytes]`` for block formats (any
        leading shape whose byte count matches); for F32 / F16 / BF16 either the raw bytes
        (uint8) or the values (f32, f16, bf16 as uint16 bits or bfloat16).
      qtype: the ggml type (GGMLQuantizationType or its integer id).
      shape: logical shape (NumPy order); the last axis is the blocked one.
    Returns:
      float32 ``shape``.
    Raises:
      ValueError: an unsupported type, or data whose size does not fit ``shape``.
    """
    qtype = _ggml_type(qtype)
    shape = tuple(int(s) for s in shape)
    data = jnp.asarray(data)
    n = int(np.prod(shape, dtype=np.int64))
    elems, nbytes = block_geometry(qtype)
    if shape and shape[-1] % elems:
        raise ValueError(f"dequantize: last axis {shape[-1]} is not a multiple of the {qtype.name} block size {elems}")
    is_float = qtype in (T.F32, T.F16, T.BF16)
    if not is_float and data.dtype != jnp.uint8:
        raise ValueError(f"dequantize: {qtype.name} data must be uint8 bytes, got {data.dtype}")
    want = n // elems * nbytes if data.dtype == jnp.uint8 else n
    if data.size != want:
        what = "bytes" if data.dtype == jnp.uint8 else "values"
        raise ValueError(f"dequantize: {qtype.name} {shape} needs {want} {what}, got {data.size}")
    if is_float:
        flat = data.reshape(-1, nbytes) if data.dtype == jnp.uint8 else data.reshape(-1)
        return _float_values(flat, qtype).reshape(shape)
    blocks = data.reshape(n // elems, nbytes)  # [B, bytes]
    return _BLOCK_DEQUANT[qtype](blocks).reshape(shape)
