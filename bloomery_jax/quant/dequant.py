"""Dequantization of ggml block formats in jnp, bit-exact with ``gguf.quants.dequantize``.

Every function takes the raw bytes of whole blocks and returns float32 values; the
arithmetic follows ggml's reference order (f16 scales widened to f32, then the same products
and sums) so that results are identical, not just close.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from .formats import SUPPORTED_TYPES, block_geometry


def _f16(b: jax.Array) -> jax.Array:
    """Little-endian f16 from a trailing pair of bytes: uint8 [..., 2] -> f32 [...]."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _q8_0(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | qs[32] (int8)  ->  d * q
    d = _f16(blocks[:, 0:2])[:, None]
    q = jax.lax.bitcast_convert_type(blocks[:, 2:], jnp.int8).astype(jnp.float32)
    return d * q


_BLOCK_DEQUANT = {
    T.Q8_0: _q8_0,
}


def dequantize(data: jax.Array, qtype, shape) -> jax.Array:
    """Values of a ggml tensor as float32 with logical ``shape``.

    Args:
      data: the file's bytes, uint8 ``[*shape[:-1], row_bytes]`` for block formats (any
        leading shape whose byte count matches), or f32 / f16 / bf16-as-uint16 values.
      qtype: the ggml type.
      shape: logical shape (NumPy order); the last axis is the blocked one.
    Returns:
      float32 ``shape``.
    """
    qtype = T(qtype)
    shape = tuple(shape)
    if qtype == T.F32:
        return jnp.asarray(data, jnp.float32).reshape(shape)
    if qtype == T.F16:
        return jnp.asarray(data).view(jnp.float16).astype(jnp.float32).reshape(shape)
    if qtype == T.BF16:
        bits = jnp.asarray(data).view(jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(shape)
    if qtype not in _BLOCK_DEQUANT:
        if qtype in SUPPORTED_TYPES:
            raise NotImplementedError(f"dequantize for {qtype.name} is not implemented yet")
        raise ValueError(f"unsupported ggml type {qtype.name}")
    elems, nbytes = block_geometry(qtype)
    n = int(np.prod(shape))
    blocks = jnp.asarray(data, jnp.uint8).reshape(n // elems, nbytes)  # [B, bytes]
    return _BLOCK_DEQUANT[qtype](blocks).reshape(shape)
