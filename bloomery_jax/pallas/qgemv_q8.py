"""Decode GEMV on 8-bit activations by integer dot products: ``y = x8 @ W^T`` (dense and MoE).

Why: the float32 planes kernel (``qgemv``) spends ~7 ALU instructions per weight turning quants
into floats and multiply-adding them; at decode that, not memory, bounds it (about 20% of copy
bandwidth on the H200, docs/LOG.md). llama.cpp's CUDA GEMV first rounds the activations to
Q8_1 blocks (``ops.actquant.quantize_q8_1``: int8 quants, one f16 scale per 32) and multiplies
four quants at a time with ``dp4a`` (PTX ``dp4a.s32.s32``: the dot product of two words' four
bytes plus an accumulator). This kernel does the same on weights in the "ggml" layout of
``quant.repack`` (the file's own quant bytes as int32 words, so a word's bytes are four
consecutive quants of one sub-block, after one mask for the low or high nibbles).

A program owns ``block_n`` rows and walks its share of K chunk by chunk (256 elements; 128 for
Q8_0). For each sub-block it takes the ``[block_n, 8]`` words, masks them to byte quants, and
for every row b of x takes ``dp4a`` against x's matching words, giving integer partial sums
(exact). These are converted to float (exactly: |sum| < 2^22) and multiply-added, scaled by
``d * sc * dx``, into a ``[block_n, 8]`` float32 accumulator; the min terms (Q4_K/Q5_K:
``dmin * m * dx * sum(q_x)``) and Q6_K's quant offset (``-32 * d * sc * dx * sum(q_x)``) go to a
``[block_n]`` accumulator from the block sums of x. The 8 columns are summed at the end.
``split_k`` programs share a row tile's K range, as in ``qgemv``.

Exactness: against the float64 product of the rounded activations (``Q8Act.values()``) and the
file's weights, every integer sum is exact and each term passes through at most
``rounding_depth`` float32 roundings, so |y - exact| <= depth * 2^-24 * sum_k |xv_k| m_k
(m = ``repack.scale_magnitudes(w, stored_quants=True)``: the terms are the stored quants' and
the offsets', which for Q6_K are larger than |w|). The activation rounding itself is llama.cpp's, not an error
of this kernel: compare against ``round_activations(x, qtype, "ggml-cuda")``.

``dp4a`` is inline PTX, which the Pallas interpreter cannot run: off the GPU an exact jnp
emulation takes its place (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as T
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..ops.actquant import Q8Act
from ..quant.repack import PackedWeight
from .moe_gemv import _ExpertView, _operands, expert_index
from .qgemv import _k4_scales, _largest_divisor, _q6_scale, _weight_operands, add_partials, many_operands, run_parts
from .qgemv_tuned import GemvConfig, pick_config

F32 = jnp.float32
LOW = 0x0F0F0F0F  # the low nibble of each byte
I2F_MAGIC = 0x4B400000  # f32 bits of 1.5 * 2^23: adding an int below 2^22 in magnitude stays exact
I2F_OFFSET = 12582912.0  # 1.5 * 2^23
__all__ = ["moe_gemv_q8", "moe_gemv_q8_many", "qgemv_q8", "qgemv_q8_many", "rounding_depth"]


def _dp4a(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
    """Per element: the dot product of the four signed bytes of ``a`` and of ``b`` (int32, same shape)."""
    if not interpret:
        (out,) = plgpu.elementwise_inline_asm(
            "dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, jnp.zeros_like(a)], constraints="=r,r,r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
        return out
    total = jnp.zeros_like(a)
    for k in range(4):  # sign-extend byte k of each word, then multiply-add
        total = total + ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
    return total


def _i2f(i: jax.Array) -> jax.Array:
    """int32 with |i| < 2^22 -> float32, exact, with an integer add and a float subtract (the
    int-to-float conversion instruction runs at a fraction of the ALU rate)."""
    return jax.lax.bitcast_convert_type(i + I2F_MAGIC, F32) - I2F_OFFSET


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The x side for one program: refs ``qs [R, K/4]``, ``d [R, K/32]``, ``sums [R, K/16]``; rows 0..n-1."""

    qs: object
    d: object
    sums: object
    n: int


def _x_words(xs: _Rows, b: int, block: int, bn: int):
    """Row b's 8 words of x block ``block`` (32 elements), broadcast to ``[BN, 8]``."""
    return jnp.broadcast_to(xs.qs[b, pl.ds(block * 8, 8)][None, :], (bn, 8))


