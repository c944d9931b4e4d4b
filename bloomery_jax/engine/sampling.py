"""On-device sampling for a batch of rows, each with its own settings, in one compiled function.

Contract. Every per-request setting is a per-row array (:class:`SamplerRows`), so requests with
different settings share one compiled step; :func:`sample` maps ``logits [B, V]`` and the rows to
one token per row plus log-probabilities. The rules, applied in this order (llama.cpp's order):

1. logit bias: ``l += bias`` (``-inf`` bans a token);
2. penalties: repetition ``r`` (HF / llama.cpp rule: ``l / r`` where ``l > 0`` else ``l * r``) on
   every token seen in the prompt or generated so far; presence ``a`` and frequency ``f``
   (OpenAI rule: ``l -= a * [c > 0] + f * c``) on generated tokens only, ``c`` = times generated;
3. temperature ``<= 0``: greedy, the first index of the largest logit (steps 4-7 skipped);
4. top-k (``k <= 0`` = off): keep the k largest (ties broken by the lower token id);
5. top-p (``p >= 1`` = off): of the kept tokens renormalised, keep each whose probability mass
   *before* it in descending order is ``< p`` (the smallest set reaching ``p``; the top token
   is always kept);
6. min-p: keep tokens with ``p >= min_p * p_max``, i.e. ``l - l_max >= log(min_p)``;
7. temperature: draw from ``softmax(l / T)`` over the kept tokens (Gumbel-max).

Reproducibility: row b's random key is ``fold_in(key(seed_b), step_b)``, with ``step_b`` the index
of the token being drawn (0 = first generated token), so a sequence's tokens depend only on its
own seed, prompt and logits, never on the other rows or the batch size.

Reported log-probabilities (``n_probs``) are those of the model's own distribution,
``log_softmax`` of the raw logits, before bias, penalties and temperature (as llama-server does by
default); the top-n list is taken from the same distribution.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError

MAX_N_PROBS = 20  # OpenAI's top_logprobs limit; the top-n width the step computes (static)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (host side). ``validate`` raises ConfigError on bad values."""

    temperature: float = 1.0  # <= 0: greedy
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    seed: int = 0
    n_probs: int = 0  # how many top log-probabilities to report per token

    def validate(self, n_vocab: int, max_n_probs: int = MAX_N_PROBS) -> None:
        def bad(field: str, why: str):
            raise ConfigError(f"sampling parameter {field}={getattr(self, field)!r}: {why}")

        def finite(field: str):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(field, "must be a finite number")

        for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            finite(f)
        if self.temperature < 0:
            bad("temperature", "must be >= 0 (0 = greedy)")
        if not 0.0 <= self.top_p <= 1.0:
            bad("top_p", "must be in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0 (1 = off)")
        for f in ("top_k", "seed", "n_probs"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                bad(f, "must be an integer")
        if not 0 <= self.n_probs <= max_n_probs:
            bad("n_probs", f"must be in [0, {max_n_probs}]")
        for tok, value in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)) or not 0 <= tok < n_vocab:
                raise ConfigError(f"sampling parameter logit_bias: token id {tok!r} is not in [0, {n_vocab})")
            if not isinstance(value, (int, float)) or math.isnan(value) or value == math.inf:
                raise ConfigError(f"sampling parameter logit_bias[{tok}]={value!r}: must be a number < +inf")


class SamplerRows(NamedTuple):
    """Per-row sampler inputs on the device (B rows, V vocabulary)."""

    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] i32
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    repetition: jax.Array  # [B] f32
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    seed: jax.Array  # [B, 2] u32, (high, low) words of the 64-bit seed
    step: jax.Array  # [B] i32, index of the token being drawn
    bias: jax.Array  # [B, V] f32
    counts: jax.Array  # [B, V] i32, times each token was generated
    seen: jax.Array  # [B, V] bool, token occurs in the prompt


class Plan(NamedTuple):
    """What a step's sampler computes, fixed when the step compiles (:func:`plan_for` picks it
    from the batch's settings, so each plan is one more compilation of the step, not a branch)."""

    draw: bool  # some row may draw at random; False: every row takes the argmax (rule 3)
    n_top: int  # width of the top log-probability report (0: none)


