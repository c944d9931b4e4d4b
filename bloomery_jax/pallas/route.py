"""Softmax top-k routing in one kernel: what ``ops.routing.route_topk`` computes with a softmax,
a sort and a gather (three to four kernels a layer on the GPU).

Contract: ``route_topk(router_logits [N, E], k) -> (experts int32 [N, k], weights float32 [N, k],
margin float32 [N])``, as ``ops.routing.route_topk``: the k experts of largest logit, best
first (equal logits: the lower id first, as ``jax.lax.top_k``); their softmax probabilities
divided by their sum (clamped below at ``WEIGHT_SUM_MIN``); the k-th minus the (k+1)-th largest
logit (+inf when k == E). The softmax is monotonic, so ranking logits ranks probabilities; the
reference ranks the rounded probabilities, so two logits within a rounding of each other may be
ordered differently (a near-tie, which ``margin`` flags). Weights match to a few ulps (the sums
run in another order).

With ``slot_table`` (``placement.Placement.slot_of``, int32 ``[L, E]``, -1 = host) and ``layer``
it also returns what the card's expert kernels read, ``CardRoute(slots, weights)``: each pick's
card slot (0 where the expert is on the host) and its weight (0 there), which the step otherwise
forms in a kernel of its own (``ops.experts.placed_moe_swiglu``'s lookup).

How: a Pallas kernel (Triton lowering) per block of tokens holds the block's logits (experts
padded to a power of two with -inf), takes the maximum and the sum of exponentials, then picks
k + 1 times the largest remaining logit and masks it out.

``router_logits(x, norm, eps, w)`` gives the logits a decode step routes by,
``rms_norm(x, norm, eps) @ w.T``, in one launch: on the GPU the norm's reduction, its multiply
and the router's product were three XLA kernels a layer (~4.9 us of a ~84 us layer on the H100,
benchmarks/gpu_2026-12-05-s16/trace). Program j forms the normed rows of x itself
(``qgemv._NormedRows``: ggml's order of operations) and the logits of experts
``j*block_e ..`` by walking D in chunks. With ``rounded=True`` it also rounds the normed rows to
Q8_1 blocks (``ops.actquant.Q8Act``, what the experts' integer-dot gate/up launch reads) in
programs of their own after the logits' (up to ``ROUND_BLOCKS`` blocks each), which run beside
them: the gate/up launch would norm and round them again in each of its hundreds of programs.
With ``route_k`` the logit program that finishes last (``pallas.tickets``) also routes every
row as ``route_topk`` does (the same code on the logits the launch stored), so a decode step has
no top-k launch: the same experts, slots and margins; weights to a few ulps, its softmax's sums
running over the launch's warps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..ops.actquant import Q8Act
from ..ops.routing import WEIGHT_SUM_MIN
from .qgemv import _NormedRows
from .qgemv_q8 import round_blocks
from .tickets import TICKETS, read_shared, when_last

F32 = jnp.float32
LOGITS_MAX_ROWS = 8  # rows of x router_logits unrolls (a decode step's tokens)
# router_logits' launch: experts a program and warps (none better at 1-8 of each on an H100,
# benchmarks/gpu_2026-12-07-s29/call1)
LOGITS_BLOCK_E, LOGITS_WARPS = 4, 4
LOGITS_CHUNK = 256  # router_logits walks D in chunks of at most this many columns
ROUND_BLOCKS = 64  # Q8_1 blocks a rounding program of router_logits(..., rounded=True) rounds at most
__all__ = ["CardRoute", "RouterOut", "route_topk", "router_logits", "router_logits_rounds", "router_logits_routes",
           "router_logits_serves"]


class CardRoute(NamedTuple):
    """The card's share of a routing: per pick, its expert's card slot (0 for a host expert) and
    its weight (0 for a host expert), so a host pair adds nothing on the card."""

    slots: jax.Array  # int32 [N, k]
    weights: jax.Array  # float32 [N, k]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Picks(NamedTuple):
    """A block of tokens' routing as the kernels write it ([TN, Kp], k of the Kp columns used)."""

    experts: jax.Array  # int32 [TN, Kp]
    weights: jax.Array  # float32 [TN, Kp]
    margin: jax.Array  # float32 [TN]
    slots: jax.Array | None  # int32 [TN, Kp] card slots, 0 for host experts (with a table)
    card_weights: jax.Array | None  # float32 [TN, Kp], 0 for host experts (with a table)


