"""ggml-cpu activation rounding: bit-exact against libggml-cpu's own quantize_row_q8_K / q8_0."""

from __future__ import annotations

import ctypes
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.ops.actquant import round_activations


def test_none_and_float_types():
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(round_activations(jnp.asarray(x), T.Q4_K, "none")), x)
    np.testing.assert_array_equal(np.asarray(round_activations(jnp.asarray(x), T.F32, "ggml-cpu")), x)
    np.testing.assert_array_equal(np.asarray(round_activations(jnp.asarray(x), T.F16, "ggml-cpu")),
                                  x.astype(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="unknown activation rounding"):
        round_activations(jnp.asarray(x), T.Q4_K, "fast")


def test_zero_blocks_stay_zero():
    x = np.zeros((2, 512), np.float32)
    x[1, 256:] = np.linspace(-1, 1, 256)
    for qtype in (T.Q6_K, T.Q8_0):
        got = np.asarray(round_activations(jnp.asarray(x), qtype, "ggml-cpu"))
        assert np.all(got[0] == 0) and np.all(got[1, :256] == 0) and np.all(np.isfinite(got))


@pytest.fixture(scope="module")
def ggml_cpu():
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
    ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(lib / "libggml-base.so")), ctypes.CDLL(str(lib / "libggml-cpu.so"))


def _ggml_round(libs, x: np.ndarray, name: str, block_bytes: int, block: int) -> np.ndarray:
    base, cpu = libs
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    buf = np.zeros(x.size // block * block_bytes, np.uint8)
    out = np.zeros_like(x)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    getattr(cpu, "quantize_row_" + name)(p(x), p(buf), ctypes.c_int64(x.size))  # what llama.cpp runs
    getattr(base, "dequantize_row_" + name)(p(buf), p(out), ctypes.c_int64(x.size))
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("qtype,name,block_bytes,block", [
    (T.Q4_K, "q8_K", 4 + 256 + 32, 256), (T.Q6_K, "q8_K", 4 + 256 + 32, 256), (T.Q8_0, "q8_0", 34, 32)])
def test_bit_exact_with_libggml_cpu(ggml_cpu, qtype, name, block_bytes, block):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((6, 1024)) * rng.uniform(0.01, 30, (6, 1))).astype(np.float32)
    x[0, :256] = np.abs(x[0, :256])  # a block whose largest magnitude is positive...
    x[1, :256] = -np.abs(x[1, :256])  # ...and one where it is negative (Q8_K keeps the sign)
    got = np.asarray(round_activations(jnp.asarray(x), qtype, "ggml-cpu")).reshape(-1)
    np.testing.assert_array_equal(got, _ggml_round(ggml_cpu, x, name, block_bytes, block))


def q8_1_numpy(x: np.ndarray):
    """llama.cpp CUDA's quantize_q8_1 written out per block in NumPy: d = amax / 127 in float32,
    q = roundf(x / d) (the quotient in float32, halves away from zero), the block keeps f16 d."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        v = (b / d).astype(np.float32).astype(np.float64)
    q = np.where(amax == 0, 0, np.trunc(v + np.copysign(0.5, v))).astype(np.int32)
    return q, d[..., 0].astype(np.float16).astype(np.float32)


def test_q8_1_matches_llamacpp_cuda_rounding():
    from bloomery_jax.ops.actquant import quantize_q8_1

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block
    x[1, 32:64] = np.arange(-16, 16) * np.float32(0.5)  # a block of exact multiples of 1/2
    q, d = q8_1_numpy(x)
    got = quantize_q8_1(jnp.asarray(x))
    words = np.asarray(got.qs).view(np.uint8).view(np.int8).reshape(3, -1, 32)  # little-endian bytes
    np.testing.assert_array_equal(words, q)
    np.testing.assert_array_equal(np.asarray(got.d), d)
    np.testing.assert_array_equal(np.asarray(got.sums), q.reshape(3, -1, 2, 16).sum(-1).reshape(3, -1))
    np.testing.assert_array_equal(np.asarray(got.values()), (q * d[..., None]).reshape(3, 256))
    # jitted inside a larger computation too (XLA may not rewrite the division: ops/actquant.py)
    jitted = jax.jit(lambda v: quantize_q8_1(v * 1.0).qs)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(got.qs))
    # ggml-cuda rounding of a quantized weight's input is these values; float weights see x
    np.testing.assert_array_equal(np.asarray(round_activations(jnp.asarray(x), T.Q4_K, "ggml-cuda")),
                                  np.asarray(got.values()))
    np.testing.assert_array_equal(np.asarray(round_activations(jnp.asarray(x), T.F16, "ggml-cuda")), x)


def test_q8_1_rounds_halves_away_from_zero():
    from bloomery_jax.ops.actquant import quantize_q8_1

    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0  # d = 1: the other quotients are the values themselves
    x[0, 1:5] = [2.5, -2.5, 0.5, -1.5]
    q = np.asarray(quantize_q8_1(jnp.asarray(x)).values())[0, :5]
    np.testing.assert_array_equal(q, [127, 3, -3, 1, -2])  # roundf; jnp.round would give 2, -2, 0, -2
