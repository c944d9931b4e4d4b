"""Numba row dot products on raw GGUF blocks, and the activation quantizers they pair with.

Each ``dot_<format>_<act>(row, ...) -> float32`` takes one weight row as the file's bytes
(uint8 ``[row_bytes]``, a view of the memmap) and one activation row, and returns their dot
product without ever writing the dequantized row out. For several tokens on one row,
``decode_row`` + ``mdot`` (at the end) decode the row once into a small buffer and dot it with
each token, four at a time, with the same integer block sums. Two activation variants:

* ``_f32``: float32 activations. Each block's products are summed as ``scale * quant * x``
  in float32 (the min term of Q4_K/Q5_K through precomputed sums of ``x`` per 32).
* ``_q8``: activations rounded to 8 bits as ggml's CPU backend does (``bloomery_jax.ops.actquant``
  is the spec; :func:`quantize_q8_k` / :func:`quantize_q8_0` are bit-equal to it): Q8_K (one
  f32 scale per 256, int32 sums per 32) for the K-quants, Q8_0 (f16 scale per 32) for Q8_0.
  Products are exact int32 sums per block; only the per-block combination is float.
  F32/F16/BF16 weights always take float32 activations.

Vectorization (checked with ``inspect_asm``; numba 0.68, LLVM 22 via llvmlite 0.50, target
znver4; ``scripts/host_bench.py --asm`` prints the mix). Every hot loop is a fixed 32-trip
(Q6_K: 16-trip) loop whose body covers a whole 256-element block (Q8_0: four 32-element
blocks), so LLVM keeps it a loop and the loop vectorizer turns it into packed SIMD on ymm:
  * q8 K-quants: vpmullw (quant × sub-block scale, int16) + vpdpwssd (× activation, pairwise
    into int32 lanes), one horizontal sum per 256; Q6_K also vpmaddwd; Q8_0 vpmaddwd/vpdpwssd;
  * f32: vpmovzxbd + vcvtdq2ps + vmulps/vfmadd…ps on zmm; F16/BF16 rows use vgatherdps (table).
Traps found on the way, each worth 2-8x: (1) a body of one 32-element block gets fully unrolled
before the vectorizer runs and then stays scalar (Q8_0: 2 GB/s instead of 17); (2) Numba types
int32 * int32 as int64, so every partial product is wrapped back to int16/int32 explicitly, or
LLVM keeps 64-bit lanes (vpmuldq); (3) LLVM uses vpmaddwd only where it can prove both factors
fit 16 bits: hence ``_p16`` and sign extensions instead of arithmetic for int8 scales; (4) the
Q4_K/Q5_K min term, summed inside the block loop, stopped the quant loop from vectorizing at all
("value that could not be identified as reduction"): it is a loop of its own. No vpmaddubsw or
vpdpbusd: LLVM does not form them from plain code, so the 8-bit products go through int16.
Where the CPU has AVX2, ``dot_q4_k_q8``, ``dot_q5_k_q8`` and ``dot_q6_k_q8`` are ``host.simd``'s row
dots in vector IR (vpmaddubsw + vpmaddwd on int8 activations, float lane accumulators; the same
block integers), which read :func:`pack_q8_k`'s int8 form of the activations: the ``_avx2``
kernels (32 quants an instruction), or with ``BLOOMERY_HOST_ISA=avx512`` the ``_avx512`` ones (64,
where the CPU has AVX-512BW); the ``_portable`` ones serve the rest (and ``=portable``). Every
variant the CPU can run is tested. All take ``(row, xq, xq8, xd, xb, x16, tab16)``.
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import njit

from . import simd

f32 = np.float32
i32 = np.int32
i16 = np.int16

# Kernel format codes (runtime ints in the compiled kernels: one compilation serves every format).
F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K = range(7)
FORMAT_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
QK_K = 256

_JIT = dict(cache=True, fastmath=True, nogil=True)
# The activation quantizers must round exactly like ggml (no reassociation, no reciprocal estimates).
_JIT_EXACT = dict(cache=True, fastmath=False, nogil=True)


# BLOOMERY_HOST_ISA (read at import): "avx2" (default), "avx512" (zmm kernels where the CPU has
# AVX-512BW) or "portable". AVX2 is the default because it ran the whole layer faster on the one
# AVX-512 Xeon measured (16 threads, 2026-12-04: 0.348 against 0.383 ms a token, 1.67 against
# 1.85 ms for eight), though a zmm Q6_K row ran 1.2x from L2 there and the VM's Zen 4 gains 1.1x.
HOST_ISA = os.environ.get("BLOOMERY_HOST_ISA", "avx2")
if HOST_ISA not in ("avx512", "avx2", "portable"):
    raise ValueError(f"BLOOMERY_HOST_ISA must be avx2, avx512 or portable, got {HOST_ISA!r}")


def _pick(avx512, avx2, portable):
    """The row kernel BLOOMERY_HOST_ISA asks for, or the next narrower one this CPU has."""
    if simd.HAS_AVX512BW and HOST_ISA == "avx512":
        return avx512
    return avx2 if simd.HAS_AVX2 and HOST_ISA != "portable" else portable


def conversion_tables() -> tuple[np.ndarray, np.ndarray]:
    """f16 and bf16 bit patterns → float32 values: two float32 [65536] lookup tables (exact)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    tab16 = bits.view(np.float16).astype(np.float32)
    tabbf = (bits.astype(np.uint32) << 16).view(np.float32)
    return tab16, tabbf


