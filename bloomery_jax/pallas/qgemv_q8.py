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

x comes as a :class:`Q8Act` rounded before the launch, or as floats (optionally RMS-normed or
SwiGLU-formed in-kernel) that each program rounds to the same Q8_1 blocks, bit for bit, chunk
by chunk before that chunk's dot products (:class:`_RoundingRows`): a decode layer then makes no
rounding launch of its own (twenty-eighth session: with them the twentieth session's pallas-q8
lost to the planes kernels; without, and with taller row tiles, it beat llama.cpp's decode).

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as T
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..ops.actquant import Q8Act, quantize_q8_1
from ..quant.repack import PackedWeight
from .moe_gemv import _ExpertView, _operands, _SwigluRows, expert_index
from .qgemv import (_k4_scales, _largest_divisor, _NormedRows, _q6_scale, _weight_operands, add_partials, many_operands,
                    row_index, run_parts)
from .qgemv_tuned import GemvConfig, pick_config
from .tickets import TICKETS, read_shared, when_last

F32 = jnp.float32
LOW = 0x0F0F0F0F  # the low nibble of each byte
I2F_MAGIC = 0x4B400000  # f32 bits of 1.5 * 2^23: adding an int below 2^22 in magnitude stays exact
I2F_OFFSET = 12582912.0  # 1.5 * 2^23
# programs of a dense launch above which float x is rounded in a launch of its own first: each
# program rounds the blocks of x its K range needs, so the output head's ~2,400 programs would
# round the same 64 blocks ~1,200 times over (one XLA launch rounds them once)
ROUND_FIRST_PROGRAMS = 512
__all__ = ["moe_gemv_q8", "moe_gemv_q8_many", "qgemv_q8", "qgemv_q8_many", "round_blocks", "rounding_depth"]


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


class _XBlock(NamedTuple):
    """One row's 32-element block of x as the dot products take it."""

    words: jax.Array  # int32 [BN, 8]: the block's quants, four a word, broadcast over the tile's rows
    d: jax.Array  # float32 scalar: its scale (f16-rounded)
    lo: jax.Array  # int32 scalar: sum of quants 0-15 (the mins, Q6_K's -32)
    hi: jax.Array  # int32 scalar: sum of quants 16-31


@dataclasses.dataclass(frozen=True)
class _Rows:
    """x rounded before the launch, a :class:`Q8Act`: refs ``qs [R, K/32, 8]`` (four quants a
    word), ``d [R, K/32]``, ``sums [R, K/32, 2]`` (each half block's quant sum); rows 0..n-1."""

    qs: object
    d: object
    sums: object
    n: int

    def block(self, r: int, block, bn: int) -> _XBlock:
        words = jnp.broadcast_to(self.qs[r, block, :][None, :], (bn, 8))
        return _XBlock(words, self.d[r, block], self.sums[r, block, 0], self.sums[r, block, 1])

    def prepare(self, first_block, n_blocks: int) -> None:
        """Nothing to do: the blocks were rounded before the launch."""


def _div_rn(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
    """``a / b`` rounded to nearest, as XLA divides: Triton lowers float32 division to the
    approximate ``div.full.f32``, which would round some quants differently."""
    if interpret:
        return a / b
    (out,) = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, F32)])
    return out


def _round_half_away(v: jax.Array) -> jax.Array:
    """C's ``roundf`` (halves away from zero), exact: ``floor(|v|)`` and ``|v| - floor(|v|)`` round nothing."""
    a = jnp.abs(v)
    whole = jnp.floor(a)
    r = whole + jnp.where(a - whole >= 0.5, 1.0, 0.0)
    return jnp.where(v < 0, -r, r)


class _RefRows:
    """``view[b, *idx]`` reads ``ref[b, *idx]``, the row taken as an array (``qgemv.row_index``)."""

    def __init__(self, ref):
        self.ref = ref

    def __getitem__(self, idx):
        b, *rest = idx
        return self.ref[(row_index(b), *rest)]


