"""Decode attention in one launch: the queries and the new key formed in it, its splits combined
in its last programs.

Contract: ``decode_attention_prepped(qkv [P, B, (Hq + 2 Hkv) Dh], q_norm, k_norm, cos, sin,
cache_k [L, N, S, Hkv, Dh], cache_v, lengths [B], layer, start, positions [B], tickets, scale=,
eps=) -> (float32 [B, Hq, Dh], cache_k', cache_v', tickets)`` is ``attn_prep.decode_qk_prep``
followed by ``attention.cache_decode_attention`` on its queries and caches: the same caches
(bit for bit), and the same attention up to the order of its sums (f32 throughout).

Why: a decode layer's attention is three launches in the ``pallas`` form, the q/k prep (1.9 us
a layer on the H100, thirtieth session's profile), the split kernel (4.3 us) and XLA's combine
of the splits (~1.1 us), and the step is bound by launches, not bytes.

How: the split kernel's grid ``(B, Hq, splits)``, one query head a program.
- Each program with slots to see adds up its head's partial sums of q, norms and rotates it
  (``attn_prep``'s code) and walks its share of the cached slots *before* the step's own
  (``attention``'s online softmax, by head halves: the rotation's pairs). A short row leaves most
  splits nothing to see; they store an empty share and form no query.
- The step's own key and value never come back from the cache: the programs of split 0 form
  them from the partial sums (k normed and rotated, both rounded to the cache's dtype as the
  cache would hold them) and add that slot to their share, and the one of a kv head's first
  query head stores them in the cache. No program of the launch reads that slot from the cache,
  so no program waits on the store.
- Every program stores its split's running max, sum and weighted values, then takes a ticket
  (``pallas.tickets``, one counter per query head); the last of a head's splits combines them as
  ``attention.decode_attention`` does in jnp after its launch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .attention import default_splits, softmax_step
from .attn_prep import check_prep, head_halves, normed_rotated
from .qgemv_q8 import _div_rn
from .tickets import TICKETS, read_shared, when_last

F32 = jnp.float32
__all__ = ["cache_attend_prepped", "decode_attention_prepped"]


def _kernel(start_ref, pos_ref, len_ref, qkv_ref, qn_ref, kn_ref, cos_ref, sin_ref, ck_in, cv_in, tk_in,
            ck_ref, cv_ref, tk_ref, out_ref, m_ref, l_ref, o_ref, *, groups: int, n_kv: int, layer: int,
            n_rows: int, n_slots: int, block_s: int, splits: int, scale: float, eps: float, interpret: bool):
    # start_ref [1]; pos_ref, len_ref [1]: this sequence's position and filled length; qkv_ref
    # [P, (Hq + 2 Hkv) Dh] its partial sums; qn_ref, kn_ref [Dh]; cos_ref, sin_ref [Dh/2];
    # ck_ref, cv_ref [L*N, S, Hkv, Dh] and tk_ref [TICKETS] (aliased to ck_in, cv_in, tk_in);
    # out_ref [B, Hq, Dh]; m_ref, l_ref [B, Hq, splits], o_ref [B, Hq, splits, Dh]: the splits' partials
    del ck_in, cv_in, tk_in  # the same buffers as ck_ref, cv_ref, tk_ref
    half = cos_ref.shape[0]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # read outside pl.when (interpreter)
    parts = (pl.ds(0, half), pl.ds(half, half))
    kv = h // groups
    cos, sin = cos_ref[...].astype(F32), sin_ref[...].astype(F32)
    halves = functools.partial(head_halves, qkv_ref, half)

    pos, length = pos_ref[0], len_ref[0]
    stored = (pos >= 0) & (pos < n_slots)  # padding positions store and see nothing
    sees_own = stored & (pos < length)  # the step's own slot is visible
    own = sees_own & (j == 0)  # this split adds it
    visible = jnp.where(stored, jnp.minimum(pos + 1, length), 0)
    cached = visible - sees_own.astype(jnp.int32)  # slots read from the cache: before the own slot
    row = layer * n_rows + start_ref[0] + b
    share = (cached + splits * block_s - 1) // (splits * block_s)  # blocks each split walks (at most)
    first = j * share * block_s
    n_blocks = jnp.clip((cached - first + block_s - 1) // block_s, 0, share)

    def own_slot():
        """The step's own key and value (two [Dh/2] halves each), as the cache holds them."""
        key = normed_rotated(*halves(groups * n_kv + kv), kn_ref, cos, sin, eps)
        return [x.astype(ck_ref.dtype) for x in key], [x.astype(cv_ref.dtype) for x in halves((groups + 1) * n_kv + kv)]

    def store_split(m, l, accs):
        plgpu.store(m_ref.at[b, h, pl.ds(j, 1)], jnp.full((1,), m, F32))
        plgpu.store(l_ref.at[b, h, pl.ds(j, 1)], jnp.full((1,), l, F32))
        for p, acc in zip(parts, accs):
            plgpu.store(o_ref.at[b, h, j, p], acc)

    init = (jnp.full((), -jnp.inf, F32), jnp.zeros((), F32), (jnp.zeros((half,), F32),) * 2)
    busy = (n_blocks > 0) | own

    @pl.when(~busy)  # short rows leave most splits nothing to see: no query formed
    def _():
        store_split(*init)

    @pl.when(busy)
    def _():
        q = [part * scale for part in normed_rotated(*halves(h), qn_ref, cos, sin, eps)]  # 2 x [Dh/2]

        def body(i, carry):
            m, l, accs = carry
            at = first + i * block_s
            valid = at + jnp.arange(block_s) < cached  # [BS]
            k, v = ([plgpu.load(ref.at[row, pl.ds(at, block_s), kv, p], mask=valid[:, None], other=0.0).astype(F32)
                     for p in parts] for ref in (ck_ref, cv_ref))  # [BS, Dh/2] halves
            s = jnp.where(valid, jnp.sum(k[0] * q[0][None, :], axis=1) + jnp.sum(k[1] * q[1][None, :], axis=1),
                          -jnp.inf)
            return softmax_step(m, l, accs, s, v)

        m, l, accs = jax.lax.fori_loop(0, n_blocks, body, init)

        @pl.when(~own)
        def _():
            store_split(m, l, accs)

        @pl.when(own)
        def _():
            key, value = own_slot()
            s = jnp.sum(key[0].astype(F32) * q[0]) + jnp.sum(key[1].astype(F32) * q[1])
            store_split(*softmax_step(m, l, accs, jnp.full((1,), s, F32), [x.astype(F32)[None, :] for x in value]))

    @pl.when((j == 0) & stored & (h % groups == 0))  # one program a kv head stores its key and value
    def _():
        for ref, halves_ in zip((ck_ref, cv_ref), own_slot()):
            for p, x in zip(parts, halves_):
                plgpu.store(ref.at[row, pos, kv, p], x)

    @when_last(tk_ref, b * pl.num_programs(1) + h, splits, interpret)
    def _():  # the head's splits rescaled to their common max, as attention.decode_attention's combine
        ms = [jnp.sum(read_shared(m_ref.at[b, h, pl.ds(t, 1)])) for t in range(splits)]
        ls = [jnp.sum(read_shared(l_ref.at[b, h, pl.ds(t, 1)])) for t in range(splits)]
        os = [[read_shared(o_ref.at[b, h, jnp.int32(t), p]) for p in parts] for t in range(splits)]  # [Dh/2] halves
        m_all = functools.reduce(jnp.maximum, ms)
        ws = [jnp.where(l_t > 0, jnp.exp(m_t - m_all), 0.0) for m_t, l_t in zip(ms, ls)]  # empty splits: 0
        den = functools.reduce(jnp.add, [l_t * w for l_t, w in zip(ls, ws)])
        safe = jnp.full((half,), jnp.where(den > 0, den, 1.0), F32)
        for i, p in enumerate(parts):
            num = functools.reduce(jnp.add, [o[i] * w for o, w in zip(os, ws)])  # [Dh/2]
            plgpu.store(out_ref.at[b, h, p], jnp.where(den > 0, _div_rn(num, safe, interpret), 0.0))


