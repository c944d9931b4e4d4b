"""pallas.moe_gemm (Pallas interpret mode on the CPU) and its tile plan, against a float64 reference.

Tolerance: the kernel forms every weight exactly (the ``qgemv`` plane bodies) and adds, per
output, K / W dot products of W terms each, so its rounding depth is at most K / W + W, the
planes GEMV's (``qgemv.rounding_depth``); ``errors`` of tests/test_pallas_moe_gemv.py states
the bound. The interpreter computes every product at f32 HIGHEST; the lower-precision passes
(tf32x3, bf16x3, ...) are only lowered here and are measured on the GPU (scripts/kernel_bench.py).
Quant tiles (q-bf16, q-bf16x2, q-int8) multiply the same bf16 or int8 operands in the interpreter
as on the GPU; ``quant_tile_errors`` states their model and bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.pallas.moe_gemm import QUANT_TILES, GemmConfig, _bf16_parts, dense_gemm, moe_gemm, plan_tiles
from bloomery_jax.ops.actquant import quantize_q8_1
from bloomery_jax.quant.dequant_k import k4_scales_mins
from bloomery_jax.quant.repack import PACKABLE, repack
from test_pallas_moe_gemv import errors, stacked
from test_pallas_qgemv import weight
from triton_lowering import triton_kernels

CFG = GemmConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, precision="ieee")
DEPTH_CFG = None  # errors() only reads the layout's depth, which needs no launch parameters


def grouped(x, pw, experts, cfg):
    """Pairs through a tile plan and the kernel, back in pair order: [P, N]."""
    plan = plan_tiles(experts, pw.shape[0], cfg.block_m)
    return moe_gemm(x[plan.rows], pw, plan.tile_experts, config=cfg, interpret=True)[plan.dest]


@pytest.mark.parametrize("n_pairs,n_experts,block_m", [(40, 6, 16), (5, 8, 16), (64, 4, 32), (1, 3, 16)])
def test_plan_groups_pairs_by_expert_in_whole_tiles(n_pairs, n_experts, block_m):
    rng = np.random.default_rng(n_pairs)
    experts = rng.integers(0, n_experts, n_pairs)
    plan = jax.tree.map(np.asarray, plan_tiles(jnp.asarray(experts, jnp.int32), n_experts, block_m))
    assert len(set(plan.dest)) == n_pairs  # every pair has a row of its own
    np.testing.assert_array_equal(plan.rows[plan.dest], np.arange(n_pairs))
    np.testing.assert_array_equal(plan.tile_experts[plan.dest // block_m], experts)  # a tile holds one expert
    used = np.unique(plan.dest // block_m)
    assert (plan.tile_experts[np.setdiff1d(np.arange(len(plan.tile_experts)), used)] == -1).all()
    sizes = np.bincount(experts, minlength=n_experts)
    assert len(used) == sum(-(-s // block_m) for s in sizes)  # no tile wasted beyond each group's padding


@pytest.mark.parametrize("qtype,layout", [(q, "planes") for q in PACKABLE] + [(T.Q8_0, "ggml")],
                         ids=lambda v: getattr(v, "name", v))
def test_matches_reference(qtype, layout):
    # E=6 (not a power of two), 40 pairs in scrambled order: groups of several tiles, one expert
    # unused; ggml: one type, the cheapest to interpret (each body is checked in qgemv's tests)
    rng = np.random.default_rng(int(qtype))
    raw, pw, w64 = stacked(qtype, 6, 32, 512, rng, layout)
    experts = jnp.asarray(rng.choice([0, 1, 2, 4, 5], 40, p=[0.5, 0.2, 0.1, 0.1, 0.1]), jnp.int32)
    x = jnp.asarray(rng.standard_normal((40, 512)), jnp.float32)
    y = grouped(x, pw, experts, CFG)
    assert y.shape == (40, 32) and y.dtype == jnp.float32
    assert errors(y, x, w64, experts, qtype, DEPTH_CFG).max() <= 1.0


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_wide_chunks_match_reference(qtype):
    # the whole-chunk tile forms the same weights; one K=256 product per chunk has a rounding depth
    # of at most K/256 + 256 (the planes path: K/32 + 32), so the bound is rescaled to that depth
    rng = np.random.default_rng(int(qtype) + 7)
    raw, pw, w64 = stacked(qtype, 4, 32, 512, rng)
    experts = jnp.asarray(rng.integers(0, 4, 24), jnp.int32)
    x = jnp.asarray(rng.standard_normal((24, 512)), jnp.float32)
    wide = grouped(x, pw, experts, GemmConfig(block_m=16, block_n=16, precision="ieee", wide=True))
    planes_depth, wide_depth = 512 // 32 + 32, 512 // 256 + 256
    assert (errors(wide, x, w64, experts, qtype, DEPTH_CFG) * planes_depth / wide_depth).max() <= 1.0


def _plane_mins(raw, qtype, shape):
    """f64 [E, N, K]: dmin * m of each element's sub-block for Q4_K / Q5_K, zeros for the rest."""
    e, n, k = shape
    if qtype not in (T.Q4_K, T.Q5_K):
        return np.zeros(shape)
    blocks = raw.reshape(e * n * (k // 256), -1)  # [B, block bytes]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)  # [B, 1]
    mins = np.asarray(k4_scales_mins(jnp.asarray(blocks[:, 4:16]))[1], np.float64)  # [B, 8]
    return np.repeat((dmin * mins).reshape(e, n, k // 32), 32, axis=-1)


def seen_x(x, precision):
    """f64 [P, K]: x as a quant-tile precision's products see it (the bf16 parts' sum, or the
    Q8_1 values), and whether its min term sums x itself (bf16) or those values (int8)."""
    parts = QUANT_TILES[precision]
    if parts:
        return sum(np.asarray(part, np.float64) for part in _bf16_parts(x, parts)), True
    return np.asarray(quantize_q8_1(x).values(), np.float64), False


def quant_tile_errors(y, x, raw, w64, experts, qtype, precision, exact_sums=None):
    """|y - model| / bound for quant-tile products. The kernel computes, per plane,
    ``scale * (xr . q) - min * sum(s)`` with xr the x its products see and s either x or xr,
    which is ``xr . w + sum_k min_k (xr_k - s_k)`` exactly (as ``scale * q = w + min``). Against
    that model only f32 rounding remains: a plane's W-term dot (the products are exact in f32,
    and in int32 for int8), the parts' sum or the rows' scale, the scale and min products and the
    difference, then K / W plane sums: depth at most K/W + W + 4, on the magnitude
    sum_k |xr_k| (|w_k| + |min_k|) + |s_k| |min_k|. ``exact_sums`` overrides the min term's s."""
    xr, sums_x = seen_x(x, precision)
    s = np.asarray(x, np.float64) if (sums_x if exact_sums is None else exact_sums) else xr
    ex = np.asarray(experts)
    w, mins = w64[ex], _plane_mins(raw, qtype, w64.shape)[ex]  # [P, N, K]
    model = np.einsum("pk,pnk->pn", xr, w) + np.einsum("pk,pnk->pn", xr - s, mins)
    mag = np.einsum("pk,pnk->pn", np.abs(xr), np.abs(w) + mins) + np.einsum("pk,pnk->pn", np.abs(s), mins)
    k, width = x.shape[1], 16 if qtype == T.Q6_K else 32
    return np.abs(np.asarray(y, np.float64) - model) / (1.01 * (k // width + width + 4) * 2.0 ** -24 * mag)


@pytest.mark.parametrize("qtype,layout", [(q, "planes") for q in PACKABLE] + [(T.Q5_K, "ggml"), (T.Q8_0, "ggml")],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("precision", sorted(QUANT_TILES))
def test_quant_tiles_match_their_model(qtype, layout, precision):
    rng = np.random.default_rng(int(qtype) + 3)
    raw, pw, w64 = stacked(qtype, 6, 32, 512, rng, layout)
    experts = jnp.asarray(rng.integers(0, 6, 40), jnp.int32)
    x = jnp.asarray(rng.standard_normal((40, 512)), jnp.float32)
    y = grouped(x, pw, experts, GemmConfig(block_m=16, block_n=16, precision=precision))
    assert quant_tile_errors(y, x, raw, w64, experts, qtype, precision).max() <= 1.0
    # guards the model: judged as another precision's rounding of x, it fails
    other = {"q-bf16": "q-bf16x2", "q-bf16x2": "q-bf16", "q-int8": "q-bf16"}[precision]
    assert quant_tile_errors(y, x, raw, w64, experts, qtype, other).max() > 1.0
    if qtype in (T.Q4_K, T.Q5_K) and precision != "q-bf16x2":  # and judged with the other min term
        # (with two parts x - xr is at most 2^-16 |x|, too small against the bound to tell)
        flipped = not seen_x(x, precision)[1]
        assert quant_tile_errors(y, x, raw, w64, experts, qtype, precision, exact_sums=flipped).max() > 1.0


@pytest.mark.parametrize("qtype,layout", [(T.Q4_K, "planes"), (T.Q6_K, "planes"), (T.Q8_0, "ggml")],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("n_rows", [40, 64])
def test_dense_gemm_is_one_expert(qtype, layout, n_rows):
    """A 2-D weight through ``dense_gemm`` (one expert, rows padded to whole tiles): the quant-tile
    model and bound of ``quant_tile_errors``, with every row on expert 0."""
    rng = np.random.default_rng(int(qtype) + n_rows)
    raw, _, w64 = stacked(qtype, 1, 64, 512, rng)
    pw = repack(raw[0], qtype, (64, 512), layout)  # [N, K]
    x = jnp.asarray(rng.standard_normal((n_rows, 512)), jnp.float32)
    y = dense_gemm(x, pw, "q-bf16x2", interpret=True)
    assert y.shape == (n_rows, 64)
    on_zero = jnp.zeros(n_rows, jnp.int32)
    assert quant_tile_errors(y, x, raw, w64, on_zero, qtype, "q-bf16x2").max() <= 1.0
    assert quant_tile_errors(y, x, raw, w64, on_zero, qtype, "q-bf16").max() > 1.0  # the model's guard
    with pytest.raises(ValueError, match="needs a 2-D weight"):
        dense_gemm(x, repack(raw, qtype, (1, 64, 512), layout), "q-bf16x2", interpret=True)


def test_bound_catches_a_wrong_expert():
    # guards the test: the right outputs judged against another expert fail the bound everywhere
    rng = np.random.default_rng(11)
    raw, pw, w64 = stacked(T.Q4_K, 4, 32, 512, rng)
    experts = jnp.asarray(rng.integers(0, 4, 24), jnp.int32)
    x = jnp.asarray(rng.standard_normal((24, 512)), jnp.float32)
    y = grouped(x, pw, experts, GemmConfig(block_m=16, block_n=32, precision="ieee"))
    assert errors(y, x, w64, experts, T.Q4_K, DEPTH_CFG).max() <= 1.0
    wrong = experts.at[5].set((experts[5] + 1) % 4)
    ratio = errors(y, x, w64, wrong, T.Q4_K, DEPTH_CFG)
    assert (ratio[5] > 1.0).all(), ratio[5].min()
    assert (np.delete(ratio, 5, axis=0) <= 1.0).all()


def test_bad_inputs_raise():
    _, pw, _ = stacked(T.Q4_K, 4, 16, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"x must be \[M, 256\] with M a multiple of 16"):
        moe_gemm(jnp.zeros((24, 256)), pw, jnp.zeros(1, jnp.int32), config=CFG, interpret=True)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        moe_gemm(jnp.zeros((16, 256)), pw, jnp.zeros(1, jnp.int32), config=GemmConfig(precision="fp8"),
                 interpret=True)
    rows = repack(np.zeros((4, 16, 144), np.uint8), T.Q4_K, (4, 16, 256), "rows")
    with pytest.raises(ValueError, match="needs a 3-D planes-layout or ggml-layout"):
        moe_gemm(jnp.zeros((16, 256)), rows, jnp.zeros(1, jnp.int32), config=CFG, interpret=True)
    ggml = repack(np.zeros((4, 16, 144), np.uint8), T.Q4_K, (4, 16, 256), "ggml")
    with pytest.raises(ValueError, match="wide=True builds whole planes-layout f32 chunks"):
        moe_gemm(jnp.zeros((16, 256)), ggml, jnp.zeros(1, jnp.int32), config=GemmConfig(block_m=16, wide=True),
                 interpret=True)
    with pytest.raises(ValueError, match="at precision 'q-bf16' takes wide=False"):
        moe_gemm(jnp.zeros((16, 256)), pw, jnp.zeros(1, jnp.int32),
                 config=GemmConfig(block_m=16, precision="q-bf16", wide=True), interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("qtype,precision,wide", [(q, "tf32x3", False) for q in PACKABLE] + [
    (T.Q4_K, p, False) for p in ("ieee", "tf32", "bf16x3", "bf16", "q-bf16")] + [
    (T.Q4_K, "tf32x3", True), (T.Q5_K, "tf32", True)] + [
    (q, p, False) for q in PACKABLE for p in ("q-bf16x2", "q-int8")],
    ids=lambda v: getattr(v, "name", str(v)))
def test_lowers_to_triton_for_h200(qtype, precision, wide, monkeypatch):
    """A verified Triton module for sm_90 at every format (tf32x3 and quant tiles), every
    precision (Q4_K) and with whole-chunk tiles."""
    e, n, k = 6, 128, 512
    raw = np.stack([weight(qtype, n, k, np.random.default_rng(0)) for _ in range(e)])
    pw = repack(raw, qtype, (e, n, k))
    x = jax.ShapeDtypeStruct((64, k), jnp.float32)
    tiles = jax.ShapeDtypeStruct((2,), jnp.int32)
    cfg = GemmConfig(precision=precision, wide=wide)
    built = triton_kernels(monkeypatch, lambda x, w, t: moe_gemm(x, w, t, config=cfg), x, pw, tiles)
    assert built == [(f"moe_gemm_{qtype.name.lower()}", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("qtype,precision", [(T.Q5_K, "tf32x3"), (T.Q5_K, "q-bf16"), (T.Q8_0, "q-bf16x2"),
                                             (T.Q6_K, "q-bf16"), (T.Q4_K, "q-int8")],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_ggml_lowers_to_triton_for_h200(qtype, precision, monkeypatch):
    """A verified Triton module for sm_90 on ggml-layout experts (Q5_K: every field kind): f32
    tiles, the bf16 quant tiles' paired halves (Q5_K, Q8_0), Q6_K's element order and int8 tiles."""
    e, n, k = 6, 128, 512
    raw = np.stack([weight(qtype, n, k, np.random.default_rng(0)) for _ in range(e)])
    pw = repack(raw, qtype, (e, n, k), "ggml")
    x = jax.ShapeDtypeStruct((64, k), jnp.float32)
    tiles = jax.ShapeDtypeStruct((2,), jnp.int32)
    cfg = GemmConfig(precision=precision)
    built = triton_kernels(monkeypatch, lambda x, w, t: moe_gemm(x, w, t, config=cfg), x, pw, tiles)
    assert built == [(f"moe_gemm_ggml_{qtype.name.lower()}", 90, True)]
