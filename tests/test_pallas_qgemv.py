"""pallas.qgemv (every layout, Pallas interpret mode on the CPU) against float64 and float32 references.

Tolerance, derived per kernel (``qgemv.rounding_depth``): every weight the kernels form is the
file's value or, in the rows kernel, its sub-block factors; each product then passes through at
most ``depth`` f32 roundings (the sequential K-accumulation and the final sums), so
    |y - y_f64| <= depth * 2^-24 * sum_k |x_k| m_k,   m = |s q| + |min| (= |w| without a min).
Against the float32 reference ``x @ dequantize(W).T`` (Precision.HIGHEST), whose own sequential
sum adds at most K roundings, the allowance is (depth + K) * 2^-24 * the same magnitude.
A 1% margin covers second-order terms. Scales are finite here (inf scales make NaN rows).
The "ggml" layout runs the planes kernel with other per-format bodies (same tiles, same bound).
Outputs of the two layouts are not compared bit for bit: under jit, XLA's CPU backend contracts
some ``a * b + c`` into FMAs, and where it does depends on how each body's ops fuse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from bloomery_jax.pallas.qgemv import GemvConfig, qgemv, rounding_depth
from bloomery_jax.quant import dequantize
from bloomery_jax.quant.repack import PACKABLE, dequantize_packed, repack, scale_magnitudes

U = 2.0 ** -24
F16_FIELDS = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def weight(qtype, n, k, rng):
    """Random GGUF bytes [n, row_bytes] with finite f16 scales of both signs."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // elems, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        v = rng.uniform(-0.02, 0.02, blocks.shape[0]).astype("<f2")
        blocks[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def check(qtype, layout, n, k, b, cfg, rng, x_dtype=jnp.float32):
    raw = weight(qtype, n, k, rng)
    pw = repack(raw, qtype, (n, k), layout)
    x = jnp.asarray(rng.standard_normal((b, k)), x_dtype)
    y = np.asarray(qgemv(x, pw, config=cfg, interpret=True), np.float64)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = np.asarray(dequantize_packed(pw), np.float64)
    mag = np.abs(xf) @ np.asarray(scale_magnitudes(pw), np.float64).T  # [B, N]
    depth = rounding_depth(layout, qtype, k, cfg)
    err64 = np.abs(y - xf @ w64.T)
    assert (err64 <= 1.01 * depth * U * mag).all(), (err64 / (depth * U * mag)).max()
    ref32 = np.asarray(jnp.einsum("bk,nk->bn", x.astype(jnp.float32), dequantize(raw, qtype, (n, k)),
                                  precision=jax.lax.Precision.HIGHEST), np.float64)
    err32 = np.abs(y - ref32)
    assert (err32 <= 1.01 * (depth + k) * U * mag).all(), (err32 / ((depth + k) * U * mag)).max()
    return y, xf, w64, mag, depth


@pytest.mark.parametrize("qtype,layout", [(q, lay) for lay in ("planes", "rows") for q in PACKABLE]
                         + [(T.Q4_K, "ggml"), (T.Q6_K, "ggml")], ids=lambda v: getattr(v, "name", v))
def test_matches_reference(qtype, layout):
    # 2 programs of 16 rows, 2 loop steps of 1 chunk (Q8_0: 4 steps), 2 rows of x; the other ggml
    # bodies: Q8_0 in test_split_k_ggml, Q5_K in test_many_ggml_and_mixed_layouts
    check(qtype, layout, 32, 512, 2, GemvConfig(16, 1, 4, 3), np.random.default_rng(int(qtype)))


@pytest.mark.parametrize("layout,qtype,b,cfg,dtype", [
    ("rows", T.Q4_K, 1, GemvConfig(8, 2, 4, 3), jnp.bfloat16),  # 2 chunks a step, bf16 x
    ("planes", T.Q6_K, 1, GemvConfig(8, 2, 4, 3), jnp.float32),
    ("rows", T.Q5_K, 8, GemvConfig(32, 1, 4, 3), jnp.float32),  # the largest batch, one program
])
def test_other_launch_shapes(layout, qtype, b, cfg, dtype):
    check(qtype, layout, 32, 512, b, cfg, np.random.default_rng(7), dtype)


def test_one_dimensional_x():
    rng = np.random.default_rng(3)
    pw = repack(weight(T.Q8_0, 16, 256, rng), T.Q8_0, (16, 256), "rows")
    x = jnp.asarray(rng.standard_normal(256), jnp.float32)
    y1 = qgemv(x, pw, config=GemvConfig(16, 1, 4, 3), interpret=True)
    y2 = qgemv(x[None], pw, config=GemvConfig(16, 1, 4, 3), interpret=True)
    assert y1.shape == (16,)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2)[0])  # same kernel, same order