def plan_for(params: Sequence[SamplingParams], n_top: int) -> Plan:
    """The greedy plan when every row is greedy and asks for no top log-probabilities, else the
    full plan. Why: a GPU step computes the whole draw and the top-n report branch-free for
    every batch (:data:`BRANCH_FREE_PLATFORMS`): with the step's bookkeeping ~0.25 ms of an
    8-layer decode token in the H100 trace of 2026-12-05, of which a greedy batch without
    logprobs needs only the argmax and the chosen token's logprob."""
    if all(p.temperature <= 0 and p.n_probs == 0 for p in params):
        return Plan(draw=False, n_top=0)
    return Plan(draw=True, n_top=n_top)


class SampleOut(NamedTuple):
    token: jax.Array  # [B] i32
    logprob: jax.Array  # [B] f32, raw log-probability of the chosen token
    top_ids: jax.Array  # [B, N] i32, N = n_top, descending log-probability
    top_logprobs: jax.Array  # [B, N] f32


def row_arrays(params: SamplingParams, n_vocab: int, prompt: Sequence[int] = (),
               generated: Sequence[int] = ()) -> dict[str, np.ndarray]:
    """Host arrays of one row (no batch axis) for ``params`` after ``prompt`` and ``generated``."""
    seed = int(params.seed) & ((1 << 64) - 1)  # any Python int → 64 bits, two u32 words
    bias = np.zeros(n_vocab, np.float32)
    for tok, value in params.logit_bias.items():
        bias[int(tok)] += np.float32(value)
    seen = np.zeros(n_vocab, bool)
    seen[np.asarray(prompt, np.int64)] = True
    counts = np.bincount(np.asarray(generated, np.int64), minlength=n_vocab).astype(np.int32)
    return dict(
        temperature=np.float32(params.temperature), top_k=np.int32(params.top_k),
        top_p=np.float32(params.top_p), min_p=np.float32(params.min_p),
        repetition=np.float32(params.repetition_penalty), presence=np.float32(params.presence_penalty),
        frequency=np.float32(params.frequency_penalty),
        seed=np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32), step=np.int32(len(generated)),
        bias=bias, counts=counts, seen=seen,
    )


def make_rows(rows: Sequence[dict[str, np.ndarray]]) -> SamplerRows:
    """Stack host rows (from :func:`row_arrays`) into device :class:`SamplerRows` [B, ...]."""
    return SamplerRows(**{f: jnp.asarray(np.stack([r[f] for r in rows])) for f in SamplerRows._fields})


def processed_logits(logits: jax.Array, rows: SamplerRows) -> jax.Array:
    """Logit bias then penalties (rules 1-2). logits [B, V] f32 → [B, V] f32."""
    x = logits.astype(jnp.float32) + rows.bias
    rep = rows.repetition[:, None]  # [B, 1]
    hit = rows.seen | (rows.counts > 0)
    x = jnp.where(hit, jnp.where(x > 0, x / rep, x * rep), x)
    c = rows.counts.astype(jnp.float32)
    return x - rows.presence[:, None] * (c > 0) - rows.frequency[:, None] * c


