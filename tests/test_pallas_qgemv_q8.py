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


def ratios(y, xa, w64, mag_w, qtype, k, cfg, extra=0.0):
    """|y - y_f64| / bound for every output (rows of x against rows of w64 [R, N, K] or [N, K]);
    ``extra``: an allowance added to each output's bound (``_flip_allowance``)."""
    xv = np.asarray(xa.values(), np.float64)
    if w64.ndim == 2:
        exact, mag = xv @ w64.T, np.abs(xv) @ mag_w.T
    else:
        exact, mag = np.einsum("pk,pnk->pn", xv, w64), np.einsum("pk,pnk->pn", np.abs(xv), mag_w)
    return np.abs(np.asarray(y, np.float64) - exact) / (1.01 * rounding_depth(qtype, k, cfg) * U * mag + extra)


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


# ---- float x rounded in-kernel (_RoundingRows): no rounding launch before the GEMV ----


def _kernel_blocks(x):
    """``_RoundingRows``' blocks of float x ``[R, K]`` as the Q8Act fields (qs, d, sums)."""
    from jax.experimental import pallas as pl

    from bloomery_jax.pallas.qgemv_q8 import _RefRows, _RoundingRows

    rows, k = x.shape

    def kernel(x_ref, words_ref, meta_ref):
        _RoundingRows(_RefRows(x_ref), words_ref, meta_ref, rows, interpret=True).prepare(0, k // 32)

    words, meta = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct((rows, k // 32, 8), jnp.int32)] * 2,
                                 interpret=True)(x.reshape(rows, -1, 32))
    d = jax.lax.bitcast_convert_type(meta[:, :, 0], jnp.float32)
    return words.reshape(rows, -1), d, meta[:, :, 1:3].reshape(rows, -1)


def test_in_kernel_rounding_is_quantize_q8_1():
    """Every field of every block, bit for bit: zero blocks, exact halves (roundf takes them away
    from zero, where jnp.round would go to even: 2.5 -> 3, -3.5 -> -4), signs, tiny and large."""
    rng = np.random.default_rng(70)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 32:64] = np.arange(32) - 15.5
    x[1, 64:96] = 0.0
    x[1, 64:70] = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5]  # amax 127: d = 1, x / d = x exactly
    x[2, :32] *= 1e-30
    x[2, 32:64] *= 1e30
    got = _kernel_blocks(jnp.asarray(x))
    want = quantize_q8_1(jnp.asarray(x))
    for g, w in zip(got, (want.qs, want.d, want.sums)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    quants = np.asarray(jax.lax.bitcast_convert_type(got[0][1, 16:18], jnp.int8)).ravel()  # block 2's first 8
    assert list(quants[:6]) == [127, 3, -4, 1, -1, 2]


def _flip_allowance(xf, w64):
    """Extra error per output for quants that may round the other way when x's last bits differ
    from the reference's (the in-kernel norm or SwiGLU): each element whose x/d lies within
    1e-3 of a half may move by one quant, i.e. by d * |w|. xf: the reference's float x [P, K];
    w64: [P, N, K] or [N, K]."""
    xf = np.asarray(xf)
    b = xf.reshape(*xf.shape[:-1], -1, 32).astype(np.float64)
    d = np.abs(b).max(-1, keepdims=True) / 127
    v = np.divide(b, d, out=np.zeros_like(b), where=d > 0)
    at_risk = (np.abs(np.abs(v - np.floor(v)) - 0.5) < 1e-3) * d  # [P, K/32, 32]: d where a flip may occur
    at_risk = at_risk.reshape(xf.shape)
    w = np.abs(w64)
    return at_risk @ w.T if w.ndim == 2 else np.einsum("pk,pnk->pn", at_risk, w)


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_float_x_within_the_rounded_bound(qtype):
    """qgemv_q8 and moe_gemv_q8 on float x: the bound of test_matches_reference against the float64
    product of quantize_q8_1(x) (the blocks are the same; only the kernel's float32 sums may
    associate differently)."""
    rng = np.random.default_rng(int(qtype) + 80)
    n, k = 32, 512
    raw = weight(qtype, n, k, rng)
    pw = repack(raw, qtype, (n, k), "ggml")
    x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)
    w64 = np.asarray(dequantize(raw, qtype, (n, k)), np.float64)
    mag = np.asarray(scale_magnitudes(pw, stored_quants=True), np.float64)
    xa = quantize_q8_1(x)
    y = qgemv_q8(x, pw, config=CFG, interpret=True)
    assert ratios(y, xa, w64, mag, qtype, k, CFG).max() <= 1.0
    assert ratios(y, xa, w64[::-1], mag[::-1], qtype, k, CFG).max() > 1.0
    stacked = repack(np.stack([raw, raw[::-1]]), qtype, (2, n, k), "ggml")
    experts = jnp.asarray([1, 0], jnp.int32)
    y = moe_gemv_q8(x, stacked, experts, config=CFG, interpret=True)
    w_pairs, mag_pairs = np.stack([w64[::-1], w64]), np.stack([mag[::-1], mag])
    assert ratios(y, xa, w_pairs, mag_pairs, qtype, k, CFG).max() <= 1.0
    assert ratios(y, xa, w_pairs[::-1], mag_pairs[::-1], qtype, k, CFG).max() > 1.0


