"""RoPE against a NumPy transcription of ggml's loop, NeoX vs normal, and YaRN facts by hand."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax.models.qwen3moe import Config
from bloomery_jax.ops.rope import (RopeConfig, apply_rope, rope_angles, rope_cos_sin, rope_mscale,
                                   yarn_corr_dims)

F = np.float32


def ggml_rope_np(x: np.ndarray, pos: np.ndarray, cfg: RopeConfig) -> np.ndarray:
    """ggml's CPU rope written as a scalar float32 loop: x [T, H, Dh], pos [T]."""
    out = x.copy()
    theta_scale = F(np.power(F(cfg.freq_base), F(-2.0) / F(cfg.n_dims)))
    lo, hi = yarn_corr_dims(cfg.n_dims, cfg.n_ctx_orig, cfg.freq_base, cfg.beta_fast, cfg.beta_slow)
    half = cfg.n_dims // 2
    for t in range(x.shape[0]):
        theta = F(pos[t])
        for i in range(half):
            interp = F(cfg.freq_scale) * theta
            th, mscale = interp, F(cfg.attn_factor)
            if cfg.ext_factor != 0:
                y = (F(i) - F(lo)) / max(F(0.001), F(hi) - F(lo))
                mix = (F(1) - min(F(1), max(F(0), y))) * F(cfg.ext_factor)
                th = F(interp * (F(1) - mix) + theta * mix)
                mscale = F(mscale * (F(1) + F(0.1) * np.log(F(1) / F(cfg.freq_scale))))
            c, s = F(np.cos(th)) * mscale, F(np.sin(th)) * mscale
            a, b = (i, i + half) if cfg.neox else (2 * i, 2 * i + 1)
            x0, x1 = x[t, :, a], x[t, :, b]
            out[t, :, a], out[t, :, b] = x0 * c - x1 * s, x0 * s + x1 * c
            theta = F(theta * theta_scale)
    return out


def _apply(x, pos, cfg):
    cos, sin = rope_cos_sin(jnp.asarray(pos)[None], cfg)
    return np.asarray(apply_rope(jnp.asarray(x)[None], cos, sin, neox=cfg.neox))[0]


CASES = [
    RopeConfig(n_dims=64, freq_base=1e6, neox=True),
    RopeConfig(n_dims=64, freq_base=1e4, neox=False),
    RopeConfig(n_dims=32, freq_base=1e4, neox=True),  # partial rotary on a head of 64
    RopeConfig(n_dims=64, freq_base=1e6, neox=True, freq_scale=0.25),  # linear
    RopeConfig(n_dims=64, freq_base=1e6, neox=True, freq_scale=0.25, ext_factor=1.0,
               attn_factor=0.8783, n_ctx_orig=256),  # YaRN
]


@pytest.mark.parametrize("cfg", CASES, ids=["neox", "normal", "partial", "linear", "yarn"])
def test_rope_matches_ggml_loop(cfg):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 3, 64)).astype(np.float32)
    pos = np.concatenate([np.arange(20), np.arange(480, 500)]).astype(np.int32)  # far positions too
    got, want = _apply(x, pos, cfg), ggml_rope_np(x, pos, cfg)
    # Angles are bit-identical (see test below); cos/sin of XLA and NumPy differ by ~1 ulp, and
    # the products add 2 more roundings: 1e-5 absolute on unit-scale values.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    if cfg.n_dims < 64:  # dims past n_dims are passed through untouched
        np.testing.assert_array_equal(got[..., cfg.n_dims:], x[..., cfg.n_dims:])


def test_angles_are_ggml_running_product_bit_for_bit():
    cfg = RopeConfig(n_dims=128, freq_base=1e6)
    pos = np.arange(0, 600, 7, dtype=np.int32)
    got = np.asarray(rope_angles(jnp.asarray(pos), cfg))
    # compiled as in a step, where XLA's simplifier sees the whole chain at once
    np.testing.assert_array_equal(np.asarray(jax.jit(rope_angles, static_argnums=1)(jnp.asarray(pos), cfg)), got)
    ts = F(np.power(F(1e6), F(-2.0) / F(128)))
    want = np.empty((len(pos), 64), np.float32)
    want[:, 0] = pos
    for i in range(1, 64):
        want[:, i] = want[:, i - 1] * ts
    np.testing.assert_array_equal(got, want)  # exact: same float32 operations in the same order
    # ...and it is not the same thing as pos * ts**i (which is why the running product matters)
    assert np.any(want != (pos[:, None] * np.power(ts, np.arange(64, dtype=np.float32))).astype(np.float32))


