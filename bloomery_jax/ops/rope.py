"""Rotary position embedding, computed the way ggml's ``rope`` op computes it.

Facts this module reproduces (ggml CPU backend, ``ggml_compute_forward_rope_f32``):
  * ``theta_scale = freq_base ** (-2 / n_dims)`` in float32; the angle of pair ``i`` at
    position ``p`` is a running float32 product ``p * theta_scale * theta_scale ...``
    (``i`` multiplications), not ``p * theta_scale**i`` — the two differ by rounding, and at
    positions of a few hundred that is visible in the logits.
  * scaling: ``theta_interp = freq_scale * theta_extrap``; with YaRN (``ext_factor != 0``)
    ``theta = theta_interp * (1 - mix) + theta_extrap * mix`` where
    ``mix = ext_factor * ramp(i)`` and ``ramp(i) = 1 - clip((i - lo) / max(0.001, hi - lo), 0, 1)``
    over the correction dims ``lo, hi`` of :func:`yarn_corr_dims`; the magnitude is scaled by
    ``attn_factor * (1 + 0.1 * ln(1 / freq_scale))`` (only when ``ext_factor != 0``).
  * NeoX style rotates the pairs ``(x[i], x[i + n_dims/2])``, normal style ``(x[2i], x[2i+1])``;
    dims from ``n_dims`` on are passed through unchanged (partial rotary).

How a model's metadata turns into these parameters (llama.cpp's context set-up) is the
model's business: see ``Config.rope()`` in ``models/qwen3moe.py``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Parameters of one rope op, as ggml's ``ggml_rope_ext`` receives them (hashable, static)."""

    n_dims: int  # rotated dims per head (even); the rest pass through
    freq_base: float
    neox: bool = True
    freq_scale: float = 1.0  # 1 / scaling factor
    ext_factor: float = 0.0  # YaRN extrapolation mix; 0 disables YaRN
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0  # original training context, used by the YaRN correction dims

    def __post_init__(self):
        if self.n_dims <= 0 or self.n_dims % 2:
            raise ValueError(f"rope n_dims must be a positive even number, got {self.n_dims}")


def _corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> np.float32:
    # The dim whose wavelength makes n_rot full turns over n_ctx_orig positions (float32 math).
    f = np.float32
    with np.errstate(divide="ignore"):  # n_ctx_orig = 0 (no YaRN) gives -inf, as in ggml
        num = f(n_dims) * np.log(f(n_ctx_orig) / (f(n_rot) * f(2.0) * f(math.pi)))
    return f(num / (f(2.0) * np.log(f(base))))


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """YaRN's correction range ``(lo, hi)`` in pair-index units, as ggml computes it.

    ``lo = max(0, floor(d(beta_fast)))``, ``hi = min(n_dims - 1, ceil(d(beta_slow)))`` with
    ``d(b) = n_dims * ln(n_ctx_orig / (2 pi b)) / (2 ln freq_base)``.
    """
    lo = np.floor(_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base))
    hi = np.ceil(_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base))
    return float(max(np.float32(0), lo)), float(min(np.float32(n_dims - 1), hi))


def _ramp_mix(cfg: RopeConfig) -> np.ndarray:
    """float32 ``[n_dims/2]``: the YaRN extrapolation mix of each pair (zeros without YaRN)."""
    f = np.float32
    if cfg.ext_factor == 0.0:
        return np.zeros(cfg.n_dims // 2, np.float32)
    lo, hi = yarn_corr_dims(cfg.n_dims, cfg.n_ctx_orig, cfg.freq_base, cfg.beta_fast, cfg.beta_slow)
    i = np.arange(cfg.n_dims // 2, dtype=np.float32)  # ggml's i0/2 (integer division, then float)
    y = (i - f(lo)) / max(f(0.001), f(hi) - f(lo))
    ramp = f(1) - np.minimum(f(1), np.maximum(f(0), y))
    return (ramp * f(cfg.ext_factor)).astype(np.float32)


def rope_mscale(cfg: RopeConfig) -> float:
    """Magnitude factor applied to cos and sin (float32 value as a Python float)."""
    f = np.float32
    mscale = f(cfg.attn_factor)
    if cfg.ext_factor != 0.0:
        mscale = f(mscale * (f(1) + f(0.1) * np.log(f(1) / f(cfg.freq_scale))))
    return float(mscale)


def rope_angles(positions: jax.Array, cfg: RopeConfig) -> jax.Array:
    """The rotation angle of every pair.

    Args:
      positions: int ``[...]`` token positions.
      cfg: the rope parameters.
    Returns:
      float32 ``[..., n_dims/2]``.
    """
    f = np.float32
    theta_scale = f(np.power(f(cfg.freq_base), f(-2.0) / f(cfg.n_dims)))
    p = positions.astype(jnp.float32)

    # Running product, one float32 rounding per pair, exactly as ggml's cache init does. Unrolled
    # (a scan is an XLA while loop: on the GPU each of its n_dims/2 trips launched kernels and
    # synchronised with the host), with theta_scale hidden behind an optimization barrier so
    # XLA's simplifier cannot fold the constant chain x*c*c into x*(c*c).
    scale = jax.lax.optimization_barrier(jnp.float32(theta_scale))
    extrap = [p]
    for _ in range(cfg.n_dims // 2 - 1):
        extrap.append(extrap[-1] * scale)
    theta_extrap = jnp.stack(extrap, axis=-1)  # [..., n_dims/2]
    theta_interp = f(cfg.freq_scale) * theta_extrap
    if cfg.ext_factor == 0.0:
        return theta_interp
    mix = jnp.asarray(_ramp_mix(cfg))  # [n_dims/2]
    return theta_interp * (1 - mix) + theta_extrap * mix


def rope_cos_sin(positions: jax.Array, cfg: RopeConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for :func:`apply_rope`: float32 ``[..., n_dims/2]`` each."""
    theta = rope_angles(positions, cfg)
    mscale = jnp.float32(rope_mscale(cfg))
    return jnp.cos(theta) * mscale, jnp.sin(theta) * mscale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, neox: bool) -> jax.Array:
    """Rotate the first ``2 * cos.shape[-1]`` dims of every head.

    Args:
      x: float32 ``[B, T, H, Dh]``.
      cos, sin: float32 ``[B, T, n_dims/2]`` from :func:`rope_cos_sin`.
      neox: pair ``(i, i + n_dims/2)`` (NeoX) instead of ``(2i, 2i+1)`` (normal).
    Returns:
      float32 ``[B, T, H, Dh]``.
    """
    half = cos.shape[-1]
    n_dims = 2 * half
    if n_dims > x.shape[-1]:
        raise ValueError(f"rope n_dims {n_dims} exceeds head dim {x.shape[-1]}")
    c = cos[..., None, :]  # [B, T, 1, n_dims/2], broadcast over heads
    s = sin[..., None, :]
    rot, rest = x[..., :n_dims], x[..., n_dims:]
    if neox:
        x0, x1 = rot[..., :half], rot[..., half:]
        out = jnp.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    else:
        pairs = rot.reshape(*rot.shape[:-1], half, 2)  # [B, T, H, n_dims/2, 2]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(rot.shape)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
