"""NumPy quantizers for the 32-element legacy formats Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.

Vectorized twins of ggml's reference quantizers (``quantize_row_q4_0_ref`` etc.), with the
same float32 arithmetic, so their bytes are identical to ggml's and gguf-py's for every
input whose scales fit in f16. Two deliberate differences, both only where ggml would
produce a block that reads back inf or NaN: an f16 scale or min beyond ±65504 saturates
there, and a scale so small that its inverse overflows gives quants of a zero block.

Each function maps f32 ``[NB, 32]`` to uint8 ``[NB, block_bytes]``.
"""

from __future__ import annotations

import numpy as np

from .quantize_k import f16_bytes

f32 = np.float32


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d where that is finite, else 0 (ggml: ``d ? 1/d : 0``): f32 [NB] -> [NB, 1]."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(d != 0, f32(1) / np.where(d != 0, d, 1), 0).astype(f32)
    return np.where(np.isfinite(inv), inv, 0)[:, None]


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The first element of largest magnitude, with its sign: f32 [NB, 32] -> [NB]."""
    return x[np.arange(x.shape[0]), np.abs(x).argmax(axis=1)]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [NB, 32] -> [NB, 16]: element j low nibble of byte j, element j + 16 high."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 quants as a little-endian uint32 field: uint8 [NB, 32] -> [NB, 4]."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _quants(v: np.ndarray, top: int) -> np.ndarray:
    # ggml truncates (v + offset) toward zero with an int8 cast, then caps at `top`
    return np.clip(np.trunc(v), 0, top).astype(np.uint8)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """d = (signed absmax) / -8, q = trunc(x / d + 8.5): d | qs[16]."""
    d = _signed_absmax(x) / f32(-8)
    q = _quants(x * _inverse(d) + f32(8.5), 15)
    return np.concatenate([f16_bytes(d), _pack_nibbles(q)], axis=1)


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    """d = (max - min) / 15, q = trunc((x - min) / d + 0.5): d | m | qs[16]."""
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / f32(15)
    q = _quants((x - lo[:, None]) * _inverse(d) + f32(0.5), 15)
    return np.concatenate([f16_bytes(d), f16_bytes(lo), _pack_nibbles(q)], axis=1)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """d = (signed absmax) / -16, q = trunc(x / d + 16.5): d | qh[4] | qs[16]."""
    d = _signed_absmax(x) / f32(-16)
    q = _quants(x * _inverse(d) + f32(16.5), 31)
    return np.concatenate([f16_bytes(d), _pack_fifth_bits(q), _pack_nibbles(q)], axis=1)


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """d = (max - min) / 31, q = trunc((x - min) / d + 0.5): d | m | qh[4] | qs[16]."""
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / f32(31)
    q = _quants((x - lo[:, None]) * _inverse(d) + f32(0.5), 31)
    return np.concatenate([f16_bytes(d), f16_bytes(lo), _pack_fifth_bits(q), _pack_nibbles(q)], axis=1)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """d = max|x| / 127, q = round(x / d) half away from zero: d | qs[32] (int8)."""
    d = np.abs(x).max(axis=1) / f32(127)
    v = x * _inverse(d)
    # floor of |v| plus an exact test of its fraction: roundf without the 0.49999997 + 0.5 trap
    a = np.abs(v)
    fl = np.floor(a)
    q = np.copysign(fl + (a - fl >= 0.5), v).astype(np.int8)
    return np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1)