def test_normed_x_rounded_in_kernel():
    """qgemv_q8_many and moe_gemv_q8_many with the RMS norm formed in-kernel: within the bound
    against quantize_q8_1(rms_norm(x)) plus one quant for each element near a rounding half."""
    from bloomery_jax.ops.norms import rms_norm
    from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8_many, qgemv_q8_many

    rng = np.random.default_rng(71)
    k, e = 512, 3
    x = jnp.asarray(rng.standard_normal((2, k)) * 3, jnp.float32)
    nw = jnp.asarray(rng.uniform(0.5, 1.5, k), jnp.float32)
    xf = rms_norm(x, nw, 1e-6)
    xa = quantize_q8_1(xf)
    cfg = GemvConfig(split_k=8)
    shapes = [(T.Q4_K, 64), (T.Q6_K, 32)]
    raws = [weight(q, n, k, rng) for q, n in shapes]
    ws = tuple(repack(r, q, (n, k), "ggml") for r, (q, n) in zip(raws, shapes))
    for y, w, raw, (q, n) in zip(qgemv_q8_many(x, ws, norm=nw, eps=1e-6, interpret=True), ws, raws, shapes):
        w64 = np.asarray(dequantize(raw, q, (n, k)), np.float64)
        mag = np.asarray(scale_magnitudes(w, stored_quants=True), np.float64)
        assert ratios(y, xa, w64, mag, q, k, cfg, _flip_allowance(xf, w64)).max() <= 1.0
        assert ratios(y, xa, w64[::-1], mag[::-1], q, k, cfg, _flip_allowance(xf, w64[::-1])).max() > 1.0
    raws = [np.stack([weight(T.Q4_K, 32, k, rng) for _ in range(e)]) for _ in range(2)]
    ws = tuple(repack(r, T.Q4_K, (e, 32, k), "ggml") for r in raws)
    experts = jnp.asarray(rng.integers(0, e, 4), jnp.int32)
    ex = np.asarray(experts)
    xf_pairs, xa_pairs = jax.tree.map(lambda a: jnp.repeat(a, 2, axis=0), (xf, xa))  # two pairs a token
    for y, w, raw in zip(moe_gemv_q8_many(x, ws, experts, pairs_per_row=2, norm=nw, eps=1e-6, interpret=True), ws, raws):
        w64 = np.asarray(dequantize(raw, T.Q4_K, (e, 32, k)), np.float64)[ex]
        mag = np.asarray(scale_magnitudes(w, stored_quants=True), np.float64)[ex]
        assert ratios(y, xa_pairs, w64, mag, T.Q4_K, k, cfg, _flip_allowance(xf_pairs, w64)).max() <= 1.0
        wrong = (ex + 1) % e  # another expert's weights fail
        w_wrong = np.asarray(dequantize(raw, T.Q4_K, (e, 32, k)), np.float64)[wrong]
        assert ratios(y, xa_pairs, w_wrong, mag, T.Q4_K, k, cfg, _flip_allowance(xf_pairs, w_wrong)).max() > 1.0


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_swiglu_halves_rounded_in_kernel(qtype):
    """moe_gemv_q8(..., swiglu_halves=True) on gate and up side by side: within the bound against
    quantize_q8_1(swiglu(gate, up)), plus one quant for each element near a rounding half (the
    kernel's exponential is not XLA's)."""
    from bloomery_jax.ops.experts import swiglu

    rng = np.random.default_rng(int(qtype) + 90)
    e, n, k, pairs = 3, 32, 256, 4
    raw = np.stack([weight(qtype, n, k, rng) for _ in range(e)])
    pw = repack(raw, qtype, (e, n, k), "ggml")
    gu = jnp.asarray(rng.standard_normal((pairs, 2 * k)) * 2, jnp.float32)  # [P, 2K]: gate | up
    h = swiglu(gu[:, :k], gu[:, k:])
    xa = quantize_q8_1(h)
    experts = jnp.asarray(rng.integers(0, e, pairs), jnp.int32)
    ex = np.asarray(experts)
    y = moe_gemv_q8(gu, pw, experts, swiglu_halves=True, config=CFG, interpret=True)
    w64 = np.asarray(dequantize(raw, qtype, (e, n, k)), np.float64)
    mag = np.asarray(scale_magnitudes(pw, stored_quants=True), np.float64)
    assert ratios(y, xa, w64[ex], mag[ex], qtype, k, CFG, _flip_allowance(h, w64[ex])).max() <= 1.0
    wrong = (ex + 1) % e
    assert ratios(y, xa, w64[wrong], mag[ex], qtype, k, CFG, _flip_allowance(h, w64[wrong])).max() > 1.0


