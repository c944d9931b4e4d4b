"""quant.repack against quant.dequantize: the repacked blocks hold the file's values bit for bit.

Tolerance: none. Outputs must have identical float32 bit patterns; two NaNs count as equal
whatever their payload (a NaN scale makes NaNs, and XLA may pick another payload). Scale
fields are also forced to f16 extremes (max, subnormals, zeros, inf, NaN), where a wrong
widening or a reordered product would show.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from bloomery_jax.quant import dequantize
from bloomery_jax.quant.repack import LAYOUTS, PACKABLE, dequantize_packed, repack, scale_magnitudes

F16_FIELDS = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
F16_EXTREMES = np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0000, 0x8000, 0x03FF, 0x0400,
                         0x7C00, 0xFC00, 0x7E00], dtype=np.uint16)


def random_raw(qtype, shape, rng, extremes=False):
    """uint8 [..., N, row_bytes] random GGUF bytes; optionally extreme f16 scale fields."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // elems, nbytes), dtype=np.uint8)
    if extremes:
        for k, off in enumerate(F16_FIELDS[qtype]):
            v = np.resize(np.roll(F16_EXTREMES, k), blocks.shape[0]).astype("<u2")
            blocks[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], -1)


def assert_bit_exact(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    bad = ~((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want)))
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[0]}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_values_bit_exact(qtype, layout):
    rng = np.random.default_rng(int(qtype) * 3 + len(layout))
    for shape, extremes in [((8, 512), False), ((8, 512), True), ((2, 3, 256), False)]:
        raw = random_raw(qtype, shape, rng, extremes)
        pw = repack(raw, qtype, shape, layout)
        assert pw.shape == shape and pw.layout == layout
        assert_bit_exact(dequantize_packed(pw), dequantize(raw, qtype, shape))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_byte_count(qtype, layout):
    # planes moves bits only; rows stores the K-quants' 12 packed scale bytes as 16 plain bytes
    shape = (4, 1024)
    raw = random_raw(qtype, shape, np.random.default_rng(0))
    extra = 4 * (1024 // 256) * 4 if layout == "rows" and qtype in (T.Q4_K, T.Q5_K) else 0
    assert repack(raw, qtype, shape, layout).nbytes == raw.nbytes + extra


def test_memmap_like_input_is_not_modified():
    raw = random_raw(T.Q4_K, (2, 256), np.random.default_rng(1))
    ro = raw.copy()
    ro.setflags(write=False)  # GGUF tensors arrive as read-only memmap views
    repack(ro, T.Q4_K, (2, 256), "rows")
    np.testing.assert_array_equal(ro, raw)


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_scale_magnitudes(qtype):
    # |s q| + |m| >= |w| always, with equality when there is no min (Q8_0, Q6_K)
    raw = random_raw(qtype, (32, 256), np.random.default_rng(2))
    for layout in LAYOUTS:
        pw = repack(raw, qtype, (32, 256), layout)
        w, mag = np.asarray(dequantize_packed(pw)), np.asarray(scale_magnitudes(pw))
        ok = np.isfinite(w) & np.isfinite(mag)
        if qtype in (T.Q4_K, T.Q5_K):
            assert (mag[ok] >= np.abs(w[ok]) * (1 - 2 ** -23)).all()
            assert (mag[ok] > np.abs(w[ok])).any()
        else:
            np.testing.assert_array_equal(mag[ok], np.abs(w[ok]))


@pytest.mark.parametrize("args,match", [
    ((np.zeros((1, 18), np.uint8), T.Q4_0, (1, 32)), "no GEMV layout for Q4_0"),
    ((np.zeros((1, 34 * 4), np.uint8), T.Q8_0, (1, 96 + 32)), None),
    ((np.zeros((1, 34 * 3), np.uint8), T.Q8_0, (1, 96)), "not a multiple of 128"),
    ((np.zeros((1, 144), np.uint8), T.Q4_K, (2, 256)), r"needs uint8 bytes \(2, 144\), got uint8 \(1, 144\)"),
    ((np.zeros((256,), np.uint8), T.Q4_K, (256,)), r"needs a matrix"),
])
def test_bad_input_raises(args, match):
    if match is None:
        repack(*args)  # the control: a fitting shape is accepted
        return
    with pytest.raises(ValueError, match=match):
        repack(*args)


def test_bad_layout_raises():
    with pytest.raises(ValueError, match="layout 'cols' is not one of"):
        repack(np.zeros((1, 144), np.uint8), T.Q4_K, (1, 256), "cols")


# ggml's byte ranges of each field in a block: (start, stop) of qs and qh
GGML_BYTES = {T.Q8_0: ((2, 34), None), T.Q4_K: ((16, 144), None), T.Q5_K: ((48, 176), (16, 48)),
              T.Q6_K: ((0, 128), (128, 192))}


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_ggml_words_are_the_file_bytes(qtype):
    # the dp4a kernels rely on it: byte k of word i is quant byte 4i + k of the row, in the
    # file's order; the scale fields are the planes layout's arrays
    shape = (2, 3, 512)
    raw = random_raw(qtype, shape, np.random.default_rng(int(qtype) + 50))
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(2, 3, 512 // elems, nbytes)
    pw, planes = repack(raw, qtype, shape, "ggml"), repack(raw, qtype, shape, "planes")
    for field, span in zip(("qs", "qh"), GGML_BYTES[qtype]):
        if span is None:
            assert getattr(pw, field) is None, field
            continue
        words = np.asarray(getattr(pw, field))
        assert words.dtype == np.int32 and words.shape == (2, 3, 512 // elems * (span[1] - span[0]) // 4), field
        np.testing.assert_array_equal(words.view(np.uint8).reshape(blocks.shape[:-1] + (-1,)),
                                      blocks[..., span[0]:span[1]], err_msg=field)
    for field in ("sc", "d"):
        a, b = getattr(planes, field), getattr(pw, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, field
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=field)


@pytest.mark.parametrize("layout", ["planes", "ggml"])
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_device_repack_equals_numpy(qtype, layout):
    # the load-time path for large models repacks on the device; it must give the same words
    import jax.numpy as jnp

    from bloomery_jax.quant.repack import repack_on_device

    rng = np.random.default_rng(int(qtype) + 100)
    for shape, extremes in [((8, 512), True), ((3, 16, 256), False)]:
        raw = random_raw(qtype, shape, rng, extremes)
        want, got = repack(raw, qtype, shape, layout), repack_on_device(jnp.asarray(raw), qtype, shape, layout)
        assert got.shape == want.shape and got.qtype == want.qtype and got.layout == want.layout == layout
        for field in ("qs", "d", "sc", "qh"):
            a, b = getattr(want, field), getattr(got, field)
            assert (a is None) == (b is None), field
            if a is not None:
                a, b = np.asarray(a), np.asarray(b)
                assert a.dtype == b.dtype and a.shape == b.shape, (field, a.dtype, b.dtype, a.shape, b.shape)
                assert (a.view(np.uint8) == b.view(np.uint8)).all(), field


@pytest.mark.parametrize("layout", ["planes", "ggml"])
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_device_repack_of_no_experts(qtype, layout):
    # a layer whose experts all run on the host keeps a [0, N, K] card tensor: its repack is empty
    import jax.numpy as jnp

    from bloomery_jax.quant.repack import repack_on_device

    raw = random_raw(qtype, (1, 16, 256), np.random.default_rng(0))
    one = repack(raw, qtype, (1, 16, 256), layout)
    none = repack_on_device(jnp.zeros((0, *raw.shape[1:]), jnp.uint8), qtype, (0, 16, 256), layout)
    assert none.shape == (0, 16, 256) and none.nbytes == 0 and none.layout == layout
    for field in ("qs", "d", "sc", "qh"):
        a, b = getattr(one, field), getattr(none, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert b.shape == (0, *a.shape[1:]) and b.dtype == a.dtype, field


def test_device_repack_refuses_rows():
    import jax.numpy as jnp

    from bloomery_jax.quant.repack import repack_on_device

    with pytest.raises(ValueError, match="layout 'rows' is not one of"):
        repack_on_device(jnp.zeros((1, 144), jnp.uint8), T.Q4_K, (1, 256), "rows")
