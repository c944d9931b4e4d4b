"""SwiGLU experts of a MoE layer: the grouped reference path.

Contract: ``moe_swiglu(x, experts, weights, gate, up, down)`` returns
``sum_j weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n))`` with ``e = experts[n, j]``.
Only the chosen (token, expert) pairs are computed: the pairs are sorted by expert and each
projection is one ``jax.lax.ragged_dot_general`` over the expert groups (shapes are static,
so it jits for any config). The k expert outputs of a token are summed in routing order,
as llama.cpp's chain of ``ggml_add`` does.

Note: on the CPU backend XLA lowers ``ragged_dot`` to a masked dense product (E times the
FLOPs of the pairs). On the H200 (f32, HIGHEST) a 512-token prefill took ~99 ms a layer of the
30B shape, which fits that dense product too, not a grouped GEMM (docs/LOG.md, 2026-12-03).

Experts repacked for the Pallas kernels (``PackedWeight``) never take the reference path: the
MoE GEMV kernel while the pairs are few (decode: at most ``MOE_GEMV_MAX_PAIRS`` and under half
the experts; it reads only the chosen experts' bytes), else the grouped GEMM (prefill: pairs
sorted into whole tiles of one expert each, products on the tensor cores). Neither dequantizes
a weight outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..pallas.moe_gemm import moe_gemm, pick_gemm_config, plan_tiles, tiles_round_activations
from ..pallas.moe_gemv import moe_gemv, moe_gemv_many
from ..pallas.qgemv_q8 import moe_gemv_q8, moe_gemv_q8_many
from ..quant.repack import PackedWeight, repack_on_device
from .actquant import round_activations
from .norms import rms_norm
from .qmatmul import as_f32, interpret_kernels, takes_q8, weight_qtype

MOE_GEMV_MAX_PAIRS = 64
STREAM_MIN_TOKENS = 32  # steps of this many tokens stream a layer's host experts to the card (prefill)


def streams_host_experts(n_tokens: int) -> bool:
    """Does a step of ``n_tokens`` tokens (all sequences, padding included: a static shape)
    compute its host experts on the card from streamed weights (``placed_moe_swiglu``)?"""
    return n_tokens >= STREAM_MIN_TOKENS

HIGHEST = jax.lax.Precision.HIGHEST

# lhs [M, K] (rows grouped by expert) x rhs [E, N, K] (GGUF [out, in] per expert) -> [M, N]
_GROUPED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` with ``silu(x) = x / (1 + exp(-x))``."""
    return jax.nn.silu(gate) * up