@njit(inline="always")
def _f16(row, o, tab16):
    return tab16[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@njit(inline="always")
def _k4_scales(row, o):
    """Q4_K/Q5_K: the eight 6-bit scales and mins of the block at byte ``o`` (12 bytes at o + 4)."""
    a, b, c = o + 4, o + 8, o + 12
    s0 = i32(row[a] & 63)
    s1 = i32(row[a + 1] & 63)
    s2 = i32(row[a + 2] & 63)
    s3 = i32(row[a + 3] & 63)
    s4 = i32((row[c] & 15) | ((row[a] >> 2) & 0x30))
    s5 = i32((row[c + 1] & 15) | ((row[a + 1] >> 2) & 0x30))
    s6 = i32((row[c + 2] & 15) | ((row[a + 2] >> 2) & 0x30))
    s7 = i32((row[c + 3] & 15) | ((row[a + 3] >> 2) & 0x30))
    m0 = i32(row[b] & 63)
    m1 = i32(row[b + 1] & 63)
    m2 = i32(row[b + 2] & 63)
    m3 = i32(row[b + 3] & 63)
    m4 = i32((row[c] >> 4) | ((row[b] >> 2) & 0x30))
    m5 = i32((row[c + 1] >> 4) | ((row[b + 1] >> 2) & 0x30))
    m6 = i32((row[c + 2] >> 4) | ((row[b + 2] >> 2) & 0x30))
    m7 = i32((row[c + 3] >> 4) | ((row[b + 3] >> 2) & 0x30))
    return s0, s1, s2, s3, s4, s5, s6, s7, m0, m1, m2, m3, m4, m5, m6, m7


@njit(inline="always")
def _k4_min_term(row, block_bytes, xd, xb, tab16):
    """Q4_K/Q5_K · Q8_K: the sum over blocks of xd dmin sum_j m_j xb_j.

    A loop of its own: computed inside the block loop, it stopped LLVM from vectorizing the
    quant loop ("value that could not be identified as reduction is used outside the loop").
    """
    acc = f32(0)
    for b in range(row.shape[0] // block_bytes):
        o = b * block_bytes
        _, _, _, _, _, _, _, _, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
        j = b * 8
        mins = i32(m0 * xb[j] + m1 * xb[j + 1] + m2 * xb[j + 2] + m3 * xb[j + 3]
                   + m4 * xb[j + 4] + m5 * xb[j + 5] + m6 * xb[j + 6] + m7 * xb[j + 7])
        acc += xd[b] * _f16(row, o + 2, tab16) * f32(mins)
    return acc


# ---------------------------------------------------------------------------------------------
# Q4_K: d | dmin | scales[12] | qs[128]; sub-block j, element l: nibble j % 2 of qs[32 (j // 2) + l]


@njit(**_JIT)
def dot_q4_k_f32(row, x, xs, tab16):
    """Q4_K row · float32 x. ``xs``: float32 [K / 32] sums of x per 32 (for the mins)."""
    acc = f32(0)
    for b in range(row.shape[0] // 144):
        o = b * 144
        x0 = b * 256
        d = _f16(row, o, tab16)
        dmin = _f16(row, o + 2, tab16)
        s0, s1, s2, s3, s4, s5, s6, s7, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
        c0, c1, c2, c3 = d * f32(s0), d * f32(s1), d * f32(s2), d * f32(s3)
        c4, c5, c6, c7 = d * f32(s4), d * f32(s5), d * f32(s6), d * f32(s7)
        q = o + 16
        s = f32(0)
        for l in range(32):
            b0, b1, b2, b3 = row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
            s += (c0 * f32(i32(b0 & 15)) * x[x0 + l] + c1 * f32(i32(b0 >> 4)) * x[x0 + 32 + l]
                  + c2 * f32(i32(b1 & 15)) * x[x0 + 64 + l] + c3 * f32(i32(b1 >> 4)) * x[x0 + 96 + l]
                  + c4 * f32(i32(b2 & 15)) * x[x0 + 128 + l] + c5 * f32(i32(b2 >> 4)) * x[x0 + 160 + l]
                  + c6 * f32(i32(b3 & 15)) * x[x0 + 192 + l] + c7 * f32(i32(b3 >> 4)) * x[x0 + 224 + l])
        j = b * 8
        mins = (f32(m0) * xs[j] + f32(m1) * xs[j + 1] + f32(m2) * xs[j + 2] + f32(m3) * xs[j + 3]
                + f32(m4) * xs[j + 4] + f32(m5) * xs[j + 5] + f32(m6) * xs[j + 6] + f32(m7) * xs[j + 7])
        acc += s - dmin * mins
    return acc


@njit(**_JIT)
def _dot_q4_k_q8_portable(row, xq, xq8, xd, xb, x16, tab16):
    """Q4_K row · Q8_K x: ``xq`` int16 [K] (8-bit values), ``xd`` float32 [K / 256], ``xb`` int32 [K / 32] sums of xq.
    (``xq8`` / ``x16``, :func:`pack_q8_k`'s, are the AVX2 kernel's: every K-quant q8 dot takes the same arguments.)"""
    acc = f32(0)
    for b in range(row.shape[0] // 144):
        o = b * 144
        x0 = b * 256
        s0, s1, s2, s3, s4, s5, s6, s7, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
        q = o + 16
        s = i32(0)
        for l in range(32):
            b0, b1, b2, b3 = row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
            # each product fits int16 (15 * 127); the 6-bit scale takes it to int32 (vpmaddwd)
            s = i32(s + s0 * i32(i16(b0 & 15) * i16(xq[x0 + l])) + s1 * i32(i16(b0 >> 4) * i16(xq[x0 + 32 + l]))
                    + s2 * i32(i16(b1 & 15) * i16(xq[x0 + 64 + l])) + s3 * i32(i16(b1 >> 4) * i16(xq[x0 + 96 + l]))
                    + s4 * i32(i16(b2 & 15) * i16(xq[x0 + 128 + l])) + s5 * i32(i16(b2 >> 4) * i16(xq[x0 + 160 + l]))
                    + s6 * i32(i16(b3 & 15) * i16(xq[x0 + 192 + l])) + s7 * i32(i16(b3 >> 4) * i16(xq[x0 + 224 + l])))
        acc += xd[b] * _f16(row, o, tab16) * f32(s)
    return acc - _k4_min_term(row, 144, xd, xb, tab16)


@njit(**_JIT)
def _dot_q4_k_q8_avx2(row, xq, xq8, xd, xb, x16, tab16):
    """:func:`_dot_q4_k_q8_portable` by ``simd.q4k_row_dot`` (the same block integers, summed in lanes)."""
    return simd.q4k_row_dot(row, xq8, xd, xb)


@njit(**_JIT)
def _dot_q4_k_q8_avx512(row, xq, xq8, xd, xb, x16, tab16):
    """:func:`_dot_q4_k_q8_avx2` 64 quants an instruction (zmm)."""
    return simd.q4k_row_dot_wide(row, xq8, xd, xb)


dot_q4_k_q8 = _pick(_dot_q4_k_q8_avx512, _dot_q4_k_q8_avx2, _dot_q4_k_q8_portable)


# ---------------------------------------------------------------------------------------------
# Q5_K: d | dmin | scales[12] | qh[32] | qs[128]; as Q4_K, plus bit j of qh[l] as the 5th bit


@njit(inline="always")
def _q5(lo, h, j):
    # narrowed step by step: numba widens every integer op to int64, and LLVM keeps 64-bit lanes otherwise
    return i32(i32((lo >> (4 * (j & 1))) & 15) | i32(i32((h >> j) & 1) << 4))


@njit(**_JIT)
def dot_q5_k_f32(row, x, xs, tab16):
    acc = f32(0)
    for b in range(row.shape[0] // 176):
        o = b * 176
        x0 = b * 256
        d = _f16(row, o, tab16)
        dmin = _f16(row, o + 2, tab16)
        s0, s1, s2, s3, s4, s5, s6, s7, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
        c0, c1, c2, c3 = d * f32(s0), d * f32(s1), d * f32(s2), d * f32(s3)
        c4, c5, c6, c7 = d * f32(s4), d * f32(s5), d * f32(s6), d * f32(s7)
        qh = o + 16
        q = o + 48
        s = f32(0)
        for l in range(32):
            h = row[qh + l]
            b0, b1, b2, b3 = row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
            s += (c0 * f32(i32(_q5(b0, h, 0))) * x[x0 + l] + c1 * f32(i32(_q5(b0, h, 1))) * x[x0 + 32 + l]
                  + c2 * f32(i32(_q5(b1, h, 2))) * x[x0 + 64 + l] + c3 * f32(i32(_q5(b1, h, 3))) * x[x0 + 96 + l]
                  + c4 * f32(i32(_q5(b2, h, 4))) * x[x0 + 128 + l] + c5 * f32(i32(_q5(b2, h, 5))) * x[x0 + 160 + l]
                  + c6 * f32(i32(_q5(b3, h, 6))) * x[x0 + 192 + l] + c7 * f32(i32(_q5(b3, h, 7))) * x[x0 + 224 + l])
        j = b * 8
        mins = (f32(m0) * xs[j] + f32(m1) * xs[j + 1] + f32(m2) * xs[j + 2] + f32(m3) * xs[j + 3]
                + f32(m4) * xs[j + 4] + f32(m5) * xs[j + 5] + f32(m6) * xs[j + 6] + f32(m7) * xs[j + 7])
        acc += s - dmin * mins
    return acc


@njit(**_JIT)
def _dot_q5_k_q8_portable(row, xq, xq8, xd, xb, x16, tab16):
    acc = f32(0)
    for b in range(row.shape[0] // 176):
        o = b * 176
        x0 = b * 256
        s0, s1, s2, s3, s4, s5, s6, s7, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
        qh = o + 16
        q = o + 48
        s = i32(0)
        for l in range(32):
            h = row[qh + l]
            b0, b1, b2, b3 = row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
            s = i32(s + s0 * i32(i16(_q5(b0, h, 0)) * i16(xq[x0 + l]))
                    + s1 * i32(i16(_q5(b0, h, 1)) * i16(xq[x0 + 32 + l]))
                    + s2 * i32(i16(_q5(b1, h, 2)) * i16(xq[x0 + 64 + l]))
                    + s3 * i32(i16(_q5(b1, h, 3)) * i16(xq[x0 + 96 + l]))
                    + s4 * i32(i16(_q5(b2, h, 4)) * i16(xq[x0 + 128 + l]))
                    + s5 * i32(i16(_q5(b2, h, 5)) * i16(xq[x0 + 160 + l]))
                    + s6 * i32(i16(_q5(b3, h, 6)) * i16(xq[x0 + 192 + l]))
                    + s7 * i32(i16(_q5(b3, h, 7)) * i16(xq[x0 + 224 + l])))
        acc += xd[b] * _f16(row, o, tab16) * f32(s)
    return acc - _k4_min_term(row, 176, xd, xb, tab16)


@njit(**_JIT)
def _dot_q5_k_q8_avx2(row, xq, xq8, xd, xb, x16, tab16):
    return simd.q5k_row_dot(row, xq8, xd, xb)


@njit(**_JIT)
def _dot_q5_k_q8_avx512(row, xq, xq8, xd, xb, x16, tab16):
    return simd.q5k_row_dot_wide(row, xq8, xd, xb)


dot_q5_k_q8 = _pick(_dot_q5_k_q8_avx512, _dot_q5_k_q8_avx2, _dot_q5_k_q8_portable)


# ---------------------------------------------------------------------------------------------
# Q6_K: ql[128] | qh[64] | scales[16] (int8) | d. In half h (128 elements), element 32 g + l:
# low 4 bits: nibble g // 2 of ql[64 h + 32 (g % 2) + l]; high 2 bits: bits 2g of qh[32 h + l];
# value (q - 32) * scale[8 h + (32 g + l) // 16] * d.


@njit(inline="always")
def _q6(row, ql, qh, g, l):
    lo = i32((row[ql + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15)
    return i32(i32(lo | i32(i32((row[qh + l] >> (2 * g)) & 3) << 4)) - 32)


@njit(inline="always")
def _p16(a, b):
    """a * b known to fit int16, said so to LLVM (truncation) so that it can use vpmaddwd."""
    return i32(i16(i16(a) * i16(b)))


@njit(inline="always")
def _i8(v):
    return i32(np.int8(v))  # a sign extension: LLVM then knows the value fits 8 bits


@njit(**_JIT)
def dot_q6_k_f32(row, x, tab16):
    acc = f32(0)
    for b in range(row.shape[0] // 210):
        o = b * 210
        d = _f16(row, o + 208, tab16)
        sc = o + 192
        for h in range(2):
            ql = o + 64 * h
            qh = o + 128 + 32 * h
            x0 = b * 256 + 128 * h
            k = sc + 8 * h
            c0, c1, c2, c3 = d * f32(_i8(row[k])), d * f32(_i8(row[k + 1])), d * f32(_i8(row[k + 2])), d * f32(_i8(row[k + 3]))
            c4, c5, c6, c7 = d * f32(_i8(row[k + 4])), d * f32(_i8(row[k + 5])), d * f32(_i8(row[k + 6])), d * f32(_i8(row[k + 7]))
            s = f32(0)
            for l in range(16):
                m = l + 16
                s += (c0 * f32(_q6(row, ql, qh, 0, l)) * x[x0 + l] + c1 * f32(_q6(row, ql, qh, 0, m)) * x[x0 + m]
                      + c2 * f32(_q6(row, ql, qh, 1, l)) * x[x0 + 32 + l] + c3 * f32(_q6(row, ql, qh, 1, m)) * x[x0 + 32 + m]
                      + c4 * f32(_q6(row, ql, qh, 2, l)) * x[x0 + 64 + l] + c5 * f32(_q6(row, ql, qh, 2, m)) * x[x0 + 64 + m]
                      + c6 * f32(_q6(row, ql, qh, 3, l)) * x[x0 + 96 + l] + c7 * f32(_q6(row, ql, qh, 3, m)) * x[x0 + 96 + m])
            acc += s
    return acc


@njit(**_JIT)
def _dot_q6_k_q8_portable(row, xq, xq8, xd, xb, x16, tab16):
    acc = f32(0)
    for b in range(row.shape[0] // 210):
        o = b * 210
        sc = o + 192
        s = i32(0)
        for h in range(2):
            ql = o + 64 * h
            qh = o + 128 + 32 * h
            x0 = b * 256 + 128 * h
            k = sc + 8 * h
            c0, c1, c2, c3 = _i8(row[k]), _i8(row[k + 1]), _i8(row[k + 2]), _i8(row[k + 3])
            c4, c5, c6, c7 = _i8(row[k + 4]), _i8(row[k + 5]), _i8(row[k + 6]), _i8(row[k + 7])
            for l in range(16):
                m = l + 16
                # (q - 32) * x fits int16 (32 * 127); the int8 scale takes it to int32
                s = i32(s + c0 * _p16(_q6(row, ql, qh, 0, l), xq[x0 + l])
                        + c1 * _p16(_q6(row, ql, qh, 0, m), xq[x0 + m])
                        + c2 * _p16(_q6(row, ql, qh, 1, l), xq[x0 + 32 + l])
                        + c3 * _p16(_q6(row, ql, qh, 1, m), xq[x0 + 32 + m])
                        + c4 * _p16(_q6(row, ql, qh, 2, l), xq[x0 + 64 + l])
                        + c5 * _p16(_q6(row, ql, qh, 2, m), xq[x0 + 64 + m])
                        + c6 * _p16(_q6(row, ql, qh, 3, l), xq[x0 + 96 + l])
                        + c7 * _p16(_q6(row, ql, qh, 3, m), xq[x0 + 96 + m]))
        acc += xd[b] * (_f16(row, o + 208, tab16) * f32(s))
    return acc


@njit(**_JIT)
def _dot_q6_k_q8_avx2(row, xq, xq8, xd, xb, x16, tab16):
    """:func:`_dot_q6_k_q8_portable` by ``simd.q6k_row_dot`` (the same block integers, summed in lanes)."""
    return simd.q6k_row_dot(row, xq8, xd, x16)


@njit(**_JIT)
def _dot_q6_k_q8_avx512(row, xq, xq8, xd, xb, x16, tab16):
    return simd.q6k_row_dot_wide(row, xq8, xd, x16)


dot_q6_k_q8 = _pick(_dot_q6_k_q8_avx512, _dot_q6_k_q8_avx2, _dot_q6_k_q8_portable)


# ---------------------------------------------------------------------------------------------
# Q8_0: d (f16) | qs[32] (int8). Four blocks per loop body (see the module docstring).


@njit(**_JIT)
def dot_q8_0_f32(row, x, tab16):
    nb = row.shape[0] // 34
    acc = f32(0)
    for b in range(0, nb - nb % 4, 4):
        o = b * 34
        x0 = b * 32
        s0 = f32(0)
        s1 = f32(0)
        s2 = f32(0)
        s3 = f32(0)
        for l in range(32):
            s0 += f32(np.int8(row[o + 2 + l])) * x[x0 + l]
            s1 += f32(np.int8(row[o + 36 + l])) * x[x0 + 32 + l]
            s2 += f32(np.int8(row[o + 70 + l])) * x[x0 + 64 + l]
            s3 += f32(np.int8(row[o + 104 + l])) * x[x0 + 96 + l]
        acc += (_f16(row, o, tab16) * s0 + _f16(row, o + 34, tab16) * s1
                + _f16(row, o + 68, tab16) * s2 + _f16(row, o + 102, tab16) * s3)
    for b in range(nb - nb % 4, nb):  # rows of 32 * (4 n + r) elements: a scalar tail
        o = b * 34
        s = f32(0)
        for l in range(32):
            s += f32(np.int8(row[o + 2 + l])) * x[b * 32 + l]
        acc += _f16(row, o, tab16) * s
    return acc


@njit(**_JIT)
def dot_q8_0_q8(row, xq, xd, tab16):
    """Q8_0 row · Q8_0 x: ``xq`` int16 [K] (8-bit values), ``xd`` float32 [K / 32] (f16-rounded scales)."""
    nb = row.shape[0] // 34
    acc = f32(0)
    for b in range(0, nb - nb % 4, 4):
        o = b * 34
        x0 = b * 32
        s0 = i32(0)
        s1 = i32(0)
        s2 = i32(0)
        s3 = i32(0)
        for l in range(32):
            s0 = i32(s0 + i32(np.int8(row[o + 2 + l])) * i32(xq[x0 + l]))
            s1 = i32(s1 + i32(np.int8(row[o + 36 + l])) * i32(xq[x0 + 32 + l]))
            s2 = i32(s2 + i32(np.int8(row[o + 70 + l])) * i32(xq[x0 + 64 + l]))
            s3 = i32(s3 + i32(np.int8(row[o + 104 + l])) * i32(xq[x0 + 96 + l]))
        acc += (_f16(row, o, tab16) * xd[b] * f32(s0) + _f16(row, o + 34, tab16) * xd[b + 1] * f32(s1)
                + _f16(row, o + 68, tab16) * xd[b + 2] * f32(s2) + _f16(row, o + 102, tab16) * xd[b + 3] * f32(s3))
    for b in range(nb - nb % 4, nb):
        o = b * 34
        s = i32(0)
        for l in range(32):
            s = i32(s + i32(np.int8(row[o + 2 + l])) * i32(xq[b * 32 + l]))
        acc += _f16(row, o, tab16) * xd[b] * f32(s)
    return acc


# ---------------------------------------------------------------------------------------------
# Float rows (the bytes of F32 / F16 / BF16 values)


@njit(**_JIT)
def dot_f32(row, x):
    w = row.view(np.float32)
    acc = f32(0)
    for i in range(w.shape[0]):
        acc += w[i] * x[i]
    return acc


@njit(**_JIT)
def dot_f16(row, x, tab):
    """F16 (``tab`` = the f16 table) or BF16 (the bf16 table) row · float32 x, by table lookup."""
    w = row.view(np.uint16)
    acc = f32(0)
    for i in range(w.shape[0]):
        acc += tab[w[i]] * x[i]
    return acc


# ---------------------------------------------------------------------------------------------
# Activation rounding, bit-equal with bloomery_jax.ops.actquant (ggml-cpu's x86 paths)


_ABS_BITS = i32(0x7FFFFFFF)  # a float32's bits without the sign: for non-NaN x they order as |x|
_INF_BITS = i32(0x7F800000)  # above this, a NaN


@njit(**_JIT_EXACT)
def _abs_top(bits):
    """The largest |x| of x's float32 ``bits`` (int32), as bits without the sign; NaNs left out.
    Integer lanes: LLVM vectorizes this (vpmaxsd) where it would not the float scan (every int32
    kept int32: Numba widens int32 arithmetic to int64, which halves the lanes)."""
    top = i32(0)
    for j in range(bits.shape[0]):
        a = i32(bits[j] & _ABS_BITS)
        top = max(top, a if a <= _INF_BITS else i32(0))
    return top


@njit(**_JIT_EXACT)
def quantize_q8_k(x, xq, xd, xb):
    """float32 x [K] → Q8_K: xq int16 [K], xd float32 [K / 256], xb int32 [K / 32] (sums of xq).

    The 8-bit quants are stored widened to int16: the dot loops then read them without a sign
    extension each time (measured +10% for Q4_K, +27% Q6_K, +50% Q8_0 on one thread).

    Per 256: the first element of largest |x| sets ``iscale = -127 / x_max``; ``q = min(127,
    rint(iscale * x))`` (half to even, as ggml's nearest_int) and the value is ``q * (1 / iscale)``.
    The largest |x| is found per 32 on the bits (_abs_top), then the first element holding it, in
    the first 32 that does: the same element as one scalar scan, 1.91 against 2.80 us for K = 2048
    and 0.79 against 1.07 for 768 (one core of the 2-core VM, twenty-third session).
    """
    tops = np.empty(8, np.int32)
    for b in range(x.shape[0] // QK_K):
        x0 = b * QK_K
        bits = x[x0:x0 + QK_K].view(np.int32)
        top = i32(0)
        for c in range(8):
            tops[c] = _abs_top(bits[32 * c:32 * c + 32])
            top = max(top, tops[c])
        if top == 0:
            xd[b] = 0
            xq[x0:x0 + QK_K] = 0
            xb[b * 8:b * 8 + 8] = 0
            continue
        first = 0
        while tops[first // 32] != top:
            first += 32
        while i32(bits[first] & _ABS_BITS) != top:
            first += 1
        iscale = f32(f32(-127.0) / x[x0 + first])
        for j in range(QK_K):
            v = np.rint(f32(iscale * x[x0 + j]))
            xq[x0 + j] = np.int16(min(f32(127.0), v))
        xd[b] = f32(f32(1.0) / iscale)
        for j in range(8):
            s = i32(0)
            for i in range(32):
                s = i32(s + i32(xq[x0 + 32 * j + i]))
            xb[b * 8 + j] = s


@njit(**_JIT)
def pack_q8_k(xq, xq8, x16):
    """The AVX2 row dots' form of :func:`quantize_q8_k`'s quants: xq8 int8 [K] (the same values) and
    x16 int16 [K / 16], their sums per 16 (at most 16 * 128)."""
    for i in range(xq.shape[0]):
        xq8[i] = np.int8(xq[i])
    for g in range(x16.shape[0]):
        s = i32(0)
        for i in range(16):
            s += i32(xq[16 * g + i])
        x16[g] = i16(s)


@njit(**_JIT_EXACT)
def f16_round(v):
    """The float32 value of float16(v) (round to nearest even; inf beyond 65504), v >= 0 finite."""
    if v == 0:
        return f32(0)
    _, e = math.frexp(float(v))  # v = m 2^e, 0.5 <= m < 1
    ulp = math.ldexp(1.0, max(e - 1, -14) - 10)  # f16 spacing at v (2^-24 below the normals)
    r = np.rint(float(v) / ulp) * ulp  # exact in float64: v / ulp only rescales
    if r > 65504.0:
        return f32(np.inf)
    return f32(r)


@njit(**_JIT_EXACT)
def quantize_q8_0(x, xq, xd):
    """float32 x [K] → Q8_0: xq int16 [K] (8-bit values, widened as in quantize_q8_k), xd float32 [K / 32].

    Per 32: ``q = rint(x * (127 / amax))``, value ``q * f16(amax / 127)`` (the block stores d as f16).
    """
    for b in range(x.shape[0] // 32):
        x0 = b * 32
        amax = f32(0)
        for j in range(32):
            amax = max(amax, abs(x[x0 + j]))
        inv = f32(f32(127.0) / amax) if amax != 0 else f32(0)
        for j in range(32):
            xq[x0 + j] = np.int16(np.rint(f32(x[x0 + j] * inv)))
        xd[b] = f16_round(f32(amax / f32(127.0)))


@njit(**_JIT)
def sums32(x, xs):
    """float32 x [K] → xs float32 [K / 32], the sum of each 32 (the Q4_K/Q5_K min terms)."""
    for b in range(x.shape[0] // 32):
        s = f32(0)
        for j in range(32):
            s += x[b * 32 + j]
        xs[b] = s


# ---------------------------------------------------------------------------------------------
# Multi-token rows: a row decoded once into small buffers, then dotted with several tokens.
#
# ``decode_row`` turns a quantized row into int16 ``wq [K]`` (the block's integer weight, scale
# included where it is an integer: Q4_K/Q5_K sub-block scale × quant <= 63 * 31, Q6_K int8 scale
# × (q - 32) <= 128 * 32, Q8_0 the int8 quant), the float scale per block ``wsc`` (d per 256,
# Q8_0 per 32) and the Q4_K/Q5_K mins (``wm`` int16 per 32, ``wdm`` = dmin per 256). Against
# Q8_K / Q8_0 activations ``mdot`` then forms the same exact int32 block sums as the per-token
# kernels above (so the same rounding count, K / 32 + 16 at most). For float32 activations
# ``decode_row`` also writes the dequantized row ``wf`` float32 [K]: ``d (s q)`` (exact integer
# s q, one rounding), ``- dmin m`` (two more), and ``mdot`` is a plain K-term float32 dot: at
# most K + 3 roundings a term, within the K + 64 of ``reference.dot_rounds``. F32/F16/BF16 rows
# are copied/looked up into ``wf`` exactly.


@njit(**_JIT)
def decode_row(fmt, kind, row, wq, wsc, wm, wdm, wf, tab16, tabbf):
    """Decode one row of format ``fmt`` for activation kind ``kind`` (0 float32, 1 Q8_K, 2 Q8_0)."""
    K = wq.shape[0]
    if fmt == F32:
        w = row.view(np.float32)
        for i in range(K):
            wf[i] = w[i]
        return
    if fmt == F16 or fmt == BF16:
        tab = tab16 if fmt == F16 else tabbf
        w = row.view(np.uint16)
        for i in range(K):
            wf[i] = tab[w[i]]
        return
    if fmt == Q4_K or fmt == Q5_K:
        bb = 144 if fmt == Q4_K else 176
        for b in range(row.shape[0] // bb):
            o = b * bb
            x0 = b * 256
            s0, s1, s2, s3, s4, s5, s6, s7, m0, m1, m2, m3, m4, m5, m6, m7 = _k4_scales(row, o)
            wsc[b] = _f16(row, o, tab16)
            wdm[b] = _f16(row, o + 2, tab16)
            j = b * 8
            wm[j], wm[j + 1], wm[j + 2], wm[j + 3] = i16(m0), i16(m1), i16(m2), i16(m3)
            wm[j + 4], wm[j + 5], wm[j + 6], wm[j + 7] = i16(m4), i16(m5), i16(m6), i16(m7)
            if fmt == Q4_K:
                q = o + 16
                for l in range(32):
                    b0, b1, b2, b3 = row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
                    wq[x0 + l] = i16(s0 * i32(b0 & 15))
                    wq[x0 + 32 + l] = i16(s1 * i32(b0 >> 4))
                    wq[x0 + 64 + l] = i16(s2 * i32(b1 & 15))
                    wq[x0 + 96 + l] = i16(s3 * i32(b1 >> 4))
                    wq[x0 + 128 + l] = i16(s4 * i32(b2 & 15))
                    wq[x0 + 160 + l] = i16(s5 * i32(b2 >> 4))
                    wq[x0 + 192 + l] = i16(s6 * i32(b3 & 15))
                    wq[x0 + 224 + l] = i16(s7 * i32(b3 >> 4))
            else:
                qh = o + 16
                q = o + 48
                for l in range(32):
                    h = row[qh + l]
                    b0, b1, b2, b3 = row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
                    wq[x0 + l] = i16(s0 * _q5(b0, h, 0))
                    wq[x0 + 32 + l] = i16(s1 * _q5(b0, h, 1))
                    wq[x0 + 64 + l] = i16(s2 * _q5(b1, h, 2))
                    wq[x0 + 96 + l] = i16(s3 * _q5(b1, h, 3))
                    wq[x0 + 128 + l] = i16(s4 * _q5(b2, h, 4))
                    wq[x0 + 160 + l] = i16(s5 * _q5(b2, h, 5))
                    wq[x0 + 192 + l] = i16(s6 * _q5(b3, h, 6))
                    wq[x0 + 224 + l] = i16(s7 * _q5(b3, h, 7))
        if kind == 0:  # (d (s q)) - (dmin m): eight 32-element streams a body, as in the dots
            for b in range(K // 256):
                x0 = b * 256
                d = wsc[b]
                dm = wdm[b]
                j = b * 8
                n0, n1, n2, n3 = dm * f32(wm[j]), dm * f32(wm[j + 1]), dm * f32(wm[j + 2]), dm * f32(wm[j + 3])
                n4, n5, n6, n7 = dm * f32(wm[j + 4]), dm * f32(wm[j + 5]), dm * f32(wm[j + 6]), dm * f32(wm[j + 7])
                for l in range(32):
                    wf[x0 + l] = d * f32(wq[x0 + l]) - n0
                    wf[x0 + 32 + l] = d * f32(wq[x0 + 32 + l]) - n1
                    wf[x0 + 64 + l] = d * f32(wq[x0 + 64 + l]) - n2
                    wf[x0 + 96 + l] = d * f32(wq[x0 + 96 + l]) - n3
                    wf[x0 + 128 + l] = d * f32(wq[x0 + 128 + l]) - n4
                    wf[x0 + 160 + l] = d * f32(wq[x0 + 160 + l]) - n5
                    wf[x0 + 192 + l] = d * f32(wq[x0 + 192 + l]) - n6
                    wf[x0 + 224 + l] = d * f32(wq[x0 + 224 + l]) - n7
        return
    if fmt == Q6_K:
        for b in range(row.shape[0] // 210):
            o = b * 210
            wsc[b] = _f16(row, o + 208, tab16)
            for h in range(2):
                ql = o + 64 * h
                qh = o + 128 + 32 * h
                x0 = b * 256 + 128 * h
                k = o + 192 + 8 * h
                c0, c1, c2, c3 = _i8(row[k]), _i8(row[k + 1]), _i8(row[k + 2]), _i8(row[k + 3])
                c4, c5, c6, c7 = _i8(row[k + 4]), _i8(row[k + 5]), _i8(row[k + 6]), _i8(row[k + 7])
                for l in range(16):
                    m = l + 16
                    wq[x0 + l] = i16(c0 * _q6(row, ql, qh, 0, l))
                    wq[x0 + m] = i16(c1 * _q6(row, ql, qh, 0, m))
                    wq[x0 + 32 + l] = i16(c2 * _q6(row, ql, qh, 1, l))
                    wq[x0 + 32 + m] = i16(c3 * _q6(row, ql, qh, 1, m))
                    wq[x0 + 64 + l] = i16(c4 * _q6(row, ql, qh, 2, l))
                    wq[x0 + 64 + m] = i16(c5 * _q6(row, ql, qh, 2, m))
                    wq[x0 + 96 + l] = i16(c6 * _q6(row, ql, qh, 3, l))
                    wq[x0 + 96 + m] = i16(c7 * _q6(row, ql, qh, 3, m))
        if kind == 0:
            for b in range(K // 256):
                x0 = b * 256
                d = wsc[b]
                for l in range(256):
                    wf[x0 + l] = d * f32(wq[x0 + l])
        return
    # Q8_0: four blocks a body (see the module docstring), then the tail
    nb = row.shape[0] // 34
    for b in range(nb):
        wsc[b] = _f16(row, b * 34, tab16)
    for b in range(0, nb - nb % 4, 4):
        o = b * 34
        x0 = b * 32
        for l in range(32):
            wq[x0 + l] = i16(np.int8(row[o + 2 + l]))
            wq[x0 + 32 + l] = i16(np.int8(row[o + 36 + l]))
            wq[x0 + 64 + l] = i16(np.int8(row[o + 70 + l]))
            wq[x0 + 96 + l] = i16(np.int8(row[o + 104 + l]))
    for b in range(nb - nb % 4, nb):
        for l in range(32):
            wq[b * 32 + l] = i16(np.int8(row[b * 34 + 2 + l]))
    if kind == 0:
        for b in range(0, nb - nb % 4, 4):
            x0 = b * 32
            d0, d1, d2, d3 = wsc[b], wsc[b + 1], wsc[b + 2], wsc[b + 3]
            for l in range(32):
                wf[x0 + l] = d0 * f32(wq[x0 + l])
                wf[x0 + 32 + l] = d1 * f32(wq[x0 + 32 + l])
                wf[x0 + 64 + l] = d2 * f32(wq[x0 + 64 + l])
                wf[x0 + 96 + l] = d3 * f32(wq[x0 + 96 + l])
        for b in range(nb - nb % 4, nb):
            for l in range(32):
                wf[b * 32 + l] = wsc[b] * f32(wq[b * 32 + l])


@njit(**_JIT)
def _mdot_f32(wf, ids, X, res):
    """:func:`mdot` for float32 activations (fast-math: its reductions are vectorized)."""
    n = ids.shape[0]
    n4 = n - n % 4
    for i in range(0, n4, 4):
        res[i], res[i + 1], res[i + 2], res[i + 3] = _fdot4(wf, X[ids[i]], X[ids[i + 1]], X[ids[i + 2]], X[ids[i + 3]])
    for i in range(n4, n):
        res[i] = _fdot1(wf, X[ids[i]])


# Not fast-math: the integer block sums vectorize without it, and its float part (a few scalar
# products a block) must round one way. A non-inlined callee is linked as a weak copy into every
# caller's module and optimized again there; under fast-math that copy may reassociate
# ``xd * d * s`` differently (it did: LLVM 22, the layer kernel's copy of _kdot1), and which copy
# runs depends on load order: a fresh compile runs this function's own code, a process that
# loads the layer kernel from the disk cache its copy (last bits differed, ~15 % of outputs).
@njit(**_JIT_EXACT)
def mdot(fmt, kind, wq, wsc, wm, wdm, wf, ids, X, XQK, XDK, XBK, XQ0, XD0, res):
    """``res[i]`` = the decoded row · activation row ``ids[i]`` (in the form ``kind`` reads).

    Four tokens a pass (each weight vector loaded once for four products, four reductions),
    then the rest one by one; each token's sum is the same expression either way.
    """
    if kind == 0:
        _mdot_f32(wf, ids, X, res)
        return
    n = ids.shape[0]
    n4 = n - n % 4
    if kind == 1:
        mins = fmt == Q4_K or fmt == Q5_K
        for i in range(0, n4, 4):
            a, b, c, d = ids[i], ids[i + 1], ids[i + 2], ids[i + 3]
            res[i], res[i + 1], res[i + 2], res[i + 3] = _kdot4(wq, wsc, XQK[a], XDK[a], XQK[b], XDK[b],
                                                                XQK[c], XDK[c], XQK[d], XDK[d])
        for i in range(n4, n):
            t = ids[i]
            res[i] = _kdot1(wq, wsc, XQK[t], XDK[t])
        if mins:
            for i in range(n):
                t = ids[i]
                res[i] -= _kmins(wm, wdm, XDK[t], XBK[t])
        return
    for i in range(0, n4, 4):
        a, b, c, d = ids[i], ids[i + 1], ids[i + 2], ids[i + 3]
        res[i], res[i + 1], res[i + 2], res[i + 3] = _q0dot4(wq, wsc, XQ0[a], XD0[a], XQ0[b], XD0[b],
                                                             XQ0[c], XD0[c], XQ0[d], XD0[d])
    for i in range(n4, n):
        t = ids[i]
        res[i] = _q0dot1(wq, wsc, XQ0[t], XD0[t])


@njit(inline="always")
def _fdot1(wf, x):
    acc = f32(0)
    for c in range(wf.shape[0]):
        acc += wf[c] * x[c]
    return acc


@njit(inline="always")
def _fdot4(wf, x0, x1, x2, x3):
    a0 = f32(0)
    a1 = f32(0)
    a2 = f32(0)
    a3 = f32(0)
    for c in range(wf.shape[0]):
        w = wf[c]
        a0 += w * x0[c]
        a1 += w * x1[c]
        a2 += w * x2[c]
        a3 += w * x3[c]
    return a0, a1, a2, a3


@njit(inline="always")
def _kdot1(wq, wsc, xq, xd):
    acc = f32(0)
    for b in range(wq.shape[0] // 256):
        x0 = b * 256
        s = i32(0)
        for l in range(256):
            s = i32(s + i32(wq[x0 + l]) * i32(xq[x0 + l]))
        acc += xd[b] * wsc[b] * f32(s)
    return acc


@njit(inline="always")
def _kdot4(wq, wsc, xq0, xd0, xq1, xd1, xq2, xd2, xq3, xd3):
    a0 = f32(0)
    a1 = f32(0)
    a2 = f32(0)
    a3 = f32(0)
    for b in range(wq.shape[0] // 256):
        x0 = b * 256
        s0 = i32(0)
        s1 = i32(0)
        s2 = i32(0)
        s3 = i32(0)
        for l in range(256):
            w = i32(wq[x0 + l])
            s0 = i32(s0 + w * i32(xq0[x0 + l]))
            s1 = i32(s1 + w * i32(xq1[x0 + l]))
            s2 = i32(s2 + w * i32(xq2[x0 + l]))
            s3 = i32(s3 + w * i32(xq3[x0 + l]))
        d = wsc[b]
        a0 += xd0[b] * d * f32(s0)
        a1 += xd1[b] * d * f32(s1)
        a2 += xd2[b] * d * f32(s2)
        a3 += xd3[b] * d * f32(s3)
    return a0, a1, a2, a3


@njit(inline="always")
def _kmins(wm, wdm, xd, xb):
    macc = f32(0)
    for b in range(xb.shape[0] // 8):
        j = b * 8
        m = i32(wm[j] * xb[j] + wm[j + 1] * xb[j + 1] + wm[j + 2] * xb[j + 2] + wm[j + 3] * xb[j + 3]
                + wm[j + 4] * xb[j + 4] + wm[j + 5] * xb[j + 5] + wm[j + 6] * xb[j + 6] + wm[j + 7] * xb[j + 7])
        macc += xd[b] * wdm[b] * f32(m)
    return macc


@njit(inline="always")
def _q0dot1(wq, wsc, xq, xd):
    nb = wq.shape[0] // 32
    acc = f32(0)
    for b in range(0, nb - nb % 4, 4):
        x0 = b * 32
        s0 = i32(0)
        s1 = i32(0)
        s2 = i32(0)
        s3 = i32(0)
        for l in range(32):
            s0 = i32(s0 + i32(wq[x0 + l]) * i32(xq[x0 + l]))
            s1 = i32(s1 + i32(wq[x0 + 32 + l]) * i32(xq[x0 + 32 + l]))
            s2 = i32(s2 + i32(wq[x0 + 64 + l]) * i32(xq[x0 + 64 + l]))
            s3 = i32(s3 + i32(wq[x0 + 96 + l]) * i32(xq[x0 + 96 + l]))
        acc += (wsc[b] * xd[b] * f32(s0) + wsc[b + 1] * xd[b + 1] * f32(s1)
                + wsc[b + 2] * xd[b + 2] * f32(s2) + wsc[b + 3] * xd[b + 3] * f32(s3))
    for b in range(nb - nb % 4, nb):
        s = i32(0)
        for l in range(32):
            s = i32(s + i32(wq[b * 32 + l]) * i32(xq[b * 32 + l]))
        acc += wsc[b] * xd[b] * f32(s)
    return acc


@njit(inline="always")
def _q0dot4(wq, wsc, xq0, xd0, xq1, xd1, xq2, xd2, xq3, xd3):
    """Four tokens, one 32-block at a time: 32-trip bodies of four products (trap 1 of the
    module docstring: LLVM keeps the loop and vectorizes it), the same block sums as _q0dot1."""
    nb = wq.shape[0] // 32
    a0 = f32(0)
    a1 = f32(0)
    a2 = f32(0)
    a3 = f32(0)
    for b in range(0, nb - nb % 4, 4):
        x0 = b * 32
        for t in range(4):
            xq = xq0 if t == 0 else (xq1 if t == 1 else (xq2 if t == 2 else xq3))
            xd = xd0 if t == 0 else (xd1 if t == 1 else (xd2 if t == 2 else xd3))
            s0 = i32(0)
            s1 = i32(0)
            s2 = i32(0)
            s3 = i32(0)
            for l in range(32):
                s0 = i32(s0 + i32(wq[x0 + l]) * i32(xq[x0 + l]))
                s1 = i32(s1 + i32(wq[x0 + 32 + l]) * i32(xq[x0 + 32 + l]))
                s2 = i32(s2 + i32(wq[x0 + 64 + l]) * i32(xq[x0 + 64 + l]))
                s3 = i32(s3 + i32(wq[x0 + 96 + l]) * i32(xq[x0 + 96 + l]))
            v = (wsc[b] * xd[b] * f32(s0) + wsc[b + 1] * xd[b + 1] * f32(s1)
                 + wsc[b + 2] * xd[b + 2] * f32(s2) + wsc[b + 3] * xd[b + 3] * f32(s3))
            if t == 0:
                a0 += v
            elif t == 1:
                a1 += v
            elif t == 2:
                a2 += v
            else:
                a3 += v
    for b in range(nb - nb % 4, nb):
        for t in range(4):
            xq = xq0 if t == 0 else (xq1 if t == 1 else (xq2 if t == 2 else xq3))
            xd = xd0 if t == 0 else (xd1 if t == 1 else (xd2 if t == 2 else xd3))
            s = i32(0)
            for l in range(32):
                s = i32(s + i32(wq[b * 32 + l]) * i32(xq[b * 32 + l]))
            v = wsc[b] * xd[b] * f32(s)
            if t == 0:
                a0 += v
            elif t == 1:
                a1 += v
            elif t == 2:
                a2 += v
            else:
                a3 += v
    return a0, a1, a2, a3
