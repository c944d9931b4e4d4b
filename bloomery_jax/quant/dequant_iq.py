"""jnp dequantization of the non-linear 4-bit formats IQ4_NL (32 a block) and IQ4_XS (256).

Both map a 4-bit index through ggml's fixed 16-entry codebook and multiply by the block
scale (IQ4_XS: f16 super-scale times a 6-bit signed sub-block scale, computed first as in
ggml). Products are exact in f32, so the result is bit-exact with gguf on any backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .unpack import f16, nibbles, u16

# ggml's kvalues_iq4nl: a non-uniform grid denser near zero, where weights cluster.
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def _codebook(idx: jax.Array) -> jax.Array:
    return jnp.asarray(IQ4_NL_VALUES)[idx.astype(jnp.int32)]


def iq4_nl(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | qs[16]: element j in the low nibble of byte j, j + 16 in the high one
    nb = blocks.shape[0]
    d = f16(blocks[:, 0:2])[:, None]
    q = nibbles(blocks[:, 2:18]).reshape(nb, 32)
    return d * _codebook(q)


def iq4_xs(blocks: jax.Array) -> jax.Array:
    # block: d (f16) | scales_h (u16: 2 high bits per sub-block) | scales_l[4] (4 low bits) | qs[128]
    nb = blocks.shape[0]
    d = f16(blocks[:, 0:2])[:, None]
    low = blocks[:, 4:8]
    low = jnp.stack([low & 0x0F, low >> 4], axis=-1).reshape(nb, 8)  # sub-block 2i, 2i+1 in byte i
    shifts = jnp.arange(0, 16, 2, dtype=jnp.uint16)
    high = ((u16(blocks[:, 2:4])[:, None] >> shifts) & 0x03).astype(jnp.uint8)  # [B, 8]
    sc = (low | (high << 4)).astype(jnp.int32) - 32
    dl = d * sc.astype(jnp.float32)  # [B, 8]
    q = nibbles(blocks[:, 8:136].reshape(nb, 8, 16)).reshape(nb, 8, 32)  # [B, 8, 32]
    return (dl[..., None] * _codebook(q)).reshape(nb, 256)