def _rank_order_keys(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two uint32 keys whose lexicographic order, larger first, is the rank order of ``x``:
    descending value, equal values by ascending token id. x [B, V] f32 -> (hi, lo) [B, V] u32."""
    x = jnp.where(x == 0, 0.0, x)  # -0.0 ties +0.0, as in a comparison sort
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    ordered = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order == float order
    hi = jax.lax.bitcast_convert_type(ordered, jnp.uint32) ^ jnp.uint32(0x80000000)  # -> unsigned order
    V = x.shape[1]
    lo = jnp.broadcast_to(jnp.uint32(V - 1) - jnp.arange(V, dtype=jnp.uint32), x.shape)  # lower id: larger
    return hi, lo


SEARCH_DIGIT_BITS = 4  # bits of a threshold fixed per pass of :func:`_first_below` (16 candidates)


def _first_below(key: jax.Array, weight: jax.Array, target: jax.Array, bits: int,
                 above: jax.Array | None = None) -> jax.Array:
    """The least t in [0, 2^bits) with ``mass(t) < target``, where ``mass(t)`` is ``above`` (0
    when None) plus the weight of the entries whose key is > t; 2^bits - 1 when there is none.

    mass(t) falls as t grows, so t is found a digit at a time from the top: of the 16 blocks a
    digit opens, the first whose largest t already satisfies it holds the answer. No sort: each
    pass is one compare-and-sum over the row. key [B, V] u32 (< 2^bits), weight [B, V] (f32 or
    i32, >= 0), target [B], above [B] or None -> [B] u32.
    """
    fanout = 1 << SEARCH_DIGIT_BITS
    top = -(-bits // SEARCH_DIGIT_BITS) * SEARCH_DIGIT_BITS  # bits rounded up to whole digits
    prefix = jnp.zeros(key.shape[:1], jnp.uint32)
    digits = jnp.arange(fanout, dtype=jnp.uint32)
    for shift in range(top - SEARCH_DIGIT_BITS, -1, -SEARCH_DIGIT_BITS):
        low_ones = jnp.uint32((1 << shift) - 1)
        # candidate c: the largest t of the block whose digit is c; [B, 16]
        cand = prefix[:, None] | (digits[None, :] << shift) | low_ones
        cand = jnp.minimum(cand, jnp.uint32((1 << bits) - 1))
        # [B, 16, V] summed along V: a row reduction, XLA's fastest kind on a GPU
        mass = jnp.sum(jnp.where(key[:, None, :] > cand[:, :, None], weight[:, None, :], 0), axis=2)  # [B, 16]
        if above is not None:
            mass = mass + above[:, None]
        ok = mass < target[:, None]
        digit = jnp.where(ok.any(axis=1), jnp.argmax(ok, axis=1), fanout - 1).astype(jnp.uint32)
        prefix = prefix | (digit << shift)
    return jnp.minimum(prefix, jnp.uint32((1 << bits) - 1))


def _rank_prefix(hi: jax.Array, lo: jax.Array, lo_bits: int, weight: jax.Array, target: jax.Array) -> jax.Array:
    """Which entries have less than ``target`` of ``weight`` before them in rank order (the
    order of the keys (hi, lo), larger first): a prefix of that order, found without sorting.
    [B, V] keys, weight [B, V], target [B] -> bool [B, V]."""
    t_hi = _first_below(hi, weight, target, 32)
    on_hi = hi == t_hi[:, None]
    above = jnp.sum(jnp.where(hi > t_hi[:, None], weight, 0), axis=1)
    t_lo = _first_below(jnp.where(on_hi, lo, 0), jnp.where(on_hi, weight, 0), target, lo_bits, above)
    return (hi > t_hi[:, None]) | (on_hi & (lo >= t_lo[:, None]))


def _keep(x: jax.Array, rows: SamplerRows, is_first: jax.Array, below) -> jax.Array:
    """Rules 4-6 on logits ``x`` [B, V] in either order: bool [B, V], the kept tokens in x's order.

    ``is_first`` marks rank 0 (always kept); ``below(weight, target)`` says which entries have
    less than ``target`` [B] of ``weight`` [B, V] before them in rank order. Top-k keeps the
    entries with fewer than k entries before them, top-p those with less than p of the
    renormalised mass before them."""
    top = jnp.max(x, axis=1, keepdims=True)  # [B, 1]
    k = rows.top_k
    keep = (k[:, None] <= 0) | below(jnp.ones(x.shape, jnp.int32), k)
    e = jnp.where(keep, jnp.exp(x - top), 0.0)
    p = e / jnp.sum(e, axis=1, keepdims=True)
    top_p = rows.top_p
    # p >= 1 is off outright: the f32 running sum can reach 1 before the last tokens.
    keep &= (top_p[:, None] >= 1.0) | below(p, top_p) | is_first
    log_min_p = jnp.log(rows.min_p)[:, None]  # -inf when min_p == 0: keeps all
    return keep & ((x - top >= log_min_p) | is_first)


def _keep_searched(x: jax.Array, rows: SamplerRows) -> jax.Array:
    """Rules 4-6 without a sort: the kept tokens, bool [B, V] in vocabulary order.

    Both cuts are a prefix of the rank order, whose end :func:`_rank_prefix` finds by searching
    the keys' bits. On a GPU this keeps the decode step free of the cub sort, a custom call that
    no CUDA graph can hold (so a decode block's loop could not become a graph node)."""
    V = x.shape[1]
    hi, lo = _rank_order_keys(x)
    lo_bits = max(1, (V - 1).bit_length())
    is_first = jnp.arange(V)[None, :] == jnp.argmax(x, axis=1)[:, None]  # the lowest id among ties
    return _keep(x, rows, is_first, lambda w, t: _rank_prefix(hi, lo, lo_bits, w, t))


def _keep_sorted(x: jax.Array, rows: SamplerRows) -> jax.Array:
    """Rules 4-6 by a sort of each row: the kept tokens, bool [B, V] in vocabulary order."""
    B, V = x.shape
    ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V))
    # Stable ascending sort of -x: descending logits, equal logits by ascending token id.
    neg, perm = jax.lax.sort((-x, ids), dimension=1, num_keys=1, is_stable=True)
    # in rank order, what is before an entry is a running sum (of ones: its rank)
    keep = _keep(-neg, rows, ids == 0, lambda w, t: jnp.cumsum(w, axis=1) - w < t[:, None])
    return jnp.zeros_like(keep).at[jnp.arange(B)[:, None], perm].set(keep)


