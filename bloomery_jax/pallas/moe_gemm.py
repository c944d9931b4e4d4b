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
In the interpreter (CPU tests) every f32-tile choice runs as an f32 product at HIGHEST, so the tests
check the tiling and dequantization and the GPU bench measures what each precision costs in
error and time.

Quant tiles (precisions ``"q-bf16"``, ``"q-bf16x2"`` and ``"q-int8"``): the product takes the
stored quants themselves, ``q - bias`` (in [-128, 128): exact in bf16 and in int8), not
dequantized f32 weights, and applies each plane's scale and min after its W-column product, as
llama.cpp's MMQ kernels do with integer quants:

    y[r, n] += scale[n] * (x[r, cols] . (q[n, cols] - bias)) - min[n] * sum(x[r, cols])

The tile needs no f32 build and the product is one bf16 pass (bf16 tensor cores run twice the
TF32 rate, and tf32x3 takes three). Only the activations round: ``"q-bf16"`` rounds x to bf16
(at most 2^-8 of each element; llama.cpp's q8_1 rows err up to 2^-8 of their 32-block's largest);
``"q-bf16x2"`` splits x into two bf16 parts and takes two passes (x kept to 2^-16). The sums
of x over each plane are f32, formed before the launch from the unrounded x. ``"q-int8"`` is
llama.cpp's arithmetic: x rounded to its CUDA Q8_1 rows (``ops.actquant.quantize_q8_1``, up to
2^-8 of each 32-block's largest), exact int8 x int8 -> int32 products, then the row's block
scale; its min term sums the Q8_1 values, so the result is ``q8_1(x) . w`` up to f32 rounding,
what ``act_rounding="ggml-cuda"`` computes (``kernels=pallas-q8`` takes it; on the H100 it ran
slower than q-bf16). The interpreter multiplies the same bf16 or int8 operands, so the CPU
tests check the rounding too.

On "ggml"-layout weights (kept for the decode GEMVs of ``qgemv_q8``) the bf16 quant tiles take
each 32-element sub-block of Q8_0, Q4_K and Q5_K as two 16-column halves in the paired order of
``qgemv.paired_format``, x's columns permuted to match before the launch: in element order
the tile passed through shared memory on its way to the tensor cores (offline sm_90 counts of
this launch at 32 x 64, instructions / shared-memory operations / barriers: Q4_K planes
1,656 / 54 / 6, ggml 1,920 / 254 / 20, paired 1,688 / 50 / 6; Q8_0 648 / 38 / 6, 832 / 166 /
12, 648 / 34 / 6). Q6_K keeps the element order (2,232 / 286 / 36; planes 1,696 / 58 / 6).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as T
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..ops.actquant import q8_1_ints, quantize_q8_1
from ..quant.repack import PackedWeight
from .moe_gemv import _ExpertView, _kernel_name, _operands, check_stacked
from .qgemv import F32, _largest_divisor, format_of, pair_columns, paired_format

__all__ = ["GemmConfig", "TilePlan", "dense_gemm", "moe_gemm", "pick_gemm_config", "plan_tiles"]

GEMM_ALGORITHMS = {
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
}


