"""Prefill grouped GEMM for MoE experts: tiles of rows, each tile times its expert's repacked weight.

Contract: ``moe_gemm(x [M, K], w [E, N, K], tile_experts [M / block_m]) -> float32 [M, N]`` with
``y[r] = x[r] @ dequantize(w)[tile_experts[r // block_m]].T`` for every row of a tile whose
expert is in [0, E); tiles marked -1 are skipped and their output rows are unspecified.
``plan_tiles`` lays (token, expert) pairs out that way: each expert's pairs in consecutive
rows, every expert's group padded to whole tiles, so a tile never mixes experts.

How: a Pallas kernel (Triton lowering) on a grid ``(tiles, N / block_n)``. Program (t, i) loads
its tile's expert index, walks K chunk by chunk, dequantizes each plane (or, in the "ggml"
layout, each sub-block) of rows ``i*block_n..`` of that expert into a float32 ``[block_n, W]``
tile (the ``qgemv`` format bodies, exact values) and multiply-adds
``x_tile [block_m, W] @ w_tile^T`` on the tensor cores.
Nothing is dequantized outside the kernel; each expert's weight is read once per row tile of x.

``wide`` (Q4_K, Q5_K, planes layout only) builds a whole 256-column chunk at once over a plane
axis and takes one K=256 product per chunk instead of eight K=32 ones (fewer layout conversions
of fresh tiles; not yet timed on the GPU). Precision is a launch parameter: ``"ieee"`` (plain
f32 FMAs), ``"tf32x3"`` (three TF32 passes, close to f32), ``"tf32"``, ``"bf16x3"``, ``"bf16"``.
In the interpreter (CPU tests) every choice runs as an f32 product at HIGHEST, so the tests
check the tiling and dequantization and the GPU bench measures what each precision costs in
error and time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..quant.repack import PackedWeight
from .moe_gemv import _ExpertView, _kernel_name, _operands, check_stacked
from .qgemv import F32, _largest_divisor, format_of

__all__ = ["GemmConfig", "TilePlan", "moe_gemm", "pick_gemm_config", "plan_tiles"]

_ALGORITHMS = {
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
}


_NT = (((1,), (1,)), ((), ()))  # x [BM, W] . w [BN, W] over W -> [BM, BN]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Launch parameters: rows of x per tile, weight rows per program, Triton warps and stages,
    and the precision of the tensor-core products (a key of ``_ALGORITHMS``)."""

    block_m: int = 32
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    precision: str = "tf32x3"
    wide: bool = False  # one K=chunk product per chunk (Q4_K, Q5_K, planes layout) instead of one per plane