def _block_sum(xs: _Rows, b: int, block: int):
    """Row b's integer sum of the quants of x block ``block`` (two half-block sums)."""
    return xs.sums[b, 2 * block] + xs.sums[b, 2 * block + 1]


def _k4_chunk(c, refs, xs: _Rows, accs, macc, *, bn, with_qh, interpret):
    """Chunk c of a Q4_K/Q5_K row tile: sub-block pairs (2s, 2s+1) share the words 8s..8s+7."""
    qs_ref, sc_ref, dm_ref, *qh_ref = refs  # [BN, K/8] i32, [G, 3, BN] i32, [G, 2, BN] f16, [BN, K/32] i32
    scales = _k4_scales(c, sc_ref, dm_ref)  # sub-block t -> (d * sc, dmin * m), [BN] each
    if with_qh:
        qh = qh_ref[0][:, pl.ds(c * 8, 8)]  # [BN, 8]: bit t of byte l = 5th bit of sub-block t, element l
    for s in range(4):
        words = qs_ref[:, pl.ds(c * 32 + 8 * s, 8)]  # [BN, 8]: byte l holds element l of 2s (low), of 2s+1 (high)
        for half in range(2):
            t = 2 * s + half  # sub-block
            q = (words >> (4 * half)) & LOW if half else words & LOW
            if with_qh:
                q = q | (((qh >> t) & 0x01010101) << 4)
            dl, ml = scales(t)
            block = c * 8 + t
            for r in range(xs.n):
                dx = xs.d[r, block]
                accs[r] = accs[r] + _i2f(_dp4a(q, _x_words(xs, r, block, bn), interpret)) * (dl * dx)[:, None]
                macc[r] = macc[r] + ml * (dx * _block_sum(xs, r, block).astype(F32))
    return accs, macc