class _RoundingRows:
    """x as floats, rounded to Q8_1 blocks in the launch: the blocks of
    ``ops.actquant.quantize_q8_1``, bit for bit, with no launch of their own before the GEMV (four
    a decode layer; they cost the twentieth session's pallas-q8 its gain).

    Before each chunk's dot products, the program rounds that chunk's blocks of every row into
    two scratch outputs that the caller drops, spread over its threads (one word each at a
    chunk of 8 blocks and 64 threads), and waits at a barrier; the dot products then read them
    back as they read pre-rounded blocks. Rounding each block where the dot products read it
    would repeat it in every thread (a block is broadcast over the tile's rows): ~10x the SASS
    of the dot products. Programs of other row tiles (and other pairs of the token) round the
    same blocks and write the same bits to the same places: a benign race.

    ``src``: x's rows as :func:`round_blocks` reads them. Scratch: ``words [R, K/32, 8]``, and
    ``meta [R, K/32, 8]`` holding in columns 0-2 the f32 bits of the block's scale and its two
    half-block quant sums (kept in the words' layout: as [K/32] vectors each would cost a layout
    change through shared memory)."""

    def __init__(self, src, words_ref, meta_ref, n: int, interpret: bool):
        self.src, self.words, self.meta, self.n, self.interpret = src, words_ref, meta_ref, n, interpret

    def block(self, r: int, block, bn: int) -> _XBlock:
        words = jnp.broadcast_to(self.words[r, block, :][None, :], (bn, 8))
        d = jax.lax.bitcast_convert_type(self.meta[r, block, 0], F32)
        return _XBlock(words, d, self.meta[r, block, 1], self.meta[r, block, 2])

    def prepare(self, first_block, n_blocks: int) -> None:
        """Round blocks ``first_block .. + n_blocks`` of every row into the scratch."""
        blocks = pl.ds(first_block, n_blocks)
        col = jax.lax.broadcasted_iota(jnp.int32, (n_blocks, 8), 1)
        for r in range(self.n):
            b = round_blocks(self.src, r, blocks, self.interpret)
            self.words[r, blocks, :] = b.words
            d16 = jax.lax.bitcast_convert_type(b.d, jnp.int32)
            self.meta[r, blocks, :] = jnp.where(col == 0, d16, jnp.where(col == 1, b.lo, jnp.where(col == 2, b.hi, 0)))
        if not self.interpret:  # every thread's blocks written before any thread reads them
            plgpu.debug_barrier()


class RoundedBlocks(NamedTuple):
    """Blocks of one row of x rounded to Q8_1 in a kernel (:func:`round_blocks`), spread over
    the program's threads as ``[n_blocks, 8]`` tiles (one word a thread)."""

    words: jax.Array  # int32 [nb, 8]: four quants a word, element order
    d: jax.Array  # float32 [nb, 8]: the block's scale rounded to f16, in each of its words' places
    lo: jax.Array  # int32 [nb, 1]: sum of quants 0-15
    hi: jax.Array  # int32 [nb, 1]: sum of quants 16-31


def round_blocks(src, r: int, blocks, interpret: bool) -> RoundedBlocks:
    """Row r's 32-element blocks ``blocks`` (a ``pl.ds``) of ``src[r, blocks, cols]`` (x as
    ``[K/32, 32]`` blocks: a ref, or a view forming the row: ``_NormedRows``, ``_SwigluRows``)
    rounded as ``ops.actquant.quantize_q8_1`` rounds them, bit for bit: read four times with
    stride 4, so element 4w + j of a block, byte j of its word w, lies in column w of read j and
    the words pack without a reshape."""
    n_blocks = blocks.size
    col = jax.lax.broadcasted_iota(jnp.int32, (n_blocks, 8), 1)
    xs = [src[r, blocks, pl.ds(j, 8, stride=4)].astype(F32) for j in range(4)]  # [nb, 8] each
    amax = jnp.max(jnp.maximum(jnp.maximum(jnp.abs(xs[0]), jnp.abs(xs[1])),
                               jnp.maximum(jnp.abs(xs[2]), jnp.abs(xs[3]))), axis=1, keepdims=True)
    amax = jnp.broadcast_to(amax, (n_blocks, 8))  # [nb, 8]: each thread its own block's
    d = _div_rn(amax, jnp.full(amax.shape, 127.0, F32), interpret)
    divisor = jnp.where(amax == 0, 1.0, d)  # an all-zero block: quants 0, not 0 / 0
    qs = [_exact_int(_round_half_away(_div_rn(x, divisor, interpret))) for x in xs]
    words = (qs[0] & 0xFF) | ((qs[1] & 0xFF) << 8) | ((qs[2] & 0xFF) << 16) | (qs[3] << 24)
    per_word = qs[0] + qs[1] + qs[2] + qs[3]  # words 0-3 hold quants 0-15
    lo = jnp.sum(jnp.where(col < 4, per_word, 0), axis=1, keepdims=True)  # [nb, 1]
    hi = jnp.sum(per_word, axis=1, keepdims=True) - lo
    return RoundedBlocks(words, d.astype(jnp.float16).astype(F32), lo, hi)


def _exact_int(v: jax.Array) -> jax.Array:
    """float32 holding an integer below 2^22 in magnitude -> int32, by :func:`_i2f`'s trick
    backwards (``astype`` would clamp to the int32 range first: two more instructions)."""
    return jax.lax.bitcast_convert_type(v + I2F_OFFSET, jnp.int32) - I2F_MAGIC


