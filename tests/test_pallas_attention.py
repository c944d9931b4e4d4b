"""pallas.decode_attention (Pallas interpret mode on the CPU) against ops.attention.gqa_attention.

Tolerance: both compute in float32 and differ only in summation order (the kernel adds scores
over Dh and values over the cache in blocks, then combines splits); outputs are weighted means
of values of magnitude ~1, so 2e-6 absolute is ~20 ulps of headroom over the measured ~1e-7, and
a wrong slot, head or mask moves outputs by ~1e-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax.ops.attention import gqa_attention
from bloomery_jax.pallas.attention import cache_decode_attention, decode_attention
from triton_lowering import triton_kernels

ATOL = 2e-6


def cache(B, S, Hq, Hkv, Dh, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, Hq, Dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, Hkv, Dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, Hkv, Dh)), jnp.float32)
    return q, k, v


def reference(q, k, v, visible, scale):
    S = k.shape[1]
    mask = (jnp.arange(S)[None, :] < visible[:, None])[:, None, :]  # [B, 1, S]
    return gqa_attention(q[:, None], k, v, mask, scale)[:, 0]  # [B, Hq, Dh]


@pytest.mark.parametrize("B,S,Hq,Hkv,Dh,visible,block_s,splits", [
    (2, 100, 8, 2, 64, [37, 100], 16, 4),  # S not a multiple of the block; row 0: shares of one block
    (1, 64, 4, 4, 32, [64], 16, 1),  # MHA, one split
    (3, 40, 8, 1, 16, [1, 17, 40], 8, 3),  # MQA, a row that sees one slot; splits not dividing the blocks
    (2, 200, 4, 2, 16, [9, 200], 8, None),  # the default: 16 splits, most of them idle for row 0
])
def test_matches_reference(B, S, Hq, Hkv, Dh, visible, block_s, splits):
    q, k, v = cache(B, S, Hq, Hkv, Dh)
    vis = jnp.asarray(visible, jnp.int32)
    want = reference(q, k, v, vis, 0.125)
    G = Hq // Hkv
    for per_program in sorted({1, 2 if G % 2 == 0 else 1, G}):  # one head a program, or several of a kv head
        got = decode_attention(q, k, v, vis, 0.125, block_s=block_s, splits=splits, heads_per_program=per_program,
                               interpret=True)
        assert got.shape == (B, Hq, Dh) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL, err_msg=f"P={per_program}")


def test_slots_past_visible_are_ignored():
    # changing the cache past `visible` changes nothing; changing a visible slot does (guards the test)
    q, k, v = cache(1, 64, 4, 2, 32, seed=1)
    vis = jnp.asarray([20], jnp.int32)
    run = lambda k, v: np.asarray(decode_attention(q, k, v, vis, 0.2, block_s=16, splits=2, interpret=True))
    base = run(k, v)
    np.testing.assert_array_equal(run(k.at[0, 20:].set(9.0), v.at[0, 20:].set(9.0)), base)
    assert np.abs(run(k, v.at[0, 19].set(9.0)) - base).max() > 1e-2


def test_rows_pick_cache_rows():
    # five cache rows, three queries reading rows 4, 0 and 4: each equals the reference on its row
    q, _, _ = cache(3, 50, 8, 2, 32, seed=3)
    _, k, v = cache(5, 50, 8, 2, 32, seed=4)
    rows, vis = jnp.asarray([4, 0, 4], jnp.int32), jnp.asarray([50, 7, 12], jnp.int32)
    got = decode_attention(q, k, v, vis, 0.3, rows, block_s=16, splits=2, interpret=True)
    want = reference(q, k[rows], v[rows], vis, 0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL)


def test_whole_cache_buffer_with_a_window():
    """cache_decode_attention over [L, N, S, Hkv, Dh]: query b of the window starting at slot 1 reads
    layer 2 of slot 1 + b up to min(position + 1, length); a padding position gets zeros."""
    L, N, S, Hkv, Dh, Hq = 3, 4, 40, 2, 16, 4
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(rng.standard_normal((L, N, S, Hkv, Dh)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((3, Hq, Dh)), jnp.float32)
    positions = jnp.asarray([9, 39, S], jnp.int32)  # the last row is padding
    lengths = jnp.asarray([10, 25, 3], jnp.int32)  # row 1: its length (25) limits, not its position
    got = np.asarray(cache_decode_attention(k, v, 2, 1, q, positions, lengths, 0.25, interpret=True))
    want = reference(q[:2], k[2, 1:3], v[2, 1:3], jnp.asarray([10, 25], jnp.int32), 0.25)
    np.testing.assert_allclose(got[:2], np.asarray(want), rtol=0, atol=ATOL)
    assert (got[2] == 0).all()


def test_no_visible_slot_gives_zeros():
    q, k, v = cache(2, 32, 4, 2, 16, seed=2)
    got = decode_attention(q, k, v, jnp.asarray([0, 5], jnp.int32), 0.25, block_s=8, splits=2, interpret=True)
    assert (np.asarray(got[0]) == 0).all() and np.isfinite(np.asarray(got)).all()


def test_bad_inputs_raise():
    q, k, v = cache(1, 32, 6, 4, 16)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        decode_attention(q, k, v, jnp.asarray([3], jnp.int32), 0.25, interpret=True)
    q, k, v = cache(1, 32, 4, 2, 16)
    with pytest.raises(ValueError, match="without rows"):
        decode_attention(q, jnp.concatenate([k, k]), jnp.concatenate([v, v]), jnp.asarray([3], jnp.int32), 0.25,
                         interpret=True)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        decode_attention(q, k, v, jnp.asarray([3], jnp.int32), 0.25, splits=0, interpret=True)
    with pytest.raises(ValueError, match="heads_per_program 3 must divide"):
        decode_attention(q, k, v, jnp.asarray([3], jnp.int32), 0.25, heads_per_program=3, interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_h200(monkeypatch):
    """A verified Triton module for sm_90 at the Qwen3-30B-A3B decode shape."""
    q = jax.ShapeDtypeStruct((2, 32, 128), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 641, 4, 128), jnp.float32)
    vis = jax.ShapeDtypeStruct((2,), jnp.int32)
    built = triton_kernels(monkeypatch, lambda q, k, v, n: decode_attention(q, k, v, n, 0.088), q, kv, kv, vis)
    assert built == [("decode_attention", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_whole_cache_lowers_to_triton_for_h200(monkeypatch):
    """The model's call: a 48-layer, 2-slot, 4096-position cache buffer, layer 47, a traced window start."""
    q = jax.ShapeDtypeStruct((2, 32, 128), jnp.float32)
    kv = jax.ShapeDtypeStruct((48, 2, 4096, 4, 128), jnp.float32)
    ints = jax.ShapeDtypeStruct((2,), jnp.int32)
    start = jax.ShapeDtypeStruct((), jnp.int32)
    fn = lambda q, k, v, s, p, n: cache_decode_attention(k, v, 47, s, q, p, n, 0.088)  # noqa: E731
    assert triton_kernels(monkeypatch, fn, q, kv, kv, start, ints, ints) == [("decode_attention", 90, True)]
