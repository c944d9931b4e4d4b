"""Our jnp dequantizers against gguf-py's NumPy reference, bit for bit.

Tolerance: none. Outputs must have identical float32 bit patterns (so +0 and -0 differ);
the only allowance is that two NaNs count as equal whatever their payload, because
gguf-py's NumPy and XLA may propagate different NaN payloads and a NaN is a NaN to every
consumer. Scale fields are forced to the f16 extremes (±65504, ±2^-24, ±0, subnormals,
inf, NaN) because that is where a wrong widening or a reordered product would show.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from bloomery_jax.quant import QTensor, dequantize

BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
               T.IQ4_NL, T.IQ4_XS]
FLOAT_TYPES = [T.F32, T.F16, T.BF16]

# byte offsets of the f16 scale / min fields inside one block (ggml's block structs)
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
}

# f16 bit patterns: ±max finite, ±smallest subnormal, ±0, largest subnormal, smallest normal, ±inf, NaN
F16_EXTREMES = np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0000, 0x8000, 0x03FF, 0x0400,
                         0x7C00, 0xFC00, 0x7E00], dtype=np.uint16)


def ref_dequant(raw: np.ndarray, qtype: T) -> np.ndarray:
    """gguf-py's answer, f32 with the logical shape (raw: uint8 [..., row_bytes])."""
    if qtype == T.F32:
        return raw.view(np.float32)
    with np.errstate(all="ignore"):  # inf / NaN scales are part of the test
        return gguf.quants.dequantize(raw, qtype)


def assert_bit_exact(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    same = got.view(np.uint32) == want.view(np.uint32)
    both_nan = np.isnan(got) & np.isnan(want)
    bad = ~(same | both_nan)
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[0]}: got {got[bad][:4]}, want {want[bad][:4]}"


def random_blocks(qtype: T, nblocks: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, (nblocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)


def with_f16_fields(blocks: np.ndarray, qtype: T, values: np.ndarray) -> np.ndarray:
    """Copy of ``blocks`` with every f16 field of block i set to values[i] (cycled per field)."""
    blocks = blocks.copy()
    for k, off in enumerate(F16_FIELDS[qtype]):
        v = np.roll(values, k).astype("<u2")  # different fields get different extremes
        blocks[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return blocks


def logical_shape(qtype: T, raw: np.ndarray) -> tuple[int, ...]:
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    return (*raw.shape[:-1], raw.shape[-1] // nbytes * elems)


def check(raw: np.ndarray, qtype: T, jit: bool):
    shape = logical_shape(qtype, raw)
    fn = (lambda d: dequantize(d, qtype, shape))
    if jit:
        fn = jax.jit(fn)
    assert_bit_exact(fn(raw), ref_dequant(raw, qtype))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_types_random_and_extreme(qtype, jit):
    rng = np.random.default_rng(int(qtype) * 7 + jit)
    n = 64
    rand = random_blocks(qtype, n, rng)
    subnormals = rng.integers(1, 0x0400, 16, dtype=np.uint16) | (rng.integers(0, 2, 16, dtype=np.uint16) << 15)
    specials = np.concatenate([np.resize(F16_EXTREMES, n - 16), subnormals])
    extreme = with_f16_fields(random_blocks(qtype, n, rng), qtype, specials)
    zeros = np.zeros_like(rand)
    check(np.concatenate([rand, extreme, zeros]).reshape(12, -1), qtype, jit)
    if jit:  # eager mode compiles every op per shape: the other shapes only under jit
        # one block, many rows, and a 3-d tensor whose rows hold several blocks
        check(rand[:1], qtype, jit)
        check(extreme.reshape(16, -1), qtype, jit)
        check(zeros.reshape(2, 4, -1), qtype, jit)


def test_extremes_really_reach_the_scale_fields():
    # guards the test above: an all-65504 Q4_K scale with all-15 quants gives a huge value
    blocks = with_f16_fields(np.full((1, 144), 0xFF, np.uint8), T.Q4_K, np.array([0x7BFF], np.uint16))
    out = np.asarray(dequantize(blocks, T.Q4_K, (256,)))
    assert np.abs(out).max() > 65504 * 63, out.max()
    assert_bit_exact(out, ref_dequant(blocks, T.Q4_K).reshape(256))


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types_bytes_and_values(qtype):
    rng = np.random.default_rng(3)
    width = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (5, 16 * width), dtype=np.uint8)
    if qtype in (T.F16, T.BF16):
        raw[0, :2 * len(F16_EXTREMES)] = F16_EXTREMES.astype("<u2").view(np.uint8)
    want = ref_dequant(raw, qtype)
    shape = want.shape
    assert_bit_exact(dequantize(raw, qtype, shape), want)  # raw bytes
    assert_bit_exact(jax.jit(lambda d: dequantize(d, qtype, shape))(raw), want)
    values = {T.F32: raw.view(np.float32), T.F16: raw.view(np.float16), T.BF16: raw.view(np.uint16)}[qtype]
    assert_bit_exact(dequantize(values, qtype, shape), want)  # the values' own dtype


@settings(max_examples=15, deadline=None)
@given(qtype=st.sampled_from(BLOCK_TYPES), data=st.data())
def test_property_any_bytes(qtype, data):
    nbytes = 2 * GGML_QUANT_SIZES[qtype][1]
    raw = np.frombuffer(data.draw(st.binary(min_size=nbytes, max_size=nbytes)), np.uint8).reshape(1, -1)
    check(raw, qtype, jit=True)


def test_qtensor_inside_jit():
    rng = np.random.default_rng(5)
    raw = random_blocks(T.Q6_K, 6, rng).reshape(3, -1)
    qt = QTensor.from_numpy(raw, T.Q6_K, (3, 512))
    x = jnp.ones((512,), jnp.float32)
    got = jax.jit(lambda w: w.dequantize())(qt)
    assert_bit_exact(got, ref_dequant(raw, T.Q6_K))
    # a matmul over it: not bit-exact (summation order), so only checked to f32 rounding
    np.testing.assert_allclose(jax.jit(lambda w, v: w.dequantize() @ v)(qt, x),
                               ref_dequant(raw, T.Q6_K).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("qtype,match", [
    (T.Q8_1, "Q8_1 is not supported"),
    (T.IQ2_XXS, "IQ2_XXS is not supported"),
    (999, "999 is not a ggml type id"),
])
def test_unsupported_type_raises(qtype, match):
    with pytest.raises(ValueError, match=match):
        dequantize(np.zeros(64, np.uint8), qtype, (32,))


def test_size_mismatch_raises():
    with pytest.raises(ValueError, match=r"Q4_K \(2, 256\) needs 288 bytes, got 144"):
        dequantize(np.zeros((1, 144), np.uint8), T.Q4_K, (2, 256))
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        dequantize(np.zeros((1, 144), np.uint8), T.Q4_K, (128,))
    with pytest.raises(ValueError, match="must be uint8 bytes"):
        dequantize(np.zeros((1, 34), np.int8), T.Q8_0, (32,))
