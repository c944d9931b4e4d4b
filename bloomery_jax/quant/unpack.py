"""Bit-level helpers shared by the jnp dequantizers: little-endian fields and packed integers.

All helpers are jittable and work on uint8 arrays whose last axis holds the bytes of one
field; every leading axis (blocks, sub-blocks) is carried through unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# f16 widened to f32 is exact, so reading a scale this way loses nothing (ggml's FP16_TO_FP32).


def f16(b: jax.Array) -> jax.Array:
    """Little-endian f16 from a trailing pair of bytes: uint8 [..., 2] -> f32 [...]."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def u16(b: jax.Array) -> jax.Array:
    """Little-endian uint16 from a trailing pair of bytes: uint8 [..., 2] -> uint16 [...]."""
    return b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)


def as_int8(b: jax.Array) -> jax.Array:
    """Reinterpret uint8 bytes as int8 (two's complement), same shape."""
    return jax.lax.bitcast_convert_type(b, jnp.int8)


def nibbles(b: jax.Array) -> jax.Array:
    """Split bytes into (low, high) nibbles: uint8 [..., n] -> uint8 [..., 2, n].

    ggml's 4-bit layouts store element j of a run in the low nibble of byte j and element
    j + n in the high nibble, so ``nibbles(qs).reshape(..., 2 * n)`` is the element order.
    """
    return jnp.stack([b & 0x0F, b >> 4], axis=-2)


def crumbs(b: jax.Array) -> jax.Array:
    """Split bytes into their four 2-bit fields, lowest first: uint8 [..., n] -> uint8 [..., 4, n]."""
    return jnp.stack([(b >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-2)


def bits(b: jax.Array) -> jax.Array:
    """Split bytes into their eight bits, lowest first: uint8 [..., n] -> uint8 [..., 8, n]."""
    return jnp.stack([(b >> s) & 0x01 for s in range(8)], axis=-2)


def bits_le(b: jax.Array) -> jax.Array:
    """Bits of a little-endian bit field in element order: uint8 [..., n] -> uint8 [..., 8 * n].

    Bit j of the field (bit j % 8 of byte j // 8) comes out at position j, as when ggml reads
    the bytes as one little-endian uint32 and shifts right by j.
    """
    per_byte = jnp.stack([(b >> s) & 0x01 for s in range(8)], axis=-1)  # [..., n, 8]
    return per_byte.reshape(*b.shape[:-1], 8 * b.shape[-1])


def bytes_as(data: jax.Array, dtype) -> jax.Array:
    """Reinterpret little-endian bytes as ``dtype``: uint8 [..., k * size] -> dtype [..., k]."""
    size = jnp.dtype(dtype).itemsize
    grouped = data.reshape(*data.shape[:-1], data.shape[-1] // size, size)  # [..., k, size]
    return jax.lax.bitcast_convert_type(grouped, dtype)