def test_swiglu_halves_from_split_partials():
    """moe_gemv_q8(..., swiglu_halves=True) on the gate/up launch's split-K partials [S, P, 2K]
    adds them in order s = 0, 1, ... where it forms SwiGLU: bit for bit what it gives on their
    sum taken in that order; and moe_gemv_q8_many(..., joined=True, partials=True) leaves
    partials that sum to its joined output (the add that launch would make)."""
    from bloomery_jax.ops.norms import rms_norm
    from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8_many

    rng = np.random.default_rng(93)
    e, n, k, pairs = 3, 32, 256, 4
    pw = repack(np.stack([weight(T.Q6_K, n, k, rng) for _ in range(e)]), T.Q6_K, (e, n, k), "ggml")
    parts = jnp.asarray(rng.standard_normal((3, pairs, 2 * k)), jnp.float32)  # [S, P, 2K]
    experts = jnp.asarray(rng.integers(0, e, pairs), jnp.int32)
    summed = (parts[0] + parts[1]) + parts[2]
    got = moe_gemv_q8(parts, pw, experts, swiglu_halves=True, config=CFG, interpret=True)
    np.testing.assert_array_equal(got, moe_gemv_q8(summed, pw, experts, swiglu_halves=True, config=CFG, interpret=True))
    assert not np.array_equal(got, moe_gemv_q8(parts[0], pw, experts, swiglu_halves=True, config=CFG, interpret=True))
    with pytest.raises(ValueError, match="SwiGLU's"):
        moe_gemv_q8(parts[:, :, :k], pw, experts, config=CFG, interpret=True)
    # the gate/up side: split 2 of K = 512's two chunks
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    gate_up = tuple(repack(np.stack([weight(T.Q4_K, 32, 512, rng) for _ in range(e)]), T.Q4_K, (e, 32, 512), "ggml")
                    for _ in range(2))
    cfg = GemvConfig(split_k=2)
    x8 = quantize_q8_1(rms_norm(x, jnp.ones(512), 1e-6))
    split = moe_gemv_q8_many(x8, gate_up, experts, pairs_per_row=2, config=cfg, joined=True, partials=True,
                             interpret=True)
    assert split.shape == (2, pairs, 64)
    joined = moe_gemv_q8_many(x8, gate_up, experts, pairs_per_row=2, config=cfg, joined=True, interpret=True)
    np.testing.assert_array_equal(jnp.sum(split, axis=0), joined)