def _choose(logits: jax.Array, k: int, n_exp: int, kp: int, table: jax.Array | None) -> _Picks:
    """Top-k routing of ``logits [TN, Ep]`` (padding -inf) in a kernel (module docstring); with
    ``table [1, Ep]`` (the layer's card slots, padding -1) also the picks' card slots."""
    tn, ep = logits.shape
    ids = jax.lax.broadcasted_iota(jnp.int32, (tn, ep), 1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (tn, kp), 1)
    top = jnp.max(logits, axis=1)  # [TN]
    z = jnp.sum(jnp.exp(logits - top[:, None]), axis=1)  # [TN] softmax denominator
    experts = jnp.zeros((tn, kp), jnp.int32)
    probs = jnp.zeros((tn, kp), F32)
    total = jnp.zeros((tn,), F32)
    remaining, last = logits, top
    slots = jnp.zeros((tn, kp), jnp.int32)
    for j in range(k):
        best = jnp.max(remaining, axis=1)  # [TN]
        pick = jnp.min(jnp.where(remaining == best[:, None], ids, ep), axis=1)  # lowest id among equals
        p = jnp.exp(best - top) / z
        experts = jnp.where(slot == j, pick[:, None], experts)
        if table is not None:  # the pick's card slot, -1 = host
            slots = jnp.where(slot == j, jnp.max(jnp.where(ids == pick[:, None], table, -1), axis=1)[:, None], slots)
        probs = jnp.where(slot == j, p[:, None], probs)
        total = total + p
        remaining = jnp.where(ids == pick[:, None], -jnp.inf, remaining)
        last = best
    weights = probs / jnp.maximum(total, WEIGHT_SUM_MIN)[:, None]
    margin = last - jnp.max(remaining, axis=1) if k < n_exp else jnp.full((tn,), jnp.inf, F32)
    if table is None:
        return _Picks(experts, weights, margin, None, None)
    return _Picks(experts, weights, margin, jnp.maximum(slots, 0), jnp.where(slots >= 0, weights, 0.0))


def _store_picks(picks: _Picks, refs) -> None:
    """Write ``picks`` to its refs (experts, weights, margin, and with a table slots and card weights)."""
    for ref, value in zip(refs, picks):
        ref[...] = value


def _kernel(l_ref, *refs, k: int, n_exp: int, placed: bool):
    # l_ref [TN, Ep] logits (padding -inf); placed: t_ref [1, Ep] the layer's slots (padding -1);
    # then the _Picks' refs ([TN, Kp] and m_ref [TN])
    table = refs[0][...] if placed else None
    outs = refs[1:] if placed else refs
    _store_picks(_choose(l_ref[...].astype(F32), k, n_exp, outs[0].shape[1], table), outs)


