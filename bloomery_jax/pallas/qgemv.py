"""Quantized GEMV for decode: ``y[B, N] = x[B, K] @ W[N, K]^T`` on repacked GGUF weights.

``qgemv`` is the entry point; it dispatches on the weight's layout to the "planes" kernel of
this file (the default layout, measured on the H200; it reads "ggml"-layout weights too) or to
the "rows" kernel (``qgemv_rows``, which cuts the per-element work but has not been timed on
the GPU yet).

The planes kernel: one Pallas kernel (Triton lowering) per format, Q8_0, Q4_K, Q5_K, Q6_K in
the "planes" layout of ``quant.repack`` (a chunk of a row is W int32 words; plane p of the words is W consecutive
elements sharing one scale). A program owns ``block_n`` rows and walks K chunk by chunk,
``chunks_per_step`` chunks per loop step; each plane is dequantized into a ``[block_n, W]``
float32 tile and multiply-added into one ``[block_n, W]`` accumulator per row of x, summed
across W at the end. B (1-8 rows of x) is unrolled, so the weight is read once for all rows.
With ``split_k`` S > 1, S programs share a row tile, each walking 1/S of K into its own partial
output ``[S, B, N]``, summed after the launch: matrices with few rows (the 512-row k and v of a
layer) otherwise leave most of the card's SMs idle.
The same kernel reads the "ggml" layout (the file's quant bytes as words, kept for the integer
dot-product kernels of ``qgemv_q8``) through other per-format bodies (``GGML_FORMATS``): each
yields a sub-block (W = 32 elements, 16 for Q6_K) unpacked from its words with one shift and mask
per byte and a ``[BN, W / 4, 4] -> [BN, W]`` reshape, with the planes bodies' exact values, so
all that follows, and the bound below, is the same. ``format_of(layout, qtype)`` picks the body.
``paired_format`` gives the tensor-core tiles of ``moe_gemm`` the same sub-blocks as two halves
in another column order, which reach the products without passing through shared memory.

Exactness: every weight the kernel forms equals ``dequantize`` of the file bit for bit (the
f16 scales widen exactly, ``d * sc`` and its product with the quant are exact in f32, and the
min is subtracted with one rounding, as in ggml). Only the sum order differs from a plain
matmul: each accumulator element adds K / W products in sequence, then the W columns are
summed, then the S partials, so |y - exact| <= (K / W + W + S) * 2^-24 * sum_k |x_k| |w_nk|
(``rounding_depth``; tests use this bound).

It is compute-bound: each thread holds 4 columns of 8 sub-blocks, so every scale is rebuilt for
4 elements (measured 2026-12-02 at ~20% of copy bandwidth; docs/LOG.md).

The reference twin is ``x @ dequantize(W).T`` in float32 (``ops.qmatmul``).
Launch parameters are data (``qgemv_tuned``), measured by ``scripts/kernel_bench.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as T
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..quant.repack import MAGIC, PackedWeight, k4_scale_min
from . import qgemv_rows
from .qgemv_tuned import GemvConfig, pick_config, pick_many_config

F32 = jnp.float32
TWO23 = 8388608.0  # 2^23: bitcast(MAGIC | q) - TWO23 == q exactly, with no int->float convert
__all__ = ["GemvConfig", "format_of", "pick_config", "qgemv", "qgemv_many", "rounding_depth"]


@dataclasses.dataclass(frozen=True)
class _Format:
    chunk: int  # elements of a row per chunk
    width: int  # columns W of a plane tile (= accumulator width)
    # (c, refs) -> iterable of Plane: chunk c's [BN, W] tiles, columns col..col+W
    # (the planes of a chunk in the planes layout, its sub-blocks in the ggml one)
    planes: object
    chunk_tile: object = None  # (c, refs) -> float32 [BN, chunk]: the whole chunk at once, where built


def _as_f32(q: jax.Array, offset: float = TWO23) -> jax.Array:
    """int32 q in [0, 2^23) -> float32 (q + TWO23 - offset), exact (full-rate ALU ops only)."""
    return jax.lax.bitcast_convert_type(q | MAGIC, F32) - offset


class Plane(NamedTuple):
    """W columns of BN weight rows sharing one scale per row: weight = scale * (q - bias) - min.
    ``q`` may be the fields of the paired order (``paired_format``): the methods then return
    its two halves."""

    col: object  # int or traced int32: the first column of the row it covers
    q: object  # int32 [BN, W], the stored quants, in [0, 2^8); or fields ((f0, f1), (f2, f3)) (_byte_field_pairs)
    bias: float  # what the stored quants are offset by (128 for Q8_0's int8, 32 for Q6_K, else 0)
    scale: jax.Array  # float32 [BN]: d, or d * sub-block scale (exact products)
    min: jax.Array | None  # float32 [BN]: dmin * sub-block min (Q4_K, Q5_K), else None

    def weights(self) -> jax.Array:
        """float32 [BN, W], the dequantized values, equal to ``dequantize`` bit for bit (one
        rounding where a min is subtracted, as in ggml)."""
        def of(q):
            w = self.scale[:, None] * _as_f32(q, TWO23 + self.bias)
            return w if self.min is None else w - self.min[:, None]

        return _joined(jax.tree.map(of, self.q))

    def ints(self) -> jax.Array:
        """``q - bias``, int32 [BN, W], in [-128, 128)."""
        return _joined(jax.tree.map(lambda q: q - int(self.bias), self.q))

    def quants(self, dtype) -> jax.Array:
        """``q - bias`` as ``dtype`` [BN, W]: exact in any float type of at least 8 significant
        bits (bf16 and up)."""
        return _joined(jax.tree.map(lambda q: _as_f32(q, TWO23 + self.bias).astype(dtype), self.q))


def _fma_rows(accs, w, x_ref, col, width):
    """accs[b] += w * x[b, col:col+width] for every row b of x; w float32 [BN, W]."""
    out = []
    for b, acc in enumerate(accs):
        xv = x_ref[b, pl.ds(col, width)].astype(F32)  # [W]
        out.append(acc + w * xv[None, :])
    return tuple(out)


def _q8_0_planes(c, refs):
    qs_ref, d_ref = refs  # [BN, K/4] int32, [K/32, BN] f16
    words = qs_ref[:, pl.ds(c * 32, 32)]  # [BN, 32]: byte p of word j = block 4c+p, element j
    for p in range(4):
        d = d_ref[c * 4 + p, :].astype(F32)  # [BN]
        q = ((words >> (8 * p)) & 0xFF) ^ 0x80  # XOR 0x80 maps the int8 byte to q + 128 in 0..255
        yield Plane(c * 128 + p * 32, q, 128.0, d, None)


def _k4_scales(c, sc_ref, dm_ref):
    """Chunk c's ``(d * sc, dmin * m)`` of sub-block p, float32 [BN] each: a function of p."""
    a, b, cc = sc_ref[c, 0, :], sc_ref[c, 1, :], sc_ref[c, 2, :]  # [BN] packed 6-bit fields
    d, dmin = dm_ref[c, 0, :].astype(F32), dm_ref[c, 1, :].astype(F32)  # [BN]

    def of(p):
        sc, mn = k4_scale_min(a, b, cc, p)
        return d * sc.astype(F32), dmin * mn.astype(F32)  # exact products

    return of


