"""GELU (tanh approximation) and GeGLU, as ggml's ``gelu`` and ``geglu`` ops define them.

ggml's GELU is the tanh approximation
``gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))`` (not the erf form), and
``geglu(gate, up) = gelu(gate) * up`` is the gated FFN of Gemma (llama.cpp's ``LLM_FFN_GELU``
with a parallel gate). We compute it in float32. ggml's CPU backend instead looks the value
up in a float16 table indexed by the float16-rounded input (exact only for ``|x| >= 10``);
that differs from this by about one float16 rounding (relative 2^-11), far below the 8-bit
activation rounding the same backend applies before every quantized matmul.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """The tanh-approximated GELU, elementwise.

    Args:
      x: float ``[...]``; computed in float32.
    Returns:
      float32 ``[...]``.
    """
    x = x.astype(jnp.float32)
    inner = jnp.float32(SQRT_2_OVER_PI) * x * (1.0 + jnp.float32(GELU_COEF_A) * x * x)
    return 0.5 * x * (1.0 + jnp.tanh(inner))


def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``gelu_tanh(gate) * up`` (Gemma's gated FFN).

    Args:
      gate, up: float ``[..., F]`` (F hidden size).
    Returns:
      float32 ``[..., F]``.
    """
    return gelu_tanh(gate) * up.astype(jnp.float32)