@functools.partial(jax.jit, static_argnames=("layer", "scale", "eps", "block_s", "splits", "num_warps", "interpret"),
                   donate_argnames=("cache_k", "cache_v", "tickets"))
def decode_attention_prepped(qkv: jax.Array, q_norm: jax.Array, k_norm: jax.Array, cos: jax.Array, sin: jax.Array,
                             cache_k: jax.Array, cache_v: jax.Array, lengths: jax.Array, layer: int, start,
                             positions: jax.Array, tickets: jax.Array, *, scale: float, eps: float, block_s: int = 64,
                             splits: int | None = None, num_warps: int = 4, interpret: bool = False):
    """One decode token a sequence: its attention output, and the caches holding its key and value.

    Args:
      qkv, q_norm, k_norm, cos, sin, cache_k, cache_v, layer, start, positions, eps: as for
        ``attn_prep.decode_qk_prep`` (caches donated).
      lengths: int32 ``[B]``: the sequences' filled slots after this step's writes (the cache's
        ``lengths``); query b sees slots ``s <= positions[b]`` and ``s < lengths[b]``.
      tickets: the step's counter buffer (``tickets.new_tickets``; donated), returned at 0 again.
      scale: multiplies the scores.
      block_s, splits, num_warps: as for ``attention.decode_attention``.
      interpret: run with the Pallas interpreter (CPU tests).
    Returns:
      (float32 ``[B, Hq, Dh]``, cache_k, cache_v, tickets).
    """
    L, N, S, Hkv, Dh = cache_k.shape
    name = "decode_attention_prepped"
    n_parts, B, width, Hq = check_prep(name, qkv, q_norm, k_norm, cos, sin, cache_k, cache_v, positions)
    if lengths.shape != (B,) or tickets.shape != (TICKETS,) or B * Hq > TICKETS:
        raise ValueError(f"{name}: needs lengths [{B}], tickets [{TICKETS}] and B * Hq <= {TICKETS}; got lengths "
                         f"{lengths.shape}, tickets {tickets.shape}, B * Hq = {B * Hq}")
    n_splits = default_splits(S, block_s) if splits is None else splits
    if n_splits < 1:
        raise ValueError(f"decode_attention_prepped: splits must be >= 1, got {splits}")
    flat = lambda a: a.reshape(L * N, S, Hkv, Dh)  # merges the leading axes: a view, not a copy  # noqa: E731
    whole = pl.BlockSpec(memory_space=pl.ANY)
    per_seq = pl.BlockSpec((1,), lambda b, h, j: (b,))
    table = pl.BlockSpec((None, Dh // 2), lambda b, h, j: (b, 0))  # [Dh/2]
    norm = pl.BlockSpec((Dh,), lambda b, h, j: (0,))
    counters = pl.BlockSpec((TICKETS,), lambda b, h, j: (0,))
    kernel = functools.partial(_kernel, groups=Hq // Hkv, n_kv=Hkv, layer=int(layer), n_rows=N, n_slots=S,
                               block_s=block_s, splits=n_splits, scale=float(scale), eps=float(eps),
                               interpret=interpret)
    cache = jax.ShapeDtypeStruct((L * N, S, Hkv, Dh), cache_k.dtype)
    ck, cv, tk, out, *_ = pl.pallas_call(
        kernel,
        out_shape=(cache, cache, jax.ShapeDtypeStruct((TICKETS,), jnp.int32), jax.ShapeDtypeStruct((B, Hq, Dh), F32),
                   jax.ShapeDtypeStruct((B, Hq, n_splits), F32), jax.ShapeDtypeStruct((B, Hq, n_splits), F32),
                   jax.ShapeDtypeStruct((B, Hq, n_splits, Dh), F32)),
        grid=(B, Hq, n_splits),
        in_specs=[pl.BlockSpec((1,), lambda b, h, j: (0,)), per_seq, per_seq,
                  pl.BlockSpec((n_parts, None, width), lambda b, h, j: (0, b, 0)),  # [P, width]: sequence b's
                  norm, norm, table, table, whole, whole, counters],
        out_specs=(whole, whole, counters, whole, whole, whole, whole),
        input_output_aliases={8: 0, 9: 1, 10: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="decode_attention_prepped",
    )(jnp.asarray(start, jnp.int32).reshape(1), positions.astype(jnp.int32), lengths.astype(jnp.int32), qkv,
      q_norm, k_norm, cos.astype(F32), sin.astype(F32), flat(cache_k), flat(cache_v), tickets)
    return out, ck.reshape(cache_k.shape), cv.reshape(cache_v.shape), tk


def cache_attend_prepped(cache, layer: int, start, qkv: jax.Array, norms, rope, positions: jax.Array, scale: float,
                         tickets: jax.Array, *, interpret: bool = False):
    """:func:`decode_attention_prepped` on a cache object's ``k``, ``v`` buffers and ``lengths``
    (``models.kv_cache.KVCache``, ``engine.cache.SlotCache``): ``norms = (q_norm, k_norm, eps)``,
    ``rope = (cos, sin)``. Returns (the attention output, the cache with the new buffers, tickets)."""
    q_norm, k_norm, eps = norms
    cos, sin = rope
    out, new_k, new_v, tickets = decode_attention_prepped(
        qkv, q_norm, k_norm, cos, sin, cache.k, cache.v, cache.lengths, layer, start, positions, tickets,
        scale=float(scale), eps=float(eps), interpret=interpret)
    return out, dataclasses.replace(cache, k=new_k, v=new_v), tickets