def test_bound_is_tight_enough_to_catch_a_wrong_weight():
    # guards the tolerance: one quant off by one step moves y by |x_k s|, far above the bound
    y, xf, w64, mag, depth = check(T.Q4_K, "rows", 16, 512, 1, GemvConfig(16, 1, 4, 3),
                                   np.random.default_rng(11))
    wrong = w64.copy()
    step = np.abs(w64[0, 1:32] - w64[0, 0:31])
    wrong[0, 5] += step[step > 0].min()
    err = np.abs(y - xf @ wrong.T)[0, 0]
    assert err > 1.01 * depth * U * mag[0, 0], (err, depth * U * mag[0, 0])


def test_bad_shapes_raise():
    pw = repack(weight(T.Q4_K, 8, 256, np.random.default_rng(0)), T.Q4_K, (8, 256), "rows")
    with pytest.raises(ValueError, match=r"x must be \[B<=8, 256\]"):
        qgemv(jnp.zeros((9, 256)), pw, interpret=True)
    with pytest.raises(ValueError, match=r"x must be \[B<=8, 256\]"):
        qgemv(jnp.zeros((1, 512)), pw, interpret=True)
    stacked = repack(np.zeros((2, 8, 144), np.uint8), T.Q4_K, (2, 8, 256), "rows")
    with pytest.raises(ValueError, match="needs a 2-D packed"):
        qgemv(jnp.zeros((1, 256)), stacked, interpret=True)


def test_many_in_one_launch():
    # q, k and v of a layer in one launch (two formats, three heights): each output within the
    # planes bound of its own weight (the tile height may differ from qgemv's, so the final
    # W-column sums may associate differently; rounding_depth does not depend on it)
    from bloomery_jax.pallas.qgemv import qgemv_many

    rng = np.random.default_rng(21)
    shapes = [(T.Q4_K, 64), (T.Q4_K, 32), (T.Q6_K, 32)]
    ws = tuple(repack(weight(q, n, 512, rng), q, (n, 512)) for q, n in shapes)
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    ys = qgemv_many(x, ws, interpret=True)
    assert [y.shape for y in ys] == [(2, 64), (2, 32), (2, 32)]
    xf = np.asarray(x, np.float64)
    for y, w, (q, _) in zip(ys, ws, shapes):
        exact = xf @ np.asarray(dequantize_packed(w), np.float64).T
        mag = np.abs(xf) @ np.asarray(scale_magnitudes(w), np.float64).T
        bound = 1.01 * rounding_depth("planes", q, 512, None) * U * mag
        assert (np.abs(np.asarray(y, np.float64) - exact) <= bound).all()
    # the wrong weight's values fail that bound (guards the test)
    assert not (np.abs(np.asarray(ys[1], np.float64) - xf @ np.asarray(dequantize_packed(ws[2]), np.float64).T)
                <= 1.01 * rounding_depth("planes", T.Q4_K, 512, None) * U * mag).all()
    with pytest.raises(ValueError, match="planes-layout"):
        qgemv_many(x, (ws[0], repack(weight(T.Q4_K, 32, 256, rng), T.Q4_K, (32, 256))), interpret=True)


