"""The AVX2 and AVX-512 row dots (host/simd.py) against the same sums computed here with NumPy from the GGUF
block layout: the block integers exactly (int64), their float combination in float64. On random
bytes (every bit pattern of quants, scales and mins; d and dmin set to finite float16 values) and on
the extremes that would overflow a lane if a product or pair sum did not fit (all quants and
scales at their maximum against activations of -128 and 127).

Tolerance: each block's eight lanes are exact integers below 2^25 (one rounding at most in the
conversion), scaled by ``xd_b d_b`` (two roundings) and summed over blocks and lanes in float32:
at most ``4 + n_blocks + 3`` roundings of 2^-24, relative to the sum of every product's absolute
value (which bounds every partial sum: the lanes' signs may cancel)."""

import numpy as np
import pytest

from bloomery_jax.host import blocks as B
from bloomery_jax.host import simd

pytestmark = pytest.mark.skipif(not simd.HAS_AVX2, reason="the host CPU has no AVX2")


_UNUSED16, _TAB16 = np.zeros(1, np.int16), B.conversion_tables()[0]


def _row_dot(fmt: str, wide: bool, row, x, xd, xb=None, x16=None) -> float:
    """``blocks``' AVX2 (or, ``wide``, AVX-512) kernel of ``fmt`` ("q4_k" ...), which is the simd
    intrinsic behind the uniform signature; the arguments its format does not read are dummies."""
    dot = getattr(B, f"_dot_{fmt}_q8_{'avx512' if wide else 'avx2'}")
    xb = np.zeros(1, np.int32) if xb is None else xb
    return dot(row, _UNUSED16, x, xd, xb, _UNUSED16 if x16 is None else x16, _TAB16)


WIDTHS = [False, pytest.param(True, marks=pytest.mark.skipif(not simd.HAS_AVX512BW, reason="no AVX-512BW"))]


def k_ints(block: np.ndarray, x: np.ndarray) -> tuple[int, int]:
    """sum_j s_j sum_l q_jl x_jl and sum_j m_j (sum of x over sub-block j), from a Q4_K block
    (144 bytes) or a Q5_K one (176 bytes: qh[32] before the nibbles, bit j of qh[l] on top)."""
    sc = block[4:16].astype(np.int64)
    s = np.concatenate([sc[0:4] & 63, (sc[8:12] & 15) | ((sc[0:4] >> 6) << 4)])
    m = np.concatenate([sc[4:8] & 63, (sc[8:12] >> 4) | ((sc[4:8] >> 6) << 4)])
    qs = block[-128:].astype(np.int64).reshape(4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=1).reshape(8, 32)  # sub-block 2g: low nibbles of group g
    if block.size == 176:
        qh = block[16:48].astype(np.int64)
        q = q | (((qh[None, :] >> np.arange(8)[:, None]) & 1) << 4)
    xs = x.astype(np.int64).reshape(8, 32)
    return int((s * (q * xs).sum(1)).sum()), int((m * xs.sum(1)).sum())


def q6k_int(block: np.ndarray, x: np.ndarray, absolute: bool = False) -> int:
    """sum over the 16 sub-blocks of c_k sum_l (q - 32) x, from 210 bytes (of |c_k (q - 32) x|
    with ``absolute``)."""
    ql = block[0:128].astype(np.int64)
    qh = block[128:192].astype(np.int64)
    c = block[192:208].view(np.int8).astype(np.int64)
    q = np.empty(256, np.int64)
    for h in range(2):
        l0, l1, hb = ql[64 * h:64 * h + 32], ql[64 * h + 32:64 * h + 64], qh[32 * h:32 * h + 32]
        for g, low in enumerate((l0 & 15, l1 & 15, l0 >> 4, l1 >> 4)):
            q[128 * h + 32 * g:128 * h + 32 * g + 32] = low | (((hb >> (2 * g)) & 3) << 4)
    prods = np.repeat(c, 16) * (q - 32) * x.astype(np.int64)
    return int(np.abs(prods).sum() if absolute else prods.sum())


def _f16(block, at, rng):
    """Write a random finite float16 (either sign, 2^-8 to 2^2) at byte ``at``; return its value."""
    v = np.float16(rng.choice([-1, 1]) * 2.0 ** rng.uniform(-8, 2))
    block[at:at + 2] = np.frombuffer(v.tobytes(), np.uint8)
    return float(v)


def _rows(rng, block_bytes, n_random=40):
    """(row of 4 blocks, int8 activations [1024], xd [4]): random blocks, then all-0xFF blocks
    against all -128 and all 127."""
    for case in range(n_random + 2):
        if case < n_random:
            row = rng.integers(0, 256, 4 * block_bytes, dtype=np.uint8)
            x = rng.integers(-128, 128, 1024).astype(np.int8)
        else:
            row = np.full(4 * block_bytes, 255, np.uint8)
            x = np.full(1024, -128 if case == n_random else 127, np.int8)
        yield row, x, (2.0 ** rng.uniform(-10, 0, 4)).astype(np.float32)


def _check(got, terms, magnitude, n_blocks):
    tol = (4 + n_blocks + 3) * 2.0 ** -24 * magnitude
    assert abs(float(got) - sum(terms)) <= tol, (got, sum(terms), tol)


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("block_bytes", [144, 176])
def test_q4k_q5k_row_dots(block_bytes, wide):
    rng = np.random.default_rng(block_bytes)
    fmt = "q4_k" if block_bytes == 144 else "q5_k"
    for row, x, xd in _rows(rng, block_bytes):
        xb = x.astype(np.int32).reshape(-1, 32).sum(1).astype(np.int32)
        terms, magnitude = [], 0.0
        for b in range(4):
            blk = row[b * block_bytes:(b + 1) * block_bytes]
            d, dmin = _f16(blk, 0, rng), _f16(blk, 2, rng)
            xs = x[256 * b:256 * (b + 1)]
            s, m = k_ints(blk, xs)
            abs_s, abs_m = k_ints(blk, np.abs(xs.astype(np.int64)))  # scales, mins and quants are >= 0
            terms += [float(xd[b]) * d * s, -float(xd[b]) * dmin * m]
            magnitude += float(xd[b]) * (abs(d) * abs_s + abs(dmin) * abs_m)
        _check(_row_dot(fmt, wide, row, x, xd, xb=xb), terms, magnitude, 4)


@pytest.mark.parametrize("wide", WIDTHS)
def test_q6k_row_dot(wide):
    rng = np.random.default_rng(1)
    for row, x, xd in _rows(rng, 210):
        x16 = x.astype(np.int16).reshape(-1, 16).sum(1).astype(np.int16)
        terms, magnitude = [], 0.0
        for b in range(4):
            blk = row[b * 210:(b + 1) * 210]
            d = _f16(blk, 208, rng)
            xs = x[256 * b:256 * (b + 1)]
            terms.append(float(xd[b]) * d * q6k_int(blk, xs))
            magnitude += float(xd[b]) * abs(d) * q6k_int(blk, xs, absolute=True)
        _check(_row_dot("q6_k", wide, row, x, xd, x16=x16), terms, magnitude, 4)
