"""pallas.prefill_attention (Pallas interpret mode on the CPU) against ops.attention.gqa_attention
with ops.attention.causal_mask.

Tolerance: in the interpreter both compute in float32 at HIGHEST and differ only in summation
order (the kernel sums scores and values block by block, rescaling as it goes); outputs are
weighted means of values of magnitude ~1, so 2e-6 absolute is ~20 ulps of headroom over the
measured ~1e-7, and a wrong slot, head or mask moves outputs by ~1e-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax.ops.attention import causal_mask, gqa_attention
from bloomery_jax.pallas.flash_attention import cache_prefill_attention, prefill_attention
from triton_lowering import triton_kernels

ATOL = 2e-6


def arrays(B, T, S, Hq, Hkv, Dh, R=None, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return f(B, T, Hq, Dh), f(R or B, S, Hkv, Dh), f(R or B, S, Hkv, Dh)


@pytest.mark.parametrize("B,T,S,Hq,Hkv,Dh,starts,lengths,block", [
    (1, 40, 64, 4, 2, 32, [0], [40], 16),  # a whole prompt from position 0; T not a multiple of the block
    (2, 24, 80, 8, 2, 16, [10, 50], [34, 74], 16),  # chunked prefill: earlier positions already cached
    (2, 16, 48, 4, 4, 32, [0, 5], [16, 21], 32),  # MHA, one query block bigger than T
    (3, 20, 64, 6, 1, 16, [0, 30, 0], [20, 50, 7], 16),  # MQA, group of 6; row 2's tail is padding
])
def test_matches_reference(B, T, S, Hq, Hkv, Dh, starts, lengths, block):
    q, k, v = arrays(B, T, S, Hq, Hkv, Dh)
    pos = jnp.asarray(np.array(starts)[:, None] + np.arange(T)[None, :], jnp.int32)  # [B, T]
    lens = jnp.asarray(lengths, jnp.int32)
    mask = causal_mask(pos, lens, S)
    seen = np.asarray(mask.any(axis=-1))  # queries that see a slot (the rest are padding: zeros)
    want = np.asarray(gqa_attention(q, k, v, mask | ~mask.any(-1, keepdims=True), 0.125))
    got = np.asarray(prefill_attention(q, k, v, pos, lens, 0.125, block_t=block, block_s=block, interpret=True))
    assert got.shape == (B, T, Hq, Dh) and got.dtype == np.float32
    np.testing.assert_allclose(got[seen], want[seen], rtol=0, atol=ATOL)
    np.testing.assert_array_equal(got[~seen], 0.0)


def test_cache_rows_and_slots_past_the_length():
    # the whole-cache form reads layer 1's rows of the window; slots past a row's length and
    # other layers' rows change nothing, a visible slot does (guards the test)
    L, N, S, Hq, Hkv, Dh, T = 2, 3, 48, 4, 2, 16, 12
    q, _, _ = arrays(2, T, S, Hq, Hkv, Dh)
    rng = np.random.default_rng(5)
    kc = jnp.asarray(rng.standard_normal((L, N, S, Hkv, Dh)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((L, N, S, Hkv, Dh)), jnp.float32)
    pos = jnp.asarray(np.array([[3], [20]]) + np.arange(T)[None, :], jnp.int32)
    lens = jnp.asarray([15, 32], jnp.int32)
    run = lambda kc, vc: np.asarray(cache_prefill_attention(kc, vc, 1, 1, q, pos, lens, 0.2, interpret=True))  # noqa: E731
    got = run(kc, vc)
    want = np.asarray(gqa_attention(q, kc[1, 1:3], vc[1, 1:3], causal_mask(pos, lens, S), 0.2))
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    np.testing.assert_array_equal(run(kc.at[0].set(9.0).at[1, 1, 15:].set(9.0), vc.at[1, 2, 32:].set(9.0)), got)
    assert not np.array_equal(run(kc.at[1, 1, 3].set(9.0), vc), got)


def test_bad_arguments():
    q, k, v = arrays(1, 8, 16, 3, 2, 16)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        prefill_attention(q, k, v, jnp.zeros((1, 8), jnp.int32), jnp.ones(1, jnp.int32), 1.0, interpret=True)
    q, k, v = arrays(1, 8, 16, 4, 2, 16)
    with pytest.raises(ValueError, match="precision"):
        prefill_attention(q, k, v, jnp.zeros((1, 8), jnp.int32), jnp.ones(1, jnp.int32), 1.0, precision="fp8",
                          interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_h200(monkeypatch):
    # a Qwen3-30B-A3B prefill of 512 tokens over a 2-layer cache of 2 slots (32 and 4 heads of 128)
    q = jax.ShapeDtypeStruct((1, 512, 32, 128), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 2, 1024, 4, 128), jnp.float32)
    ints = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = lambda q, k, v, p, n: cache_prefill_attention(k, v, 1, 0, q, p, n, 0.088)  # noqa: E731
    assert triton_kernels(monkeypatch, fn, q, kv, kv, ints, lens) == [("prefill_attention", 90, True)]