@pytest.mark.parametrize("tokens, k, split", [(1, 8, 2), (2, 3, 1), (3, 2, 3)])
def test_combine_adds_the_weighted_pairs_to_x(tokens, k, split, monkeypatch):
    """moe_gemv_q8(..., combine=(weights, x, tickets)): the last program of each token's row tile
    returns x + sum_j weights[:, j] * y[pair j]. Against float64 on the rounded activations:
    each pair's y within the kernel's bound (module docstring), weighted, plus one rounding
    for each of the k products, the k - 1 adds and the add of x, each at most 2^-24 of
    |x| + sum_j w_j |y_j|. (Not against the plain launch's rows: the interpreter compiles each
    kernel body whole, and the two bodies' float products may round differently.) Weights
    taken in the wrong order fail that bound; the tickets come back at 0, and a second
    launch on them combines again. Each program reads its pair's one row of x (the interpreter
    would clamp reads of more rows to the same values, so the count is checked itself: the
    thirty-first session's first form read eight)."""
    from bloomery_jax.pallas.tickets import new_tickets

    rows_read = _spy_rows_read(monkeypatch)

    rng = np.random.default_rng(tokens * 10 + k)
    e, n, kk = 4, 64, 512
    raw = np.stack([weight(T.Q6_K, n, kk, rng) for _ in range(e)])
    pw = repack(raw, T.Q6_K, (e, n, kk), "ggml")
    cfg = GemvConfig(16, 1, 4, 3, split)  # 4 row tiles, split programs a tile
    pairs = tokens * k
    h = jnp.asarray(rng.standard_normal((pairs, kk)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, e, pairs), jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 1, (tokens, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((tokens, n)) * 4, jnp.float32)
    ex = np.asarray(experts)
    xv = np.asarray(quantize_q8_1(h).values(), np.float64)  # [P, K]: what the launch rounds h to
    w64 = np.asarray(dequantize(raw, T.Q6_K, (e, n, kk)), np.float64)[ex]  # [P, N, K]
    mag_w = np.asarray(scale_magnitudes(pw, stored_quants=True), np.float64)[ex]
    y = np.einsum("pk,pnk->pn", xv, w64).reshape(tokens, k, n)
    y_bound = (rounding_depth(T.Q6_K, kk, cfg) * U * np.einsum("pk,pnk->pn", np.abs(xv), mag_w)).reshape(tokens, k, n)
    w = np.asarray(weights, np.float64)
    x64 = np.asarray(x, np.float64)
    bound = 1.01 * (np.einsum("tk,tkn->tn", w, y_bound) + (k + 1) * U * (np.abs(x64) + np.einsum("tk,tkn->tn", w, np.abs(y))))
    tickets = new_tickets()
    for _ in range(2):
        got, tickets = moe_gemv_q8(h, pw, experts, config=cfg, combine=(weights, x, tickets), interpret=True)
        assert got.shape == (tokens, n) and not np.asarray(tickets).any()
        assert (np.abs(np.asarray(got, np.float64) - (x64 + np.einsum("tk,tkn->tn", w, y))) <= bound).all()
    assert rows_read == {1}, rows_read
    wrong = x64 + np.einsum("tk,tkn->tn", w[:, ::-1], y)
    assert not (np.abs(np.asarray(got, np.float64) - wrong) <= bound).all()
    with pytest.raises(ValueError, match="combine needs"):
        moe_gemv_q8(h, pw, experts, config=cfg, combine=(weights, x[:, :8], tickets), interpret=True)


@pytest.mark.parametrize("rows, split", [(1, 4), (3, 1)])
def test_dense_combine_adds_x(rows, split, monkeypatch):
    """qgemv_q8(..., combine=(x_res, tickets)): the last program of each row tile returns x_res
    plus the product. Against float64 on the rounded activations: the product within the
    kernel's bound, plus one rounding of the add (2^-24 of |x_res| + |y|); x_res left out fails
    it; the tickets come back at 0, and a second launch on them adds again; each program reads
    all the rows of x."""
    from bloomery_jax.pallas.tickets import new_tickets

    rows_read = _spy_rows_read(monkeypatch)

    rng = np.random.default_rng(rows * 7 + split)
    n, k = 64, 1024
    raw = weight(T.Q4_K, n, k, rng)
    pw = repack(raw, T.Q4_K, (n, k), "ggml")
    cfg = GemvConfig(16, 1, 4, 3, split)
    a = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, n)) * 4, jnp.float32)
    xv = np.asarray(quantize_q8_1(a).values(), np.float64)
    w64 = np.asarray(dequantize(raw, T.Q4_K, (n, k)), np.float64)
    y = xv @ w64.T
    mag_w = np.asarray(scale_magnitudes(pw, stored_quants=True), np.float64)
    x64 = np.asarray(x, np.float64)
    bound = 1.01 * (rounding_depth(T.Q4_K, k, cfg) * U * (np.abs(xv) @ mag_w.T) + U * (np.abs(x64) + np.abs(y)))
    tickets = new_tickets()
    for _ in range(2):
        got, tickets = qgemv_q8(a, pw, config=cfg, combine=(x, tickets), interpret=True)
        assert got.shape == (rows, n) and not np.asarray(tickets).any()
        assert (np.abs(np.asarray(got, np.float64) - (x64 + y)) <= bound).all()
    assert rows_read == {rows}, rows_read
    assert not (np.abs(np.asarray(got, np.float64) - y) <= bound).all()
    with pytest.raises(ValueError, match="combine needs"):
        qgemv_q8(a, pw, config=cfg, combine=(x[:, :8], tickets), interpret=True)


