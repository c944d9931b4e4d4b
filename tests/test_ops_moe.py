"""Routing, SwiGLU experts and the quantized matmul reference against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, quants

from bloomery_jax.ops.experts import moe_swiglu
from bloomery_jax.ops.qmatmul import qmatmul, take_rows
from bloomery_jax.ops.routing import route_topk
from bloomery_jax.quant import QTensor


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("n_exp,k", [(8, 2), (16, 4), (5, 5)])
def test_route_topk_matches_numpy(n_exp, k):
    rng = np.random.default_rng(n_exp)
    logits = (rng.standard_normal((50, n_exp)) * 3).astype(np.float32)
    experts, weights, margin = (np.asarray(a) for a in route_topk(jnp.asarray(logits), k))
    order = np.argsort(-logits.astype(np.float64), axis=-1)
    np.testing.assert_array_equal(experts, order[:, :k])  # random logits: no ties
    p = _softmax(logits.astype(np.float64))
    top = np.take_along_axis(p, order[:, :k], -1)
    # float32 softmax and a k-term sum: 1e-6 relative on weights in (0, 1].
    np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True), rtol=1e-6, atol=1e-7)
    srt = np.take_along_axis(logits, order, -1)
    if k < n_exp:
        np.testing.assert_allclose(margin, srt[:, k - 1] - srt[:, k], rtol=0, atol=1e-6)
    else:
        assert np.all(np.isinf(margin))


def moe_np(x, experts, weights, wg, wu, wd):
    out = np.zeros((x.shape[0], wd.shape[1]))
    for n in range(x.shape[0]):
        for e, w in zip(experts[n], weights[n]):
            g, u = wg[e] @ x[n], wu[e] @ x[n]
            out[n] += w * (wd[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_moe_swiglu_matches_dense_loop():
    rng = np.random.default_rng(0)
    N, D, F, E, k = 37, 32, 48, 8, 3
    x = rng.standard_normal((N, D)).astype(np.float32)
    # experts 6 and 7 are never chosen: empty groups must be fine
    experts = np.stack([rng.choice(6, k, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.dirichlet(np.ones(k), N).astype(np.float32)
    wg, wu = (rng.standard_normal((2, E, F, D)) / np.sqrt(D)).astype(np.float32)
    wd = (rng.standard_normal((E, D, F)) / np.sqrt(F)).astype(np.float32)
    got = np.asarray(jax.jit(moe_swiglu)(x, experts, weights, wg, wu, wd))
    want = moe_np(x.astype(np.float64), experts, weights, wg, wu, wd)
    # float32 dot products over 32-48 terms of O(1) values: 2e-5 absolute.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_moe_swiglu_with_quantized_experts():
    rng = np.random.default_rng(1)
    N, D, F, E, k = 9, 64, 32, 4, 2
    x = rng.standard_normal((N, D)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
    weights = np.full((N, k), 0.5, np.float32)
    raw = [(rng.standard_normal(s) * 0.2).astype(np.float32) for s in ((E, F, D), (E, F, D), (E, D, F))]
    qts = [QTensor.from_numpy(quants.quantize(a, T.Q8_0), T.Q8_0, a.shape) for a in raw]
    deq = [quants.dequantize(quants.quantize(a, T.Q8_0), T.Q8_0).reshape(a.shape) for a in raw]
    got = np.asarray(moe_swiglu(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), *qts))
    # Same dequantized values as gguf-py's: only float32 rounding remains (1e-5 absolute).
    np.testing.assert_allclose(got, moe_np(x.astype(np.float64), experts, weights, *deq), rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0])
def test_qmatmul_and_take_rows(qtype):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    stored = w if qtype == T.F32 else quants.quantize(w, qtype)
    qt = QTensor.from_numpy(stored, qtype, w.shape)
    deq = quants.dequantize(stored, qtype).reshape(w.shape).astype(np.float64)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    # HIGHEST-precision float32 dot over 64 terms: 1e-5 relative to the largest output.
    got = np.asarray(qmatmul(jnp.asarray(x), qt))
    want = x @ deq.T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    rows = np.array([[3, 0], [23, 3]], np.int32)
    np.testing.assert_array_equal(np.asarray(take_rows(qt, jnp.asarray(rows))), deq[rows].astype(np.float32))
