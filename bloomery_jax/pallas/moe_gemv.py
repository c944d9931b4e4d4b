"""Decode GEMV for MoE experts: ``y[p] = x[p] @ W[experts[p]]^T`` on a repacked ``[E, N, K]`` weight.

Contract: ``moe_gemv(x [P, K], w [E, N, K], experts [P]) -> float32 [P, N]`` with
``y[p] = x[p] @ dequantize(w)[experts[p]].T`` for every pair p (one token routed to one
expert; P is small, decode). Pairs may repeat an expert. Expert indices must lie in [0, E);
others are clamped into that range so the kernel never reads outside the weight.

How: the planes kernel of ``qgemv`` (same per-format bodies, for the "planes" or the "ggml"
layout, same K loop, same split-K) on a grid ``(split_k, P, N / block_n)``. Program (s, p, i)
reads row p of x and rows ``i*block_n..`` of expert ``experts[p]`` straight from the stacked
``[E, ...]`` arrays: nothing is gathered or dequantized outside the kernel, so a layer reads
only the chosen experts' bytes. Pallas' Triton lowering has no scalar prefetch, so the expert
cannot be chosen by a BlockSpec's index map; instead each program loads its expert index from
``experts`` (a one-element block) and uses it as the leading scalar index of every weight load
(``_ExpertView``). The weight blocks span all E experts (only the row tile is blocked), which
costs nothing: a Triton block is a pointer, and only the indexed expert's words are loaded.

Exactness: as ``qgemv`` (every weight formed equals ``dequantize`` bit for bit, only the sum
order differs), so |y - exact| <= ``rounding_depth(layout, qtype, K, config)`` * 2^-24 *
sum_k |x_k w_k| per output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as T
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..quant.repack import PackedWeight
from .qgemv import (F32, _accumulate, _launch, _NormedRows, _weight_fields, accumulate_part, add_partials,
                    format_of, many_operands, row_index, run_parts, tuning_layout)
from .qgemv_tuned import GemvConfig, pick_config

__all__ = ["GemvConfig", "moe_gemv", "moe_gemv_many"]


class _ExpertView:
    """``view[idx]`` reads ``ref[e, *idx]``: one expert of a stacked weight ref.

    ``ref.at[e]`` would say the same, but the Triton lowering refuses a load through two
    indexers; folding e into the single indexer keeps one pointer computation per load.
    """

    def __init__(self, ref, e):
        self.ref, self.e = ref, e

    def __getitem__(self, idx):
        return self.ref[(self.e, *(idx if isinstance(idx, tuple) else (idx,)))]


class _SwigluRows:
    """``view[b, cols, *rest]`` is ``silu(gate[b, cols, *rest]) * up[b, cols + offset, *rest]`` in
    float32: a pair's hidden vector formed where the down projection reads it, so it needs no
    [P, F] array of its own (``offset``: where up starts along the ref's second axis; the ref may
    be gate's own, gate and up side by side)."""

    def __init__(self, gate_ref, up_ref, offset: int = 0):
        self.gate, self.up, self.offset = gate_ref, up_ref, offset

    def __getitem__(self, idx):
        b, cols, *rest = idx
        g = self.gate[(row_index(b), cols, *rest)].astype(F32)
        up = self.up[(row_index(b), pl.ds(cols.start + self.offset, cols.size, cols.stride), *rest)]
        return g / (1.0 + jnp.exp(-g)) * up.astype(F32)


def expert_index(e_ref, n_experts: int):
    """The pair's expert from its one-element block, clamped into [0, E): a bad index must not
    read out of bounds."""
    return jnp.clip(e_ref[0], 0, n_experts - 1)


def check_stacked(w: PackedWeight, name: str) -> T:
    """The type of a stacked expert weight the MoE kernels can read ([E, N, K], planes or ggml layout)."""
    qtype = T(w.qtype)
    if format_of(w.layout, qtype) is None or len(w.shape) != 3:
        raise ValueError(f"{name}: needs a 3-D planes-layout or ggml-layout Q8_0/Q4_K/Q5_K/Q6_K weight, got "
                         f"{qtype.name} {w.shape} {w.layout}")
    return qtype


def _kernel_name(family: str, layout: str, qtype: T) -> str:
    """``family_q4_k`` for the planes layout (the names the benches know), ``family_ggml_q4_k`` else."""
    infix = "" if layout == "planes" else f"{layout}_"
    return f"{family}_{infix}{qtype.name.lower()}"


def _moe_kernel(e_ref, *refs, fmt, n_experts: int, steps: int, per_step: int, swiglu: str | None):
    # e_ref [1] int32; x_ref [1, K] (or gate and up [1, K] each, or [1, 2K] side by side);
    # w_refs [E, ...] blocks; o_ref [1, 1, BN]
    if swiglu == "pair":
        x_ref, refs = _SwigluRows(*refs[:2]), refs[2:]
    elif swiglu == "halves":
        x_ref, refs = _SwigluRows(refs[0], refs[0], offset=refs[0].shape[1] // 2), refs[1:]
    else:
        x_ref, refs = refs[0], refs[1:]
    *w_refs, o_ref = refs
    e = expert_index(e_ref, n_experts)
    views = [_ExpertView(r, e) for r in w_refs]
    (y,) = _accumulate(x_ref, views, fmt=fmt, bn=o_ref.shape[2], nrows=1, steps=steps, per_step=per_step,
                       first=pl.program_id(0) * (steps * per_step))
    o_ref[0, 0, :] = y


def _operands(w: PackedWeight, bn: int):
    """The stacked arrays in kernel order with BlockSpecs: all experts, rows i*bn.. of each, i
    the last grid index (``moe_gemm`` reads them too)."""
    arrays, specs = [], []
    for a, rows_last in _weight_fields(w):
        if rows_last:  # [E, chunks, fields, N]: the tile is a slice of the last axis
            spec = pl.BlockSpec((*a.shape[:-1], bn), lambda *g, nd=a.ndim: (0,) * (nd - 1) + (g[-1],))
        else:  # [E, N, cols]
            spec = pl.BlockSpec((a.shape[0], bn, a.shape[2]), lambda *g: (0, g[-1], 0))
        arrays.append(a)
        specs.append(spec)
    return arrays, specs


def _check_rows(name: str, x: jax.Array, experts: jax.Array, k: int, pairs_per_row: int) -> int:
    """The pair count P, after checking ``x [P / pairs_per_row, k]`` and ``experts [P]``."""
    n_pairs = experts.shape[0] if experts.ndim == 1 else -1
    if x.ndim != 2 or x.shape[1] != k or pairs_per_row < 1 or n_pairs != x.shape[0] * pairs_per_row:
        raise ValueError(f"{name}: x must be [P / {pairs_per_row}, {k}] and experts [P], got {x.shape} and "
                         f"{experts.shape}")
    return n_pairs


@functools.partial(jax.jit, static_argnames=("config", "pairs_per_row", "swiglu_halves", "interpret"))
def moe_gemv(x: jax.Array, w: PackedWeight, experts: jax.Array, *, up: jax.Array | None = None,
             swiglu_halves: bool = False, config: GemvConfig | None = None, pairs_per_row: int = 1,
             interpret: bool = False) -> jax.Array:
    """``x[p // pairs_per_row] @ W[experts[p]]^T`` for every pair p, float32 accumulation.

    Args:
      x: float ``[P / pairs_per_row, K]`` (f32, bf16 or f16; widened in-kernel): one row per
        (token, expert) pair, or per token with its ``pairs_per_row`` pairs in a row (token-major
        routing: the kernel reads the token's row, so nothing copies it k times first).
      w: PackedWeight ``[E, N, K]`` in the "planes" or "ggml" layout, Q8_0, Q4_K, Q5_K or Q6_K.
      experts: integer ``[P]``, the expert of each pair, in [0, E) (repeats allowed).
      up: None, or an array shaped like x: then x is a gate projection and each row the kernel
        reads is ``silu(x) * up`` (``ops.experts.swiglu`` formed in-kernel, for a MoE down
        projection; the exponential is the kernel's, so the last bits may differ).
      swiglu_halves: x is ``[P / pairs_per_row, 2K]``, gate then up side by side (what
        ``moe_gemv_many(..., joined=True)`` returns), and each row read is ``silu(gate) * up``
        as with ``up``: no launch splits the two apart first.
      config: launch parameters; None picks ``pick_config`` for one expert's ``[N, K]``.
        ``block_n`` and ``chunks_per_step`` shrink to divisors as in ``qgemv``.
      pairs_per_row: consecutive pairs that share a row of x.
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[P, N]``.
    """
    qtype = check_stacked(w, "moe_gemv")
    n_exp, n, k = w.shape
    if swiglu_halves and up is not None:
        raise ValueError("moe_gemv: up and swiglu_halves exclude each other")
    width = 2 * k if swiglu_halves else k  # columns of a row of x
    n_pairs = _check_rows("moe_gemv", x, experts, width, pairs_per_row)
    if up is not None and up.shape != x.shape:
        raise ValueError(f"moe_gemv: up must be shaped like x {x.shape}, got {up.shape}")
    cfg = config or pick_config(tuning_layout(w.layout), qtype.name, n, k)
    fmt = format_of(w.layout, qtype)
    bn, steps, per_step, split = _launch(fmt, n, k, cfg)
    arrays, specs = _operands(w, bn)
    kernel = functools.partial(_moe_kernel, fmt=fmt, n_experts=n_exp, steps=steps, per_step=per_step,
                               swiglu="halves" if swiglu_halves else None if up is None else "pair")
    xs = (x,) if up is None else (x, up)
    x_spec = pl.BlockSpec((1, width), lambda s, p, i: (p // pairs_per_row, 0))  # this pair's row of x
    return add_partials(pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, n_pairs, n), F32),
        grid=(split, n_pairs, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda s, p, i: (p,)), *[x_spec] * len(xs), *specs],  # expert, x rows
        out_specs=pl.BlockSpec((1, 1, bn), lambda s, p, i: (s, p, i)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=_kernel_name("moe_gemv", w.layout, qtype),
    )(experts.astype(jnp.int32), *xs, *arrays))


def _moe_many_kernel(e_ref, x_ref, *refs, parts, n_experts: int, bn: int, eps: float | None):
    if eps is not None:  # refs[0]: the norm weight [K]
        x_ref, refs = _NormedRows(x_ref, refs[0], eps, 1), refs[1:]
    e = expert_index(e_ref, n_experts)
    o_ref = refs[-1]  # [1, 1, BN]

    def store(b, y):
        o_ref[0, 0, :] = y

    run_parts(pl.program_id(2), refs[:-1], parts, accumulate_part(x_ref, store, bn=bn, nrows=1),
              view=lambda r: _ExpertView(r, e))


@functools.partial(jax.jit, static_argnames=("pairs_per_row", "eps", "config", "joined", "interpret"))
def moe_gemv_many(x: jax.Array, ws: tuple, experts: jax.Array, *, pairs_per_row: int = 1,
                  norm: jax.Array | None = None, eps: float = 0.0, config: GemvConfig | None = None,
                  joined: bool = False, interpret: bool = False):
    """``tuple(moe_gemv(x, w, experts) for w in ws)`` in one launch (gate and up of a MoE layer).

    As ``qgemv.qgemv_many`` for stacked expert weights: program (p, i) serves pair p and a row
    tile of the weight whose tiles cover i. Per output the products and K accumulation are
    those of :func:`moe_gemv`; the same rounding bound holds.

    Args:
      x: float ``[P / pairs_per_row, K]``; ws: tuple of 3-D planes- or ggml-layout PackedWeights
        ``[E, N_j, K]`` with the same E; experts: integer ``[P]``.
      pairs_per_row: consecutive pairs that share a row of x (as in :func:`moe_gemv`).
      norm, eps: None, or a float ``[K]`` RMS-norm weight and its epsilon: the products are
        those of ``ops.norms.rms_norm(x, norm, eps)``, formed in-kernel as ``qgemv_many`` does.
      config: launch parameters (``qgemv.many_operands``); None picks ``pick_many_config``.
      joined: return the outputs side by side, float32 ``[P, sum N_j]``, not cut apart (on the
        GPU the cut is a kernel of its own; ``moe_gemv(..., swiglu_halves=True)`` reads them so).
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      tuple of float32 ``[P, N_j]`` (one array with ``joined``).
    """
    n_exp, _, k = ws[0].shape
    n_pairs = _check_rows("moe_gemv_many", x, experts, k, pairs_per_row)
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"moe_gemv_many: norm must be [{k}], got {norm.shape}")
    m = many_operands(ws, k, (n_exp,), "moe_gemv_many", config=config)
    norms = () if norm is None else (norm.astype(F32),)
    y = pl.pallas_call(
        functools.partial(_moe_many_kernel, parts=m.parts, n_experts=n_exp, bn=m.bn,
                          eps=None if norm is None else float(eps)),
        out_shape=jax.ShapeDtypeStruct((m.split_k, n_pairs, m.tiles * m.bn), F32),
        grid=(m.split_k, n_pairs, m.tiles),
        in_specs=[pl.BlockSpec((1,), lambda s, p, i: (p,)),
                  pl.BlockSpec((1, k), lambda s, p, i: (p // pairs_per_row, 0)),
                  *[pl.BlockSpec((k,), lambda s, p, i: (0,))] * len(norms), *m.specs],
        out_specs=pl.BlockSpec((1, 1, m.bn), lambda s, p, i: (s, p, i)),
        compiler_params=m.compiler_params,
        interpret=interpret,
        name="moe_gemv_many",
    )(experts.astype(jnp.int32), x, *norms, *m.arrays)
    return add_partials(y) if joined else m.split(y)
