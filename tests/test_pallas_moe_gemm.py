"""pallas.moe_gemm (Pallas interpret mode on the CPU) and its tile plan, against a float64 reference.

Tolerance: the kernel forms every weight exactly (the ``qgemv`` plane bodies) and adds, per
output, K / W dot products of W terms each, so its rounding depth is at most K / W + W, the
planes GEMV's (``qgemv.rounding_depth``); ``errors`` of tests/test_pallas_moe_gemv.py states
the bound. The interpreter computes every product at f32 HIGHEST; the lower-precision passes
(tf32x3, bf16x3, ...) are only lowered here and are measured on the GPU (scripts/kernel_bench.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.pallas.moe_gemm import GemmConfig, moe_gemm, plan_tiles
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
    with pytest.raises(ValueError, match="wide=True builds whole planes-layout chunks"):
        moe_gemm(jnp.zeros((16, 256)), ggml, jnp.zeros(1, jnp.int32), config=GemmConfig(block_m=16, wide=True),
                 interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("qtype,precision,wide", [(q, "tf32x3", False) for q in PACKABLE] + [
    (T.Q4_K, p, False) for p in ("ieee", "tf32", "bf16x3", "bf16")] + [(T.Q4_K, "tf32x3", True), (T.Q5_K, "tf32", True)],
    ids=lambda v: getattr(v, "name", str(v)))
def test_lowers_to_triton_for_h200(qtype, precision, wide, monkeypatch):
    """A verified Triton module for sm_90 at every format (tf32x3), every precision (Q4_K) and
    with whole-chunk tiles."""
    e, n, k = 6, 128, 512
    raw = np.stack([weight(qtype, n, k, np.random.default_rng(0)) for _ in range(e)])
    pw = repack(raw, qtype, (e, n, k))
    x = jax.ShapeDtypeStruct((64, k), jnp.float32)
    tiles = jax.ShapeDtypeStruct((2,), jnp.int32)
    cfg = GemmConfig(precision=precision, wide=wide)
    built = triton_kernels(monkeypatch, lambda x, w, t: moe_gemm(x, w, t, config=cfg), x, pw, tiles)
    assert built == [(f"moe_gemm_{qtype.name.lower()}", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_ggml_lowers_to_triton_for_h200(monkeypatch):
    """A verified Triton module for sm_90 on ggml-layout experts (Q5_K: every field kind)."""
    e, n, k = 6, 128, 512
    raw = np.stack([weight(T.Q5_K, n, k, np.random.default_rng(0)) for _ in range(e)])
    pw = repack(raw, T.Q5_K, (e, n, k), "ggml")
    x = jax.ShapeDtypeStruct((64, k), jnp.float32)
    tiles = jax.ShapeDtypeStruct((2,), jnp.int32)
    built = triton_kernels(monkeypatch, lambda x, w, t: moe_gemm(x, w, t, config=GemmConfig()), x, pw, tiles)
    assert built == [("moe_gemm_ggml_q5_k", 90, True)]
