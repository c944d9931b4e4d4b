"""The AVX2 block sums (host/simd.py) against integer sums computed here with NumPy from the
GGUF block layout, on random bytes (every bit pattern of quants, scales and mins) and on the
extremes that would overflow a lane if a product or pair sum did not fit (all quants at their
maximum against activations of -128 and 127). Exact: these are integers."""

import numpy as np
import pytest
from numba import njit

from bloomery_jax.host import simd

pytestmark = pytest.mark.skipif(not simd.HAS_AVX2, reason="the host CPU has no AVX2")


@njit
def _q4k_sums(row, o, xq, x0, xb, j):
    return simd.q4k_block_sums(row, o, xq, x0, xb, j)


@njit
def _q5k_sums(row, o, xq, x0, xb, j):
    return simd.q5k_block_sums(row, o, xq, x0, xb, j)


@njit
def _q6k_sum(row, o, xq, x0):
    return simd.q6k_block_sum(row, o, xq, x0)


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


def q6k_int(block: np.ndarray, x: np.ndarray) -> int:
    """sum over the 16 sub-blocks of c_k sum_l (q - 32) x, from 210 bytes."""
    ql = block[0:128].astype(np.int64)
    qh = block[128:192].astype(np.int64)
    c = block[192:208].view(np.int8).astype(np.int64)
    q = np.empty(256, np.int64)
    for h in range(2):
        l0, l1, hb = ql[64 * h:64 * h + 32], ql[64 * h + 32:64 * h + 64], qh[32 * h:32 * h + 32]
        for g, low in enumerate((l0 & 15, l1 & 15, l0 >> 4, l1 >> 4)):
            q[128 * h + 32 * g:128 * h + 32 * g + 32] = low | (((hb >> (2 * g)) & 3) << 4)
    return int((np.repeat(c, 16) * (q - 32) * x.astype(np.int64)).sum())


def _cases(rng, block_bytes):
    for _ in range(50):
        yield rng.integers(0, 256, block_bytes, dtype=np.uint8), rng.integers(-128, 128, 256).astype(np.int16)
    top = np.full(block_bytes, 255, np.uint8)
    for v in (-128, 127):
        yield top, np.full(256, v, np.int16)


@pytest.mark.parametrize("block_bytes", [144, 176])
def test_q4k_q5k_block_sums_exact(block_bytes):
    rng = np.random.default_rng(block_bytes)
    sums = _q4k_sums if block_bytes == 144 else _q5k_sums
    for block, x in _cases(rng, block_bytes):
        row = np.concatenate([rng.integers(0, 256, block_bytes, dtype=np.uint8), block])  # the 2nd block
        xq = np.concatenate([np.zeros(256, np.int16), x])
        xb = np.concatenate([np.zeros(8, np.int32), x.reshape(8, 32).sum(1).astype(np.int32)])
        assert sums(row, block_bytes, xq, 256, xb, 8) == k_ints(block, x)


def test_q6k_block_sum_exact():
    rng = np.random.default_rng(1)
    for block, x in _cases(rng, 210):
        row = np.concatenate([rng.integers(0, 256, 210, dtype=np.uint8), block])
        xq = np.concatenate([np.zeros(256, np.int16), x])
        assert _q6k_sum(row, 210, xq, 256) == q6k_int(block, x)