def pick_gemm_config(n_pairs: int, n_experts: int) -> GemmConfig:
    """Launch parameters by the mean rows per expert (measured on the H200 at the 30B shape,
    tf32x3, benchmarks/gpu_2026-12-03-s3): 8 rows per expert (128 tokens) ran best at block_m 16,
    1.75 ms against 2.50 at 32; 32 rows (512 tokens) at block_m 64, 2.54 ms against 3.61 at 32
    and 4.00 at 16; 128 rows (2048 tokens) at 64 rows and 128 columns, 8.76 ms against 9.76."""
    rows = n_pairs / max(n_experts, 1)
    if rows < 16:
        return GemmConfig(block_m=16, block_n=64)
    if rows < 96:
        return GemmConfig(block_m=64, block_n=64)
    return GemmConfig(block_m=64, block_n=128, num_warps=8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Where the pairs of a MoE layer sit in the tiled rows ``moe_gemm`` reads."""

    rows: jax.Array  # int32 [M]: the pair each tiled row holds (padding rows repeat pair 0)
    dest: jax.Array  # int32 [P]: the tiled row of each pair
    tile_experts: jax.Array  # int32 [M / block_m]: each tile's expert, -1 for tiles past the last group


def plan_tiles(experts: jax.Array, n_experts: int, block_m: int) -> TilePlan:
    """Group pairs by expert in tiles of ``block_m`` rows.

    M is static: at most ``min(E, P)`` groups are non-empty and each wastes under one tile, so
    ``M = ceil((P + min(E, P) * (block_m - 1)) / block_m) * block_m`` always holds them.

    Args:
      experts: int32 ``[P]``, the expert of each pair, in [0, n_experts).
      n_experts: E.
      block_m: rows per tile.
    """
    n_pairs = experts.shape[0]
    experts = experts.astype(jnp.int32)
    order = jnp.argsort(experts, stable=True)  # [P] pair ids grouped by expert
    sizes = jnp.bincount(experts, length=n_experts).astype(jnp.int32)  # [E]
    padded = (sizes + block_m - 1) // block_m * block_m  # [E]
    pad_end = jnp.cumsum(padded)  # [E]
    grouped = experts[order]  # [P]
    rank = jnp.arange(n_pairs, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[grouped]  # [P] place in its group
    dest = jnp.zeros(n_pairs, jnp.int32).at[order].set((pad_end - padded)[grouped] + rank)  # [P]
    n_tiles = -(-(n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m)
    rows = jnp.zeros(n_tiles * block_m, jnp.int32).at[dest].set(jnp.arange(n_pairs, dtype=jnp.int32))  # [M]
    tile_start = jnp.arange(n_tiles, dtype=jnp.int32) * block_m  # [M / block_m]
    tile_experts = jnp.searchsorted(pad_end, tile_start, side="right").astype(jnp.int32)
    return TilePlan(rows, dest, jnp.where(tile_start < pad_end[-1], tile_experts, -1))


def _gemm_kernel(e_ref, x_ref, *refs, fmt, n_experts: int, chunks: int, algorithm, wide: bool):
    *w_refs, o_ref = refs  # e_ref [1] int32, x_ref [BM, K], w_refs [E, ...] blocks, o_ref [BM, BN]
    e = e_ref[0]

    @pl.when(e >= 0)
    def _():
        views = [_ExpertView(r, jnp.minimum(e, n_experts - 1)) for r in w_refs]

        def step(c, acc):
            if wide:
                tiles = [(c * fmt.chunk, fmt.chunk_tile(c, views))]  # [BN, chunk]
            else:
                tiles = fmt.planes(c, views)  # [BN, W] each
            for col, w in tiles:
                xt = x_ref[:, pl.ds(col, w.shape[1])].astype(F32)  # [BM, W or chunk]
                acc = acc + jax.lax.dot_general(xt, w, _NT, precision=algorithm,
                                                preferred_element_type=F32)  # [BM, BN]
            return acc

        o_ref[...] = jax.lax.fori_loop(0, chunks, step, jnp.zeros(o_ref.shape, F32))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def moe_gemm(x: jax.Array, w: PackedWeight, tile_experts: jax.Array, *, config: GemmConfig = GemmConfig(),
             interpret: bool = False) -> jax.Array:
    """``x[r] @ W[tile_experts[r // block_m]]^T`` for every row of every used tile, f32 accumulation.

    Args:
      x: float ``[M, K]``, M a multiple of ``config.block_m`` (``plan_tiles`` lays pairs out so).
      w: PackedWeight ``[E, N, K]`` in the "planes" or "ggml" layout, Q8_0, Q4_K, Q5_K or Q6_K
        (``config.wide``: planes only).
      tile_experts: int32 ``[M / block_m]``, each tile's expert, -1 to skip the tile.
      config: launch parameters; ``block_n`` shrinks to the largest power-of-two divisor of N.
      interpret: run with the Pallas interpreter (CPU tests; products at f32 HIGHEST).
    Returns:
      float32 ``[M, N]``.
    """
    qtype = check_stacked(w, "moe_gemm")
    if config.precision not in _ALGORITHMS:
        raise ValueError(f"moe_gemm: precision {config.precision!r} is not one of {sorted(_ALGORITHMS)}")
    n_exp, n, k = w.shape
    bm = config.block_m
    if x.ndim != 2 or x.shape[1] != k or x.shape[0] % bm or tile_experts.shape != (x.shape[0] // bm,):
        raise ValueError(f"moe_gemm: x must be [M, {k}] with M a multiple of {bm} and tile_experts [M/{bm}], "
                         f"got {x.shape} and {tile_experts.shape}")
    if config.wide and w.layout != "planes":
        raise ValueError(f"moe_gemm: wide=True builds whole planes-layout chunks; a {w.layout}-layout weight "
                         "takes wide=False")
    fmt = format_of(w.layout, qtype)
    bn = _largest_divisor(n, config.block_n, pow2=True)
    arrays, specs = _operands(w, bn)
    algorithm = jax.lax.Precision.HIGHEST if interpret else _ALGORITHMS[config.precision]
    kernel = functools.partial(_gemm_kernel, fmt=fmt, n_experts=n_exp, chunks=k // fmt.chunk, algorithm=algorithm,
                               wide=config.wide and fmt.chunk_tile is not None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), F32),
        grid=(x.shape[0] // bm, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda t, i: (t,)),  # this tile's expert
                  pl.BlockSpec((bm, k), lambda t, i: (t, 0)),  # this tile's rows of x
                  *specs],
        out_specs=pl.BlockSpec((bm, bn), lambda t, i: (t, i)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=_kernel_name("moe_gemm", w.layout, qtype),
    )(tile_experts.astype(jnp.int32), x, *arrays)