def _q6_k_chunk(c, refs, xs: _Rows, accs, macc, *, bn, interpret):
    """Chunk c of a Q6_K row tile: per 128-element half h and 32-element quarter j, eight words
    whose bytes hold 6-bit quants (q - 32 is the value) of two 16-element sub-blocks."""
    qs_ref, qh_ref, sc_ref, d_ref = refs  # [BN, K/8] i32, [BN, K/16] i32, [G, 4, BN] i32, [G, BN] f16
    d = d_ref[c, :].astype(F32)  # [BN]
    scw = [sc_ref[c, i, :] for i in range(4)]  # [BN] words of four int8 scales
    first_four = jax.lax.broadcasted_iota(jnp.int32, (1, 8), 1) < 4  # words 0-3: the quarter's first sub-block
    for h in range(2):
        hi = qh_ref[:, pl.ds(c * 16 + 8 * h, 8)]  # [BN, 8]: 2-bit field j of byte l = high bits of element 32j + l
        for j in range(4):
            low = qs_ref[:, pl.ds(c * 32 + 16 * h + 8 * (j % 2), 8)]  # [BN, 8]
            q = ((low >> (4 * (j // 2))) & LOW) | (((hi >> (2 * j)) & 0x03030303) << 4)  # bytes 0..63
            sub = 8 * h + 2 * j  # first of the quarter's two sub-blocks
            sa, sb = _q6_scale(scw, sub).astype(F32), _q6_scale(scw, sub + 1).astype(F32)  # exact
            block = c * 8 + 4 * h + j
            for r in range(xs.n):
                dx = xs.d[r, block]
                la, lb = d * sa * dx, d * sb * dx  # [BN]
                scale = jnp.where(first_four, la[:, None], lb[:, None])  # [BN, 8]
                accs[r] = accs[r] + _i2f(_dp4a(q, _x_words(xs, r, block, bn), interpret)) * scale
                # the quants are stored + 32: take 32 * sum(q_x) of each sub-block back out
                s_a, s_b = xs.sums[r, 2 * block].astype(F32), xs.sums[r, 2 * block + 1].astype(F32)
                macc[r] = macc[r] + 32.0 * (la * s_a + lb * s_b)
    return accs, macc


def _q8_0_chunk(c, refs, xs: _Rows, accs, macc, *, bn, interpret):
    """Chunk c (four blocks of 32) of a Q8_0 row tile."""
    qs_ref, d_ref = refs  # [BN, K/4] i32, [K/32, BN] f16
    for p in range(4):
        block = c * 4 + p
        q = qs_ref[:, pl.ds(block * 8, 8)]  # [BN, 8]: signed bytes
        d = d_ref[block, :].astype(F32)  # [BN]
        for r in range(xs.n):
            accs[r] = accs[r] + _i2f(_dp4a(q, _x_words(xs, r, block, bn), interpret)) * (d * xs.d[r, block])[:, None]
    return accs, macc


CHUNKS = {  # type -> (chunk elements, chunk body)
    T.Q8_0: (128, _q8_0_chunk),
    T.Q4_K: (256, functools.partial(_k4_chunk, with_qh=False)),
    T.Q5_K: (256, functools.partial(_k4_chunk, with_qh=True)),
    T.Q6_K: (256, _q6_k_chunk),
}


def rounding_depth(qtype, k: int, config: GemvConfig | None) -> int:
    """Longest chain of f32 roundings a term passes through (see the module docstring): one per
    sub-block (16 elements at the least) into its accumulator column, the column sum, the min
    accumulator, and the split partials."""
    return k // 16 + 16 + (config.split_k if config else 1)


def _check(w: PackedWeight, dims: int, name: str) -> T:
    qtype = T(w.qtype)
    if qtype not in CHUNKS or len(w.shape) != dims or w.layout != "ggml":
        raise ValueError(f"{name}: needs a {dims}-D ggml-layout Q8_0/Q4_K/Q5_K/Q6_K weight, got "
                         f"{qtype.name} {w.shape} {w.layout}")
    return qtype


def _launch(qtype, n: int, k: int, cfg: GemvConfig) -> tuple[int, int, int]:
    """(rows per program, chunks per program, split) from ``cfg``, shrunk to divisors."""
    chunks = k // CHUNKS[qtype][0]
    bn = _largest_divisor(n, cfg.block_n, pow2=True)
    split = _largest_divisor(chunks, cfg.split_k, pow2=False)
    return bn, chunks // split, split


def _body(xs: _Rows, w_refs, store, *, qtype, bn: int, per_program: int, interpret: bool, share=None):
    """One program: its chunks (those of split-K share ``share``, default ``pl.program_id(0)``),
    then ``store(r, y)`` for each row r of x."""
    body = functools.partial(CHUNKS[qtype][1], bn=bn, interpret=interpret)
    first = (pl.program_id(0) if share is None else share) * per_program

    def step(i, carry):
        accs, macc = carry
        return body(first + i, w_refs, xs, list(accs), list(macc))

    init = ([jnp.zeros((bn, 8), F32) for _ in range(xs.n)], [jnp.zeros((bn,), F32) for _ in range(xs.n)])
    accs, macc = jax.lax.fori_loop(0, per_program, step, init)
    for r in range(xs.n):
        store(r, jnp.sum(accs[r], axis=1) - macc[r])


def _dense_kernel(xq_ref, xd_ref, xs_ref, *refs, qtype, per_program: int, interpret: bool):
    *w_refs, o_ref = refs  # o_ref [1, B, BN]

    def store(r, y):
        o_ref[0, r, :] = y

    _body(_Rows(xq_ref, xd_ref, xs_ref, xq_ref.shape[0]), w_refs, store, qtype=qtype, bn=o_ref.shape[2],
          per_program=per_program, interpret=interpret)


def _x_specs(x: Q8Act, n_rows: int, first_row):
    """BlockSpecs of the three x arrays: ``n_rows`` rows from ``first_row(*grid index)`` on."""
    return [pl.BlockSpec((n_rows, a.shape[1]), lambda *g: (first_row(*g), 0)) for a in (x.qs, x.d, x.sums)]


_ALL_ROWS = lambda *g: 0  # dense: every program reads all B rows  # noqa: E731
_PAIR_ROW = lambda s, p, i: p  # MoE: program (s, p, i) reads pair p's row  # noqa: E731


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def qgemv_q8(x: Q8Act, w: PackedWeight, *, config: GemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """``x.values() @ W^T`` for up to 8 activation rows, float32.

    Args:
      x: :class:`Q8Act` of ``[B, K]`` activations (B = 1..8), from ``quantize_q8_1``.
      w: ggml-layout PackedWeight ``[N, K]`` (Q8_0, Q4_K, Q5_K or Q6_K).
      config: launch parameters (``block_n``, ``num_warps``, ``num_stages``, ``split_k``;
        ``chunks_per_step`` is unused); None picks ``pick_config("q8", ...)``.
      interpret: Pallas interpreter with the dp4a emulation (CPU tests).
    Returns:
      float32 ``[B, N]``.
    """
    qtype = _check(w, 2, "qgemv_q8")
    n, k = w.shape
    if x.qs.ndim != 2 or x.qs.shape[1] * 4 != k or not 1 <= x.qs.shape[0] <= 8:
        raise ValueError(f"qgemv_q8: x must hold [B<=8, {k}] activations, got quants {x.qs.shape}")
    cfg = config or pick_config("q8", qtype.name, n, k)
    bn, per_program, split = _launch(qtype, n, k, cfg)
    arrays, specs = _weight_operands(w, bn)  # the planes kernel's fields and specs: same order, same grid
    rows = x.qs.shape[0]
    return add_partials(pl.pallas_call(
        functools.partial(_dense_kernel, qtype=qtype, per_program=per_program, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((split, rows, n), F32),
        grid=(split, n // bn),
        in_specs=[*_x_specs(x, rows, _ALL_ROWS), *specs],
        out_specs=pl.BlockSpec((1, rows, bn), lambda s, i: (s, 0, i)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"qgemv_q8_{qtype.name.lower()}",
    )(x.qs, x.d, x.sums, *arrays))


def _moe_kernel(e_ref, xq_ref, xd_ref, xs_ref, *refs, qtype, n_experts: int, per_program: int, interpret: bool):
    *w_refs, o_ref = refs  # o_ref [1, 1, BN]
    e = expert_index(e_ref, n_experts)

    def store(r, y):
        o_ref[0, 0, :] = y

    _body(_Rows(xq_ref, xd_ref, xs_ref, 1), [_ExpertView(r, e) for r in w_refs], store, qtype=qtype,
          bn=o_ref.shape[2], per_program=per_program, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def moe_gemv_q8(x: Q8Act, w: PackedWeight, experts: jax.Array, *, config: GemvConfig | None = None,
                interpret: bool = False) -> jax.Array:
    """``x.values()[p] @ W[experts[p]]^T`` for every (token, expert) pair p, float32.

    Args:
      x: :class:`Q8Act` of ``[P, K]`` activations, one row per pair.
      w: ggml-layout PackedWeight ``[E, N, K]``; experts: integer ``[P]`` in [0, E) (others clamped).
      config, interpret: as for :func:`qgemv_q8` (the pick is for one expert's ``[N, K]``).
    Returns:
      float32 ``[P, N]``.
    """
    qtype = _check(w, 3, "moe_gemv_q8")
    n_exp, n, k = w.shape
    if x.qs.ndim != 2 or x.qs.shape[1] * 4 != k or experts.shape != (x.qs.shape[0],):
        raise ValueError(f"moe_gemv_q8: x must hold [P, {k}] activations and experts [P], got quants "
                         f"{x.qs.shape} and experts {experts.shape}")
    cfg = config or pick_config("q8", qtype.name, n, k)
    bn, per_program, split = _launch(qtype, n, k, cfg)
    arrays, specs = _operands(w, bn)  # moe_gemv's: every expert, the row tile on the last grid axis
    n_pairs = x.qs.shape[0]
    return add_partials(pl.pallas_call(
        functools.partial(_moe_kernel, qtype=qtype, n_experts=n_exp, per_program=per_program, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((split, n_pairs, n), F32),
        grid=(split, n_pairs, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda s, p, i: (p,)), *_x_specs(x, 1, _PAIR_ROW), *specs],
        out_specs=pl.BlockSpec((1, 1, bn), lambda s, p, i: (s, p, i)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"moe_gemv_q8_{qtype.name.lower()}",
    )(experts.astype(jnp.int32), x.qs, x.d, x.sums, *arrays))


def _part_body(xs: _Rows, store, *, bn: int, interpret: bool):
    """This file's ``qgemv.run_parts`` body: one weight's chunks of a launch over several."""

    def body(part, refs, share):
        _body(xs, refs, store, qtype=T(part.qtype), bn=bn, per_program=part.steps * part.per_step,
              interpret=interpret, share=share)

    return body


def _q8_many(ws, k: int, lead: tuple, name: str, config: GemvConfig | None):
    for w in ws:
        _check(w, len(lead) + 2, name)
    return many_operands(ws, k, lead, name, tuning="q8", config=config)


def _dense_many_kernel(xq_ref, xd_ref, xs_ref, *refs, parts, bn: int, interpret: bool):
    o_ref = refs[-1]  # [1, B, BN]

    def store(r, y):
        o_ref[0, r, :] = y

    xs = _Rows(xq_ref, xd_ref, xs_ref, xq_ref.shape[0])
    run_parts(pl.program_id(1), refs[:-1], parts, _part_body(xs, store, bn=bn, interpret=interpret))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def qgemv_q8_many(x: Q8Act, ws: tuple, *, config: GemvConfig | None = None, interpret: bool = False) -> tuple:
    """``tuple(qgemv_q8(x, w) for w in ws)`` in one launch (q, k and v of a layer: decode is
    bound by launches). Per output the sums are :func:`qgemv_q8`'s; the same bound holds with
    the launch's split (``many_operands``: ``config``, else tuned from the "q8" table)."""
    rows, k = x.qs.shape[0], x.qs.shape[1] * 4
    m = _q8_many(ws, k, (), "qgemv_q8_many", config)
    y = pl.pallas_call(
        functools.partial(_dense_many_kernel, parts=m.parts, bn=m.bn, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((m.split_k, rows, m.tiles * m.bn), F32),
        grid=(m.split_k, m.tiles),
        in_specs=[*_x_specs(x, rows, _ALL_ROWS), *m.specs],
        out_specs=pl.BlockSpec((1, rows, m.bn), lambda s, i: (s, 0, i)),
        compiler_params=m.compiler_params,
        interpret=interpret,
        name="qgemv_q8_many",
    )(x.qs, x.d, x.sums, *m.arrays)
    return m.split(y)


def _moe_many_kernel(e_ref, xq_ref, xd_ref, xs_ref, *refs, parts, n_experts: int, bn: int, interpret: bool):
    e = expert_index(e_ref, n_experts)
    o_ref = refs[-1]  # [1, 1, BN]

    def store(r, y):
        o_ref[0, 0, :] = y

    xs = _Rows(xq_ref, xd_ref, xs_ref, 1)
    run_parts(pl.program_id(2), refs[:-1], parts, _part_body(xs, store, bn=bn, interpret=interpret),
              view=lambda r: _ExpertView(r, e))


@functools.partial(jax.jit, static_argnames=("pairs_per_row", "config", "interpret"))
def moe_gemv_q8_many(x: Q8Act, ws: tuple, experts: jax.Array, *, pairs_per_row: int = 1,
                     config: GemvConfig | None = None, interpret: bool = False) -> tuple:
    """``tuple(moe_gemv_q8(x, w, experts) for w in ws)`` in one launch (gate and up of a layer).
    With ``pairs_per_row`` > 1, x holds one row per token and pair p reads row p // pairs_per_row
    (token-major routing: nothing copies a token's row k times first). ``config`` as for
    :func:`qgemv_q8_many`."""
    n_exp, _, k = ws[0].shape
    n_pairs = experts.shape[0] if experts.ndim == 1 else -1
    if x.qs.ndim != 2 or x.qs.shape[1] * 4 != k or pairs_per_row < 1 or n_pairs != x.qs.shape[0] * pairs_per_row:
        raise ValueError(f"moe_gemv_q8_many: x must hold [P / {pairs_per_row}, {k}] activations and experts [P], "
                         f"got quants {x.qs.shape} and experts {experts.shape}")
    m = _q8_many(ws, k, (n_exp,), "moe_gemv_q8_many", config)
    y = pl.pallas_call(
        functools.partial(_moe_many_kernel, parts=m.parts, n_experts=n_exp, bn=m.bn, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((m.split_k, n_pairs, m.tiles * m.bn), F32),
        grid=(m.split_k, n_pairs, m.tiles),
        in_specs=[pl.BlockSpec((1,), lambda s, p, i: (p,)), *_x_specs(x, 1, lambda s, p, i: p // pairs_per_row),
                  *m.specs],
        out_specs=pl.BlockSpec((1, 1, m.bn), lambda s, p, i: (s, p, i)),
        compiler_params=m.compiler_params,
        interpret=interpret,
        name="moe_gemv_q8_many",
    )(experts.astype(jnp.int32), x.qs, x.d, x.sums, *m.arrays)
    return m.split(y)
