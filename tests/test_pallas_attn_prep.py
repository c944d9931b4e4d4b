"""pallas.decode_qk_prep (Pallas interpret mode on the CPU) against ops.norms.rms_norm,
ops.rope.apply_rope and KVCache.write.

Tolerance: the kernel does the reference's float32 operations except the norm's mean square,
which it sums as two halves; outputs are of magnitude ~1, so 1e-6 absolute is ~10 ulps over the
measured ~1e-7, while a wrong head, half or weight moves them by ~1e-1. The cache rows the
kernel does not write must be bit for bit what they were.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax.engine.cache import SlotCache
from bloomery_jax.ops.norms import rms_norm
from bloomery_jax.ops.rope import RopeConfig, apply_rope, rope_cos_sin
from bloomery_jax.pallas.attn_prep import decode_qk_prep, serves
from triton_lowering import triton_kernels

ATOL = 1e-6
EPS = 1e-6


def inputs(B, Hq, Hkv, Dh, L=3, N=None, S=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = f(B, Hq, Dh), f(B, Hkv, Dh), f(B, Hkv, Dh)
    qn, kn = 1.0 + 0.3 * f(Dh), 1.0 + 0.3 * f(Dh)
    shape = (L, N or B, S, Hkv, Dh)
    return q, k, v, qn, kn, f(*shape).astype(dtype), f(*shape).astype(dtype)


def reference(q, k, v, qn, kn, ck, cv, layer, start, positions, cfg):
    """The model's XLA path: norms, rotation, then the cache scatter of ``SlotCache.write``."""
    cos, sin = rope_cos_sin(positions[:, None], cfg)  # [B, 1, Dh/2]
    rot = lambda x, w: apply_rope(rms_norm(x[:, None], w, EPS), cos, sin, neox=True)[:, 0]  # noqa: E731
    window = SlotCache(ck, cv, jnp.zeros((ck.shape[1],), jnp.int32), jnp.int32(start), q.shape[0])
    new = window.write(layer, rot(k, kn)[:, None], v[:, None], positions[:, None])
    return rot(q, qn), new.k, new.v


def side_by_side(q, k, v, parts: int, rng):
    """q|k|v as ``parts`` partial sums ``[P, B, (Hq + 2 Hkv) Dh]``: random splits, whose sum
    rounds (P > 1) within the tolerance, as the kernel's split-K partial sums do."""
    whole = jnp.concatenate([a.reshape(a.shape[0], -1) for a in (q, k, v)], axis=1)
    pieces = [jnp.asarray(rng.standard_normal(whole.shape), jnp.float32) for _ in range(parts - 1)]
    return jnp.stack([whole - sum(pieces, jnp.zeros_like(whole))] + pieces)


@pytest.mark.parametrize("B,Hq,Hkv,Dh,N,start,layer,positions,dtype,parts", [
    (2, 8, 2, 64, 2, 0, 1, [5, 15], jnp.float32, 1),  # GQA, the last position of slot 1
    (3, 4, 4, 32, 5, 2, 2, [0, 16, 7], jnp.float32, 2),  # MHA in a window of slots 2-4; row 1 is padding (S)
    (1, 6, 1, 16, 1, 0, 0, [-1], jnp.float32, 3),  # MQA with a group of 6 (not a power of two); padding below 0
    (2, 8, 2, 64, 4, 1, 0, [3, 9], jnp.bfloat16, 2),  # a bf16 cache: stored rounded, as the scatter stores
])
def test_matches_norm_rope_and_cache_write(B, Hq, Hkv, Dh, N, start, layer, positions, dtype, parts):
    q, k, v, qn, kn, ck, cv = inputs(B, Hq, Hkv, Dh, N=N, dtype=dtype)
    pos = jnp.asarray(positions, jnp.int32)
    cfg = RopeConfig(n_dims=Dh, freq_base=10000.0, neox=True)
    want_q, want_k, want_v = reference(q, k, v, qn, kn, ck, cv, layer, start, pos, cfg)
    cos, sin = rope_cos_sin(pos, cfg)  # [B, Dh/2]
    qkv = side_by_side(q, k, v, parts, np.random.default_rng(parts))
    got_q, got_k, got_v = decode_qk_prep(qkv, qn, kn, cos, sin, jnp.array(ck), jnp.array(cv), layer,
                                         jnp.int32(start), pos, eps=EPS, interpret=True)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    atol = ATOL if dtype == jnp.float32 else 2.0 ** -7  # bf16: one rounding step of a value near 1 apart
    np.testing.assert_allclose(f32(got_q), f32(want_q), rtol=0, atol=ATOL)
    np.testing.assert_allclose(f32(got_k), f32(want_k), rtol=0, atol=atol)
    if parts == 1:  # v is stored as it is
        np.testing.assert_array_equal(f32(got_v), f32(want_v))
    np.testing.assert_allclose(f32(got_v), f32(want_v), rtol=0, atol=atol)
    written = np.zeros(ck.shape, bool)
    for b, p in enumerate(positions):
        if 0 <= p < ck.shape[2]:
            written[layer, start + b, p] = True
    np.testing.assert_array_equal(f32(got_k)[~written], f32(ck)[~written])  # nothing else moved
    assert written.sum() == 0 or not np.array_equal(f32(got_k)[written], f32(ck)[written])  # the written did


def test_rejects_shapes_it_cannot_serve():
    q, k, v, qn, kn, ck, cv = inputs(1, 4, 2, 24)  # Dh/2 = 12: not a Triton block
    cos = sin = jnp.zeros((1, 12), jnp.float32)
    assert not serves(24, 24) and not serves(64, 32) and serves(128, 128)
    with pytest.raises(ValueError, match="decode_qk_prep"):
        decode_qk_prep(side_by_side(q, k, v, 1, None), qn, kn, cos, sin, ck, cv, 0, 0, jnp.zeros((1,), jnp.int32),
                       eps=EPS, interpret=True)


def test_lowers_to_triton_for_an_h200(monkeypatch):
    # Qwen3-30B-A3B's heads: 32 query and 4 kv heads of 128
    q, k, v, qn, kn, ck, cv = inputs(1, 32, 4, 128, L=2, N=2, S=8)
    cos = sin = jnp.zeros((1, 64), jnp.float32)
    qkv = jax.ShapeDtypeStruct((2, 1, (32 + 8) * 128), jnp.float32)  # two partial sums (split-K 2)
    fn = lambda *a: decode_qk_prep(*a, 1, jnp.int32(1), jnp.zeros((1,), jnp.int32), eps=EPS)  # noqa: E731
    built = triton_kernels(monkeypatch, fn, qkv, qn, kn, cos, sin, ck, cv)
    assert [(name, cc) for name, cc, _ in built] == [("decode_qk_prep", 90)] and all(ok for *_, ok in built)
