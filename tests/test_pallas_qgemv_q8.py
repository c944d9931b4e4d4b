"""pallas.qgemv_q8 (integer dot products on Q8_1 activations; Pallas interpret mode with the dp4a
emulation on the CPU) against float64, and its Triton lowering with the inline PTX.

Tolerance (``qgemv_q8.rounding_depth``): the truth is the float64 product of the Q8_1-rounded
activations (``Q8Act.values()``, llama.cpp's CUDA rounding, tested in test_ops_actquant.py)
and the file's weights; every integer partial sum is exact, and each term then passes through
at most ``depth`` float32 roundings, so
    |y - y_f64| <= depth * 2^-24 * sum_k |xv_k| m_k,
m = |s q| + |min| (Q6_K: |s q| + |32 s|, q the stored quant; repack.scale_magnitudes(stored_quants=True)),
with a 1% margin for second-order terms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.ops.actquant import quantize_q8_1
from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8, qgemv_q8, rounding_depth
from bloomery_jax.pallas.qgemv_tuned import GemvConfig
from bloomery_jax.quant import dequantize
from bloomery_jax.quant.repack import PACKABLE, repack, scale_magnitudes
from test_pallas_qgemv import U, weight
from triton_lowering import triton_kernels

CFG = GemvConfig(16, 1, 4, 3, 2)  # 2 row tiles of 16 at N=32, two programs per tile's K range


def ratios(y, xa, w64, mag_w, qtype, k, cfg):
    """|y - y_f64| / bound for every output (rows of x against rows of w64 [R, N, K] or [N, K])."""
    xv = np.asarray(xa.values(), np.float64)
    if w64.ndim == 2:
        exact, mag = xv @ w64.T, np.abs(xv) @ mag_w.T
    else:
        exact, mag = np.einsum("pk,pnk->pn", xv, w64), np.einsum("pk,pnk->pn", np.abs(xv), mag_w)
    return np.abs(np.asarray(y, np.float64) - exact) / (1.01 * rounding_depth(qtype, k, cfg) * U * mag)


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_matches_reference(qtype):
    rng = np.random.default_rng(int(qtype) + 40)
    n, k = 32, 512
    raw = weight(qtype, n, k, rng)
    pw = repack(raw, qtype, (n, k), "ggml")
    xa = quantize_q8_1(jnp.asarray(rng.standard_normal((2, k)), jnp.float32))
    y = qgemv_q8(xa, pw, config=CFG, interpret=True)
    assert y.shape == (2, n) and y.dtype == jnp.float32
    w64 = np.asarray(dequantize(raw, qtype, (n, k)), np.float64)
    mag = np.asarray(scale_magnitudes(pw, stored_quants=True), np.float64)
    assert ratios(y, xa, w64, mag, qtype, k, CFG).max() <= 1.0
    # the same kernel on another row order of the weight is far outside the bound (guards the test)
    assert ratios(y, xa, w64[::-1], mag[::-1], qtype, k, CFG).max() > 1.0


def test_one_row_no_split():
    rng = np.random.default_rng(9)
    raw = weight(T.Q6_K, 64, 256, rng)
    pw = repack(raw, T.Q6_K, (64, 256), "ggml")
    cfg = GemvConfig(64, 1, 4, 3, 1)
    xa = quantize_q8_1(jnp.asarray(rng.standard_normal((1, 256)), jnp.float32))
    y = qgemv_q8(xa, pw, config=cfg, interpret=True)
    w64 = np.asarray(dequantize(raw, T.Q6_K, (64, 256)), np.float64)
    assert ratios(y, xa, w64, np.asarray(scale_magnitudes(pw, stored_quants=True), np.float64), T.Q6_K, 256, cfg).max() <= 1.0


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_moe_matches_reference(qtype):
    rng = np.random.default_rng(int(qtype) + 50)
    e, n, k = 5, 32, 512
    raw = np.stack([weight(qtype, n, k, rng) for _ in range(e)])
    pw = repack(raw, qtype, (e, n, k), "ggml")
    experts = jnp.asarray(rng.integers(0, e, 6), jnp.int32)
    xa = quantize_q8_1(jnp.asarray(rng.standard_normal((6, k)), jnp.float32))
    y = moe_gemv_q8(xa, pw, experts, config=CFG, interpret=True)
    w64 = np.asarray(dequantize(raw, qtype, (e, n, k)), np.float64)
    mag = np.asarray(scale_magnitudes(pw, stored_quants=True), np.float64)
    ex = np.asarray(experts)
    assert ratios(y, xa, w64[ex], mag[ex], qtype, k, CFG).max() <= 1.0
    assert ratios(y, xa, w64[(ex + 1) % e], mag[ex], qtype, k, CFG).max() > 1.0  # a wrong expert fails


def test_bad_inputs_raise():
    rng = np.random.default_rng(1)
    planes = repack(weight(T.Q4_K, 32, 256, rng), T.Q4_K, (32, 256))
    xa = quantize_q8_1(jnp.zeros((1, 256)))
    with pytest.raises(ValueError, match="ggml-layout"):
        qgemv_q8(xa, planes, interpret=True)
    ggml = repack(weight(T.Q4_K, 32, 256, rng), T.Q4_K, (32, 256), "ggml")
    with pytest.raises(ValueError, match="activations"):
        qgemv_q8(quantize_q8_1(jnp.zeros((1, 512))), ggml, interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_lowers_to_triton_for_h200(qtype, monkeypatch):
    """A verified Triton module for sm_90, dp4a as inline PTX, at a decode shape (k/v of the 30B model)."""
    pw = repack(weight(qtype, 512, 2048, np.random.default_rng(0)), qtype, (512, 2048), "ggml")
    xa = quantize_q8_1(jnp.zeros((1, 2048)))
    assert triton_kernels(monkeypatch, lambda x, w: qgemv_q8(x, w), xa, pw) == [(f"qgemv_q8_{qtype.name.lower()}", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_moe_lowers_to_triton_for_h200(monkeypatch):
    rng = np.random.default_rng(0)
    pw = repack(np.stack([weight(T.Q6_K, 2048, 768, rng) for _ in range(4)]), T.Q6_K, (4, 2048, 768), "ggml")
    xa = quantize_q8_1(jnp.zeros((8, 768)))
    experts = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert triton_kernels(monkeypatch, lambda x, w, e: moe_gemv_q8(x, w, e), xa, pw, experts) == [
        ("moe_gemv_q8_q6_k", 90, True)]


def test_many_in_one_launch():
    # q, k and v of a layer (two formats, three heights) in one launch: each within its own bound
    from bloomery_jax.pallas.qgemv_q8 import qgemv_q8_many

    rng = np.random.default_rng(61)
    shapes = [(T.Q4_K, 64), (T.Q4_K, 32), (T.Q6_K, 32)]
    raws = [weight(q, n, 512, rng) for q, n in shapes]
    ws = tuple(repack(r, q, (n, 512), "ggml") for r, (q, n) in zip(raws, shapes))
    xa = quantize_q8_1(jnp.asarray(rng.standard_normal((2, 512)), jnp.float32))
    ys = qgemv_q8_many(xa, ws, interpret=True)
    assert [y.shape for y in ys] == [(2, 64), (2, 32), (2, 32)]
    cfg = GemvConfig(split_k=8)  # the largest split the launch may take: a bound for any
    for y, w, raw, (q, n) in zip(ys, ws, raws, shapes):
        w64 = np.asarray(dequantize(raw, q, (n, 512)), np.float64)
        assert ratios(y, xa, w64, np.asarray(scale_magnitudes(w, stored_quants=True), np.float64), q, 512, cfg).max() <= 1.0


def test_moe_many_in_one_launch():
    from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8_many

    rng = np.random.default_rng(62)
    e = 4
    raws = [np.stack([weight(q, 32, 512, rng) for _ in range(e)]) for q in (T.Q4_K, T.Q5_K)]
    ws = tuple(repack(r, q, (e, 32, 512), "ggml") for r, q in zip(raws, (T.Q4_K, T.Q5_K)))
    experts = jnp.asarray(rng.integers(0, e, 5), jnp.int32)
    xa = quantize_q8_1(jnp.asarray(rng.standard_normal((5, 512)), jnp.float32))
    ex = np.asarray(experts)
    cfg = GemvConfig(split_k=8)
    for y, w, raw, q in zip(moe_gemv_q8_many(xa, ws, experts, interpret=True), ws, raws, (T.Q4_K, T.Q5_K)):
        w64 = np.asarray(dequantize(raw, q, (e, 32, 512)), np.float64)
        assert ratios(y, xa, w64[ex], np.asarray(scale_magnitudes(w, stored_quants=True), np.float64)[ex], q, 512, cfg).max() <= 1.0


def _pallas_grids(fn, *args) -> list[tuple]:
    """The grid of every Pallas call in ``fn``'s jaxpr."""
    grids = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.append(tuple(eqn.params["grid_mapping"].grid))
            for v in eqn.params.values():
                if hasattr(v, "jaxpr"):
                    walk(v.jaxpr if hasattr(v.jaxpr, "eqns") else v.jaxpr.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


def test_many_launches_take_the_callers_config():
    """``qgemv_q8_many`` and ``moe_gemv_q8_many`` launch with a config the caller gives (what
    layer_kernel_bench.py sweeps): its split and row tile set the grid, and each output stays
    within that config's bound."""
    from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8_many, qgemv_q8_many

    rng = np.random.default_rng(64)
    e = 4
    raws = [np.stack([weight(T.Q4_K, 32, 512, rng) for _ in range(e)]) for _ in range(2)]
    ws = tuple(repack(r, T.Q4_K, (e, 32, 512), "ggml") for r in raws)
    experts = jnp.asarray(rng.integers(0, e, 5), jnp.int32)
    xa = quantize_q8_1(jnp.asarray(rng.standard_normal((5, 512)), jnp.float32))
    cfg = GemvConfig(16, 1, 4, 3, 1)  # 2 row tiles of 16 a weight, no split (the default splits in 2)
    moe = lambda x, ws, e, config=None: moe_gemv_q8_many(x, ws, e, config=config, interpret=True)  # noqa: E731
    assert _pallas_grids(moe, xa, ws, experts) == [(2, 5, 2)]
    assert _pallas_grids(functools.partial(moe, config=cfg), xa, ws, experts) == [(1, 5, 4)]
    ex = np.asarray(experts)
    for y, w, raw in zip(moe(xa, ws, experts, cfg), ws, raws):
        w64 = np.asarray(dequantize(raw, T.Q4_K, (e, 32, 512)), np.float64)
        mag = np.asarray(scale_magnitudes(w, stored_quants=True), np.float64)[ex]
        assert ratios(y, xa, w64[ex], mag, T.Q4_K, 512, cfg).max() <= 1.0
    dense = tuple(repack(r[0], T.Q4_K, (32, 512), "ggml") for r in raws)
    assert _pallas_grids(lambda x, ws: qgemv_q8_many(x, ws, config=cfg, interpret=True), xa, dense) == [(1, 4)]


def test_moe_many_pairs_share_their_token_row():
    """pairs_per_row=k: pair p reads token p // k's quantized row; the same outputs, bit for bit,
    as the rows copied out once per pair."""
    from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8_many

    rng = np.random.default_rng(63)
    raws = [np.stack([weight(q, 32, 512, rng) for _ in range(4)]) for q in (T.Q4_K, T.Q6_K)]
    ws = tuple(repack(r, q, (4, 32, 512), "ggml") for r, q in zip(raws, (T.Q4_K, T.Q6_K)))
    n, k = 3, 2
    experts = jnp.asarray(rng.integers(0, 4, n * k), jnp.int32)
    xa = quantize_q8_1(jnp.asarray(rng.standard_normal((n, 512)), jnp.float32))
    per_pair = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), xa)
    got = moe_gemv_q8_many(xa, ws, experts, pairs_per_row=k, interpret=True)
    want = moe_gemv_q8_many(per_pair, ws, experts, interpret=True)
    for a, b in zip(got, want):
        assert a.shape == (n * k, 32)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"x must hold \[P / 2, 512\]"):
        moe_gemv_q8_many(xa, ws, experts[:5], pairs_per_row=k, interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_many_lowers_to_triton_for_h200(monkeypatch):
    from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8_many, qgemv_q8_many

    rng = np.random.default_rng(0)
    ws = tuple(repack(weight(q, n, 2048, rng), q, (n, 2048), "ggml") for q, n in [(T.Q4_K, 4096), (T.Q4_K, 512), (T.Q6_K, 512)])
    assert triton_kernels(monkeypatch, lambda x, ws: qgemv_q8_many(x, ws), quantize_q8_1(jnp.zeros((1, 2048))), ws) == [
        ("qgemv_q8_many", 90, True)]
    gu = tuple(repack(np.stack([weight(T.Q4_K, 768, 2048, rng) for _ in range(2)]), T.Q4_K, (2, 768, 2048), "ggml")
               for _ in range(2))
    experts = jax.ShapeDtypeStruct((8,), jnp.int32)  # the decode step's call: one token, its 8 pairs
    assert triton_kernels(monkeypatch, lambda x, ws, e: moe_gemv_q8_many(x, ws, e, pairs_per_row=8),
                          quantize_q8_1(jnp.zeros((1, 2048))), gu, experts) == [("moe_gemv_q8_many", 90, True)]