# precisions that multiply quants: x as that many bf16 parts, or (0) as llama.cpp's int8 Q8_1 rows
QUANT_TILES = {"q-bf16": 1, "q-bf16x2": 2, "q-int8": 0}
_NT = (((1,), (1,)), ((), ()))  # x [BM, W] . w [BN, W] over W -> [BM, BN]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Launch parameters: rows of x per tile, weight rows per program, Triton warps and stages,
    and the precision of the tensor-core products (a key of ``GEMM_ALGORITHMS``)."""

    block_m: int = 32
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    precision: str = "tf32x3"  # a key of GEMM_ALGORITHMS or QUANT_TILES
    wide: bool = False  # one K=chunk product per chunk (Q4_K, Q5_K, planes layout) instead of one per plane


def pick_gemm_config(n_pairs: int, n_experts: int, precision: str = "tf32x3") -> GemmConfig:
    """Launch parameters by the mean rows per expert, for ``precision``.

    f32 tiles (measured on the H200 at the 30B shape, tf32x3, benchmarks/gpu_2026-12-03-s3): 8
    rows per expert (128 tokens) ran best at block_m 16, 1.75 ms against 2.50 at 32; 32 rows
    (512 tokens) at block_m 64, 2.54 ms against 3.61 at 32 and 4.00 at 16; 128 rows (2048
    tokens) at 64 rows and 128 columns, 8.76 ms against 9.76.

    Quant tiles (measured on the H100 at 512 tokens, benchmarks/gpu_2026-12-05-s14): 32 x 64
    won for both bf16 forms (q-bf16x2 1.37-1.42 ms against 1.69 at 16 x 64 and 32 x 128, and
    2.51 at 64 x 64; q-bf16 0.92 against 1.25 at 64 x 64). Below 16 rows per expert block_m 16,
    as for f32 tiles (not measured for quant tiles)."""
    rows = n_pairs / max(n_experts, 1)
    if precision in QUANT_TILES:
        return GemmConfig(block_m=16 if rows < 16 else 32, block_n=64, precision=precision)
    if rows < 16:
        return GemmConfig(block_m=16, block_n=64, precision=precision)
    if rows < 96:
        return GemmConfig(block_m=64, block_n=64, precision=precision)
    return GemmConfig(block_m=64, block_n=128, num_warps=8, precision=precision)


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
                tiles = [(plane.col, plane.weights()) for plane in fmt.planes(c, views)]  # [BN, W] each
            for col, w in tiles:
                xt = x_ref[:, pl.ds(col, w.shape[1])].astype(F32)  # [BM, W or chunk]
                acc = acc + jax.lax.dot_general(xt, w, _NT, precision=algorithm,
                                                preferred_element_type=F32)  # [BM, BN]
            return acc

        o_ref[...] = jax.lax.fori_loop(0, chunks, step, jnp.zeros(o_ref.shape, F32))


def _quant_tile_kernel(e_ref, *refs, fmt, n_experts: int, chunks: int, parts: int, with_min: bool):
    # e_ref [1] int32; then x: `parts` bf16 refs [BM, K] that sum to it, or (parts 0) its int8
    # Q8_1 quants [BM, K] and their block scales xd_ref [K / 32, BM]; xs_ref [K / W, BM] f32 sums
    # of x over each plane's columns (with_min only); w_refs [E, ...] blocks; o_ref [BM, BN]
    n_x = max(parts, 1)
    x_refs, refs = refs[:n_x], refs[n_x:]
    xd_ref, refs = (None, refs) if parts else (refs[0], refs[1:])
    xs_ref, refs = (refs[0], refs[1:]) if with_min else (None, refs)
    *w_refs, o_ref = refs
    e = e_ref[0]

    @pl.when(e >= 0)
    def _():
        views = [_ExpertView(r, jnp.minimum(e, n_experts - 1)) for r in w_refs]

        def step(c, acc):
            for plane in fmt.planes(c, views):
                cols = pl.ds(plane.col, fmt.width)
                if parts:
                    q = plane.quants(jnp.bfloat16)  # [BN, W], exact (paired: two [BN, W / 2] halves)
                    products = [_tile_product(x_ref, plane.col, q) for x_ref in x_refs]  # [BM, BN] each
                    dot = functools.reduce(jnp.add, products)  # not sum(): IEEE keeps its 0 + first
                else:  # integer products, exact; then the rows' block scales
                    q, xt = plane.ints(), x_refs[0][:, cols]  # [BN, W], [BM, W]
                    if fmt.width < 32:  # int8 products take K = 32 (K = 16 doubled on the H100)
                        block = jax.lax.div(plane.col, 32) * 32
                        q, xt = _in_q8_block(q, plane.col), x_refs[0][:, pl.ds(block, 32)]
                    dot = jax.lax.dot_general(xt, q.astype(jnp.int8), _NT, preferred_element_type=jnp.int32)
                    dot = dot.astype(F32) * xd_ref[plane.col // 32, :][:, None]  # [BM, BN]
                acc = acc + dot * plane.scale[None, :]
                if plane.min is not None:
                    xs = xs_ref[plane.col // fmt.width, :]  # [BM]
                    acc = acc - xs[:, None] * plane.min[None, :]
            return acc

        o_ref[...] = jax.lax.fori_loop(0, chunks, step, jnp.zeros(o_ref.shape, F32))


def _tile_product(x_ref, col, q) -> jax.Array:
    """``x[:, col:col+W] . q^T`` ``[BM, BN]`` for a plane's bf16 quants q ``[BN, W]``, or for its
    halves in the paired order (x's columns then in that order too: ``qgemv.pair_columns``)."""
    if not isinstance(q, tuple):
        return jax.lax.dot_general(x_ref[:, pl.ds(col, q.shape[1])], q, _NT, preferred_element_type=F32)
    half = q[0].shape[1]
    lo, hi = (jax.lax.dot_general(x_ref[:, pl.ds(col + h * half, half)], t, _NT, preferred_element_type=F32)
              for h, t in enumerate(q))
    return lo + hi


def _in_q8_block(q: jax.Array, col) -> jax.Array:
    """A plane's quants [BN, W] (W < 32) placed in the columns they take in their Q8_1 block of
    32, zeros elsewhere: [BN, 32]. A product over the whole block then adds the plane alone."""
    n, w = q.shape
    slot = jax.lax.broadcasted_iota(jnp.int32, (1, 32 // w, 1), 1)  # [1, 32 / W, 1]
    mine = jax.lax.div(jax.lax.rem(col, 32), w)  # col >= 0: lax's truncating ops, no jnp floor fix-ups
    spread = jnp.where(slot == mine, q[:, None, :], 0)  # [BN, 32 / W, W]
    return spread.reshape(n, 32)


def _bf16_parts(x: jax.Array, parts: int) -> list[jax.Array]:
    """x [M, K] as ``parts`` bf16 arrays whose sum is x to 2^-(8 parts) of each element.

    Each part is rounded by integer ops: XLA on a GPU allows excess precision and may fold
    ``f32(bf16(v))`` back to ``v``, which made every remainder 0 (measured: q-bf16x2 erred as
    much as q-bf16 on the H100)."""
    out, rest = [], x.astype(F32)
    for _ in range(parts):
        bits = jax.lax.bitcast_convert_type(rest, jnp.uint32)
        # to the nearest bf16, ties to even
        bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
        head = jax.lax.bitcast_convert_type(bits, F32)  # a bf16 value, held in f32
        out.append(head.astype(jnp.bfloat16))  # exact
        rest = rest - head  # exact
    return out


def _quant_tile_inputs(x: jax.Array, parts: int, width: int, with_min: bool, paired: bool = False):
    """What ``_quant_tile_kernel`` reads of x [M, K], in its order, as (row tiles [M, K], column
    blocks [K / W, M]): the bf16 parts (``paired``: their columns in the weight tiles' paired
    order), or the int8 Q8_1 quants and their scales [K / 32, M]; then, with mins, the plane sums
    of what the products see (x itself, or the Q8_1 values ``d * q``, from their integer sums)."""
    m, k = x.shape
    if parts:
        rows, cols = _bf16_parts(x, parts), []
        if paired:
            rows = [pair_columns(r, width) for r in rows]
        sums = x.astype(F32).reshape(m, k // width, width).sum(axis=2)  # [M, K / W]
    else:
        q8 = quantize_q8_1(x)
        rows, cols = [q8_1_ints(q8.qs).reshape(m, k).astype(jnp.int8)], [q8.d.T]
        sums = q8.d * (q8.sums[:, 0::2] + q8.sums[:, 1::2]).astype(F32)  # [M, K / 32]: W is 32 where mins are
    return rows, cols + ([sums.T] if with_min else [])


def tiles_round_activations(precision: str, act_rounding: str) -> bool:
    """Do the tiles of ``precision`` round x themselves as ``act_rounding`` asks? q-int8 tiles
    round it to Q8_1 blocks, which is ``"ggml-cuda"``: the caller then rounds nothing first
    (rounding Q8_1 values again gives the same values, only at the cost of a pass over x)."""
    return precision == "q-int8" and act_rounding == "ggml-cuda"


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
      interpret: run with the Pallas interpreter (CPU tests; f32 tiles multiply at f32 HIGHEST, quant
        tiles as on the GPU).
    Returns:
      float32 ``[M, N]``.
    """
    qtype = check_stacked(w, "moe_gemm")
    if config.precision not in GEMM_ALGORITHMS and config.precision not in QUANT_TILES:
        raise ValueError(f"moe_gemm: precision {config.precision!r} is not one of "
                         f"{sorted(GEMM_ALGORITHMS) + sorted(QUANT_TILES)}")
    n_exp, n, k = w.shape
    bm = config.block_m
    if x.ndim != 2 or x.shape[1] != k or x.shape[0] % bm or tile_experts.shape != (x.shape[0] // bm,):
        raise ValueError(f"moe_gemm: x must be [M, {k}] with M a multiple of {bm} and tile_experts [M/{bm}], "
                         f"got {x.shape} and {tile_experts.shape}")
    if config.wide and (w.layout != "planes" or config.precision in QUANT_TILES):
        raise ValueError(f"moe_gemm: wide=True builds whole planes-layout f32 chunks; a {w.layout}-layout weight "
                         f"at precision {config.precision!r} takes wide=False")
    quant_tiles = config.precision in QUANT_TILES
    # bf16 quant tiles take the ggml sub-blocks in the paired order where there is one
    paired_fmt = paired_format(w.layout, qtype) if quant_tiles and QUANT_TILES[config.precision] else None
    fmt = paired_fmt or format_of(w.layout, qtype)
    bn = _largest_divisor(n, config.block_n, pow2=True)
    arrays, specs = _operands(w, bn)
    x_spec = pl.BlockSpec((bm, k), lambda t, i: (t, 0))  # this tile's rows of x
    if quant_tiles:
        parts, with_min = QUANT_TILES[config.precision], qtype in (T.Q4_K, T.Q5_K)
        rows, cols = _quant_tile_inputs(x, parts, fmt.width, with_min, paired_fmt is not None)
        xs = rows + cols
        x_specs = [x_spec] * len(rows) + [pl.BlockSpec((a.shape[0], bm), lambda t, i: (0, t)) for a in cols]
        kernel = functools.partial(_quant_tile_kernel, fmt=fmt, n_experts=n_exp, chunks=k // fmt.chunk,
                                   parts=parts, with_min=with_min)
    else:
        xs, x_specs = [x], [x_spec]
        algorithm = jax.lax.Precision.HIGHEST if interpret else GEMM_ALGORITHMS[config.precision]
        kernel = functools.partial(_gemm_kernel, fmt=fmt, n_experts=n_exp, chunks=k // fmt.chunk,
                                   algorithm=algorithm, wide=config.wide and fmt.chunk_tile is not None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), F32),
        grid=(x.shape[0] // bm, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda t, i: (t,)),  # this tile's expert
                  *x_specs,
                  *specs],
        out_specs=pl.BlockSpec((bm, bn), lambda t, i: (t, i)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=_kernel_name("moe_gemm", w.layout, qtype),
    )(tile_experts.astype(jnp.int32), *xs, *arrays)


def dense_gemm(x: jax.Array, w: PackedWeight, precision: str, interpret: bool = False) -> jax.Array:
    """``x @ dequantize(w).T`` for a 2-D packed weight: :func:`moe_gemm` with one expert.

    The prefill products of dense weights (attention projections, dense FFNs) on the tiles of
    ``precision`` (quant tiles need no f32 copy of the weight: the f32 path dequantizes the
    whole weight to a fresh [N, K] array each step). Rows are padded to whole tiles.

    Args:
      x: float ``[R, K]``; w: PackedWeight ``[N, K]`` (planes or ggml layout).
      precision: a ``moe_gemm`` precision; interpret: the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[R, N]``.
    """
    if len(w.shape) != 2:
        raise ValueError(f"dense_gemm: needs a 2-D weight, got {w.shape}")
    n_rows = x.shape[0]
    config = pick_gemm_config(n_rows, 1, precision)
    m = -(-n_rows // config.block_m) * config.block_m
    x = jnp.pad(x, ((0, m - n_rows), (0, 0)))  # [M, K], M whole tiles
    one = {f: None if a is None else a[None] for f, a in (("qs", w.qs), ("d", w.d), ("sc", w.sc), ("qh", w.qh))}
    stacked = dataclasses.replace(w, **one, shape=(1, *w.shape))  # [1, N, K]: one expert
    y = moe_gemm(x, stacked, jnp.zeros(m // config.block_m, jnp.int32), config=config, interpret=interpret)
    return y[:n_rows]