def test_tuned_file_overrides_the_tables(tmp_path, monkeypatch):
    """``BLOOMERY_GEMV_TUNED`` (what ``layer_kernel_bench.py --tuned-out`` writes) comes before
    the tables for the launches it names and leaves the others alone; a file that cannot be read
    is an error naming it."""
    import json

    from bloomery_jax.pallas import qgemv_tuned

    qkv = [("Q4_K", 4096), ("Q4_K", 512), ("Q6_K", 512)]
    before_down = qgemv_tuned.pick_config("planes", "Q6_K", 2048, 768)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"single": [["planes", "Q4_K", 4096, 2048, [64, 1, 2, 3, 4]]],
                                "many": [["planes", [list(w) for w in qkv], 2048, [16, 2, 4, 3, 2]]]}))
    monkeypatch.setenv("BLOOMERY_GEMV_TUNED", str(path))
    qgemv_tuned.measured_here.cache_clear()
    try:
        assert qgemv_tuned.pick_config("planes", "Q4_K", 4096, 2048) == GemvConfig(64, 1, 2, 3, 4)
        assert qgemv_tuned.pick_many_config("planes", qkv, 2048) == GemvConfig(16, 2, 4, 3, 2)
        assert qgemv_tuned.pick_config("planes", "Q6_K", 2048, 768) == before_down
        path.write_text('{"single": [["planes", "Q4_K", 4096]]}')
        qgemv_tuned.measured_here.cache_clear()
        with pytest.raises(ValueError, match="BLOOMERY_GEMV_TUNED=.*tuned.json"):
            qgemv_tuned.pick_config("planes", "Q4_K", 4096, 2048)
    finally:
        monkeypatch.delenv("BLOOMERY_GEMV_TUNED")
        qgemv_tuned.measured_here.cache_clear()
    assert qgemv_tuned.pick_config("planes", "Q4_K", 4096, 2048) == GemvConfig(*qgemv_tuned.TUNED[("planes", "Q4_K", 4096, 2048)])


def test_many_launch_config(monkeypatch):
    """A launch over several weights takes the config of the weight with the most rows, or a
    TUNED_MANY entry, or the caller's; any of them gives each output within its bound."""
    from bloomery_jax.pallas import qgemv_tuned
    from bloomery_jax.pallas.qgemv import qgemv_many

    qkv = [("Q4_K", 4096), ("Q4_K", 512), ("Q6_K", 512)]
    monkeypatch.delitem(qgemv_tuned.TUNED_MANY, ("planes", tuple(qkv), 2048), raising=False)
    assert qgemv_tuned.pick_many_config("planes", qkv, 2048) == qgemv_tuned.pick_config("planes", "Q4_K", 4096, 2048)
    monkeypatch.setitem(qgemv_tuned.TUNED_MANY, ("planes", tuple(qkv), 2048), (64, 1, 4, 2, 2))
    assert qgemv_tuned.pick_many_config("planes", qkv, 2048) == GemvConfig(64, 1, 4, 2, 2)
    rng = np.random.default_rng(37)
    shapes = [(T.Q4_K, 64), (T.Q6_K, 32)]
    ws = tuple(repack(weight(q, n, 512, rng), q, (n, 512)) for q, n in shapes)
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    xf = np.asarray(x, np.float64)
    cfg = GemvConfig(64, 1, 4, 3, 2)  # block_n 64 is cut to 32 (the Q6_K weight's rows), a split of 2
    ys = qgemv_many(x, ws, config=cfg, interpret=True)
    for y, w, (q, _) in zip(ys, ws, shapes):
        exact = xf @ np.asarray(dequantize_packed(w), np.float64).T
        mag = np.abs(xf) @ np.asarray(scale_magnitudes(w), np.float64).T
        assert (np.abs(np.asarray(y, np.float64) - exact) <= 1.01 * rounding_depth("planes", q, 512, cfg) * U * mag).all()
    # partials=True: the launch's two partial sums as written, the outputs side by side
    parts = np.asarray(qgemv_many(x, ws, config=cfg, partials=True, interpret=True))
    assert parts.shape == (2, 2, 96)
    np.testing.assert_array_equal(parts[0] + parts[1], np.concatenate([np.asarray(y) for y in ys], axis=1))