def _q6_scale(scw, s: int):
    """Sub-block s's int8 scale, sign-extended, from the chunk's four scale words (int32 [BN] each)."""
    return (scw[s // 4] << (24 - 8 * (s % 4))) >> 24  # arithmetic shift


def _k4_planes(c, refs, with_qh):
    qs_ref, sc_ref, dm_ref, *qh_ref = refs  # [BN, K/8] i32, [G, 3, BN] i32, [G, 2, BN] f16, [BN, K/8] u8
    words = qs_ref[:, pl.ds(c * 32, 32)]  # [BN, 32]: nibble p of word j = sub-block p, element j
    if with_qh:
        qh = qh_ref[0][:, pl.ds(c * 32, 32)].astype(jnp.int32)  # [BN, 32]: bit p = 5th bit
    scales = _k4_scales(c, sc_ref, dm_ref)
    for p in range(8):
        dl, ml = scales(p)  # [BN]
        q = (words >> (4 * p)) & 0xF
        if with_qh:
            q = q | (((qh >> p) & 1) << 4)
        yield Plane(c * 256 + p * 32, q, 0.0, dl, ml)  # [BN, 32]


def _q6_k_planes(c, refs):
    qs_ref, qh_ref, sc_ref, d_ref = refs  # [BN, K/8] i32, [BN, K/16] i32, [G, 4, BN] i32, [G, BN] f16
    hi = qh_ref[:, pl.ds(c * 16, 16)]  # [BN, 16]: bits 16h+2p.. = high 2 bits of (h, p, j)
    scw = [sc_ref[c, i, :] for i in range(4)]  # [BN] words of four int8 scales
    d = d_ref[c, :].astype(F32)  # [BN]
    for h in range(2):
        words = qs_ref[:, pl.ds(c * 32 + h * 16, 16)]  # [BN, 16]: nibble p = plane p
        for p in range(8):
            s = 8 * h + p  # sub-block
            dl = d * _q6_scale(scw, s).astype(F32)  # [BN]
            q = ((words >> (4 * p)) & 0xF) | (((hi >> (16 * h + 2 * p)) & 3) << 4)
            yield Plane(c * 256 + h * 128 + p * 16, q, 32.0, dl, None)  # [BN, 16], quants biased by 32


def _k4_chunk(c, refs, with_qh):
    """Chunk c of a Q4_K/Q5_K row tile as one float32 ``[BN, 256]`` tile (element order), the
    eight planes built at once over a plane axis instead of one by one (same values)."""
    qs_ref, sc_ref, dm_ref, *qh_ref = refs
    words = qs_ref[:, pl.ds(c * 32, 32)]  # [BN, 32]
    p = jax.lax.broadcasted_iota(jnp.int32, (1, 8), 1)  # [1, 8] plane (sub-block) index
    a, b, cc = (sc_ref[c, i, :][:, None] for i in range(3))  # [BN, 1] packed 6-bit fields
    u = 8 * (p - 4)
    lo = p < 4
    sc = jnp.where(lo, (a >> (8 * p)) & 63, ((cc >> u) & 0x0F) | (((a >> (u + 6)) & 3) << 4))  # [BN, 8]
    mn = jnp.where(lo, (b >> (8 * p)) & 63, ((cc >> (u + 4)) & 0x0F) | (((b >> (u + 6)) & 3) << 4))
    d, dmin = dm_ref[c, 0, :].astype(F32)[:, None], dm_ref[c, 1, :].astype(F32)[:, None]  # [BN, 1]
    dl, ml = d * sc.astype(F32), dmin * mn.astype(F32)  # [BN, 8], exact products
    shifts = 4 * p[:, :, None]  # [1, 8, 1]
    q = (words[:, None, :] >> shifts) & 0xF  # [BN, 8, 32]
    if with_qh:
        qh = qh_ref[0][:, pl.ds(c * 32, 32)].astype(jnp.int32)  # [BN, 32]
        q = q | (((qh[:, None, :] >> p[:, :, None]) & 1) << 4)
    w = dl[:, :, None] * _as_f32(q) - ml[:, :, None]  # [BN, 8, 32]
    return w.reshape(w.shape[0], 256)  # [BN, 256]: element 32 p + j of the chunk


FORMATS = {
    T.Q8_0: _Format(128, 32, _q8_0_planes),
    T.Q4_K: _Format(256, 32, functools.partial(_k4_planes, with_qh=False), functools.partial(_k4_chunk, with_qh=False)),
    T.Q5_K: _Format(256, 32, functools.partial(_k4_planes, with_qh=True), functools.partial(_k4_chunk, with_qh=True)),
    T.Q6_K: _Format(256, 16, _q6_k_planes),
}


# --- the "ggml" layout: the file's quant bytes as int32 words, byte k of word i = element 4i + k
# of a sub-block. The bodies read each sub-block's words and unpack one bit field of every byte
# over a byte axis; the [BN, n, 4] result, read row-major, is the sub-block in element order.
# Same chunks and tile widths as the planes bodies, same values (the same exact f32 tricks).


def _byte_fields(words, shift: int, mask: int):
    """Field ``(byte >> shift) & mask`` of every byte of a word tile, in element order:
    int32 [BN, n] -> int32 [BN, 4n] (element 4i + k is byte k of word i)."""
    k = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)  # [1, 1, 4] byte of a word
    fields = (words[:, :, None] >> (8 * k + shift)) & mask  # [BN, n, 4]
    return fields.reshape(words.shape[0], 4 * words.shape[1])  # [BN, n, 4] -> [BN, 4n]


# The paired order: the fields of bytes 0-1 and of bytes 2-3 of every word as two tiles, joined
# on a new minor axis (``[BN, n, 2] -> [BN, 2n]``): half h's column 2i + j is element 4i + 2h + j.
# Unlike the element order's reshape, which Triton builds in registers and then moves to the
# tensor cores' operand layout through shared memory (128 16-bit stores a chunk, twenty-ninth
# session), a join keeps each thread's two fields side by side, where a bf16 operand wants
# them: the tile reaches the products as the planes layout's does (offline sm_90 counts of a
# q-bf16 Q4_K tile kernel: planes 928 SASS instructions, 54 shared-memory operations; element
# order 1,112 and 254; paired 984 and 50). x's columns must be in the same order
# (``pair_columns``).


def _byte_field_pairs(words, shift: int, mask: int):
    """``_byte_fields`` for the paired order, not yet joined: ``((f0, f1), (f2, f3))``, ``f_k``
    the int32 ``[BN, n]`` fields of byte k (``_joined`` makes the halves, after the fields are
    converted: a join of bf16 fields compiles to fewer instructions than one of int32 fields)."""
    fields = [(words >> (8 * k + shift)) & mask for k in range(4)]  # [BN, n] each
    return (fields[0], fields[1]), (fields[2], fields[3])


def _joined(q):
    """A tile as the products take it: q itself, or for fields ``((f0, f1), (f2, f3))`` the two
    halves of the paired order, ``[BN, n, 2] -> [BN, 2n]`` each."""
    if not isinstance(q, tuple):
        return q
    return tuple(jnp.stack(pair, axis=-1).reshape(pair[0].shape[0], 2 * pair[0].shape[1]) for pair in q)


def pair_columns(x: jax.Array, width: int = 32) -> jax.Array:
    """x ``[M, K]`` with each ``width``-column group in the paired order of its weight tiles."""
    m, k = x.shape
    groups = x.reshape(m, k // width, width // 4, 2, 2)  # [M, groups, i, h, j]: element 4i + 2h + j
    return groups.transpose(0, 1, 3, 2, 4).reshape(m, k)  # [M, groups, h, i, j]


def _q8_0_ggml(c, refs, fields=_byte_fields):
    qs_ref, d_ref = refs  # [BN, K/4] int32 (block b = words 8b..8b+7), [K/32, BN] f16
    for p in range(4):
        blk = 4 * c + p  # ggml block: 32 elements, one scale
        words = qs_ref[:, pl.ds(blk * 8, 8)]  # [BN, 8]
        d = d_ref[blk, :].astype(F32)  # [BN]
        q = jax.tree.map(lambda f: f ^ 0x80, fields(words, 0, 0xFF))  # int8 biased by 128, as planes
        yield Plane(blk * 32, q, 128.0, d, None)  # [BN, 32]


def _k4_ggml(c, refs, with_qh, fields=_byte_fields):
    qs_ref, sc_ref, dm_ref, *qh_ref = refs  # [BN, K/8] i32, [G, 3, BN] i32, [G, 2, BN] f16, [BN, K/32] i32
    if with_qh:
        qh = qh_ref[0][:, pl.ds(c * 8, 8)]  # [BN, 8]: bit p of byte l = 5th bit of sub-block p, element l
    scales = _k4_scales(c, sc_ref, dm_ref)
    for s in range(4):
        # bytes 32s..32s+31: low nibbles are sub-block 2s, high nibbles sub-block 2s + 1
        words = qs_ref[:, pl.ds(c * 32 + 8 * s, 8)]  # [BN, 8]
        for p in (2 * s, 2 * s + 1):
            q = fields(words, 4 * (p % 2), 0xF)  # [BN, 32]
            if with_qh:
                q = jax.tree.map(lambda lo, hi: lo | (hi << 4), q, fields(qh, p, 1))
            dl, ml = scales(p)  # [BN]
            yield Plane(c * 256 + p * 32, q, 0.0, dl, ml)  # [BN, 32]


def _q6_k_ggml(c, refs):
    qs_ref, qh_ref, sc_ref, d_ref = refs  # [BN, K/8] ql words, [BN, K/16] qh words, [G, 4, BN] i32, [G, BN] f16
    scw = [sc_ref[c, i, :] for i in range(4)]  # [BN] words of four int8 scales
    d = d_ref[c, :].astype(F32)  # [BN]
    for h in range(2):  # 128-element half: ql bytes 64h.., qh bytes 32h..
        # sub-block m of the half (elements 16m..16m+15) takes the low (m < 4) or high nibbles
        # of ql bytes 64h + 16 (m % 4).. and field m // 2 of qh bytes 32h + 16 (m % 2)..; each
        # word group serves several sub-blocks, so all are loaded first
        lows = [qs_ref[:, pl.ds(c * 32 + 16 * h + 4 * g, 4)] for g in range(4)]  # [BN, 4] each
        his = [qh_ref[:, pl.ds(c * 16 + 8 * h + 4 * r, 4)] for r in range(2)]  # [BN, 4] each
        for m in range(8):  # the planes body's order: the same sequence of additions into the accumulators
            q = _byte_fields(lows[m % 4], 4 * (m // 4), 0xF) | (_byte_fields(his[m % 2], 2 * (m // 2), 3) << 4)
            dl = d * _q6_scale(scw, 8 * h + m).astype(F32)  # [BN]
            yield Plane(c * 256 + h * 128 + m * 16, q, 32.0, dl, None)  # [BN, 16], biased by 32


GGML_FORMATS = {
    T.Q8_0: _Format(128, 32, _q8_0_ggml),
    T.Q4_K: _Format(256, 32, functools.partial(_k4_ggml, with_qh=False)),
    T.Q5_K: _Format(256, 32, functools.partial(_k4_ggml, with_qh=True)),
    T.Q6_K: _Format(256, 16, _q6_k_ggml),
}
F32_LAYOUTS = {"planes": FORMATS, "ggml": GGML_FORMATS}  # the layouts the f32 kernels of this file read
# the ggml bodies in the paired order, where a half is a whole tensor-core step (16 columns)
PAIRED_FORMATS = {
    T.Q8_0: _Format(128, 32, functools.partial(_q8_0_ggml, fields=_byte_field_pairs)),
    T.Q4_K: _Format(256, 32, functools.partial(_k4_ggml, with_qh=False, fields=_byte_field_pairs)),
    T.Q5_K: _Format(256, 32, functools.partial(_k4_ggml, with_qh=True, fields=_byte_field_pairs)),
}


def format_of(layout: str, qtype) -> _Format | None:
    """The f32 kernel body for weights of that layout and type; None where this file has none
    ("rows" weights go to ``qgemv_rows``)."""
    return F32_LAYOUTS.get(layout, {}).get(T(qtype))


def paired_format(layout: str, qtype) -> _Format | None:
    """The body yielding a weight's sub-blocks as the paired order's halves, for the
    tensor-core tiles: ggml-layout Q8_0, Q4_K and Q5_K; None elsewhere. Q6_K's 16-element
    sub-blocks would halve to 8 columns, under a bf16 product's 16; two to a tile, each plane's
    product must zero the other's columns, and every way tried (a select on x or on the tile, an
    integer mask before the join, a loaded mask, masked loads) sent the tile through shared memory
    again or spilled (thirty-second session, offline sm_90 counts)."""
    return PAIRED_FORMATS.get(T(qtype)) if layout == "ggml" else None


def tuning_layout(layout: str) -> str:
    """The ``pick_config`` layout key of a weight: the ggml bodies run the planes kernels' loop
    and launch, so they take the planes parameters until measured on their own."""
    return "planes" if layout == "ggml" else layout


def _accumulate(x_ref, w_refs, *, fmt: _Format, bn: int, nrows: int, steps: int, per_step: int, first=0):
    """The K loop of one program: B float32 ``[BN]`` rows of y (one per row of x) for its BN
    weight rows, over chunks ``first .. first + steps * per_step``.

    ``w_refs`` are the weight fields in kernel order, each a ref or any object whose
    ``[...]`` reads the ref the same way (``moe_gemv`` passes views that prefix an expert).
    """
    accs = tuple(jnp.zeros((bn, fmt.width), F32) for _ in range(nrows))

    def step(i, accs):
        for u in range(per_step):  # unrolled: the loads of all chunks of a step issue together
            for plane in fmt.planes(first + i * per_step + u, w_refs):
                accs = _fma_rows(accs, plane.weights(), x_ref, plane.col, fmt.width)
        return accs

    accs = jax.lax.fori_loop(0, steps, step, accs)
    return [jnp.sum(acc, axis=1) for acc in accs]


def _kernel(x_ref, *refs, fmt: _Format, nrows: int, steps: int, per_step: int):
    *w_refs, o_ref = refs  # o_ref: [1, B, BN], this program's partial sum
    first = pl.program_id(0) * (steps * per_step)  # the first chunk of this program's share of K
    ys = _accumulate(x_ref, w_refs, fmt=fmt, bn=o_ref.shape[2], nrows=nrows, steps=steps, per_step=per_step,
                     first=first)
    for b in range(nrows):
        o_ref[0, b, :] = ys[b]


def add_partials(y: jax.Array) -> jax.Array:
    """The split-K partial sums ``[S, ...]`` of a launch added up: ``[...]``."""
    return y[0] if y.shape[0] == 1 else jnp.sum(y, axis=0)


def _weight_fields(w: PackedWeight) -> list[tuple[jax.Array, bool]]:
    """The packed arrays in the order the format's body unpacks them, each with
    ``rows_last``: True for ``[..., chunks, fields, N]`` (scales), False for ``[..., N, cols]``."""
    qtype = T(w.qtype)
    if qtype == T.Q8_0:
        return [(w.qs, False), (w.d, True)]
    if qtype in (T.Q4_K, T.Q5_K):
        return [(w.qs, False), (w.sc, True), (w.d, True)] + ([(w.qh, False)] if qtype == T.Q5_K else [])
    return [(w.qs, False), (w.qh, False), (w.sc, True), (w.d, True)]


def _weight_operands(w: PackedWeight, bn: int):
    """The packed arrays in kernel order with their BlockSpecs (a program owns rows i*bn..)."""
    n = w.shape[0]
    row_tile = lambda a: pl.BlockSpec((bn, a.shape[1]), lambda s, i: (i, 0))  # [N, cols]
    rows_last = lambda a: pl.BlockSpec((*a.shape[:-1], bn), lambda s, i: (0,) * (a.ndim - 1) + (i,))
    ops = [(a, rows_last if last else row_tile) for a, last in _weight_fields(w)]
    assert all(a.shape[-1 if spec is rows_last else 0] == n for a, spec in ops)
    return [a for a, _ in ops], [spec(a) for a, spec in ops]


def _largest_divisor(n: int, cap: int, pow2: bool) -> int:
    for v in range(min(cap, n), 0, -1):
        if n % v == 0 and (not pow2 or v & (v - 1) == 0):
            return v
    return 1


def rounding_depth(layout: str, qtype, k: int, config: GemvConfig) -> int:
    """Longest chain of f32 roundings a product passes through in that kernel: the bound on
    |y - exact| is depth * 2^-24 * sum_k |x_k| m_k (m from ``repack.scale_magnitudes``)."""
    if layout == "rows":
        return qgemv_rows.rounding_depth(qtype, k, config)
    width = format_of(layout, qtype).width
    return k // width + width + (config.split_k if config else 1)


def _launch(fmt: _Format, n: int, k: int, cfg: GemvConfig) -> tuple[int, int, int, int]:
    """(rows per program, K-loop steps, chunks per step, split) for an ``[N, K]`` weight:
    ``cfg``'s block_n, split_k and chunks_per_step shrunk to the largest divisors of N, K / chunk
    and a split's chunks; each program walks ``steps * per_step`` chunks."""
    bn = _largest_divisor(n, cfg.block_n, pow2=True)
    split = _largest_divisor(k // fmt.chunk, cfg.split_k, pow2=False)
    chunks = k // fmt.chunk // split
    per_step = _largest_divisor(chunks, cfg.chunks_per_step, pow2=False)
    return bn, chunks // per_step, per_step, split


def _planes_call(x2, w: PackedWeight, cfg: GemvConfig, interpret: bool) -> jax.Array:
    qtype = T(w.qtype)
    n, k = w.shape
    fmt = format_of(w.layout, qtype)
    bn, steps, per_step, split = _launch(fmt, n, k, cfg)
    arrays, specs = _weight_operands(w, bn)
    nrows = x2.shape[0]
    kernel = functools.partial(_kernel, fmt=fmt, nrows=nrows, steps=steps, per_step=per_step)
    return add_partials(pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, nrows, n), F32),
        grid=(split, n // bn),
        in_specs=[pl.BlockSpec((nrows, k), lambda s, i: (0, 0)), *specs],
        out_specs=pl.BlockSpec((1, nrows, bn), lambda s, i: (s, 0, i)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"qgemv_{w.layout}_{qtype.name.lower()}",
    )(x2, *arrays))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def qgemv(x: jax.Array, w: PackedWeight, *, config: GemvConfig | None = None,
          interpret: bool = False) -> jax.Array:
    """``x @ W^T`` with float32 accumulation, W a 2-D repacked GGUF weight.

    Args:
      x: float ``[B, K]`` (B = 1..8) or ``[K]``; f32, bf16 or f16 (widened to f32 in-kernel).
      w: PackedWeight ``[N, K]`` (``quant.repack``, any layout; "planes" and "ggml" take the
        planes kernel, "rows" ``qgemv_rows``) of type Q8_0, Q4_K, Q5_K or Q6_K.
      config: launch parameters; None picks ``pick_config``. ``block_n`` and
        ``chunks_per_step`` are shrunk to the largest divisors of N and K / chunk (powers of
        two for the rows kernel).
      interpret: run the kernel with the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[B, N]`` (``[N]`` for 1-D x).
    """
    qtype = T(w.qtype)
    if qtype not in FORMATS or len(w.shape) != 2:
        raise ValueError(f"qgemv: needs a 2-D packed Q8_0/Q4_K/Q5_K/Q6_K weight, got {qtype.name} {w.shape}")
    n, k = w.shape
    squeeze = x.ndim == 1
    x2 = x[None] if squeeze else x
    if x2.ndim != 2 or x2.shape[1] != k or not 1 <= x2.shape[0] <= 8:
        raise ValueError(f"qgemv: x must be [B<=8, {k}] or [{k}], got {x.shape}")
    cfg = config or pick_config(tuning_layout(w.layout), qtype.name, n, k)
    call = qgemv_rows.rows_call if w.layout == "rows" else _planes_call
    y = call(x2, w, cfg, interpret)
    return y[0] if squeeze else y


@dataclasses.dataclass(frozen=True)
class _Part:
    """One weight of a launch over several: its type, format, fields, row tiles and loop steps."""

    qtype: int
    fmt: _Format
    n_fields: int
    tiles: int
    steps: int
    per_step: int
    start: int  # first program (along the tile axis) of this weight


def run_parts(i, w_refs, parts, body, view=lambda r: r):
    """Program i of a launch over several weights: ``body(part, refs, share)`` for the weight
    whose row tiles cover i (one ``pl.when`` per weight, so only that weight's loads run), with
    its refs and the program's split-K share (``pl.program_id(0)``). ``view`` wraps each weight
    ref (the MoE kernels prefix the pair's expert)."""
    share = pl.program_id(0)  # read outside pl.when: the interpreter cannot read it in a branch
    at = 0
    for part in parts:
        refs = [view(r) for r in w_refs[at:at + part.n_fields]]

        @pl.when((i >= part.start) & (i < part.start + part.tiles))
        def _(refs=refs, part=part):
            body(part, refs, share)

        at += part.n_fields


def accumulate_part(x_ref, store, *, bn: int, nrows: int):
    """The f32 kernels' ``run_parts`` body: the part's K loop, then ``store(b, y)`` per row b of x."""

    def body(part, refs, share):
        ys = _accumulate(x_ref, refs, fmt=part.fmt, bn=bn, nrows=nrows, steps=part.steps, per_step=part.per_step,
                         first=share * (part.steps * part.per_step))
        for b in range(nrows):
            store(b, ys[b])

    return body


class _NormedRows:
    """``view[b, *idx]`` is row b of x RMS-normalised and scaled by the norm weight, as
    ``ops.norms.rms_norm``: the whole row's mean square is taken once per program (x is one
    [B, K] block, or [B, K/32, 32] for ``qgemv_q8``, the weight shaped as a row), so no
    normalised copy of x is written first."""

    def __init__(self, x_ref, w_ref, eps: float, nrows: int):
        self.x, self.w = x_ref, w_ref
        k = math.prod(x_ref.shape[1:])
        self.scales = []
        for b in range(nrows):
            row = x_ref[b].astype(F32)  # [K] or [K/32, 32]
            self.scales.append(1.0 / jnp.sqrt(jnp.sum(row * row) / k + jnp.float32(eps)))

    def __getitem__(self, idx):
        b, *rest = idx  # b an int: the row's scale; the read takes it as an array (see row_index)
        return (self.x[(row_index(b), *rest)].astype(F32) * self.scales[b]) * self.w[tuple(rest)].astype(F32)

    def on(self, x_ref, w_ref) -> "_NormedRows":
        """The same rows read from other refs of the same values (x and the weight in another
        shape), with the scales already taken."""
        view = object.__new__(_NormedRows)
        view.x, view.w, view.scales = x_ref, w_ref, self.scales
        return view


def row_index(b: int) -> jax.Array:
    """Row b as a ref index: an int32 array, because the interpreter turns a strided read
    (``qgemv_q8``'s rounding) into a gather, which takes no Python int."""
    return jnp.int32(b)


def _many_kernel(x_ref, *refs, parts, nrows: int, bn: int, eps: float | None):
    if eps is not None:  # refs[0]: the norm weight [K]
        x_ref, refs = _NormedRows(x_ref, refs[0], eps, nrows), refs[1:]
    o_ref = refs[-1]  # [1, B, BN]

    def store(b, y):
        o_ref[0, b, :] = y

    run_parts(pl.program_id(1), refs[:-1], parts, accumulate_part(x_ref, store, bn=bn, nrows=nrows))


@dataclasses.dataclass(frozen=True)
class Many:
    """What one launch over several planes- or ggml-layout weights needs (``many_operands``)."""

    bn: int  # common tile height
    parts: tuple  # each weight's _Part, in output order
    arrays: list  # the weights' fields in kernel order
    specs: list  # their BlockSpecs: the last grid axis walks the tiles of all weights in turn
    tiles: int  # programs along that axis
    compiler_params: object
    split_k: int  # programs sharing a row tile (the first grid axis); every part's chunks divide by it

    def split(self, y: jax.Array) -> tuple:
        """The launch's partial sums ``[S, ..., tiles * bn]`` added and cut into each weight's ``[..., N_j]``."""
        y = add_partials(y)
        bounds = [p.start * self.bn for p in self.parts] + [self.tiles * self.bn]
        return tuple(y[..., a:b] for a, b in zip(bounds[:-1], bounds[1:]))


def many_operands(ws, k: int, lead: tuple, name: str, tuning: str | None = None,
                  config: GemvConfig | None = None) -> Many:
    """Check and lay out weights for one launch: each a planes- or ggml-layout (layouts may mix)
    Q8_0/Q4_K/Q5_K/Q6_K PackedWeight of shape ``[*lead, N_j, K]`` (2-D dense weights: lead ``()``;
    stacked experts: ``(E,)``). The launch takes ``config``, or else ``pick_many_config`` for
    these weights (``tuning`` names the table, default: the first weight's layout's); the tile
    height is its ``block_n`` halved until it divides every N, the split its ``split_k`` lowered
    until it divides every weight's chunk count; each weight's loop steps come from its chunks."""
    for w in ws:
        if (format_of(w.layout, w.qtype) is None or len(w.shape) != len(lead) + 2
                or tuple(w.shape[:-2]) != lead or w.shape[-1] != k):
            raise ValueError(f"{name}: needs planes-layout or ggml-layout Q8_0/Q4_K/Q5_K/Q6_K weights "
                             f"[{', '.join(map(str, lead + ('N', k)))}], "
                             f"got {T(w.qtype).name} {w.shape} {w.layout}")
    cfg = config or pick_many_config(tuning or tuning_layout(ws[0].layout), [(T(w.qtype).name, w.shape[-2]) for w in ws], k)
    bn = cfg.block_n
    while any(w.shape[-2] % bn for w in ws):
        bn //= 2
    split = cfg.split_k
    while any((k // format_of(w.layout, w.qtype).chunk) % split for w in ws):
        split -= 1
    cfg = dataclasses.replace(cfg, block_n=bn, split_k=split)
    parts, arrays, specs, start = [], [], [], 0
    for w in ws:
        fmt = format_of(w.layout, w.qtype)
        _, steps, per_step, _ = _launch(fmt, w.shape[-2], k, cfg)
        tiles = w.shape[-2] // bn
        fields = _weight_fields(w)
        for a, rows_last in fields:
            tile = lambda g, s=start, t=tiles: jnp.clip(g[-1] - s, 0, t - 1)  # this weight's tile of a program
            if rows_last:  # [..., chunks, fields, N]
                specs.append(pl.BlockSpec((*a.shape[:-1], bn), lambda *g, tile=tile, nd=a.ndim: (0,) * (nd - 1) + (tile(g),)))
            elif lead:  # [E, N, cols]
                specs.append(pl.BlockSpec((a.shape[0], bn, a.shape[2]), lambda *g, tile=tile: (0, tile(g), 0)))
            else:  # [N, cols]
                specs.append(pl.BlockSpec((bn, a.shape[1]), lambda *g, tile=tile: (tile(g), 0)))
            arrays.append(a)
        parts.append(_Part(int(w.qtype), fmt, len(fields), tiles, steps, per_step, start))
        start += tiles
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return Many(bn, tuple(parts), arrays, specs, start, params, split)


@functools.partial(jax.jit, static_argnames=("eps", "config", "partials", "interpret"))
def qgemv_many(x: jax.Array, ws: tuple, *, norm: jax.Array | None = None, eps: float = 0.0,
               config: GemvConfig | None = None, partials: bool = False, interpret: bool = False):
    """``tuple(x @ w.T for w in ws)`` in one launch: several planes- or ggml-layout weights that
    read the same x (q, k and v of a layer), each with its own format and layout.

    Program i serves a row tile of one weight (``pl.when`` picks the weight, so only its loads
    run). Per output row the products and the K accumulation are those of :func:`qgemv` on that
    weight alone; the tile height (``many_operands``) may differ from qgemv's, and with it how
    the final sum over the W accumulator columns associates: the same ``rounding_depth`` bound
    holds.

    Args:
      x: float ``[B, K]`` (B = 1..8).
      ws: tuple of 2-D planes- or ggml-layout PackedWeights ``[N_j, K]`` (Q8_0, Q4_K, Q5_K or Q6_K).
      norm: None, or a float ``[K]`` RMS-norm weight: then the products are those of
        ``ops.norms.rms_norm(x, norm, eps)`` (formed in-kernel; the mean square sums in another
        order, so the last bits may differ).
      eps: the norm's epsilon.
      config: launch parameters (``many_operands``); None picks ``pick_many_config``.
      partials: return the launch's output as it is, float32 ``[S, B, sum N_j]``: the S split-K
        partial sums (S >= 1) of the outputs side by side, for a consumer that adds them as it
        reads (``attn_prep``) instead of a launch that adds and cuts them.
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      tuple of float32 ``[B, N_j]`` (one array with ``partials``).
    """
    if x.ndim != 2 or not 1 <= x.shape[0] <= 8:
        raise ValueError(f"qgemv_many: x must be [B<=8, K], got {x.shape}")
    nrows, k = x.shape
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"qgemv_many: norm must be [{k}], got {norm.shape}")
    m = many_operands(ws, k, (), "qgemv_many", config=config)
    norms = () if norm is None else (norm.astype(F32),)
    y = pl.pallas_call(
        functools.partial(_many_kernel, parts=m.parts, nrows=nrows, bn=m.bn,
                          eps=None if norm is None else float(eps)),
        out_shape=jax.ShapeDtypeStruct((m.split_k, nrows, m.tiles * m.bn), F32),
        grid=(m.split_k, m.tiles),
        in_specs=[pl.BlockSpec((nrows, k), lambda s, i: (0, 0)), *[pl.BlockSpec((k,), lambda s, i: (0,))] * len(norms),
                  *m.specs],
        out_specs=pl.BlockSpec((1, nrows, m.bn), lambda s, i: (s, 0, i)),
        compiler_params=m.compiler_params,
        interpret=interpret,
        name="qgemv_many",
    )(x, *norms, *m.arrays)
    return y if partials else m.split(y)