# Platforms whose sampler finds the top-k and top-p cuts by searching (:func:`_keep_searched`)
# instead of sorting. On a CPU a sort of the row is cheaper than the search's 28 reductions.
SEARCH_PLATFORMS = ("gpu",)


def filtered_logits(x: jax.Array, rows: SamplerRows, search: bool | None = None) -> jax.Array:
    """Rules 4-7: the processed logits of the kept tokens over the temperature, -inf elsewhere,
    [B, V] in vocabulary order. ``search``: find the cuts without a sort (None: on the platforms
    of :data:`SEARCH_PLATFORMS`); the kept tokens are the same either way, except for a token
    whose top-p decision lies within f32 rounding of the boundary (the sums run in other orders)."""
    if search is None:  # $BLOOMERY_SAMPLER_CUTS (sort | search) overrides the platform's choice
        cuts = os.environ.get("BLOOMERY_SAMPLER_CUTS", "")
        search = cuts == "search" if cuts else jax.default_backend() in SEARCH_PLATFORMS
    keep = (_keep_searched if search else _keep_sorted)(x, rows)
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    return jnp.where(keep, x / t, -jnp.inf)


def _row_keys(rows: SamplerRows) -> jax.Array:
    def one(seed_words, step):
        return jax.random.fold_in(jax.random.wrap_key_data(seed_words, impl="threefry2x32"), step)

    return jax.vmap(one)(rows.seed, rows.step)


# Platforms whose sampler computes the draw for every batch and selects, instead of branching.
# On a GPU, XLA reads a conditional's predicate back to the host: the host stops launching until
# the device has run the whole step up to the sampler, so it cannot launch ahead (the H200 trace of
# an 8-layer decode block: the branch held the host 0.84 ms of each 1.7 ms step, and the next
# step's graph launch, ~0.5 ms of host time, then ran with the card idle). The draw costs
# the card tens of microseconds. On a CPU the branch is cheap and the draw's sort is not (Gemma's
# 262k vocabulary), so it stays.
BRANCH_FREE_PLATFORMS = ("gpu",)


def sample_tokens(logits: jax.Array, rows: SamplerRows, branch_free: bool | None = None,
                  search: bool | None = None) -> jax.Array:
    """The chosen token of each row. logits [B, V] → [B] i32.

    ``branch_free``: compute the draw even for an all-greedy batch (None: on the platforms of
    :data:`BRANCH_FREE_PLATFORMS`). ``search``: as :func:`filtered_logits`. The tokens are the
    same either way: the Gumbel noise is indexed by token id."""
    x = processed_logits(logits, rows)
    greedy = _argmax(x)

    def draw(_):
        z = filtered_logits(x, rows, search)
        g = jax.vmap(lambda key: jax.random.gumbel(key, (x.shape[1],), jnp.float32))(_row_keys(rows))
        drawn = _argmax(z + g)
        return jnp.where(rows.temperature > 0, drawn, greedy)

    if branch_free is None:
        branch_free = jax.default_backend() in BRANCH_FREE_PLATFORMS
    if branch_free:
        return draw(None)
    # An all-greedy batch skips the sort and the noise (most of the sampler's cost).
    return jax.lax.cond(jnp.all(rows.temperature <= 0), lambda _: greedy, draw, None)


def _argmax(x: jax.Array) -> jax.Array:
    """The first index of each row's largest value: [B, V] -> [B] i32."""
    return jnp.argmax(x, axis=1).astype(jnp.int32)


TOP_K_TILE = 512  # row length of each stage of :func:`top_k_tree` (one shared-memory sort on a GPU)