def test_many_ggml_and_mixed_layouts(monkeypatch):
    # a ggml weight (Q5_K: its qh words are a third row-tiled field) and a planes one in one
    # launch: each output within its own bound (one chunk a loop step: a smaller program to trace;
    # the shapes of test_matches_reference, whose references are still cached here)
    from bloomery_jax.pallas import qgemv_tuned
    from bloomery_jax.pallas.qgemv import qgemv_many

    for q in ("Q5_K", "Q6_K"):
        monkeypatch.setitem(qgemv_tuned.DEFAULTS, ("planes", q), (16, 1, 4, 3))
    rng = np.random.default_rng(29)
    ws = (repack(weight(T.Q5_K, 32, 512, rng), T.Q5_K, (32, 512), "ggml"),
          repack(weight(T.Q6_K, 32, 512, rng), T.Q6_K, (32, 512), "planes"))
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    ys = [np.asarray(y) for y in qgemv_many(x, ws, interpret=True)]
    xf = np.asarray(x, np.float64)
    for y, w in zip(ys, ws):
        exact = xf @ np.asarray(dequantize_packed(w), np.float64).T
        mag = np.abs(xf) @ np.asarray(scale_magnitudes(w), np.float64).T
        assert (np.abs(y - exact) <= 1.01 * rounding_depth(w.layout, w.qtype, 512, None) * U * mag).all()