def _k4_chunk(c, refs, xs, accs, macc, *, bn, with_qh, interpret):
    """Chunk c of a Q4_K/Q5_K row tile: sub-block pairs (2s, 2s+1) share the words 8s..8s+7."""
    qs_ref, sc_ref, dm_ref, *qh_ref = refs  # [BN, K/8] i32, [G, 3, BN] i32, [G, 2, BN] f16, [BN, K/32] i32
    scales = _k4_scales(c, sc_ref, dm_ref)  # sub-block t -> (d * sc, dmin * m), [BN] each
    if with_qh:
        qh = qh_ref[0][:, pl.ds(c * 8, 8)]  # [BN, 8]: bit t of byte l = 5th bit of sub-block t, element l
    # [BN, 8] each: byte l of word s holds element l of sub-block 2s (low nibble) and of 2s+1 (high)
    chunk_words = [qs_ref[:, pl.ds(c * 32 + 8 * s, 8)] for s in range(4)]
    xs.prepare(c * 8, 8)  # after the weight loads: they are in flight while x's blocks are rounded
    for s, words in enumerate(chunk_words):
        for half in range(2):
            t = 2 * s + half  # sub-block
            q = (words >> (4 * half)) & LOW if half else words & LOW
            if with_qh:
                q = q | (((qh >> t) & 0x01010101) << 4)
            dl, ml = scales(t)
            block = c * 8 + t
            for r in range(xs.n):
                xb = xs.block(r, block, bn)
                accs[r] = accs[r] + _i2f(_dp4a(q, xb.words, interpret)) * (dl * xb.d)[:, None]
                macc[r] = macc[r] + ml * (xb.d * (xb.lo + xb.hi).astype(F32))
    return accs, macc


