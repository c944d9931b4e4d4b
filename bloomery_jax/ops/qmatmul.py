"""Quantized matmul reference and row lookup: dequantize the blocks, then plain float32 math.

This is the slow twin every fused kernel is checked against: values are exactly the
file's dequantized values (``QTensor.dequantize``) and the product is float32 with
``Precision.HIGHEST`` (no bf16 passes on accelerators). ``act_rounding="ggml-cpu"`` first
rounds the activations as llama.cpp's CPU backend does (see ``ops/actquant.py``).

A weight repacked for the Pallas kernels (``PackedWeight``, ``kernels=pallas`` at load) takes
the decode GEMV kernel when at most ``GEMV_MAX_ROWS`` rows of x multiply it. More rows (prefill)
take the product at the model's prefill precision (``precision``, a ``pallas.moe_gemm``
precision): quant tiles (``pallas.moe_gemm.dense_gemm``, also in the interpreter), or the
product of the weight's (bit-identical) dequantized values, on a GPU with that tensor-core
algorithm (default three TF32 passes: errors as f32's, measured 1.2e-6 against 1.3e-6 relative
for plain f32 FMAs) rather than HIGHEST's f32 FMAs, which run at a tenth of the tensor cores'
rate. With ``act_rounding="ggml-cuda"`` or ``"q8-decode"`` and a weight in the "ggml" layout
(``kernels=pallas-q8``, ``pallas-q8-bf16``) the decode GEMV takes integer dot products on the
Q8_1-rounded activations (``pallas.qgemv_q8``, which rounds them itself), as llama.cpp's CUDA
backend does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..pallas.moe_gemm import GEMM_ALGORITHMS, QUANT_TILES, dense_gemm, tiles_round_activations
from ..pallas.qgemv import qgemv, qgemv_many
from ..pallas.qgemv_q8 import qgemv_q8, qgemv_q8_many
from ..quant import QTensor, dequantize
from ..quant.repack import PackedWeight, dequantize_packed
from .actquant import round_activations
from .norms import rms_norm

HIGHEST = jax.lax.Precision.HIGHEST
GEMV_MAX_ROWS = 8  # rows of x the GEMV kernel takes in one pass (it unrolls them)


def as_f32(w) -> jax.Array:
    """The float32 values of a weight given as a QTensor, a PackedWeight or a plain array."""
    if isinstance(w, QTensor):
        return w.dequantize(jnp.float32)
    if isinstance(w, PackedWeight):
        return dequantize_packed(w)
    return jnp.asarray(w, jnp.float32)


def weight_qtype(w) -> int:
    """The ggml type of a weight (plain arrays count as F32)."""
    return w.qtype if isinstance(w, (QTensor, PackedWeight)) else 0


def interpret_kernels() -> bool:
    """Pallas kernels run in the interpreter off the GPU (CPU tests)."""
    return jax.default_backend() not in ("gpu", "cuda")


def qmatmul(x: jax.Array, w, act_rounding: str = "none", precision: str = "tf32x3") -> jax.Array:
    """``x @ w.T`` for a GGUF weight ``w`` of shape ``[N, K]`` (K inputs to N outputs).

    Args:
      x: float ``[..., K]``.
      w: QTensor, PackedWeight or array ``[N, K]``.
      act_rounding: one of ``ops.actquant.ACT_ROUNDINGS`` (``"ggml-cpu"``: round ``x`` as llama.cpp's CPU backend;
        ``"ggml-cuda"`` and ``"q8-decode"``: the integer-dot GEMV at decode, see above).
      precision: a PackedWeight's product for more than ``GEMV_MAX_ROWS`` rows (see above).
    Returns:
      float32 ``[..., N]``.
    """
    if takes_q8(w, act_rounding) and x.size // x.shape[-1] <= GEMV_MAX_ROWS:  # x rounded to Q8_1 in-kernel
        rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [R, K]
        return qgemv_q8(rows, w, interpret=interpret_kernels()).reshape(*x.shape[:-1], w.shape[0])
    quant_tiles = isinstance(w, PackedWeight) and x.size // x.shape[-1] > GEMV_MAX_ROWS and precision in QUANT_TILES
    x = x.astype(jnp.float32)
    if not (quant_tiles and tiles_round_activations(precision, act_rounding)):
        x = round_activations(x, weight_qtype(w), act_rounding)
    if isinstance(w, PackedWeight):
        rows = x.reshape(-1, x.shape[-1])  # [R, K]
        if quant_tiles:
            return dense_gemm(rows, w, precision, interpret=interpret_kernels()).reshape(*x.shape[:-1], w.shape[0])
        if rows.shape[0] <= GEMV_MAX_ROWS:
            return qgemv(rows, w, interpret=interpret_kernels()).reshape(*x.shape[:-1], w.shape[0])
        if not interpret_kernels():
            return jnp.einsum("...k,nk->...n", x, as_f32(w), precision=GEMM_ALGORITHMS[precision])
    return jnp.einsum("...k,nk->...n", x, as_f32(w), precision=HIGHEST)


def qmatmul_add(x_res: jax.Array, x: jax.Array, w, act_rounding: str, precision: str, tickets: jax.Array):
    """``(x_res + qmatmul(x, w, act_rounding, precision), tickets)``: a residual add. The
    integer-dot decode GEMV makes it in the last program of each row tile
    (``pallas.qgemv_q8(..., combine=)``, with ``tickets`` from ``pallas.tickets.new_tickets``),
    so it has no launch of its own; elsewhere XLA adds, and the tickets pass through."""
    if takes_q8(w, act_rounding) and x.size // x.shape[-1] <= GEMV_MAX_ROWS:
        rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [R, K]
        res = x_res.reshape(rows.shape[0], w.shape[0]).astype(jnp.float32)  # [R, N]
        out, tickets = qgemv_q8(rows, w, combine=(res, tickets), interpret=interpret_kernels())
        return out.reshape(x_res.shape), tickets
    return x_res + qmatmul(x, w, act_rounding, precision), tickets


def qmatmul_many(x: jax.Array, ws, act_rounding: str = "none", norm: tuple | None = None, partials: bool = False,
                 precision: str = "tf32x3"):
    """``tuple(qmatmul(x, w, act_rounding, precision) for w in ws)``: weights that read the same x (q, k, v).

    Decode steps with repacked weights take one launch for all of them (``qgemv_many``): the
    step is bound by launches and latency, not bytes (docs/LOG.md, decode profile). Anything
    else (prefill, the reference path, activation rounding that depends on the weight type) is
    one ``qmatmul`` per weight. ``norm = (weight [K], eps)`` first RMS-normalises x
    (``ops.norms.rms_norm``); the one-launch f32 path does that inside the kernel.
    ``partials``: return float32 ``[S, R, sum N_j]`` (R = rows of x), whose sum over S is the
    outputs side by side: the one-launch path's split-K partial sums as the kernel wrote them
    (``qgemv_many(..., partials=True)``), S = 1 elsewhere.
    """
    rows = x.reshape(-1, x.shape[-1])  # [R, K]
    one_launch = None
    if rows.shape[0] <= GEMV_MAX_ROWS:
        if act_rounding == "none" and all(isinstance(w, PackedWeight) and w.layout in ("planes", "ggml") for w in ws):
            one_launch = qgemv_many
        elif all(takes_q8(w, act_rounding) for w in ws):  # x rounded to Q8_1 in the launch
            one_launch = qgemv_q8_many
    if one_launch is not None:
        kw = {} if norm is None else dict(norm=norm[0], eps=float(norm[1]))
        ys = one_launch(rows.astype(jnp.float32), tuple(ws), **kw, partials=partials, interpret=interpret_kernels())
        return ys if partials else tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)
    if norm is not None:
        x = rms_norm(x, *norm)
        rows = x.reshape(-1, x.shape[-1])
    ys = tuple(qmatmul(rows, w, act_rounding, precision) for w in ws)  # [R, N_j] each
    if partials:
        return jnp.concatenate(ys, axis=-1)[None]  # [1, R, sum N_j]
    return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)


def takes_q8(w, act_rounding: str) -> bool:
    """The integer dot-product GEMV serves ``w``: Q8_1 activations at decode (``"ggml-cuda"``,
    ``"q8-decode"``) and a ggml-layout weight."""
    return act_rounding in ("ggml-cuda", "q8-decode") and isinstance(w, PackedWeight) and w.layout == "ggml"


def take_rows(w, rows: jax.Array) -> jax.Array:
    """Rows of a ``[N, K]`` weight (the embedding lookup), dequantizing only those rows.

    Args:
      w: QTensor or array ``[N, K]``.
      rows: int ``[...]`` row indices.
    Returns:
      float32 ``[..., K]``.
    """
    if not isinstance(w, QTensor):
        return jnp.asarray(w, jnp.float32)[rows]
    if len(w.shape) != 2:
        raise ValueError(f"take_rows needs a 2-D weight, got shape {w.shape}")
    flat = rows.reshape(-1)  # [R]
    # data is [N, row_bytes] for blocks, [N, K] for plain types: a row is data[i] either way.
    picked = w.data[flat]
    vals = dequantize(picked, w.qtype, (flat.shape[0], w.shape[1]))  # [R, K]
    return vals.reshape(*rows.shape, w.shape[1])
