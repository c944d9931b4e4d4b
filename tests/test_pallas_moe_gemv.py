"""pallas.moe_gemv (Pallas interpret mode on the CPU) against a float64 reference, and its Triton lowering.

Tolerance, as for the planes kernel of ``qgemv`` (tests/test_pallas_qgemv.py): every weight the
kernel forms equals ``dequantize`` of the file bit for bit, so only the sum order differs and
    |y[p] - y_f64[p]| <= depth * 2^-24 * sum_k |x[p, k]| |w[experts[p], n, k]|,
with ``depth = qgemv.rounding_depth(layout, ...)`` (the same for "planes" and "ggml") and a 1%
margin for second-order terms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.pallas.moe_gemv import GemvConfig, moe_gemv
from bloomery_jax.pallas.qgemv import qgemv, rounding_depth
from bloomery_jax.quant import dequantize
from bloomery_jax.quant.repack import PACKABLE, repack
from test_pallas_qgemv import U, weight
from triton_lowering import triton_kernels

CFG = GemvConfig(16, 1, 4, 3)  # 2 row tiles of 16 at N=32, one chunk per loop step


def stacked(qtype, e, n, k, rng, layout="planes"):
    """Random GGUF bytes [E, N, row_bytes] (finite f16 scales), their repack, f64 values."""
    raw = np.stack([weight(qtype, n, k, rng) for _ in range(e)])
    w64 = np.asarray(dequantize(raw, qtype, (e, n, k)), np.float64)
    return raw, repack(raw, qtype, (e, n, k), layout), w64


def errors(y, x, w64, experts, qtype, cfg):
    """|y - y_f64| / bound for every output, with the truth built from the given expert index."""
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w = w64[np.asarray(experts)]  # [P, N, K]
    exact = np.einsum("pk,pnk->pn", xf, w)
    mag = np.einsum("pk,pnk->pn", np.abs(xf), np.abs(w))  # sum_k |x w|
    bound = 1.01 * rounding_depth("planes", qtype, x.shape[1], cfg) * U * mag
    return np.abs(np.asarray(y, np.float64) - exact) / bound


@pytest.mark.parametrize("qtype,layout", [(q, "planes") for q in PACKABLE] + [(T.Q5_K, "ggml")],
                         ids=lambda v: getattr(v, "name", v))
def test_matches_reference(qtype, layout):
    # E=6 experts (not a power of two), 16 pairs: every expert repeats, pairs in scrambled order;
    # ggml: Q5_K, whose four fields all go through the expert view (each body: qgemv's tests)
    rng = np.random.default_rng(int(qtype))
    raw, pw, w64 = stacked(qtype, 6, 32, 512, rng, layout)
    experts = jnp.asarray(rng.integers(0, 6, 16), jnp.int32)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
    y = moe_gemv(x, pw, experts, config=CFG, interpret=True)
    assert y.shape == (16, 32) and y.dtype == jnp.float32
    assert errors(y, x, w64, experts, qtype, CFG).max() <= 1.0


@pytest.mark.parametrize("qtype,cfg,dtype", [
    (T.Q4_K, GemvConfig(32, 2, 4, 3), jnp.bfloat16),  # one row tile, 2 chunks a step, bf16 x
    (T.Q6_K, GemvConfig(8, 2, 4, 3), jnp.float32),
], ids=["Q4_K-bf16", "Q6_K-f32"])
def test_single_pair(qtype, cfg, dtype):
    rng = np.random.default_rng(5)
    raw, pw, w64 = stacked(qtype, 4, 32, 512, rng)
    experts = jnp.asarray([3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((1, 512)), dtype)
    y = moe_gemv(x, pw, experts, config=cfg, interpret=True)
    assert errors(y, x, w64, experts, qtype, cfg).max() <= 1.0


def test_same_sums_as_qgemv_on_the_expert():
    # the same bodies and K loop: each pair's row equals qgemv on its expert's own 2-D weight
    rng = np.random.default_rng(9)
    raw, pw, _ = stacked(T.Q5_K, 4, 32, 512, rng)
    experts = np.array([2, 0, 2, 3])
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.float32)
    y = np.asarray(moe_gemv(x, pw, jnp.asarray(experts), config=CFG, interpret=True))
    for p, e in enumerate(experts):
        one = repack(raw[e], T.Q5_K, (32, 512))
        np.testing.assert_array_equal(y[p], np.asarray(qgemv(x[p:p + 1], one, config=CFG, interpret=True))[0])


def test_bound_catches_a_wrong_expert():
    # guards the test: the right outputs judged against a neighbouring expert fail the bound everywhere
    rng = np.random.default_rng(11)
    raw, pw, w64 = stacked(T.Q4_K, 4, 32, 512, rng)
    experts = jnp.asarray([1, 3, 0, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.float32)
    y = moe_gemv(x, pw, experts, config=CFG, interpret=True)
    assert errors(y, x, w64, experts, T.Q4_K, CFG).max() <= 1.0
    wrong = experts.at[2].set(2)
    ratio = errors(y, x, w64, wrong, T.Q4_K, CFG)
    assert (ratio[2] > 1.0).all(), ratio[2].min()
    assert (np.delete(ratio, 2, axis=0) <= 1.0).all()


def test_out_of_range_experts_are_clamped():
    rng = np.random.default_rng(13)
    _, pw, _ = stacked(T.Q8_0, 4, 32, 256, rng)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    y = moe_gemv(x, pw, jnp.asarray([7, -2], jnp.int32), config=CFG, interpret=True)
    want = moe_gemv(x, pw, jnp.asarray([3, 0], jnp.int32), config=CFG, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_bad_inputs_raise():
    _, pw, _ = stacked(T.Q4_K, 4, 16, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"x must be \[P / 1, 256\] and experts \[P\]"):
        moe_gemv(jnp.zeros((2, 512)), pw, jnp.zeros(2, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"x must be \[P / 1, 256\] and experts \[P\]"):
        moe_gemv(jnp.zeros((2, 256)), pw, jnp.zeros(3, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"x must be \[P / 2, 256\] and experts \[P\]"):
        moe_gemv(jnp.zeros((2, 256)), pw, jnp.zeros(3, jnp.int32), pairs_per_row=2, interpret=True)
    flat = repack(np.zeros((16, 144), np.uint8), T.Q4_K, (16, 256))
    with pytest.raises(ValueError, match="needs a 3-D planes-layout"):
        moe_gemv(jnp.zeros((2, 256)), flat, jnp.zeros(2, jnp.int32), interpret=True)
    rows = repack(np.zeros((4, 16, 144), np.uint8), T.Q4_K, (4, 16, 256), "rows")
    with pytest.raises(ValueError, match="needs a 3-D planes-layout or ggml-layout"):
        moe_gemv(jnp.zeros((2, 256)), rows, jnp.zeros(2, jnp.int32), interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
def test_lowers_to_triton_for_h200(qtype, monkeypatch):
    """A verified Triton module for sm_90 at the default launch parameters and a decode shape
    (E=6, 16 pairs)."""
    e, n, k = 6, 64, 512
    raw = np.stack([weight(qtype, n, k, np.random.default_rng(0)) for _ in range(e)])
    pw = repack(raw, qtype, (e, n, k))
    x = jax.ShapeDtypeStruct((16, k), jnp.bfloat16)
    experts = jax.ShapeDtypeStruct((16,), jnp.int32)
    assert triton_kernels(monkeypatch, moe_gemv, x, pw, experts) == [(f"moe_gemv_{qtype.name.lower()}", 90, True)]


def test_many_in_one_launch():
    # gate and up of a layer in one launch: each output within the bound of its own weight
    from bloomery_jax.pallas.moe_gemv import moe_gemv_many

    rng = np.random.default_rng(17)
    (_, g, g64), (_, u, u64) = stacked(T.Q4_K, 6, 64, 512, rng), stacked(T.Q5_K, 6, 32, 512, rng)
    experts = jnp.asarray(rng.integers(0, 6, 5), jnp.int32)
    x = jnp.asarray(rng.standard_normal((5, 512)), jnp.float32)
    yg, yu = moe_gemv_many(x, (g, u), experts, interpret=True)
    assert yg.shape == (5, 64) and yu.shape == (5, 32)
    assert errors(yg, x, g64, experts, T.Q4_K, CFG).max() <= 1.0
    assert errors(yu, x, u64, experts, T.Q5_K, CFG).max() <= 1.0
    assert errors(yu, x, u64, (experts + 1) % 6, T.Q5_K, CFG).max() > 1.0  # guards the test


def test_pairs_share_their_token_row():
    """pairs_per_row=k reads token p // k's row for pair p: the same outputs, bit for bit, as the
    rows copied out once per pair."""
    from bloomery_jax.pallas.moe_gemv import moe_gemv_many

    rng = np.random.default_rng(23)
    (_, g, _), (_, u, _) = stacked(T.Q4_K, 6, 64, 512, rng), stacked(T.Q6_K, 6, 32, 512, rng)
    n, k = 3, 4
    experts = jnp.asarray(rng.integers(0, 6, n * k), jnp.int32)
    x = jnp.asarray(rng.standard_normal((n, 512)), jnp.float32)
    per_pair = jnp.repeat(x, k, axis=0)  # [P, K]
    for got, want in ((moe_gemv_many(x, (g, u), experts, pairs_per_row=k, interpret=True),
                       moe_gemv_many(per_pair, (g, u), experts, interpret=True)),
                      ((moe_gemv(x, g, experts, config=CFG, pairs_per_row=k, interpret=True),),
                       (moe_gemv(per_pair, g, experts, config=CFG, interpret=True),))):
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.shape[0] == n * k
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_swiglu_rows():
    """up=...: the down projection reads silu(gate) * up formed in-kernel. Against the hidden
    vector formed first (ops.experts.swiglu): each product's factor differs by at most a few
    ulps (exp, division), so the outputs agree to 4 ulps of sum |h w| (measured: 0.8)."""
    from bloomery_jax.ops.experts import swiglu

    rng = np.random.default_rng(29)
    _, d, d64 = stacked(T.Q6_K, 5, 32, 512, rng)
    experts = jnp.asarray(rng.integers(0, 5, 6), jnp.int32)
    g = jnp.asarray(rng.standard_normal((6, 512)) * 3, jnp.float32)
    u = jnp.asarray(rng.standard_normal((6, 512)), jnp.float32)
    got = np.asarray(moe_gemv(g, d, experts, up=u, config=CFG, interpret=True), np.float64)
    h = swiglu(g, u)
    want = np.asarray(moe_gemv(h, d, experts, config=CFG, interpret=True), np.float64)
    mag = np.einsum("pk,pnk->pn", np.abs(np.asarray(h, np.float64)), np.abs(d64[np.asarray(experts)]))
    assert np.all(np.abs(got - want) <= 4 * U * mag)
    assert errors(got, h, d64, experts, T.Q6_K, CFG).max() <= 1.0  # the kernel's own bound (measured: 0.02)
    with pytest.raises(ValueError, match="up must be shaped like x"):
        moe_gemv(g, d, experts, up=u[:5], interpret=True)


def test_gate_and_up_side_by_side():
    """moe_gemv_many(joined=True) is the tuple's outputs side by side, and moe_gemv(swiglu_halves=True)
    on that is moe_gemv(gate, up=up): the same programs, bit for bit."""
    from bloomery_jax.pallas.moe_gemv import moe_gemv_many

    rng = np.random.default_rng(41)
    (_, gw, _), (_, uw, _), (_, dw, _) = (stacked(q, 5, n, k, rng) for q, n, k in
                                          ((T.Q4_K, 256, 512), (T.Q4_K, 256, 512), (T.Q6_K, 512, 256)))
    experts = jnp.asarray(rng.integers(0, 5, 6), jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.float32)  # 3 tokens of 2 pairs
    g, u = moe_gemv_many(x, (gw, uw), experts, pairs_per_row=2, interpret=True)
    gu = moe_gemv_many(x, (gw, uw), experts, pairs_per_row=2, joined=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(gu), np.concatenate([np.asarray(g), np.asarray(u)], axis=1))
    got = moe_gemv(gu, dw, experts, swiglu_halves=True, config=CFG, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(moe_gemv(g, dw, experts, up=u, config=CFG, interpret=True)))
    with pytest.raises(ValueError, match="exclude each other"):
        moe_gemv(gu, dw, experts, up=gu, swiglu_halves=True, interpret=True)


def test_many_with_the_norm_in_kernel():
    """norm=: gate and up read rms_norm(x) formed in-kernel. Against the normalised x handed in:
    the mean square sums in another order, so the scale may differ by an ulp or two; each output
    within 4 ulps of sum |x_n w| (as qgemv_many's norm test)."""
    from bloomery_jax.ops.norms import rms_norm
    from bloomery_jax.pallas.moe_gemv import moe_gemv_many

    rng = np.random.default_rng(43)
    (_, gw, g64), (_, uw, u64) = (stacked(T.Q4_K, 5, 64, 512, rng) for _ in range(2))
    experts = jnp.asarray(rng.integers(0, 5, 4), jnp.int32)
    x = jnp.asarray(rng.standard_normal((2, 512)) * 5, jnp.float32)  # 2 tokens of 2 pairs
    nw = jnp.asarray(rng.uniform(0.5, 2, 512), jnp.float32)
    got = moe_gemv_many(x, (gw, uw), experts, pairs_per_row=2, norm=nw, eps=1e-6, interpret=True)
    xn = rms_norm(x, nw, 1e-6)
    want = moe_gemv_many(xn, (gw, uw), experts, pairs_per_row=2, interpret=True)
    xp = np.repeat(np.abs(np.asarray(xn, np.float64)), 2, axis=0)  # [P, K]: each pair's token row
    for a, b, w64 in zip(got, want, (g64, u64)):
        mag = np.einsum("pk,pnk->pn", xp, np.abs(w64[np.asarray(experts)]))
        assert np.all(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) <= 4 * U * mag)
    with pytest.raises(ValueError, match=r"norm must be \[512\]"):
        moe_gemv_many(x, (gw, uw), experts, pairs_per_row=2, norm=nw[:256], interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_fused_swiglu_lowers_to_triton_for_h200(monkeypatch):
    """The decode down projection with the hidden vector formed in-kernel (Q6_K, 8 pairs)."""
    rng = np.random.default_rng(0)
    pw = repack(np.stack([weight(T.Q6_K, 2048, 768, rng) for _ in range(2)]), T.Q6_K, (2, 2048, 768))
    h = jax.ShapeDtypeStruct((8, 768), jnp.float32)
    experts = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert triton_kernels(monkeypatch, lambda g, u, w, e: moe_gemv(g, w, e, up=u), h, h, pw, experts) == [
        ("moe_gemv_q6_k", 90, True)]
    gu = jax.ShapeDtypeStruct((8, 2 * 768), jnp.float32)  # gate and up side by side (moe_gemv_many joined)
    assert triton_kernels(monkeypatch, lambda x, w, e: moe_gemv(x, w, e, swiglu_halves=True), gu, pw, experts) == [
        ("moe_gemv_q6_k", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_many_lowers_to_triton_for_h200(monkeypatch):
    from bloomery_jax.pallas.moe_gemv import moe_gemv_many

    rng = np.random.default_rng(0)
    ws = tuple(repack(np.stack([weight(T.Q4_K, 768, 2048, rng) for _ in range(4)]), T.Q4_K, (4, 768, 2048))
               for _ in range(2))
    x = jax.ShapeDtypeStruct((1, 2048), jnp.float32)  # the decode step's call: one token, its 8 pairs
    experts = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert triton_kernels(monkeypatch, lambda x, ws, e: moe_gemv_many(x, ws, e, pairs_per_row=8), x, ws, experts) == [
        ("moe_gemv_many", 90, True)]
    nw = jax.ShapeDtypeStruct((2048,), jnp.float32)  # the model's call: the ffn norm in-kernel, outputs joined
    fn = lambda x, n, ws, e: moe_gemv_many(x, ws, e, pairs_per_row=8, norm=n, eps=1e-6, joined=True)  # noqa: E731
    assert triton_kernels(monkeypatch, fn, x, nw, ws, experts) == [("moe_gemv_many", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_ggml_lowers_to_triton_for_h200(monkeypatch):
    """moe_gemv (Q6_K) and moe_gemv_many (gate Q4_K, up Q5_K) on ggml-layout experts."""
    from bloomery_jax.pallas.moe_gemv import moe_gemv_many

    e, n, k = 6, 64, 512
    rng = np.random.default_rng(0)
    ws = [repack(np.stack([weight(q, n, k, rng) for _ in range(e)]), q, (e, n, k), "ggml")
          for q in (T.Q4_K, T.Q5_K, T.Q6_K)]
    x = jax.ShapeDtypeStruct((8, k), jnp.bfloat16)
    experts = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert triton_kernels(monkeypatch, moe_gemv, x, ws[2], experts) == [("moe_gemv_ggml_q6_k", 90, True)]
    assert triton_kernels(monkeypatch, lambda x, ws, e: moe_gemv_many(x, ws, e), x, tuple(ws[:2]), experts) == [
        ("moe_gemv_many", 90, True)]


def test_split_k():
    # 2 programs share each (pair, row tile): partial sums over halves of K, added after the launch
    rng = np.random.default_rng(31)
    cfg = GemvConfig(16, 1, 4, 3, 2)
    raw, pw, w64 = stacked(T.Q4_K, 5, 32, 512, rng)
    experts = jnp.asarray(rng.integers(0, 5, 7), jnp.int32)
    x = jnp.asarray(rng.standard_normal((7, 512)), jnp.float32)
    y = moe_gemv(x, pw, experts, config=cfg, interpret=True)
    assert errors(y, x, w64, experts, T.Q4_K, cfg).max() <= 1.0
    assert errors(y, x, w64, (experts + 1) % 5, T.Q4_K, cfg).max() > 1.0  # guards the test