def grouped_matmul(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of ``x_sorted`` times their group's weight.

    Args:
      x_sorted: float32 ``[M, K]``, rows ordered by group.
      w: float32 ``[E, N, K]``.
      group_sizes: int32 ``[E]``, summing to M.
    Returns:
      float32 ``[M, N]``.
    """
    return jax.lax.ragged_dot_general(x_sorted, w, group_sizes, _GROUPED_DN, precision=HIGHEST)


def takes_rounded_x(gate, n_tokens: int, k: int, act_rounding: str) -> bool:
    """:func:`moe_swiglu` on these experts runs the integer-dot decode GEMV, whose gate/up launch
    can read x already normed and rounded to Q8_1 blocks (its ``x8``, which the router's launch
    can leave: ``pallas.route.router_logits(..., rounded=True)``)."""
    return _takes_gemv(gate, n_tokens, k) and takes_q8(gate, act_rounding)


def _takes_gemv(gate, n_tokens: int, k: int) -> bool:
    return isinstance(gate, PackedWeight) and n_tokens * k <= min(MOE_GEMV_MAX_PAIRS, gate.shape[0] // 2)


def moe_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate, up, down,
               act_rounding: str = "none", precision: str = "tf32x3", norm: tuple | None = None,
               x8=None, tickets=None):
    """Weighted sum of the chosen SwiGLU experts of every token.

    Args:
      x: float32 ``[N, D]`` (N tokens); with ``norm``, before the norm.
      experts: int32 ``[N, k]`` chosen experts.
      weights: float32 ``[N, k]`` their weights.
      gate, up: QTensor or array ``[E, F, D]``; down: ``[E, D, F]`` (F expert hidden size).
      act_rounding: one of ``ops.actquant.ACT_ROUNDINGS`` (``"ggml-cuda"`` and ``"q8-decode"`` take the integer-dot
        GEMVs at decode on "ggml"-layout weights, which round x in the launch).
      precision: the grouped GEMM's tensor-core precision (``pallas.moe_gemm``; packed weights only).
      norm: None, or ``(weight [D], eps)``: the experts read ``ops.norms.rms_norm(x, weight, eps)``
        (the decode GEMV forms it in its gate/up launch; other paths first).
      x8: None, or the normed x as Q8_1 blocks (``ops.actquant.Q8Act`` of ``[N, D]``), which
        the integer-dot gate/up launch then reads in place of x and the norm
        (:func:`takes_rounded_x`); other paths ignore it.
      tickets: None, or a counter buffer (``pallas.tickets.new_tickets``): return x plus the
        output, and the tickets (the integer-dot down launch adds x and the weighted rows
        itself, in each row tile's last program; other paths add in XLA).
    Returns:
      float32 ``[N, D]``; with ``tickets``, ``(x + that, tickets)``.
    """
    N, k = experts.shape
    if _takes_gemv(gate, N, k):
        return _moe_swiglu_gemv(x, experts, weights, gate, up, down, act_rounding, norm, x8, tickets)
    if tickets is not None:
        return x + moe_swiglu(x, experts, weights, gate, up, down, act_rounding, precision, norm), tickets
    if norm is not None:
        x = rms_norm(x, *norm)
    if isinstance(gate, PackedWeight):
        config = pick_gemm_config(N * k, gate.shape[0], precision)
        return _moe_swiglu_gemm(x, experts, weights, gate, up, down, act_rounding, config)
    wg, wu, wd = as_f32(gate), as_f32(up), as_f32(down)
    n_exp = wg.shape[0]
    flat = experts.reshape(N * k)  # [P] pairs, token-major
    order = jnp.argsort(flat, stable=True)  # [P] pair ids grouped by expert
    group_sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)  # [E]
    x = x.astype(jnp.float32)
    rows = order // k  # [P] token of each sorted pair
    xg = round_activations(x, weight_qtype(gate), act_rounding)[rows]  # [P, D]
    xu = round_activations(x, weight_qtype(up), act_rounding)[rows]
    h = swiglu(grouped_matmul(xg, wg, group_sizes), grouped_matmul(xu, wu, group_sizes))  # [P, F]
    h = round_activations(h, weight_qtype(down), act_rounding)
    y = grouped_matmul(h, wd, group_sizes)  # [P, D]
    inv = jnp.argsort(order)  # [P]: sorted row of each token-major pair
    return _weighted_sum(y[inv].reshape(N, k, -1), weights)


def _weighted_sum(y: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum_j weights[n, j] * y[n, j]`` over ``y [N, k, D]``, added in routing order as
    llama.cpp's chain of ``ggml_add`` does."""
    y = y * weights[:, :, None]  # [N, k, D]
    out = y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + y[:, j]
    return out


def _moe_swiglu_gemv(x, experts, weights, gate, up, down, act_rounding, norm, x8, tickets):
    """:func:`moe_swiglu` for few pairs with the Pallas MoE GEMV (packed weights)."""
    N, k = experts.shape
    interpret = interpret_kernels()
    flat = experts.reshape(N * k)  # [P] pairs, token-major
    x = residual = x.astype(jnp.float32)
    # The gate/up kernels read each token's row for its k pairs (pairs_per_row): no [P, D] copy.
    q8 = takes_q8(gate, act_rounding)  # integer dot products on Q8_1 rows, rounded in the launches
    if act_rounding == "none" or q8:  # gate and up read the same x: one launch, the norm formed in it
        many, one = (moe_gemv_q8_many, moe_gemv_q8) if q8 else (moe_gemv_many, moe_gemv)
        kw = {} if norm is None else dict(norm=norm[0], eps=float(norm[1]))
        if q8 and x8 is not None:  # the router's launch normed and rounded x already
            x, kw = x8, {}
        if q8:  # gate/up's split-K partials [S, P, 2F], added where down reads them: no launch of their own
            kw["partials"] = True
        gu = many(x, (gate, up), flat, pairs_per_row=k, joined=True, **kw, interpret=interpret)  # [(S,) P, 2F]
        if q8 and tickets is not None:  # down adds the weighted rows to x itself: no launch of their own
            return one(gu, down, flat, swiglu_halves=True, combine=(weights, residual, tickets), interpret=interpret)
        y = one(gu, down, flat, swiglu_halves=True, interpret=interpret)  # swiglu formed where down reads it
        out = _weighted_sum(y.reshape(N, k, -1), weights)  # [N, k, D] -> [N, D]
        return out if tickets is None else (residual + out, tickets)
    if norm is not None:
        x = rms_norm(x, *norm)
    xg = round_activations(x, weight_qtype(gate), act_rounding)  # [N, D]
    xu = round_activations(x, weight_qtype(up), act_rounding)
    h = swiglu(moe_gemv(xg, gate, flat, pairs_per_row=k, interpret=interpret),
               moe_gemv(xu, up, flat, pairs_per_row=k, interpret=interpret))
    h = round_activations(h, weight_qtype(down), act_rounding)
    out = _weighted_sum(moe_gemv(h, down, flat, interpret=interpret).reshape(N, k, -1), weights)  # [N, k, D] -> [N, D]
    return out if tickets is None else (residual + out, tickets)


def _moe_swiglu_gemm(x, experts, weights, gate, up, down, act_rounding, config):
    """:func:`moe_swiglu` for many pairs with the Pallas grouped GEMM (packed weights), launched
    with ``config`` (``pallas.moe_gemm.GemmConfig``)."""
    N, k = experts.shape
    interpret = interpret_kernels()
    plan = plan_tiles(experts.reshape(N * k), gate.shape[0], config.block_m)
    tok = plan.rows // k  # [M] token of each tiled row
    x = x.astype(jnp.float32)
    if tiles_round_activations(config.precision, act_rounding):
        act_rounding = "none"  # the kernel rounds x itself
    xg = round_activations(x, weight_qtype(gate), act_rounding)[tok]  # [M, D]
    xu = round_activations(x, weight_qtype(up), act_rounding)[tok]
    gemm = functools.partial(moe_gemm, tile_experts=plan.tile_experts, config=config, interpret=interpret)
    h = swiglu(gemm(xg, gate), gemm(xu, up))  # [M, F]
    h = round_activations(h, weight_qtype(down), act_rounding)
    y = gemm(h, down)[plan.dest]  # [P, D] in pair (token-major) order
    return _weighted_sum(y.reshape(N, k, -1), weights)


def placed_moe_swiglu(x: jax.Array, experts: jax.Array, weights: jax.Array, gate, up, down,
                      act_rounding: str, placement, layer: int, precision: str = "tf32x3",
                      norm: tuple | None = None, card=None, x8=None, tickets=None):
    """:func:`moe_swiglu` with each expert computed where ``placement`` puts it.

    Card experts run on their slots of the layer's card buffers (``gate``/``up``/``down`` hold
    ``n_slots`` experts); host experts go through ``placement.host`` in one call for the layer,
    made only when a pair of the step has its expert on the host. A bridge that overlaps
    (``overlap``) makes that call in two halves around the card's experts, which then run while
    the host works.
    The card part gives host pairs weight 0 (their slot index is clamped to 0), so shapes never
    depend on the placement.

    Prefill streaming: a step of at least ``STREAM_MIN_TOKENS`` tokens (static: its shape says
    so) does not run a layer's host experts on the host; it takes the layer's whole expert
    tensors from the host (``HostBridge.stream``, copied to the card) and computes every pair
    on the card, where many tokens per expert make the product compute-bound. Decode steps
    keep the host kernels, which read each chosen expert once.

    Args:
      x: float32 ``[N, D]``; experts int32 ``[N, k]``; weights float32 ``[N, k]``.
      gate, up, down: the layer's card expert buffers ``[n_slots, F, D]`` / ``[n_slots, D, F]``.
      placement: ``placement.Placement`` or None (every expert on the card, slot = expert id).
      layer: this layer's index in ``placement.slot_of``.
      precision, norm: as for :func:`moe_swiglu` (the host and the streamed experts read the
        normed x, formed first).
      card: the routing's card slots and weights where the router already looked them up in
        ``placement`` (``pallas.route.CardRoute``); None: looked up here.
      x8: as for :func:`moe_swiglu`: the card's experts may read it.
      tickets: as for :func:`moe_swiglu` (x plus the output; the host's share is added after
        the card's).
    Returns:
      float32 ``[N, D]``; with ``tickets``, ``(x + that, tickets)``.
    """
    if placement is None:
        return moe_swiglu(x, experts, weights, gate, up, down, act_rounding, precision, norm, x8, tickets)
    host = placement.host if placement.host is not None and placement.host.has_layer(layer) else None
    card_x, card_norm = x, norm  # the card's kernels may form the norm themselves
    if norm is not None:
        x = rms_norm(x, *norm)
    if host is not None and streams_host_experts(x.shape[0]):
        full = [host.stream(layer, role) for role in ("gate", "up", "down")]  # QTensor [E, ...] each
        if isinstance(gate, PackedWeight):  # the kernels read the card buffers' layout: repack on the card
            full = [repack_on_device(q.data, q.qtype, q.shape, layout=gate.layout) for q in full]
        out = moe_swiglu(x, experts, weights, *full, act_rounding, precision)
        return out if tickets is None else (card_x + out, tickets)
    slot_of = placement.slot_of[layer]  # [E]
    if card is None:
        slots = slot_of[experts]  # [N, k]
        card_slots, card_weights = jnp.where(slots >= 0, slots, 0), jnp.where(slots >= 0, weights, 0.0)
    else:
        card_slots, card_weights = card
    out = jnp.zeros(x.shape, jnp.float32) if tickets is None else card_x  # what the host's share adds to
    on_host = slot_of < 0  # [E]
    card_moe = functools.partial(moe_swiglu, experts=card_slots, weights=card_weights, gate=gate, up=up, down=down,
                                 act_rounding=act_rounding, precision=precision, norm=card_norm, tickets=tickets)
    if host is not None and host.overlap and gate.shape[0]:
        started = host.moe_start(layer, x, experts, weights, on_host)
        # The barrier makes the card's input wait for the start, and the finish takes the card's
        # output, so the card's experts are queued between the halves and run while the host works.
        started, card_x, x8 = jax.lax.optimization_barrier((started, card_x, x8))
        out = card_moe(card_x, x8=x8)
        if tickets is not None:
            out, tickets = out
        out = out + host.moe_finish(layer, started, out)
        return out if tickets is None else (out, tickets)
    if gate.shape[0]:  # the layer has card slots
        out = card_moe(card_x, x8=x8)
        if tickets is not None:
            out, tickets = out
    if host is not None:
        if host.skip_empty_calls:
            # a step whose pairs are all on the card skips the round trip (~200 us on the H200);
            # the branch costs a predicate read, which the callback would have synchronised anyway
            out = out + jax.lax.cond(jnp.any(on_host[experts]), lambda: host.moe(layer, x, experts, weights, on_host),
                                     lambda: jnp.zeros(x.shape, jnp.float32))
        else:
            out = out + host.moe(layer, x, experts, weights, on_host)
    return out if tickets is None else (out, tickets)
