"""pallas.attention_prepped (Pallas interpret mode on the CPU) against the launches it replaces:
attn_prep.decode_qk_prep, then attention.cache_decode_attention on its queries and caches.

Tolerances: the caches must be bit for bit the two-launch form's (the same operations store
them). The attention output differs only in the order of f32 sums: the own slot is added after
the split's cached slots rather than inside its block, and the splits are combined in another
order. Outputs are weighted means of unit-normal values; 2e-6 absolute is ~16 ulps of a value
near 1 (measured: up to 4.8e-7 at outputs up to 2.1), while a wrong head, split weight, a missing or doubled own slot moves
them by ~1e-2 or more.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax.engine.cache import SlotCache
from bloomery_jax.ops.rope import RopeConfig, rope_cos_sin
from bloomery_jax.pallas.attention import cache_decode_attention
from bloomery_jax.pallas.attention_prepped import cache_attend_prepped, decode_attention_prepped
from bloomery_jax.pallas.attn_prep import cache_qk_prep
from bloomery_jax.pallas.tickets import TICKETS, new_tickets
from test_pallas_attn_prep import EPS, inputs, side_by_side
from triton_lowering import triton_kernels

ATOL = 2e-6


def both_ways(B, Hq, Hkv, Dh, N, S, start, layer, positions, lengths, dtype=jnp.float32, parts=2, block_s=8,
              splits=4, tickets=None):
    """(two-launch output, caches), (prepped output, caches, tickets) over the same inputs."""
    q, k, v, qn, kn, ck, cv = inputs(B, Hq, Hkv, Dh, N=N, S=S, dtype=dtype)
    pos = jnp.asarray(positions, jnp.int32)
    all_lengths = jnp.zeros((N,), jnp.int32).at[start:start + B].set(jnp.asarray(lengths, jnp.int32))
    cfg = RopeConfig(n_dims=Dh, freq_base=10000.0, neox=True)
    cos, sin = rope_cos_sin(pos, cfg)  # [B, Dh/2]
    qkv = side_by_side(q, k, v, parts, np.random.default_rng(parts))
    norms, scale = (qn, kn, EPS), float(Dh) ** -0.5
    window = lambda: SlotCache(jnp.array(ck), jnp.array(cv), all_lengths, jnp.int32(start), B)  # noqa: E731
    q1, c2 = cache_qk_prep(window(), layer, jnp.int32(start), qkv, norms, (cos, sin), pos, interpret=True)
    want = cache_decode_attention(c2.k, c2.v, layer, jnp.int32(start), q1, pos, c2.lengths, scale, interpret=True)
    got = decode_attention_prepped(qkv, qn, kn, cos, sin, jnp.array(ck), jnp.array(cv), c2.lengths, layer,
                                   jnp.int32(start), pos, new_tickets() if tickets is None else tickets, scale=scale,
                                   eps=EPS, block_s=block_s, splits=splits, interpret=True)
    return (want, c2.k, c2.v), got


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


@pytest.mark.parametrize("B,Hq,Hkv,Dh,N,S,start,layer,positions,lengths,dtype,splits", [
    # GQA, 4 splits of 8-slot blocks: one sequence deep in its row, one a block in
    (2, 8, 2, 64, 2, 64, 0, 1, [41, 9], [42, 10], jnp.float32, 4),
    # the first token (no cached slot), padding (S and -1), a length past the position
    (4, 4, 4, 32, 5, 32, 1, 2, [0, 32, -1, 12], [1, 0, 0, 20], jnp.float32, 3),
    # MQA, a group of 6; the own slot not visible (position at the length): it is stored, not seen
    (1, 6, 1, 16, 1, 40, 0, 0, [17], [17], jnp.float32, 5),
    # a bf16 cache: the own key and value as the cache holds them
    (2, 8, 2, 64, 3, 64, 1, 0, [30, 63], [31, 64], jnp.bfloat16, 4),
])
def test_matches_prep_then_attention(B, Hq, Hkv, Dh, N, S, start, layer, positions, lengths, dtype, splits):
    (want, want_k, want_v), (got, got_k, got_v, tickets) = both_ways(B, Hq, Hkv, Dh, N, S, start, layer, positions,
                                                                     lengths, dtype, splits=splits)
    np.testing.assert_array_equal(f32(got_k), f32(want_k))
    np.testing.assert_array_equal(f32(got_v), f32(want_v))
    np.testing.assert_allclose(f32(got), f32(want), rtol=0, atol=ATOL)
    assert np.abs(f32(want)).max() > 0.05  # not vacuous: the rows attend to something
    np.testing.assert_array_equal(np.asarray(tickets), np.zeros(TICKETS, np.int32))  # back at 0


def test_own_slot_counts_once():
    """The own slot must enter exactly once: leaving it out or adding it in every split moves
    the output of a short row (two cached slots) far past the tolerance."""
    (want, *_), (got, *_) = both_ways(1, 4, 2, 32, 1, 16, 0, 0, [2], [3], splits=4)
    np.testing.assert_allclose(f32(got), f32(want), rtol=0, atol=ATOL)
    (none_seen, *_), _ = both_ways(1, 4, 2, 32, 1, 16, 0, 0, [2], [2], splits=4)  # same row, own slot hidden
    assert np.abs(f32(none_seen) - f32(want)).max() > 1e-2


def test_tickets_are_reused():
    """A second launch on the returned counters gives the same output (each counter was reset)."""
    args = (2, 8, 2, 64, 2, 64, 0, 1, [41, 9], [42, 10])
    _, (first, *_, tickets) = both_ways(*args)
    _, (second, *_) = both_ways(*args, tickets=tickets)
    np.testing.assert_array_equal(f32(first), f32(second))


def test_cache_method_and_refusals():
    q, k, v, qn, kn, ck, cv = inputs(1, 4, 2, 32, N=1, S=16)
    pos = jnp.asarray([3], jnp.int32)
    cos, sin = rope_cos_sin(pos, RopeConfig(n_dims=32, freq_base=10000.0, neox=True))
    qkv = side_by_side(q, k, v, 1, None)
    window = SlotCache(ck, cv, jnp.asarray([4], jnp.int32), jnp.int32(0), 1)
    out, cache, tickets = cache_attend_prepped(window, 0, jnp.int32(0), qkv, (qn, kn, EPS), (cos, sin), pos, 0.2,
                                               new_tickets(), interpret=True)
    assert out.shape == (1, 4, 32) and cache.k.shape == ck.shape and tickets.shape == (TICKETS,)
    with pytest.raises(ValueError, match="decode_attention_prepped"):  # tickets of the wrong size
        decode_attention_prepped(qkv, qn, kn, cos, sin, ck, cv, jnp.asarray([4]), 0, 0, pos, jnp.zeros((8,), jnp.int32),
                                 scale=0.2, eps=EPS, interpret=True)


def test_lowers_to_triton_for_an_h200(monkeypatch):
    # Qwen3-30B-A3B's heads: 32 query and 4 kv heads of 128, four partial sums (q/k/v's split-K)
    q, k, v, qn, kn, ck, cv = inputs(1, 32, 4, 128, L=2, N=2, S=1024)
    cos = sin = jnp.zeros((1, 64), jnp.float32)
    qkv = jnp.zeros((4, 1, (32 + 8) * 128), jnp.float32)
    fn = lambda *a: decode_attention_prepped(*a, 1, jnp.int32(1), jnp.zeros((1,), jnp.int32), new_tickets(),  # noqa: E731
                                             scale=0.088, eps=EPS)
    built = triton_kernels(monkeypatch, fn, qkv, qn, kn, cos, sin, ck, cv, jnp.ones((1,), jnp.int32))
    assert [(name, cc) for name, cc, _ in built] == [("decode_attention_prepped", 90)] and all(ok for *_, ok in built)