def test_many_with_the_norm_in_kernel():
    """norm=: the products of rms_norm(x) formed in-kernel. Against the normalised x handed in:
    the mean square sums in another order, so the scale may differ by an ulp or two; each output
    within 4 ulps of sum |x_n w| of it (measured: 0 under the CPU interpreter, which sums in the
    same order; the GPU's order differs), and within the kernel's own bound of the f64 truth."""
    from bloomery_jax.ops.norms import rms_norm
    from bloomery_jax.pallas.qgemv import qgemv_many

    rng = np.random.default_rng(31)
    shapes = [(T.Q4_K, 64), (T.Q6_K, 32)]
    ws = tuple(repack(weight(q, n, 512, rng), q, (n, 512)) for q, n in shapes)
    x = jnp.asarray(rng.standard_normal((3, 512)) * 7, jnp.float32)
    nw = jnp.asarray(rng.uniform(0.5, 2, 512), jnp.float32)
    got = qgemv_many(x, ws, norm=nw, eps=1e-6, interpret=True)
    xn = rms_norm(x, nw, 1e-6)
    want = qgemv_many(xn, ws, interpret=True)
    xf = np.asarray(xn, np.float64)
    for g, wnt, w, (q, _) in zip(got, want, ws, shapes):
        mag = np.abs(xf) @ np.asarray(scale_magnitudes(w), np.float64).T
        assert (np.abs(np.asarray(g, np.float64) - np.asarray(wnt, np.float64)) <= 4 * U * mag).all()
        exact = xf @ np.asarray(dequantize_packed(w), np.float64).T
        assert (np.abs(np.asarray(g, np.float64) - exact) <= 1.01 * rounding_depth("planes", q, 512, None) * U * mag).all()
    with pytest.raises(ValueError, match=r"norm must be \[512\]"):
        qgemv_many(x, ws, norm=nw[:256], interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_many_with_norm_lowers_to_triton_for_h200(monkeypatch):
    from bloomery_jax.pallas.qgemv import qgemv_many
    from triton_lowering import triton_kernels

    rng = np.random.default_rng(0)
    ws = tuple(repack(weight(q, n, 2048, rng), q, (n, 2048)) for q, n in [(T.Q4_K, 4096), (T.Q4_K, 512), (T.Q6_K, 512)])
    x = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
    nw = jax.ShapeDtypeStruct((2048,), jnp.float32)
    assert triton_kernels(monkeypatch, lambda x, n, ws: qgemv_many(x, ws, norm=n, eps=1e-6), x, nw, ws) == [
        ("qgemv_many", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_many_lowers_to_triton_for_h200(monkeypatch):
    """q (Q4_K), k (Q4_K) and v (Q6_K) of the 30B shape in one verified Triton module for sm_90."""
    from bloomery_jax.pallas.qgemv import qgemv_many
    from triton_lowering import triton_kernels

    rng = np.random.default_rng(0)
    ws = tuple(repack(weight(q, n, 2048, rng), q, (n, 2048)) for q, n in [(T.Q4_K, 4096), (T.Q4_K, 512), (T.Q6_K, 512)])
    x = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
    assert triton_kernels(monkeypatch, lambda x, ws: qgemv_many(x, ws), x, ws) == [("qgemv_many", 90, True)]


@pytest.mark.parametrize("qtype,cfg", [
    (T.Q4_K, GemvConfig(16, 1, 4, 3, 2)),  # 2 chunks: each of 2 programs per row tile takes one
    (T.Q8_0, GemvConfig(16, 1, 4, 3, 3)),  # 4 chunks: a split of 3 shrinks to 2 programs of 2 chunks
    (T.Q6_K, GemvConfig(32, 1, 4, 3, 2)),
], ids=lambda v: getattr(v, "name", None) or str(v.split_k))
def test_split_k(qtype, cfg):
    """Programs sharing a row tile's K range (partial sums added after the launch) stay inside the
    bound, which counts the extra additions."""
    check(qtype, "planes", 32, 512, 2, cfg, np.random.default_rng(11))


def test_split_k_ggml():
    # the ggml bodies under a split: Q8_0's 4 chunks, a split of 3 shrinking to 2 programs of 2
    check(T.Q8_0, "ggml", 32, 512, 2, GemvConfig(16, 1, 4, 3, 3), np.random.default_rng(11))


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_split_k_lowers_to_triton_for_h200(monkeypatch):
    from triton_lowering import triton_kernels

    pw = repack(weight(T.Q4_K, 512, 2048, np.random.default_rng(0)), T.Q4_K, (512, 2048))
    x = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
    assert triton_kernels(monkeypatch, lambda x, w: qgemv(x, w, config=GemvConfig(16, 2, 4, 3, 4)), x, pw) == [
        ("qgemv_planes_q4_k", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_ggml_lowers_to_triton_for_h200(monkeypatch):
    """qgemv and qgemv_many on ggml-layout weights (every body) at the 30B attention shape."""
    from bloomery_jax.pallas.qgemv import qgemv_many
    from triton_lowering import triton_kernels

    rng = np.random.default_rng(0)
    ws = tuple(repack(weight(q, 512, 2048, rng), q, (512, 2048), "ggml") for q in PACKABLE)
    x = jax.ShapeDtypeStruct((1, 2048), jnp.float32)
    assert triton_kernels(monkeypatch, lambda x, w: qgemv(x, w), x, ws[0]) == [("qgemv_ggml_q8_0", 90, True)]
    assert triton_kernels(monkeypatch, lambda x, ws: qgemv_many(x, ws), x, ws) == [("qgemv_many", 90, True)]


def test_many_split_k(monkeypatch):
    """qgemv_many with the tuned split: every weight's chunks split the same way (Q4_K's 2 and
    Q8_0's 4 chunks: a split of 2)."""
    from bloomery_jax.pallas import qgemv_tuned
    from bloomery_jax.pallas.qgemv import many_operands, qgemv_many

    monkeypatch.setitem(qgemv_tuned.DEFAULTS, ("planes", "Q4_K"), (16, 1, 4, 3, 2))
    monkeypatch.setitem(qgemv_tuned.DEFAULTS, ("planes", "Q8_0"), (16, 1, 4, 3, 4))
    rng = np.random.default_rng(23)
    ws = tuple(repack(weight(q, 32, 512, rng), q, (32, 512)) for q in (T.Q4_K, T.Q8_0))
    assert many_operands(ws, 512, (), "test").split_k == 2
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    xf = np.asarray(x, np.float64)
    for y, w in zip(qgemv_many(x, ws, interpret=True), ws):
        exact = xf @ np.asarray(dequantize_packed(w), np.float64).T
        mag = np.abs(xf) @ np.asarray(scale_magnitudes(w), np.float64).T
        bound = 1.01 * rounding_depth("planes", w.qtype, 512, GemvConfig(split_k=2)) * U * mag
        assert (np.abs(np.asarray(y, np.float64) - exact) <= bound).all()