def top_k_tree(x: jax.Array, k: int, tile: int = TOP_K_TILE) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the last axis, in stages of rows of ``tile`` values.

    Each stage cuts the candidates into rows of ``tile`` (padding with -inf at the end), keeps
    the k largest of each row and passes them on, until one row is left. Same values, same
    indices, same order as ``lax.top_k`` (equal values: the lower index first): a stage's rows
    are in index order and each row's survivors in ``lax.top_k``'s order, so among equal values
    the earlier position is always the lower index. Why: for k > 16 XLA's top-k is a sort, and
    on a GPU a sort of one 151,936-long row goes to cub, a custom call outside the step's CUDA
    graphs (the trace of 2026-12-04: ~45 us of device time and a host launch a token); rows of
    512 stay in XLA's own sort kernel. x [B, V] -> (values [B, k], int32 indices [B, k]).
    """
    B, n = x.shape
    if n <= tile or k >= tile:
        values, idx = jax.lax.top_k(x, k)
        return values, idx.astype(jnp.int32)
    ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))  # [B, n] original index of each candidate
    while n > tile:
        rows = -(-n // tile)
        pad = rows * tile - n
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(B, rows, tile)
        ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max).reshape(B, rows, tile)
        x, where = jax.lax.top_k(x, min(k, tile))  # [B, rows, k]
        ids = jnp.take_along_axis(ids, where, axis=2)
        n = rows * x.shape[2]
        x, ids = x.reshape(B, n), ids.reshape(B, n)  # [B, rows, k] -> [B, rows * k], rows in index order
    values, where = jax.lax.top_k(x, k)
    return values, jnp.take_along_axis(ids, where, axis=1)


def sample(logits: jax.Array, rows: SamplerRows, n_top: int = MAX_N_PROBS, draw: bool = True) -> SampleOut:
    """Sample one token per row and report log-probabilities.

    Args:
      logits: [B, V] model logits of the position to sample.
      rows: the rows' settings and token statistics, B rows.
      n_top: static width of the top-n report (0 = none).
      draw: static; False takes every row's argmax (rules 1-3) without forming the draw, for a
        batch whose rows are all greedy (:func:`plan_for`): the same tokens for those rows.
    Returns:
      SampleOut with token [B], its raw logprob [B], top_ids / top_logprobs [B, n_top].
    """
    token = sample_tokens(logits, rows) if draw else _argmax(processed_logits(logits, rows))
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=1)  # [B, V]
    chosen = jnp.take_along_axis(lp, token[:, None], axis=1)[:, 0]
    if n_top > 0:
        top_lp, top_ids = top_k_tree(lp, n_top)
    else:
        top_lp = jnp.zeros((lp.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((lp.shape[0], 0), jnp.int32)
    return SampleOut(token, chosen, top_ids.astype(jnp.int32), top_lp)


def advance(rows: SamplerRows, token: jax.Array, active: jax.Array, start=0) -> SamplerRows:
    """Record each active row's new token: counts[r, token] += 1, step[r] += 1.

    Args:
      rows: N rows (the engine's whole sampler state); rows outside the window are untouched.
      token: [B] i32 tokens of rows [start, start + B).
      active: [B] bool, rows that really generated (padding rows are left alone).
      start: first row of the window (may be traced).
    """
    B = token.shape[0]
    r = start + jnp.arange(B)  # [B]
    inc = active.astype(jnp.int32)
    return rows._replace(counts=rows.counts.at[r, token].add(inc), step=rows.step.at[r].add(inc))


def take_rows(rows: SamplerRows, start, n: int) -> SamplerRows:
    """Rows ``[start, start + n)`` of a sampler state (start may be traced, n static)."""
    return SamplerRows(*(jax.lax.dynamic_slice_in_dim(x, start, n, axis=0) for x in rows))


def set_row(rows: SamplerRows, slot, row: SamplerRows) -> SamplerRows:
    """The state with row ``slot`` replaced by ``row`` (fields without the batch axis)."""
    return SamplerRows(*(x.at[slot].set(y) for x, y in zip(rows, row)))


def sampling_probs(logits: jax.Array, rows: SamplerRows, search: bool | None = None) -> jax.Array:
    """The distribution :func:`sample_tokens` draws from, in vocabulary order: [B, V] f32.

    Greedy rows are one-hot. Used by the tests; the step itself never forms it.
    """
    x = processed_logits(logits, rows)
    probs = jax.nn.softmax(filtered_logits(x, rows, search), axis=1)
    onehot = jax.nn.one_hot(jnp.argmax(x, axis=1), x.shape[1], dtype=jnp.float32)
    return jnp.where((rows.temperature > 0)[:, None], probs, onehot)
