"""Random quantized blocks with a chosen value scale: the fast path for huge synthetic files.

Quantizing floats costs far more than drawing bytes. For tensors whose values only need to be
random with a known spread (expert weights), :func:`random_blocks` draws the quant bits
uniformly and sets the scale fields so that the *dequantized* values have mean ≈ 0 and
standard deviation ``std``. The blocks are ordinary valid ggml blocks: every reader
(gguf.quants, llama.cpp, ours) decodes them to the same values.

Per block, the super-block scale ``d`` varies by a uniform factor in [0.7, 1.3] and the
sub-block scales vary too, so a kernel that mixes up blocks or sub-blocks gives wrong values
(equal scales everywhere would hide such bugs). With q uniform on 0..n-1, the moments
E[q] = (n-1)/2 and E[q^2] = (n-1)(2n-1)/6 give each block's expected E[x^2] in closed form;
``d`` is solved from it, so E[x^2] = std^2 holds in expectation over the block factor.

Layouts (ggml, little endian; f16 = IEEE half):
  Q8_0  [34]:  d f16 | qs int8[32]                           x = d*q
  Q4_K  [144]: d f16 | dmin f16 | scales[12] | qs[128] 4-bit x = d*sc_j*q - dmin*m_j
  Q5_K  [176]: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]   (5-bit q, same formula)
  Q6_K  [210]: ql[128] | qh[64] | scales int8[16] | d f16    x = d*s_j*(q-32)
The 12 ``scales`` bytes of Q4_K/Q5_K pack eight 6-bit scales sc_j and mins m_j: bytes 0-3 hold
sc_0..3 (low 6 bits) and the top 2 bits of sc_4..7, bytes 4-7 the same for the mins, bytes 8-11
the low nibbles of sc_4..7 (low half) and m_4..7 (high half).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

FAST_TYPES = frozenset({T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})

_U_LO, _U_HI = 0.7, 1.3  # per-block scale factor range
_EU2 = (_U_HI**3 - _U_LO**3) / (3 * (_U_HI - _U_LO))  # E[u^2] for u ~ U[lo, hi]


def _moments(n_levels: int) -> tuple[float, float]:
    """(E[q], E[q^2]) for q uniform on 0..n_levels-1."""
    return (n_levels - 1) / 2, (n_levels - 1) * (2 * n_levels - 1) / 6


def _random_bytes(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    """Uniform random bytes, uint8 [n, width]; raw 64-bit draws are ~5x faster than integers()."""
    count = n * width
    raw = rng.bit_generator.random_raw((count + 7) // 8)
    return raw.view(np.uint8)[:count].reshape(n, width)


def _block_factor(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.uniform(_U_LO, _U_HI, n) / np.sqrt(_EU2)).astype(np.float32)


def _put_f16(blocks: np.ndarray, at: int, x: np.ndarray) -> None:
    """Store f32 [n] as little-endian f16 into bytes at..at+2 of each block."""
    blocks[:, at:at + 2] = x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and mins, uint8 [n, 8] each -> the 12-byte Q4_K/Q5_K field, uint8 [n, 12]."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


# Every maker gets blocks already full of random bytes (the quant bits stay as drawn) and
# overwrites the scale fields; the scales themselves are drawn from the random bytes they
# replace, which saves separate draws.

_JITTER = np.array([-3, -2, -1, 0, 0, 1, 2, 3], np.int16)  # symmetric: mean 0


def _q8_0(rng, blocks, std):
    eq2 = (256**2 - 1) / 12 + 0.25  # int8 q uniform on -128..127: Var + E[q]^2, E[q] = -0.5
    _put_f16(blocks, 0, std * _block_factor(rng, len(blocks)) / np.float32(np.sqrt(eq2)))


def _k_scales(rng, blocks, std, n_levels):
    """Q4_K/Q5_K: d, dmin and the packed sub-block scales/mins (bytes 0-15)."""
    eq, eq2 = _moments(n_levels)
    r = blocks[:, 4:12].astype(np.int16)  # [n, 8] random bytes
    sc = 32 + (r & 31)  # 32..63
    m = np.clip(sc + _JITTER[r >> 5], 0, 63)
    # dmin = eq*d centres each sub-block when m_j = sc_j; the jitter leaves a small random
    # offset per sub-block whose mean is zero. Per unit d:
    # E[x^2]/d^2 = sc^2 E[q^2] - 2 eq sc m E[q] + eq^2 m^2.
    scf, mf = sc.astype(np.float32), m.astype(np.float32)
    c = (scf * scf * np.float32(eq2) - np.float32(2 * eq * eq) * scf * mf + np.float32(eq * eq) * mf * mf).mean(axis=1)
    d = (std * _block_factor(rng, len(blocks)) / np.sqrt(c)).astype(np.float16).astype(np.float32)
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, d * np.float32(eq))
    blocks[:, 4:16] = _pack_k_scales(sc.astype(np.uint8), m.astype(np.uint8))


def _q4_k(rng, blocks, std):
    _k_scales(rng, blocks, std, 16)


def _q5_k(rng, blocks, std):
    _k_scales(rng, blocks, std, 32)


def _q6_k(rng, blocks, std):
    _, eq2 = _moments(64)
    eq2 = eq2 - 2 * 32 * 31.5 + 32**2  # E[(q-32)^2] for q uniform on 0..63
    r = blocks[:, 192:208]  # [n, 16] random bytes -> scales of magnitude 64..127, random sign
    mag = 64 + (r & 63).astype(np.int16)
    s = np.where(r & 64, -mag, mag)
    ms = (mag.astype(np.float32) ** 2).mean(axis=1)
    blocks[:, 192:208] = s.astype(np.int8).view(np.uint8)
    _put_f16(blocks, 208, std * _block_factor(rng, len(blocks)) / np.sqrt(ms * np.float32(eq2)))


_MAKERS = {T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def random_blocks(qtype, shape, std: float, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of ``qtype`` whose dequantized values have mean ≈ 0 and std ≈ ``std``.

    Args:
      qtype: one of FAST_TYPES.
      shape: logical shape (NumPy order); the last axis must be a multiple of the block size.
      std: the intended standard deviation of the dequantized values.
      rng: the source of randomness (the result is a pure function of its state).
    Returns:
      uint8 ``[*shape[:-1], row_bytes]``.
    """
    qtype = T(qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if shape[-1] % elems:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size {elems}")
    n = int(np.prod(shape)) // elems
    blocks = _random_bytes(rng, n, nbytes)  # [n_blocks, block_bytes]
    _MAKERS[qtype](rng, blocks, np.float32(std))
    return blocks.reshape(*shape[:-1], shape[-1] // elems * nbytes)