def _spy_rows_read(monkeypatch) -> set:
    """The rows of x each traced q8 program reads (``_XSource.rows``' count), as they are traced."""
    from bloomery_jax.pallas import qgemv_q8 as q8

    seen, rows = set(), q8._XSource.rows

    def spy(self, refs, interpret, n_rows=None):
        out = rows(self, refs, interpret, n_rows)
        seen.add(out[0].n)
        return out

    monkeypatch.setattr(q8._XSource, "rows", spy)
    jax.clear_caches()  # a launch traced by an earlier test would skip the spy
    return seen


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_round_first_gives_the_same_output(qtype):
    """Float x rounded in every program (round_first=False), in a launch of its own first (True,
    as the output head's many programs take it) and handed over as quantize_q8_1's blocks: the
    same blocks, the same sums in the same order, so the same bits."""
    rng = np.random.default_rng(int(qtype) + 90)
    n, k = 32, 512
    pw = repack(weight(qtype, n, k, rng), qtype, (n, k), "ggml")
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    in_programs = np.asarray(qgemv_q8(x, pw, config=CFG, round_first=False, interpret=True))
    np.testing.assert_array_equal(np.asarray(qgemv_q8(x, pw, config=CFG, round_first=True, interpret=True)), in_programs)
    np.testing.assert_array_equal(np.asarray(qgemv_q8(quantize_q8_1(x), pw, config=CFG, interpret=True)), in_programs)


