"""The "rows"-layout GEMV kernel: each thread owns whole sub-blocks, scales leave the inner loop.

Weights come from ``quant.repack(..., layout="rows")``: a chunk of a row is ``[nsub, nwords]``
int32 words, each sub-block's quants in its own words, in element order. A step loads
``[block_n, cps, nsub, nwords]`` words, unpacks them with one broadcast shift into
``[block_n, cps, nsub, nwords, per_word]`` exact integer floats, and for every row b of x:

    p  = sum_j x_j q_j            over the per_word quants of each word  (in-thread)
    acc += scale * p - min * sum_j x_j                               [block_n, cps, nsub, nwords]

so the per-sub-block scale costs a few operations per word, not per element. The result is
summed over (cps, nsub, nwords) at the end.

Rounding: a term sees at most ``per_word`` roundings in p, three for the scale, min and add,
K / (chunk * cps) accumulations and a final sum of cps * nsub * nwords values; so
|y - exact| <= depth * 2^-24 * sum_k |x_k| (|s_k q_k| + |m_k|) with ``depth`` from
``rounding_depth`` (``quant.repack.scale_magnitudes`` gives the magnitudes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as T
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..quant.repack import MAGIC, PackedWeight
from .qgemv_tuned import GemvConfig

F32 = jnp.float32
TWO23 = 8388608.0


@dataclasses.dataclass(frozen=True)
class RowsFormat:
    chunk: int  # elements of a row in one chunk
    nsub: int  # sub-blocks (one scale each) per chunk
    nwords: int  # int32 words per sub-block
    per_word: int  # quants per word
    dequant: object  # (c0, cps, refs) -> (q float [BN,cps,nsub,nwords,per], scale [BN,cps,nsub], min or None)


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _as_f32(q, offset=TWO23):
    """int32 q in [0, 2^23) -> float32 q + TWO23 - offset, exact, without an int->float convert."""
    return jax.lax.bitcast_convert_type(q | MAGIC, F32) - offset


def _q8_0(c0, cps, refs):
    qs_ref, d_ref = refs  # [BN, C, 4, 8] i32, [BN, C, 4] f16
    words = qs_ref[:, pl.ds(c0, cps), :, :]  # [BN, cps, 4 blocks, 8 words]
    shift = 8 * _iota((1, 1, 1, 1, 4), 4)
    q = ((words[..., None] >> shift) & 0xFF) ^ 0x80  # int8 byte -> q + 128 in 0..255
    return _as_f32(q, TWO23 + 128.0), d_ref[:, pl.ds(c0, cps), :].astype(F32), None


def _k4(c0, cps, refs, with_qh):
    qs_ref, sc_ref, d_ref, *qh_ref = refs  # [BN,G,8,4] i32, [BN,G,2,8] u8, [BN,G,2] f16, [BN,G,8] i32
    words = qs_ref[:, pl.ds(c0, cps), :, :]  # [BN, cps, 8, 4]
    nib = _iota((1, 1, 1, 1, 8), 4)
    q = (words[..., None] >> (4 * nib)) & 15  # [BN, cps, 8, 4, 8]
    if with_qh:
        hw = qh_ref[0][:, pl.ds(c0, cps), :]  # [BN, cps, 8]: bit e = 5th bit of element e
        e = 8 * _iota((1, 1, 1, 4, 8), 3) + nib
        q = q | (((hw[..., None, None] >> e) & 1) << 4)
    sc = sc_ref[:, pl.ds(c0, cps), 0, :].astype(F32)  # [BN, cps, 8]
    mn = sc_ref[:, pl.ds(c0, cps), 1, :].astype(F32)
    d = d_ref[:, pl.ds(c0, cps), 0].astype(F32)[..., None]  # [BN, cps, 1]
    dmin = d_ref[:, pl.ds(c0, cps), 1].astype(F32)[..., None]
    return _as_f32(q), d * sc, dmin * mn  # d * sc, dmin * mn: exact products


def _q6_k(c0, cps, refs):
    qs_ref, qh_ref, sc_ref, d_ref = refs  # [BN,G,16,2] i32, [BN,G,16] i32, [BN,G,16] i8, [BN,G] f16
    words = qs_ref[:, pl.ds(c0, cps), :, :]  # [BN, cps, 16, 2]
    nib = _iota((1, 1, 1, 1, 8), 4)
    low = (words[..., None] >> (4 * nib)) & 15  # [BN, cps, 16, 2, 8]
    hw = qh_ref[:, pl.ds(c0, cps), :]  # [BN, cps, 16]: bits 2e.. = high bits of element e
    e = 8 * _iota((1, 1, 1, 2, 8), 3) + nib
    q = low | (((hw[..., None, None] >> (2 * e)) & 3) << 4)
    d = d_ref[:, pl.ds(c0, cps)].astype(F32)[..., None]  # [BN, cps, 1]
    scale = d * sc_ref[:, pl.ds(c0, cps), :].astype(F32)  # [BN, cps, 16]
    return _as_f32(q, TWO23 + 32.0), scale, None  # quants are stored biased by 32


FORMATS = {
    T.Q8_0: RowsFormat(128, 4, 8, 4, _q8_0),
    T.Q4_K: RowsFormat(256, 8, 4, 8, functools.partial(_k4, with_qh=False)),
    T.Q5_K: RowsFormat(256, 8, 4, 8, functools.partial(_k4, with_qh=True)),
    T.Q6_K: RowsFormat(256, 16, 2, 8, _q6_k),
}


def _kernel(x_ref, *refs, fmt: RowsFormat, nrows: int, steps: int, cps: int):
    *w_refs, o_ref = refs  # x_ref [B, chunks, nsub, nwords, per]; o_ref [B, BN]
    bn = o_ref.shape[1]
    accs = tuple(jnp.zeros((bn, cps, fmt.nsub, fmt.nwords), F32) for _ in range(nrows))

    def step(i, accs):
        c0 = i * cps
        q, scale, mins = fmt.dequant(c0, cps, w_refs)
        out = []
        for b, acc in enumerate(accs):
            xv = x_ref[b, pl.ds(c0, cps), :, :, :].astype(F32)  # [cps, nsub, nwords, per]
            p = jnp.sum(q * xv[None], axis=4)  # [BN, cps, nsub, nwords]
            acc = acc + scale[..., None] * p
            if mins is not None:
                acc = acc - mins[..., None] * jnp.sum(xv, axis=3)[None]
            out.append(acc)
        return tuple(out)

    accs = jax.lax.fori_loop(0, steps, step, accs)
    for b in range(nrows):
        o_ref[b, :] = jnp.sum(accs[b], axis=(1, 2, 3))


def _largest_pow2_divisor(n: int, cap: int) -> int:
    v = 1
    while v * 2 <= cap and n % (v * 2) == 0:
        v *= 2
    return v


def launch_shape(qtype, n: int, k: int, cfg: GemvConfig) -> tuple[int, int]:
    """(block_n, chunks per step) actually used: powers of two dividing N and K / chunk."""
    fmt = FORMATS[T(qtype)]
    return _largest_pow2_divisor(n, cfg.block_n), _largest_pow2_divisor(k // fmt.chunk, cfg.chunks_per_step)


def rounding_depth(qtype, k: int, cfg: GemvConfig, n: int = 1 << 20) -> int:
    """Longest chain of f32 roundings one product passes through (see the module docstring)."""
    fmt = FORMATS[T(qtype)]
    _, cps = launch_shape(qtype, n, k, cfg)
    return fmt.per_word + 3 + k // (fmt.chunk * cps) + cps * fmt.nsub * fmt.nwords


def _operands(w: PackedWeight, bn: int):
    arrays = [a for a in (w.qs, w.qh if T(w.qtype) == T.Q6_K else None, w.sc, w.d,
                          w.qh if T(w.qtype) == T.Q5_K else None) if a is not None]
    specs = [pl.BlockSpec((bn, *a.shape[1:]), lambda i, nd=a.ndim: (i,) + (0,) * (nd - 1)) for a in arrays]
    return arrays, specs


def rows_call(x2: jax.Array, w: PackedWeight, cfg: GemvConfig, interpret: bool) -> jax.Array:
    """``x2 [B, K] @ W^T`` for a rows-layout weight; float32 ``[B, N]``."""
    qtype = T(w.qtype)
    fmt = FORMATS[qtype]
    n, k = w.shape
    bn, cps = launch_shape(qtype, n, k, cfg)
    chunks = k // fmt.chunk
    nrows = x2.shape[0]
    xv = x2.reshape(nrows, chunks, fmt.nsub, fmt.nwords, fmt.per_word)  # element order, free
    arrays, specs = _operands(w, bn)
    kernel = functools.partial(_kernel, fmt=fmt, nrows=nrows, steps=chunks // cps, cps=cps)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((nrows, n), F32),
        grid=(n // bn,),
        in_specs=[pl.BlockSpec(xv.shape, lambda i: (0,) * 5), *specs],
        out_specs=pl.BlockSpec((nrows, bn), lambda i: (0, i)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"qgemv_rows_{qtype.name.lower()}",
    )(xv, *arrays)
