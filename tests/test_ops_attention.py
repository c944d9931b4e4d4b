"""RMSNorm and GQA attention against plain NumPy (float64) references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax.ops.attention import causal_mask, gqa_attention
from bloomery_jax.ops.norms import rms_norm


def test_rms_norm_matches_numpy():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 7, 96)) * 3).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    got = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6) * w
    # float32 mean over 96 terms and three roundings: 2e-6 relative to the values' scale.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_rms_norm_eps_matters_for_tiny_rows():
    x = jnp.full((1, 8), 1e-4, jnp.float32)
    w = jnp.ones(8, jnp.float32)
    # mean square 1e-8 against eps 1e-6: y = 1e-4 / sqrt(1.01e-6) = 0.0995
    assert float(rms_norm(x, w, 1e-6)[0, 0]) == pytest.approx(1e-4 / np.sqrt(1.01e-6), rel=1e-5)


def attention_np(q, k, v, q_pos, kv_len, scale):
    """Loop reference: q [B,T,Hq,D], k/v [B,S,Hkv,D], float64."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        for t in range(T):
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                vis = [s for s in range(S) if s <= q_pos[b, t] and s < kv_len[b]]
                sc = np.array([q[b, t, h] @ k[b, s, kv] for s in vis], np.float64) * scale
                p = np.exp(sc - sc.max())
                p /= p.sum()
                out[b, t, h] = sum(pi * v[b, s, kv] for pi, s in zip(p, vis))
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_gqa_attention_matches_loop(hq, hkv):
    rng = np.random.default_rng(hq * 10 + hkv)
    B, T, S, D = 2, 5, 12, 8
    q = rng.standard_normal((B, T, hq, D)).astype(np.float32)
    k = rng.standard_normal((B, S, hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, S, hkv, D)).astype(np.float32)
    q_pos = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]], np.int32)
    kv_len = np.array([8, 5], np.int32)
    mask = causal_mask(jnp.asarray(q_pos), jnp.asarray(kv_len), S)
    got = np.asarray(gqa_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, D ** -0.5))
    want = attention_np(q, k, v, q_pos, kv_len, D ** -0.5)
    # float32 softmax and sums of <= 12 terms of unit-scale values: 1e-5 absolute.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_causal_mask_excludes_future_and_unfilled_slots():
    m = np.asarray(causal_mask(jnp.asarray([[2, 5]], jnp.int32), jnp.asarray([4], jnp.int32), 8))
    assert m[0, 0].tolist() == [True, True, True, False, False, False, False, False]
    assert m[0, 1].tolist() == [True, True, True, True, False, False, False, False]  # slot 4+ unfilled