@functools.partial(jax.jit, static_argnames=("k", "layer", "block_tokens", "interpret"))
def route_topk(router_logits: jax.Array, k: int, slot_table: jax.Array | None = None, layer: int = 0, *,
               block_tokens: int = 16, interpret: bool = False):
    """Choose k experts per token (module docstring).

    Args:
      router_logits: float ``[N, E]``.
      k: experts per token, ``0 < k <= E``.
      slot_table: int32 ``[L, E]`` card slot of each expert, -1 = host; None: no CardRoute.
      layer: the row of ``slot_table`` this routing is for (static).
      block_tokens: tokens per program (rounded to a power of two, at most N's).
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      experts int32 ``[N, k]``, weights float32 ``[N, k]``, margin float32 ``[N]``; with
      ``slot_table`` also a :class:`CardRoute` of ``[N, k]`` arrays.
    """
    N, E = router_logits.shape
    if not 0 < k <= E:
        raise ValueError(f"cannot route to {k} of {E} experts")
    placed = slot_table is not None
    if placed and (slot_table.ndim != 2 or slot_table.shape[1] != E or not 0 <= layer < slot_table.shape[0]):
        raise ValueError(f"route_topk: slot_table must be [L, {E}] with layer in [0, L), got {slot_table.shape} "
                         f"and layer {layer}")
    tn = min(_pow2(block_tokens), _pow2(N))
    n_pad = pl.cdiv(N, tn) * tn
    ep, kp = _pow2(E), _pow2(k)
    logits = jnp.pad(router_logits.astype(F32), ((0, n_pad - N), (0, ep - E)), constant_values=-jnp.inf)
    logits = logits.at[N:].set(0.0)  # padding tokens: finite, discarded
    rows = lambda width: pl.BlockSpec((tn, width), lambda i: (i, 0))
    pick_shapes = (jax.ShapeDtypeStruct((n_pad, kp), jnp.int32), jax.ShapeDtypeStruct((n_pad, kp), F32))
    out_shape = (*pick_shapes, jax.ShapeDtypeStruct((n_pad,), F32)) + (pick_shapes if placed else ())
    out_specs = (rows(kp), rows(kp), pl.BlockSpec((tn,), lambda i: (i,))) + ((rows(kp), rows(kp)) if placed else ())
    operands, in_specs = [logits], [rows(ep)]
    if placed:  # the whole table goes in (a slice of it would be a copy kernel of its own); one row is read
        table = slot_table.astype(jnp.int32)
        if ep != E:
            table = jnp.pad(table, ((0, 0), (0, ep - E)), constant_values=-1)
        operands.append(table)
        in_specs.append(pl.BlockSpec((1, ep), lambda i: (layer, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, k=k, n_exp=E, placed=placed),
        out_shape=out_shape,
        grid=(n_pad // tn,),
        in_specs=in_specs,
        out_specs=out_specs,
        # a decode step's one or two rows of 128 logits fit one warp: its k + 1 rounds of max and
        # min reduce by shuffles, with no shared-memory round trip between warps
        compiler_params=plgpu.CompilerParams(num_warps=1 if tn * ep <= 256 else 4, num_stages=1),
        interpret=interpret,
        name="route_topk",
    )(*operands)
    experts, weights, margin = out[0][:N, :k], out[1][:N, :k], out[2][:N]
    if not placed:
        return experts, weights, margin
    return experts, weights, margin, CardRoute(out[3][:N, :k], out[4][:N, :k])


def _logits_chunk(d: int, largest: int = 256) -> int:
    """The D chunk router_logits walks: the largest power of two <= ``largest`` dividing D (0: none >= 16)."""
    c = largest
    while c >= 16 and d % c:
        c //= 2
    return c if c >= 16 else 0


def router_logits_serves(n_rows: int, w) -> bool:
    """``router_logits`` takes these: at most LOGITS_MAX_ROWS rows, a float32 ``[E, D]`` router
    weight held as a plain array, E a multiple of 4 and D of 16."""
    return (1 <= n_rows <= LOGITS_MAX_ROWS and isinstance(w, jax.Array) and w.dtype == F32 and w.ndim == 2
            and w.shape[0] % 4 == 0 and _logits_chunk(w.shape[1]) > 0)


def router_logits_rounds(x_shape: tuple, w) -> bool:
    """``router_logits(..., rounded=True)`` takes x of this shape and this router weight: rows of
    whole Q8_1 blocks."""
    return router_logits_serves(x_shape[0], w) and w.shape[1] % 32 == 0


def router_logits_routes(n_rows: int, w, k: int) -> bool:
    """``router_logits(..., route_k=k)`` takes these: E a power of two (the last program holds a
    row's logits as one tensor), ``0 < k <= E``."""
    return router_logits_serves(n_rows, w) and w.shape[0] == _pow2(w.shape[0]) and 0 < k <= w.shape[0]


class RouterOut(NamedTuple):
    """``router_logits``' results beyond the logits; a field not asked for is None."""

    logits: jax.Array  # float32 [N, E]
    x8: Q8Act | None  # rounded: the normed rows as Q8_1 blocks
    route: tuple | None  # route_k: route_topk's (experts, weights, margin[, CardRoute])
    tickets: jax.Array | None  # route_k: the counter buffer, back at 0


@dataclasses.dataclass(frozen=True)
class _Launch:
    """What a router_logits launch holds besides x, the norm and the router (static)."""

    logit_programs: int
    bpp: int  # Q8_1 blocks a rounding program takes (0: rounded is off)
    k: int  # experts a token the last logit program routes to (0: none)
    n_exp: int
    placed: bool

    def unpack(self, refs):
        """The kernel's refs by name (None where the launch has none)."""
        refs = list(refs)
        take = lambda on: refs.pop(0) if on else None  # noqa: E731
        r = dict(x=take(True), norm=take(True), w=take(True), xb=take(self.bpp), nb=take(self.bpp),
                 table=take(self.placed))
        take(self.k)  # the tickets' input: the same buffer as their output
        r.update(logits=take(True), qs=take(self.bpp), d=take(self.bpp), sums=take(self.bpp))
        r["picks"] = [take(self.k) for _ in range(5 if self.placed else 3)] if self.k else None
        r["tickets"] = take(self.k)
        return r


def _logits_kernel(*refs, lay: _Launch, eps: float, chunk: int, interpret: bool):
    # x [N, D] rows of x; norm [D]; w [BE, D] router rows; xb [N, D/32, 32], nb [D/32, 32]: x and
    # the norm as blocks; table [1, E] the layer's card slots. Out: logits [N, BE] ([N, E] with
    # route_k); the Q8Act's qs [N, D/32, 8], d [N, D/32] and sums [N, D/32, 2]; the _Picks'
    # refs; the tickets [TICKETS]
    r = lay.unpack(refs)
    n_rows, d = r["x"].shape
    xn = _NormedRows(r["x"], r["norm"], eps, n_rows)
    j = pl.program_id(0)

    def logit_program():
        be = r["w"].shape[0]
        cols = pl.ds(pl.multiple_of(j * be, be), be) if lay.k else slice(None)  # a whole [N, E] block with route_k
        _logits(xn, r["w"], r["logits"], cols, n_rows, d, chunk)
        if lay.k:
            _route_when_last(r, lay, n_rows, interpret)

    if not lay.bpp:
        logit_program()
        return
    pl.when(j < lay.logit_programs)(logit_program)

    @pl.when(j >= lay.logit_programs)  # the programs after the logits' round the normed rows beside them
    def _():
        blocks = pl.ds(pl.multiple_of((j - lay.logit_programs) * lay.bpp, lay.bpp), lay.bpp)
        half = jax.lax.broadcasted_iota(jnp.int32, (lay.bpp, 2), 1)
        for b in range(n_rows):
            q = round_blocks(xn.on(r["xb"], r["nb"]), b, blocks, interpret)
            r["qs"][b, blocks, :] = q.words
            r["d"][b, blocks] = jnp.max(q.d, axis=1)  # [bpp]: the same value in each of a block's words
            r["sums"][b, blocks, :] = jnp.where(half == 0, q.lo, q.hi)


def _logits(xn, w_ref, o_ref, cols, n_rows: int, d: int, chunk: int) -> None:
    """This program's logits (columns ``cols`` of o_ref): its router rows times the normed rows,
    walking D in chunks."""
    be = w_ref.shape[0]

    def step(c, accs):
        ks = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        w = w_ref[:, ks]  # [BE, chunk]
        return tuple(acc + w * xn[b, ks][None, :] for b, acc in enumerate(accs))

    accs = jax.lax.fori_loop(0, d // chunk, step, tuple(jnp.zeros((be, chunk), F32) for _ in range(n_rows)))
    for b, acc in enumerate(accs):
        o_ref[b, cols] = jnp.sum(acc, axis=1)


def _route_when_last(r, lay: _Launch, n_rows: int, interpret: bool) -> None:
    """The logit program that finishes last (``tickets``: counter 0) routes every row."""

    @when_last(r["tickets"], 0, lay.logit_programs, interpret)
    def _():
        table = None if r["table"] is None else r["table"][...]  # [1, E]
        for b in range(n_rows):
            logits = read_shared(r["logits"].at[pl.ds(b, 1), :])  # [1, E]
            picks = _choose(logits, lay.k, lay.n_exp, r["picks"][0].shape[1], table)
            _store_picks(picks, [ref.at[pl.ds(b, 1)] for ref in r["picks"]])


@functools.partial(jax.jit, static_argnames=("eps", "route_k", "layer", "block_e", "num_warps", "chunk", "rounded",
                                             "interpret"))
def router_logits(x: jax.Array, norm: jax.Array, eps: float, w: jax.Array, *, rounded: bool = False,
                  route_k: int = 0, slot_table: jax.Array | None = None, layer: int = 0,
                  tickets: jax.Array | None = None, block_e: int = LOGITS_BLOCK_E, num_warps: int = LOGITS_WARPS,
                  chunk: int = LOGITS_CHUNK, interpret: bool = False):
    """``ops.norms.rms_norm(x, norm, eps) @ w.T`` in one launch (module docstring).

    Each logit sums D products in chunks of ``c`` columns (one accumulator element a column),
    then the chunk's columns: the sum order differs from a plain dot, so logits agree to
    ~(D / c + c) * 2^-24 * sum_d |xn_d w_d|, and the normed row to a few ulps (c: the largest
    power of two <= ``chunk`` dividing D).

    Args:
      x: float ``[N, D]``, N <= LOGITS_MAX_ROWS.
      norm: float ``[D]``, the RMS-norm weight; eps its epsilon.
      w: float32 ``[E, D]``, the router weight (``router_logits_serves``).
      rounded: also return the normed rows as Q8_1 blocks (``router_logits_rounds`` says
        whether a shape allows it): ``ops.actquant.quantize_q8_1(rms_norm(x, norm, eps))``, up
        to the normed row's last bits (a quant where a value lies within them of a rounding half).
      route_k: > 0: also route each row to its ``route_k`` experts as ``route_topk`` does
        (``router_logits_routes``), in the program that finishes its logits last.
      slot_table, layer: with route_k, as for ``route_topk`` (a CardRoute too).
      tickets: with route_k, a counter buffer (``tickets.new_tickets``), returned at 0 again.
      block_e: experts a program (a power of two dividing E; lowered until it does).
      num_warps: warps a program.
      chunk: columns a loop step reads at most (D itself: the program's rows in one read).
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      float32 ``[N, E]``; with ``rounded`` or ``route_k`` a :class:`RouterOut`.
    """
    if x.ndim != 2 or not router_logits_serves(x.shape[0], w) or w.shape[1] != x.shape[1] or norm.shape != (x.shape[1],):
        raise ValueError(f"router_logits: needs x [N<={LOGITS_MAX_ROWS}, D], norm [D] and a float32 router "
                         f"[E, D] (E a multiple of 4, D of 16), got {x.shape}, {norm.shape} and {w.shape} {w.dtype}")
    n_rows, d = x.shape
    n_exp = w.shape[0]
    while n_exp % block_e:
        block_e //= 2
    if rounded and not router_logits_rounds(x.shape, w):  # serves() held above
        raise ValueError(f"router_logits: rows of {d} are not Q8_1 blocks of 32 (router_logits_rounds)")
    placed = slot_table is not None
    if route_k and not (router_logits_routes(n_rows, w, route_k) and tickets is not None and tickets.shape == (TICKETS,)):
        raise ValueError(f"router_logits: routing to {route_k} of {n_exp} experts needs E a power of two, "
                         f"0 < k <= E and tickets (new_tickets), got {None if tickets is None else tickets.shape}")
    if placed and not (route_k and slot_table.ndim == 2 and slot_table.shape[1] == n_exp
                       and 0 <= layer < slot_table.shape[0]):
        raise ValueError(f"router_logits: slot_table must be [L, {n_exp}] with layer in [0, L), and route_k > 0, "
                         f"got {slot_table.shape}, layer {layer}, route_k {route_k}")
    programs = n_exp // block_e
    nb = d // 32
    bpp = min(nb & -nb, ROUND_BLOCKS) if rounded else 0  # a power of two dividing the blocks
    lay = _Launch(programs, bpp, route_k, n_exp, placed)
    last = programs - 1  # the rounding programs' (unused) router and logit blocks
    whole = lambda *shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    x32, n32 = x.astype(F32), norm.astype(F32)
    operands = [x32, n32, w]
    in_specs = [whole(n_rows, d), whole(d), pl.BlockSpec((block_e, d), lambda j: (jnp.minimum(j, last), 0))]
    if bpp:  # x and the norm again as [D/32, 32] blocks, which the rounding programs take in turn
        operands += [x32.reshape(n_rows, nb, 32), n32.reshape(nb, 32)]
        in_specs += [whole(n_rows, nb, 32), whole(nb, 32)]
    if placed:  # the whole table goes in; one row is read
        operands.append(slot_table.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((1, n_exp), lambda j: (layer, 0)))
    tickets_in = len(operands)  # with route_k: the tickets' input, aliased to the last output
    if route_k:
        operands.append(tickets)
        in_specs.append(whole(TICKETS))
    out_shape = [jax.ShapeDtypeStruct((n_rows, n_exp), F32)]
    out_specs = [whole(n_rows, n_exp) if route_k else pl.BlockSpec((n_rows, block_e), lambda j: (0, jnp.minimum(j, last)))]
    if rounded:  # each rounding program writes its blocks of the whole Q8Act
        out_shape += [jax.ShapeDtypeStruct((n_rows, nb, 8), jnp.int32), jax.ShapeDtypeStruct((n_rows, nb), F32),
                      jax.ShapeDtypeStruct((n_rows, nb, 2), jnp.int32)]
        out_specs += [whole(n_rows, nb, 8), whole(n_rows, nb), whole(n_rows, nb, 2)]
    if route_k:
        kp = _pow2(route_k)
        picks = [(jnp.int32, (n_rows, kp)), (F32, (n_rows, kp)), (F32, (n_rows,))]
        picks += [(jnp.int32, (n_rows, kp)), (F32, (n_rows, kp))] if placed else []
        out_shape += [jax.ShapeDtypeStruct(shape, dt) for dt, shape in picks] + [jax.ShapeDtypeStruct((TICKETS,), jnp.int32)]
        out_specs += [whole(*shape) for _, shape in picks] + [whole(TICKETS)]
    out = pl.pallas_call(
        functools.partial(_logits_kernel, lay=lay, eps=float(eps), chunk=_logits_chunk(d, chunk), interpret=interpret),
        out_shape=out_shape,
        grid=(programs + (nb // bpp if bpp else 0),),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases={tickets_in: len(out_shape) - 1} if route_k else {},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="router_logits",
    )(*operands)
    if not (rounded or route_k):
        return out[0]
    out = list(out)
    logits = out.pop(0)
    x8 = Q8Act(out.pop(0).reshape(n_rows, d // 4), out.pop(0), out.pop(0).reshape(n_rows, d // 16)) if rounded else None
    route, new = None, None
    if route_k:
        experts, weights, margin = out[0][:, :route_k], out[1][:, :route_k], out[2]
        route = (experts, weights, margin) + ((CardRoute(out[3][:, :route_k], out[4][:, :route_k]),) if placed else ())
        new = out[-1]
    return RouterOut(logits, x8, route, new)