def test_float_x_bad_inputs_raise():
    from bloomery_jax.pallas.qgemv_q8 import qgemv_q8_many

    rng = np.random.default_rng(2)
    ggml = repack(weight(T.Q4_K, 32, 256, rng), T.Q4_K, (32, 256), "ggml")
    with pytest.raises(ValueError, match="activations"):
        qgemv_q8(jnp.zeros((1, 512)), ggml, interpret=True)
    with pytest.raises(ValueError, match="norm must be"):
        qgemv_q8_many(jnp.zeros((1, 256)), (ggml,), norm=jnp.ones(128), interpret=True)
    with pytest.raises(ValueError, match="formed from float x"):
        qgemv_q8_many(quantize_q8_1(jnp.zeros((1, 256))), (ggml,), norm=jnp.ones(256), interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_float_x_lowers_to_triton_for_h200(monkeypatch):
    """The decode layer's four q8 launches on float x (rounding, norm and SwiGLU in-kernel, the
    division as inline PTX) verify for sm_90: q/k/v with the norm, o, gate/up with the norm and
    the token's 8 pairs, down on gate and up side by side."""
    from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8_many, qgemv_q8_many

    rng = np.random.default_rng(0)
    x, norm = jax.ShapeDtypeStruct((1, 2048), jnp.float32), jax.ShapeDtypeStruct((2048,), jnp.float32)
    qkv = tuple(repack(weight(q, n, 2048, rng), q, (n, 2048), "ggml") for q, n in [(T.Q4_K, 4096), (T.Q4_K, 512), (T.Q6_K, 512)])
    assert triton_kernels(monkeypatch, lambda x, ws, nw: qgemv_q8_many(x, ws, norm=nw, eps=1e-6, partials=True),
                          x, qkv, norm) == [("qgemv_q8_many", 90, True)]
    o = repack(weight(T.Q4_K, 2048, 4096, rng), T.Q4_K, (2048, 4096), "ggml")
    assert triton_kernels(monkeypatch, lambda x, w: qgemv_q8(x, w), jax.ShapeDtypeStruct((1, 4096), jnp.float32), o) == [
        ("qgemv_q8_q4_k", 90, True)]
    from bloomery_jax.pallas.tickets import TICKETS

    residual = (jax.ShapeDtypeStruct((1, 2048), jnp.float32), jax.ShapeDtypeStruct((TICKETS,), jnp.int32))
    assert triton_kernels(monkeypatch, lambda x, w, c: qgemv_q8(x, w, combine=c), jax.ShapeDtypeStruct((1, 4096), jnp.float32),
                          o, residual) == [("qgemv_q8_q4_k", 90, True)]
    gu = tuple(repack(np.stack([weight(T.Q4_K, 768, 2048, rng) for _ in range(2)]), T.Q4_K, (2, 768, 2048), "ggml")
               for _ in range(2))
    experts = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert triton_kernels(monkeypatch, lambda x, ws, e, nw: moe_gemv_q8_many(x, ws, e, pairs_per_row=8, norm=nw, eps=1e-6,
                                                                             joined=True),
                          x, gu, experts, norm) == [("moe_gemv_q8_many", 90, True)]
    down = repack(np.stack([weight(T.Q6_K, 2048, 768, rng) for _ in range(2)]), T.Q6_K, (2, 2048, 768), "ggml")
    assert triton_kernels(monkeypatch, lambda h, w, e: moe_gemv_q8(h, w, e, swiglu_halves=True),
                          jax.ShapeDtypeStruct((8, 1536), jnp.float32), down, experts) == [("moe_gemv_q8_q6_k", 90, True)]
    # down adding its weighted rows to x in each row tile's last program (on split-K partials, as the step)
    combined = (jax.ShapeDtypeStruct((1, 8), jnp.float32), jax.ShapeDtypeStruct((1, 2048), jnp.float32),
                jax.ShapeDtypeStruct((TICKETS,), jnp.int32))
    assert triton_kernels(monkeypatch, lambda h, w, e, c: moe_gemv_q8(h, w, e, swiglu_halves=True, combine=c),
                          jax.ShapeDtypeStruct((2, 8, 1536), jnp.float32), down, experts, combined) == [
        ("moe_gemv_q8_q6_k", 90, True)]