def _q6_k_chunk(c, refs, xs, accs, macc, *, bn, interpret):
    """Chunk c of a Q6_K row tile: per 128-element half h and 32-element quarter j, eight words
    whose bytes hold 6-bit quants (q - 32 is the value) of two 16-element sub-blocks."""
    qs_ref, qh_ref, sc_ref, d_ref = refs  # [BN, K/8] i32, [BN, K/16] i32, [G, 4, BN] i32, [G, BN] f16
    d = d_ref[c, :].astype(F32)  # [BN]
    scw = [sc_ref[c, i, :] for i in range(4)]  # [BN] words of four int8 scales
    first_four = jax.lax.broadcasted_iota(jnp.int32, (1, 8), 1) < 4  # words 0-3: the quarter's first sub-block
    # [BN, 8] each: of half h, 2-bit field j of byte l of his[h] = high bits of element 32j + l;
    # the low nibbles of quarters j and j + 2 in lows[2h + j % 2]
    his = [qh_ref[:, pl.ds(c * 16 + 8 * h, 8)] for h in range(2)]
    lows = [qs_ref[:, pl.ds(c * 32 + 8 * i, 8)] for i in range(4)]
    xs.prepare(c * 8, 8)  # after the weight loads, as in _k4_chunk
    for h, hi in enumerate(his):
        for j in range(4):
            low = lows[2 * h + j % 2]
            q = ((low >> (4 * (j // 2))) & LOW) | (((hi >> (2 * j)) & 0x03030303) << 4)  # bytes 0..63
            sub = 8 * h + 2 * j  # first of the quarter's two sub-blocks
            sa, sb = _q6_scale(scw, sub).astype(F32), _q6_scale(scw, sub + 1).astype(F32)  # exact
            block = c * 8 + 4 * h + j
            for r in range(xs.n):
                xb = xs.block(r, block, bn)
                la, lb = d * sa * xb.d, d * sb * xb.d  # [BN]
                scale = jnp.where(first_four, la[:, None], lb[:, None])  # [BN, 8]
                accs[r] = accs[r] + _i2f(_dp4a(q, xb.words, interpret)) * scale
                # the quants are stored + 32: take 32 * sum(q_x) of each sub-block back out
                macc[r] = macc[r] + 32.0 * (la * xb.lo.astype(F32) + lb * xb.hi.astype(F32))
    return accs, macc


def _q8_0_chunk(c, refs, xs, accs, macc, *, bn, interpret):
    """Chunk c (four blocks of 32) of a Q8_0 row tile."""
    qs_ref, d_ref = refs  # [BN, K/4] i32, [K/32, BN] f16
    qs = [qs_ref[:, pl.ds((c * 4 + p) * 8, 8)] for p in range(4)]  # [BN, 8] each: signed bytes
    ds = [d_ref[c * 4 + p, :].astype(F32) for p in range(4)]  # [BN] each
    xs.prepare(c * 4, 4)  # after the weight loads, as in _k4_chunk
    for p, (q, d) in enumerate(zip(qs, ds)):
        block = c * 4 + p
        for r in range(xs.n):
            xb = xs.block(r, block, bn)
            accs[r] = accs[r] + _i2f(_dp4a(q, xb.words, interpret)) * (d * xb.d)[:, None]
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


def _body(xs, w_refs, store, *, qtype, bn: int, per_program: int, interpret: bool, share=None):
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


class _SummedRows:
    """``view[b, *idx]`` is the sum of split-K partials ``ref[s, b, *idx]`` over s, added in order
    s = 0, 1, ...: a launch's partial sums read where the next launch forms its rows, so no launch
    adds them up first."""

    def __init__(self, ref):
        self.ref = ref

    def __getitem__(self, idx):
        b, *rest = idx
        total = self.ref[(row_index(0), row_index(b), *rest)]  # ints as arrays, as row_index says why
        for s in range(1, self.ref.shape[0]):
            total = total + self.ref[(row_index(s), row_index(b), *rest)]
        return total


@dataclasses.dataclass(frozen=True)
class _XSource:
    """How a launch's x arrives (static): already rounded (a :class:`Q8Act`: three refs), or as
    floats (one ref) rounded in-kernel, these RMS-normed first (``eps``; the norm weight is a
    second ref) or gate and up side by side to form SwiGLU from (``swiglu``; with ``partials``,
    as the gate/up launch's split-K partial sums, added here)."""

    rounded: bool
    eps: float | None = None
    swiglu: bool = False
    partials: bool = False

    def rows(self, refs, interpret: bool, n_rows: int | None = None):
        """(the program's rows of x, the weights' refs, the output ref ``[1, rows, BN]``) from the
        kernel's refs: x's inputs, the weights', the output, and for float x three scratch outputs.
        ``n_rows``: rows of x a program reads, where the output ref is not its block (default:
        the output block's rows)."""
        if self.rounded:
            *ins, out = refs
            return _Rows(*ins[:3], n_rows or out.shape[1]), ins[3:], out
        *ins, out, words, meta = refs
        n = n_rows or out.shape[1]
        if self.eps is not None:
            src, ins = _NormedRows(ins[0], ins[1], self.eps, n), ins[2:]
        elif self.swiglu:  # [1, 2K/32, 32] (partials: [S, 1, 2K/32, 32]): up starts K/32 blocks in
            rows = _SummedRows(ins[0]) if self.partials else ins[0]
            src, ins = _SwigluRows(rows, rows, offset=ins[0].shape[-2] // 2), ins[1:]
        else:
            src, ins = _RefRows(ins[0]), ins[1:]
        return _RoundingRows(src, words, meta, n, interpret), ins, out


def _x_shape(x) -> tuple[int, int]:
    """(rows, columns) of x, a Q8Act or a float array (``[S, R, K]``: split-K partials)."""
    return (x.qs.shape[0], x.qs.shape[1] * 4) if isinstance(x, Q8Act) else (x.shape[-2], x.shape[-1])


@dataclasses.dataclass(frozen=True)
class _XOperands:
    """x's side of a launch: its source, its arrays and BlockSpecs (inputs), and for float x the
    scratch outputs its blocks are rounded into (dropped after the launch)."""

    source: _XSource
    arrays: list
    specs: list
    scratch: list  # ShapeDtypeStructs
    scratch_specs: list


def _x_operands(x, name: str, k: int, n_rows: int, first_row, norm=None, eps: float = 0.0,
                swiglu: bool = False) -> _XOperands:
    """x for a launch of K = ``k``, as blocks of 32: each program reads ``n_rows`` rows from
    ``first_row(*grid index)`` on; a float ``norm [K]`` is read whole by every program."""
    rows, _ = _x_shape(x)

    def block_arrays(shapes):  # [R, ...] arrays: the program's n_rows rows, all else whole
        return [pl.BlockSpec((n_rows, *s[1:]), lambda *g, nd=len(s): (first_row(*g),) + (0,) * (nd - 1)) for s in shapes]

    if isinstance(x, Q8Act):
        if norm is not None or swiglu:
            raise ValueError(f"{name}: the norm and SwiGLU are formed from float x, not from rounded blocks")
        arrays = [x.qs.reshape(rows, k // 32, 8), x.d, x.sums.reshape(rows, k // 32, 2)]
        return _XOperands(_XSource(True), arrays, block_arrays([a.shape for a in arrays]), [], [])
    if x.ndim != 2 and not (swiglu and x.ndim == 3):
        raise ValueError(f"{name}: x must be [R, K] floats (or SwiGLU's [S, R, 2K] partials), got {x.shape}")
    if x.ndim == 3:  # SwiGLU's gate and up as split-K partials: [S, R, 2K] -> [S, R, 2K/32, 32]
        blocks = x.reshape(x.shape[0], rows, -1, 32)
        specs = [pl.BlockSpec((blocks.shape[0], n_rows, *blocks.shape[2:]), lambda *g: (0, first_row(*g), 0, 0))]
    else:
        blocks = x.reshape(rows, -1, 32)  # [R, K/32, 32] (SwiGLU: [R, 2K/32, 32])
        specs = block_arrays([blocks.shape])
    arrays = [blocks]
    if norm is not None:
        arrays.append(norm.astype(F32).reshape(k // 32, 32))
        specs.append(pl.BlockSpec((k // 32, 32), lambda *g: (0, 0)))
    scratch = [jax.ShapeDtypeStruct((rows, k // 32, 8), jnp.int32)] * 2  # _RoundingRows' words and meta
    source = _XSource(False, None if norm is None else float(eps), swiglu, x.ndim == 3)
    return _XOperands(source, arrays, specs, scratch, block_arrays([a.shape for a in scratch]))


def _call(kernel, xo: _XOperands, *, y, y_spec, grid, w_specs, compiler_params, interpret: bool, name: str,
          lead_specs=(), tail=(), tail_specs=(), aliases=None):
    """A q8 launch: inputs ``lead`` (the experts, ...), x's, the weights'; outputs y, x's scratch
    (dropped), then ``tail``; ``aliases`` as pallas_call's, lead inputs to tail outputs (counted
    in the tail). Returns ``f(lead, weights) -> y`` (with a tail: ``[y, *tail]``)."""
    first_tail = 1 + len(xo.scratch)
    call = pl.pallas_call(kernel, out_shape=[y, *xo.scratch, *tail], grid=grid,
                          in_specs=[*lead_specs, *xo.specs, *w_specs], out_specs=[y_spec, *xo.scratch_specs, *tail_specs],
                          input_output_aliases={i: first_tail + o for i, o in (aliases or {}).items()},
                          compiler_params=compiler_params, interpret=interpret, name=name)

    def run(lead, weights):
        out = call(*lead, *xo.arrays, *weights)
        return [out[0], *out[first_tail:]] if tail else out[0]

    return run


def _check_norm(name: str, norm, k: int) -> None:
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"{name}: norm must be [{k}], got {norm.shape}")


_ALL_ROWS = lambda *g: 0  # dense: every program reads all B rows  # noqa: E731
_PAIR_ROW = lambda s, p, i: p  # MoE: program (s, p, i) reads pair p's row  # noqa: E731


def _dense_kernel(*refs, source: _XSource, qtype, bn: int, per_program: int, interpret: bool, combine: bool = False):
    # combine: refs start with the residual x [B, N] and the tickets' input, and end with the
    # sum's output [B, N] and the tickets; y is whole
    if combine:
        (res_ref, _), refs, (out_ref, tk_ref) = refs[:2], refs[2:-2], refs[-2:]
    n_rows = res_ref.shape[0] if combine else None
    xs, w_refs, o_ref = source.rows(refs, interpret, n_rows)  # o_ref [1, B, BN] (combine: [S, B, N])
    s, i = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(i * bn, bn), bn)

    def store(r, y):
        if combine:
            o_ref[pl.ds(s, 1), pl.ds(r, 1), cols] = y[None, None, :]
        else:
            o_ref[0, r, :] = y

    _body(xs, w_refs, store, qtype=qtype, bn=bn, per_program=per_program, interpret=interpret)
    if not combine:
        return

    @when_last(tk_ref, i, pl.num_programs(0), interpret)
    def _():  # the row tile's split-K partials added in order, then x
        for r in range(xs.n):
            out_ref[pl.ds(r, 1), cols] = res_ref[pl.ds(r, 1), cols] + _shared_sum(o_ref, pl.ds(r, 1), cols)


def _shared_sum(o_ref, row, cols) -> jax.Array:
    """``[1, BN]``: row ``row`` of the launch's split-K partials ``o_ref [S, R, N]`` at ``cols``,
    added in order s = 0, 1, ..., as the launch's programs stored them (read after the last ticket)."""
    y = read_shared(o_ref.at[pl.ds(0, 1), row, cols])  # [1, 1, BN]
    for t in range(1, o_ref.shape[0]):
        y = y + read_shared(o_ref.at[pl.ds(t, 1), row, cols])
    return y[0]


def _combined_outputs(n_rows: int, n: int) -> dict:
    """A combine launch's tail: the sum ``[n_rows, n]`` and the tickets, each one whole block."""
    return dict(tail=[jax.ShapeDtypeStruct((n_rows, n), F32), jax.ShapeDtypeStruct((TICKETS,), jnp.int32)],
                tail_specs=[_whole(n_rows, n), _whole(TICKETS)])


@functools.partial(jax.jit, static_argnames=("config", "round_first", "interpret"))
def qgemv_q8(x, w: PackedWeight, *, config: GemvConfig | None = None, round_first: bool | None = None,
             combine: tuple | None = None, interpret: bool = False):
    """``x @ W^T`` for up to 8 activation rows on integer dot products, float32.

    Args:
      x: a :class:`Q8Act` of ``[B, K]`` activations (B = 1..8) from ``quantize_q8_1``, or float
        ``[B, K]``, rounded to the same Q8_1 blocks in-kernel (bit for bit: the same output).
      w: ggml-layout PackedWeight ``[N, K]`` (Q8_0, Q4_K, Q5_K or Q6_K).
      config: launch parameters (``block_n``, ``num_warps``, ``num_stages``, ``split_k``;
        ``chunks_per_step`` is unused); None picks ``pick_config("q8", ...)``, or for x rounded
        before the launch ``pick_config("q8-given", ...)``.
      round_first: for float x, round it with ``quantize_q8_1`` before the launch (True) or in
        every program (False); None: first where the launch has more than
        ``ROUND_FIRST_PROGRAMS`` programs. The output is the same either way.
      combine: ``(x_res [B, N], tickets)`` (``tickets.new_tickets``): return ``x_res`` plus the
        product (its partials added in order, then x_res), made by the last program of each row
        tile, and the tickets back at 0: a residual add with no launch of its own.
      interpret: Pallas interpreter with the dp4a emulation (CPU tests).
    Returns:
      float32 ``[B, N]``; with ``combine``, ``(x_res + y, tickets)``.
    """
    qtype = _check(w, 2, "qgemv_q8")
    n, k = w.shape
    rows, width = _x_shape(x)
    if width != k or not 1 <= rows <= 8:
        raise ValueError(f"qgemv_q8: x must hold [B<=8, {k}] activations, got [{rows}, {width}]")
    if round_first is None and not isinstance(x, Q8Act):
        bn, _, split = _launch(qtype, n, k, config or pick_config("q8", qtype.name, n, k))
        round_first = split * (n // bn) > ROUND_FIRST_PROGRAMS
    if round_first and not isinstance(x, Q8Act):
        x = quantize_q8_1(x)
    cfg = config or pick_config(_tuning(x), qtype.name, n, k)
    bn, per_program, split = _launch(qtype, n, k, cfg)
    arrays, specs = _weight_operands(w, bn)  # the planes kernel's fields and specs: same order, same grid
    xo = _x_operands(x, "qgemv_q8", k, rows, _ALL_ROWS)
    kw = dict(y=jax.ShapeDtypeStruct((split, rows, n), F32), y_spec=pl.BlockSpec((1, rows, bn), lambda s, i: (s, 0, i)),
              grid=(split, n // bn), w_specs=specs, interpret=interpret, name=f"qgemv_q8_{qtype.name.lower()}",
              compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    lead = []
    if combine is not None:
        res, tickets = combine
        if res.shape != (rows, n) or tickets.shape != (TICKETS,) or n // bn > TICKETS:
            raise ValueError(f"qgemv_q8: combine needs x_res [{rows}, {n}] and tickets [{TICKETS}], got "
                             f"{res.shape} and {tickets.shape}")
        lead = [res.astype(F32), tickets]
        kw.update(lead_specs=[_whole(rows, n), _whole(TICKETS)], y_spec=_whole(split, rows, n),
                  **_combined_outputs(rows, n), aliases={1: 1})
    y = _call(functools.partial(_dense_kernel, source=xo.source, qtype=qtype, bn=bn, per_program=per_program,
                                interpret=interpret, combine=combine is not None), xo, **kw)(lead, arrays)
    return (y[1], y[2]) if combine is not None else add_partials(y)


def _whole(*shape) -> pl.BlockSpec:
    """Every program's block: the whole array."""
    return pl.BlockSpec(shape, lambda *g: (0,) * len(shape))


def _moe_kernel(e_ref, *refs, source: _XSource, qtype, n_experts: int, bn: int, per_program: int, interpret: bool,
                combine: int = 0):
    # combine (the pairs of a token): refs start with the pair weights [P], the residual x [N, N_out]
    # and the tickets' input, and end with the sum's output [N, N_out] and the tickets; y is whole
    if combine:
        (pw_ref, res_ref, _), refs, (out_ref, tk_ref) = refs[:3], refs[3:-2], refs[-2:]
    xs, w_refs, o_ref = source.rows(refs, interpret, n_rows=1)  # o_ref [1, 1, BN] (combine: [S, P, N_out])
    e = expert_index(e_ref, n_experts)
    s, p, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(pl.multiple_of(i * bn, bn), bn)

    def store(r, y):
        if combine:
            o_ref[pl.ds(s, 1), pl.ds(p, 1), cols] = y[None, None, :]
        else:
            o_ref[0, 0, :] = y

    _body(xs, [_ExpertView(r, e) for r in w_refs], store, qtype=qtype, bn=bn, per_program=per_program,
          interpret=interpret)
    if not combine:
        return
    tok = p // combine

    @when_last(tk_ref, tok * pl.num_programs(2) + i, pl.num_programs(0) * combine, interpret)
    def _():  # the token's row tile: its pairs' split-K partials, weighted and added in routing order, then x
        acc = None
        for j in range(combine):
            pair = pl.ds(tok * combine + j, 1)
            term = _shared_sum(o_ref, pair, cols) * pw_ref[pair][:, None]  # [1, BN]
            acc = term if acc is None else acc + term
        out_ref[pl.ds(tok, 1), cols] = res_ref[pl.ds(tok, 1), cols] + acc


@functools.partial(jax.jit, static_argnames=("swiglu_halves", "config", "interpret"))
def moe_gemv_q8(x, w: PackedWeight, experts: jax.Array, *, swiglu_halves: bool = False,
                config: GemvConfig | None = None, combine: tuple | None = None, interpret: bool = False):
    """``x[p] @ W[experts[p]]^T`` for every (token, expert) pair p, float32.

    Args:
      x: a :class:`Q8Act` of ``[P, K]`` activations, one row per pair, or float ``[P, K]``
        rounded in-kernel as :func:`qgemv_q8` does (with ``swiglu_halves`` also ``[S, P, 2K]``:
        the gate/up launch's split-K partials, ``moe_gemv_q8_many(..., joined=True,
        partials=True)``, added in the launch).
      w: ggml-layout PackedWeight ``[E, N, K]``; experts: integer ``[P]`` in [0, E) (others clamped).
      swiglu_halves: x is float ``[P, 2K]``, gate then up side by side (``moe_gemv_q8_many(...,
        joined=True)``), and the rows rounded are ``silu(gate) * up``, formed in-kernel (the
        exponential is the kernel's: the last bits, and so a rare quant, may differ from
        ``ops.experts.swiglu``'s).
      config, interpret: as for :func:`qgemv_q8` (the pick is for one expert's ``[N, K]``).
      combine: ``(weights [T, k], x [T, N], tickets)`` (P = T * k pairs, token-major; tickets:
        ``tickets.new_tickets``): also return ``x + sum_j weights[:, j] * y[token's pair j]``,
        the weights' products added in routing order as ``ops.experts``' weighted sum does, made
        by the last program of each token's row tile (``tickets``), and the tickets back at 0.
    Returns:
      float32 ``[P, N]``; with ``combine``, ``(float32 [T, N], tickets)``.
    """
    qtype = _check(w, 3, "moe_gemv_q8")
    n_exp, n, k = w.shape
    n_pairs, width = _x_shape(x)
    if width != (2 * k if swiglu_halves else k) or experts.shape != (n_pairs,):
        raise ValueError(f"moe_gemv_q8: x must hold [P, {2 * k if swiglu_halves else k}] activations and experts "
                         f"[P], got [{n_pairs}, {width}] and experts {experts.shape}")
    cfg = config or pick_config(_tuning(x), qtype.name, n, k)
    bn, per_program, split = _launch(qtype, n, k, cfg)
    arrays, specs = _operands(w, bn)  # moe_gemv's: every expert, the row tile on the last grid axis
    xo = _x_operands(x, "moe_gemv_q8", k, 1, _PAIR_ROW, swiglu=swiglu_halves)
    grid = (split, n_pairs, n // bn)
    kw = dict(y=jax.ShapeDtypeStruct((split, n_pairs, n), F32), y_spec=pl.BlockSpec((1, 1, bn), lambda s, p, i: (s, p, i)),
              grid=grid, w_specs=specs, interpret=interpret, name=f"moe_gemv_q8_{qtype.name.lower()}",
              compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    lead, lead_specs = [experts.astype(jnp.int32)], [pl.BlockSpec((1,), lambda s, p, i: (p,))]
    per_token = 0
    if combine is not None:
        weights, res, tickets = combine
        n_tok, per_token = weights.shape
        if (n_tok * per_token != n_pairs or res.shape != (n_tok, n) or tickets.shape != (TICKETS,)
                or n_tok * grid[2] > TICKETS):
            raise ValueError(f"moe_gemv_q8: combine needs weights [T, k] with T * k = {n_pairs} pairs, x [T, {n}] and "
                             f"T * {grid[2]} row tiles <= {TICKETS} tickets, got {weights.shape}, {res.shape} and "
                             f"{tickets.shape}")
        lead += [weights.astype(F32).reshape(n_pairs), res.astype(F32), tickets]
        lead_specs += [_whole(n_pairs), _whole(n_tok, n), _whole(TICKETS)]
        kw.update(y_spec=_whole(split, n_pairs, n), **_combined_outputs(n_tok, n), aliases={3: 1})
    out = _call(functools.partial(_moe_kernel, source=xo.source, qtype=qtype, n_experts=n_exp, bn=bn,
                                  per_program=per_program, interpret=interpret, combine=per_token),
                xo, lead_specs=lead_specs, **kw)(lead, arrays)
    if combine is None:
        return add_partials(out)
    return out[1], out[2]


def _part_body(xs, store, *, bn: int, interpret: bool):
    """This file's ``qgemv.run_parts`` body: one weight's chunks of a launch over several."""

    def body(part, refs, share):
        _body(xs, refs, store, qtype=T(part.qtype), bn=bn, per_program=part.steps * part.per_step,
              interpret=interpret, share=share)

    return body


def _tuning(x) -> str:
    """The launch table for x's form (``qgemv_tuned.FALLBACK``)."""
    return "q8-given" if isinstance(x, Q8Act) else "q8"


def _q8_many(x, ws, k: int, lead: tuple, name: str, config: GemvConfig | None):
    for w in ws:
        _check(w, len(lead) + 2, name)
    return many_operands(ws, k, lead, name, tuning=_tuning(x), config=config)


def _dense_many_kernel(*refs, source: _XSource, parts, bn: int, interpret: bool):
    xs, w_refs, o_ref = source.rows(refs, interpret)  # o_ref [1, B, BN]

    def store(r, y):
        o_ref[0, r, :] = y

    run_parts(pl.program_id(1), w_refs, parts, _part_body(xs, store, bn=bn, interpret=interpret))


@functools.partial(jax.jit, static_argnames=("eps", "config", "partials", "interpret"))
def qgemv_q8_many(x, ws: tuple, *, norm: jax.Array | None = None, eps: float = 0.0,
                  config: GemvConfig | None = None, partials: bool = False, interpret: bool = False):
    """``tuple(qgemv_q8(x, w) for w in ws)`` in one launch (q, k and v of a layer: decode is
    bound by launches). Per output the sums are :func:`qgemv_q8`'s; the same bound holds with
    the launch's split (``many_operands``: ``config``, else tuned from the "q8" table).

    ``norm`` (float x only), ``eps`` and ``partials`` as for ``qgemv.qgemv_many``: the rows
    rounded are ``ops.norms.rms_norm(x, norm, eps)``'s, formed in-kernel (the mean square sums
    in another order: its last bits, and so a rare quant, may differ)."""
    rows, k = _x_shape(x)
    _check_norm("qgemv_q8_many", norm, k)
    m = _q8_many(x, ws, k, (), "qgemv_q8_many", config)
    xo = _x_operands(x, "qgemv_q8_many", k, rows, _ALL_ROWS, norm, eps)
    y = _call(
        functools.partial(_dense_many_kernel, source=xo.source, parts=m.parts, bn=m.bn, interpret=interpret),
        xo, y=jax.ShapeDtypeStruct((m.split_k, rows, m.tiles * m.bn), F32),
        y_spec=pl.BlockSpec((1, rows, m.bn), lambda s, i: (s, 0, i)), grid=(m.split_k, m.tiles), w_specs=m.specs,
        compiler_params=m.compiler_params, interpret=interpret, name="qgemv_q8_many",
    )((), m.arrays)
    return y if partials else m.split(y)


def _moe_many_kernel(e_ref, *refs, source: _XSource, parts, n_experts: int, bn: int, interpret: bool):
    xs, w_refs, o_ref = source.rows(refs, interpret)  # o_ref [1, 1, BN]
    e = expert_index(e_ref, n_experts)

    def store(r, y):
        o_ref[0, 0, :] = y

    run_parts(pl.program_id(2), w_refs, parts, _part_body(xs, store, bn=bn, interpret=interpret),
              view=lambda r: _ExpertView(r, e))


@functools.partial(jax.jit, static_argnames=("pairs_per_row", "eps", "config", "joined", "partials", "interpret"))
def moe_gemv_q8_many(x, ws: tuple, experts: jax.Array, *, pairs_per_row: int = 1, norm: jax.Array | None = None,
                     eps: float = 0.0, config: GemvConfig | None = None, joined: bool = False,
                     partials: bool = False, interpret: bool = False):
    """``tuple(moe_gemv_q8(x, w, experts) for w in ws)`` in one launch (gate and up of a layer).
    With ``pairs_per_row`` > 1, x holds one row per token and pair p reads row p // pairs_per_row
    (token-major routing: nothing copies a token's row k times first). ``norm`` and ``eps`` as
    for :func:`qgemv_q8_many`, ``joined`` as for ``moe_gemv.moe_gemv_many`` (the outputs side by
    side, what ``moe_gemv_q8(..., swiglu_halves=True)`` reads; with ``partials`` the launch's
    split-K partial sums ``[S, P, sum N_j]``, which it adds itself); ``config`` as for
    :func:`qgemv_q8_many`."""
    n_exp, _, k = ws[0].shape
    rows, width = _x_shape(x)
    n_pairs = experts.shape[0] if experts.ndim == 1 else -1
    if width != k or pairs_per_row < 1 or n_pairs != rows * pairs_per_row:
        raise ValueError(f"moe_gemv_q8_many: x must hold [P / {pairs_per_row}, {k}] activations and experts [P], "
                         f"got [{rows}, {width}] and experts {experts.shape}")
    _check_norm("moe_gemv_q8_many", norm, k)
    m = _q8_many(x, ws, k, (n_exp,), "moe_gemv_q8_many", config)
    xo = _x_operands(x, "moe_gemv_q8_many", k, 1, lambda s, p, i: p // pairs_per_row, norm, eps)
    y = _call(
        functools.partial(_moe_many_kernel, source=xo.source, parts=m.parts, n_experts=n_exp, bn=m.bn,
                          interpret=interpret),
        xo, y=jax.ShapeDtypeStruct((m.split_k, n_pairs, m.tiles * m.bn), F32),
        y_spec=pl.BlockSpec((1, 1, m.bn), lambda s, p, i: (s, p, i)), grid=(m.split_k, n_pairs, m.tiles),
        lead_specs=[pl.BlockSpec((1,), lambda s, p, i: (p,))], w_specs=m.specs,
        compiler_params=m.compiler_params, interpret=interpret, name="moe_gemv_q8_many",
    )((experts.astype(jnp.int32),), m.arrays)
    if joined:
        return y if partials else add_partials(y)
    return m.split(y)