def test_neox_equals_normal_on_permuted_dims():
    """NeoX on dims reordered (0,2,4,..,1,3,5,..) is normal-style rope, exactly."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 2, 16)).astype(np.float32)
    pos = np.arange(100, 130, dtype=np.int32)
    perm = np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)])
    neox = _apply(x[..., perm], pos, RopeConfig(n_dims=16, freq_base=1e4, neox=True))
    normal = _apply(x, pos, RopeConfig(n_dims=16, freq_base=1e4, neox=False))
    np.testing.assert_array_equal(neox, normal[..., perm])


def test_rotation_depends_on_relative_position_only():
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 1, 1, 64)).astype(np.float32)
    cfg = RopeConfig(n_dims=64, freq_base=1e4)
    def score(pq, pk):
        return float(np.sum(_apply(q, np.array([pq], np.int32), cfg) * _apply(k, np.array([pk], np.int32), cfg)))
    # Same offset 5 at positions 10 and 410: angle rounding at ~400 rad is ~3e-5, scores O(8).
    assert score(15, 10) == pytest.approx(score(415, 410), abs=2e-3)
    assert score(15, 10) != pytest.approx(score(16, 10), abs=1e-2)


def test_yarn_corr_dims_hand_computed():
    # d(b) = n * ln(n_ctx / (2 pi b)) / (2 ln base)
    # n=128, ctx=4096, base=1e4: d(32) = 128 * ln(20.372) / 18.421 = 20.94 -> 20;
    #                            d(1)  = 128 * ln(651.90) / 18.421 = 45.03 -> 46.
    assert yarn_corr_dims(128, 4096, 1e4, 32, 1) == (20.0, 46.0)
    # Qwen3 with YaRN: n=128, ctx=32768, base=1e6: d(32) = 128 * ln(162.97) / 27.631 = 23.60 -> 23;
    #                                             d(1)  = 128 * ln(5215.2) / 27.631 = 39.65 -> 40.
    assert yarn_corr_dims(128, 32768, 1e6, 32, 1) == (23.0, 40.0)
    # The clamps: a tiny context puts lo below 0, a huge one puts hi above n - 1.
    assert yarn_corr_dims(64, 64, 1e4, 32, 1)[0] == 0.0
    assert yarn_corr_dims(64, 10**9, 1e4, 32, 1)[1] == 63.0


def test_yarn_angles_and_magnitude_by_hand():
    # Qwen3-style YaRN factor 4 over 32768 original positions, from a Config as llama.cpp sets it up.
    cfg = Config(n_layers=1, d_model=256, n_heads=2, n_kv_heads=1, head_dim=128, n_experts=4,
                 n_experts_used=2, expert_ff=64, n_vocab=16, rope_base=1e6, rope_scaling="yarn",
                 rope_scaling_factor=4.0, rope_orig_context=32768).rope()
    assert cfg.freq_scale == 0.25 and cfg.ext_factor == 1.0 and cfg.n_ctx_orig == 32768
    # llama.cpp cancels the op's own (1 + 0.1 ln 4) in attn_factor; the product is mscale(4).
    assert cfg.attn_factor == pytest.approx(1.0, abs=1e-6)
    assert rope_mscale(cfg) == pytest.approx(1 + 0.1 * math.log(4.0), rel=1e-6)
    p = 1000
    th = np.asarray(rope_angles(jnp.asarray([p], jnp.int32), cfg))[0]
    base = p * 1e6 ** (-2.0 * np.arange(64) / 128)
    # Pairs below lo = 23 keep the original (extrapolated) frequency, pairs from hi = 40 on are
    # interpolated by 1/4, pair 30 is mixed 10/17 extrapolated; float32 products: rel 1e-5.
    np.testing.assert_allclose(th[:23], base[:23], rtol=1e-5)
    np.testing.assert_allclose(th[40:], base[40:] / 4, rtol=1e-5)
    mix = 1 - (30 - 23) / (40 - 23)
    assert th[30] == pytest.approx(base[30] * (0.25 * (1 - mix) + mix), rel=1e-5)


def test_linear_scaling_and_no_scaling_from_config():
    common = dict(n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, n_experts=4,
                  n_experts_used=2, expert_ff=32, n_vocab=16)
    plain = Config(**common).rope()
    assert (plain.freq_scale, plain.ext_factor, plain.attn_factor, plain.neox) == (1.0, 0.0, 1.0, True)
    lin = Config(**common, rope_scaling="linear", rope_scaling_factor=2.0, rope_attn_factor=0.5).rope()
    assert (lin.freq_scale, lin.ext_factor, lin.attn_factor) == (0.5, 0.0, 0.5)
    p = jnp.asarray([300], jnp.int32)
    np.testing.assert_allclose(np.asarray(rope_angles(p, lin)), np.asarray(rope_angles(p, plain)) / 2, rtol=1e-6)
