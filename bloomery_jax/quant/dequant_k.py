"""jnp dequantization of the K-quant super-block formats (256 elements a block).

Each function maps uint8 ``[B, block_bytes]`` (B blocks) to float32 ``[B, 256]``. The
arithmetic is ggml's reference order: the f16 super-scales are widened to f32, multiplied by
the integer sub-block scale first (``d * sc``, ``dmin * m``), and that product then multiplies
the quant. Every product here is exact in f32 (an 11-bit f16 significand times integers of at
most 12 bits in all), so only the final subtraction rounds, and it rounds the same way whether
or not the compiler fuses it into an FMA. That is why these are bit-exact with gguf on any
backend, not just on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .unpack import as_int8, bits, crumbs, f16, nibbles

QK_K = 256


def _f32(q: jax.Array) -> jax.Array:
    return q.astype(jnp.float32)


def q2_k(blocks: jax.Array) -> jax.Array:
    # block: scales[16] (4-bit scale | 4-bit min) | qs[64] (2-bit) | d (f16) | dmin (f16)
    nb = blocks.shape[0]
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    d, dmin = f16(blocks[:, 80:82])[:, None], f16(blocks[:, 82:84])[:, None]
    dl = d * _f32(scales & 0x0F)  # [B, 16] one scale per 16 elements
    ml = dmin * _f32(scales >> 4)  # [B, 16]
    # qs holds two 128-element halves; within a half, shift s of byte l is element 32 s + l.
    q = crumbs(qs.reshape(nb, 2, 32)).reshape(nb, 16, 16)  # [B, half*4+shift -> sub-block, 16]
    return (dl[..., None] * _f32(q) - ml[..., None]).reshape(nb, QK_K)


def _q3_k_scales(packed: jax.Array) -> jax.Array:
    """Sixteen 6-bit signed scales from 12 bytes: uint8 [B, 12] -> int32 [B, 16] in [-32, 31].

    Low 4 bits: scale i < 8 in the low nibble of byte i, scale i >= 8 in the high nibble of
    byte i - 8. High 2 bits: scale i in bits 2 (i // 4) of byte 8 + i % 4.
    """
    nb = packed.shape[0]
    low = nibbles(packed[:, 0:8]).reshape(nb, 16)  # [B, 16]
    high = crumbs(packed[:, 8:12]).reshape(nb, 16)  # [B, shift*4+byte]
    return (low | (high << 4)).astype(jnp.int32) - 32


def q3_k(blocks: jax.Array) -> jax.Array:
    # block: hmask[32] (3rd bit) | qs[64] (low 2 bits) | scales[12] (6-bit) | d (f16)
    nb = blocks.shape[0]
    hmask, qs = blocks[:, 0:32], blocks[:, 32:96]
    d = f16(blocks[:, 108:110])[:, None]
    dl = d * _f32(_q3_k_scales(blocks[:, 96:108]))  # [B, 16]
    low = crumbs(qs.reshape(nb, 2, 32)).reshape(nb, 16, 16).astype(jnp.int32)
    # bit b of hmask[l] belongs to element 32 b + l; a clear bit subtracts 4
    high = bits(hmask).reshape(nb, 16, 16).astype(jnp.int32)  # [B, bit*2+l//16, 16]
    q = low - ((1 - high) << 2)
    return (dl[..., None] * _f32(q)).reshape(nb, QK_K)


def k4_scales_mins(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eight 6-bit scales and mins of Q4_K / Q5_K: uint8 [B, 12] -> (uint8 [B, 8], uint8 [B, 8]).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; sub-blocks 4-7 keep
    their low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits in
    the spare top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = jnp.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def q4_k(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | dmin (f16) | scales[12] (6-bit scale, 6-bit min per 32) | qs[128] (4-bit)
    nb = blocks.shape[0]
    d, dmin = f16(blocks[:, 0:2])[:, None], f16(blocks[:, 2:4])[:, None]
    sc, mn = k4_scales_mins(blocks[:, 4:16])
    dl = d * _f32(sc)  # [B, 8]
    ml = dmin * _f32(mn)  # [B, 8]
    # 32 bytes carry 64 elements: low nibbles the first sub-block, high nibbles the next
    q = nibbles(blocks[:, 16:144].reshape(nb, 4, 32)).reshape(nb, 8, 32)  # [B, 8, 32]
    return (dl[..., None] * _f32(q) - ml[..., None]).reshape(nb, QK_K)


def q5_k(blocks: jax.Array) -> jax.Array:
    # block: d | dmin | scales[12] | qh[32] (5th bit) | qs[128] (low 4 bits)
    nb = blocks.shape[0]
    d, dmin = f16(blocks[:, 0:2])[:, None], f16(blocks[:, 2:4])[:, None]
    sc, mn = k4_scales_mins(blocks[:, 4:16])
    dl = d * _f32(sc)  # [B, 8]
    ml = dmin * _f32(mn)  # [B, 8]
    low = nibbles(blocks[:, 48:176].reshape(nb, 4, 32)).reshape(nb, 8, 32)
    high = bits(blocks[:, 16:48])  # [B, 8, 32]: bit j of qh[l] is the 5th bit of sub-block j
    q = low | (high << 4)
    return (dl[..., None] * _f32(q) - ml[..., None]).reshape(nb, QK_K)


def q6_k(blocks: jax.Array) -> jax.Array:
    # block: ql[128] (low 4 bits) | qh[64] (high 2 bits) | scales[16] (int8) | d (f16)
    nb = blocks.shape[0]
    d = f16(blocks[:, 208:210])[:, None]
    dl = d * _f32(as_int8(blocks[:, 192:208]))  # [B, 16]
    # per 128-element half: ql bytes 0-63 give elements 0-63 (low) and 64-127 (high nibble)
    low = nibbles(blocks[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 8, 32)
    # qh bytes 0-31 of a half: 2-bit field k of byte l is element 32 k + l
    high = crumbs(blocks[:, 128:192].reshape(nb, 2, 32)).reshape(nb, 8, 32)
    q = (low | (high << 4)).astype(jnp.int32) - 32
    return (dl[..., None] * _f32(q.reshape(nb, 16, 16))).reshape(nb, QK_K)
