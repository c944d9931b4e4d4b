"""NumPy quantizers: float32 rows -> the exact bytes of a ggml tensor.

    raw = quantize(x, GGMLQuantizationType.Q4_K)   # f32 [..., n] -> uint8 [..., row_bytes(n)]

The bytes are laid out exactly as ggml stores them, so ``gguf.quants.dequantize``, llama.cpp
and our ``dequantize`` read them. Q2_K to Q6_K follow llama.cpp's reference quantizers
(``quantize_k_low``, ``quantize_k``); Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are vectorized twins of
ggml's reference ones with identical bytes (``quantize_legacy``); BF16 is delegated to
gguf-py. One deliberate difference from ggml everywhere: an f16 value (an F16 element, a
block scale or min) beyond ±65504 saturates there instead of becoming inf, so a finite
input never dequantizes to inf or NaN. Work is done in chunks of whole blocks so that the
temporaries stay in cache (there is no Python loop over blocks), and the chunks are spread
over threads: NumPy releases the GIL inside its loops, and each chunk writes only its own
rows, so the bytes do not depend on the thread count.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from . import quantize_k, quantize_k_low, quantize_legacy as legacy
from .formats import block_geometry
from .quantize_k import f16_bytes

# Elements a work chunk, measured on the 16-core H200 host (2026-12-02, 4096 x 4096 Q4_K):
# one thread is fastest with 64K (the search temporaries stay in L2: 41 MB/s against 36 at
# 256K); threads need bigger chunks, since the many small NumPy calls per chunk hold the GIL
# (16 threads: 28 MB/s at 64K, 73 at 256K, 185 at 1M, 82 at 4M). Threads split the input
# evenly between these bounds.
_CHUNK_ELEMS = 1 << 16
_THREAD_CHUNK_ELEMS = 1 << 20


def _quantize_f32(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint8)  # f32 [N, 1] -> uint8 [N, 4]


def _quantize_f16(x: np.ndarray) -> np.ndarray:
    return f16_bytes(x).reshape(x.shape[0], 2)  # f32 [N, 1] -> uint8 [N, 2]


_BLOCK_QUANT = {
    T.F32: _quantize_f32,
    T.F16: _quantize_f16,
    T.Q4_0: legacy.quantize_q4_0,
    T.Q4_1: legacy.quantize_q4_1,
    T.Q5_0: legacy.quantize_q5_0,
    T.Q5_1: legacy.quantize_q5_1,
    T.Q8_0: legacy.quantize_q8_0,
    T.Q2_K: quantize_k_low.quantize_q2_k,
    T.Q3_K: quantize_k_low.quantize_q3_k,
    T.Q4_K: quantize_k.quantize_q4_k,
    T.Q5_K: quantize_k.quantize_q5_k,
    T.Q6_K: quantize_k.quantize_q6_k,
}
QUANTIZE_TYPES = frozenset(_BLOCK_QUANT) | {T.BF16}


def _quantize_bf16(x: np.ndarray) -> np.ndarray:
    # gguf-py's BF16 is ggml's rounding (to nearest even, NaNs kept quiet); one long row,
    # because gguf-py works in groups of 16 rows and a row per element would crawl
    out = gguf.quants.quantize(x.reshape(1, -1), T.BF16)
    return np.ascontiguousarray(out).view(np.uint8).reshape(x.shape[0], 2)  # f32 [N, 1] -> [N, 2]


_BLOCK_QUANT[T.BF16] = _quantize_bf16


def default_threads() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def quantize(x: np.ndarray, qtype, *, threads: int | None = None) -> np.ndarray:
    """Quantize rows of float values into ggml blocks.

    Args:
      x: float array [..., n] (converted to float32); n a multiple of the type's block size;
        every value finite.
      qtype: a type in ``QUANTIZE_TYPES`` (GGMLQuantizationType or its integer id).
      threads: worker threads (default: every CPU this process may use). NumPy holds the
        GIL between its calls, so threads scale only ~3-5x on the K-quants on 16 cores;
        ``QuantizePool`` (worker processes) does better there (see its module).
    Returns:
      uint8 [..., row_bytes] with row_bytes = n / block_elems * block_bytes (for F32 / F16 /
      BF16 the values' own bytes).
    Raises:
      ValueError: an unsupported type, a row length that is not a whole number of blocks,
        or non-finite input.
    """
    qtype = T(qtype)
    if qtype not in QUANTIZE_TYPES:
        names = ", ".join(sorted(t.name for t in QUANTIZE_TYPES))
        raise ValueError(f"quantize: no quantizer for {qtype.name} (have: {names})")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("quantize: input must have at least one axis")
    elems, nbytes = block_geometry(qtype)
    n = x.shape[-1]
    if n % elems:
        raise ValueError(f"quantize: row length {n} is not a multiple of the {qtype.name} block size {elems}")
    if not np.isfinite(x).all():
        raise ValueError(f"quantize: input to {qtype.name} holds {np.count_nonzero(~np.isfinite(x))} non-finite values")
    fn = _BLOCK_QUANT[qtype]
    blocks = x.reshape(-1, elems)  # [NB, elems]
    out = np.empty((blocks.shape[0], nbytes), np.uint8)
    threads = threads or default_threads()
    chunk = _CHUNK_ELEMS
    if threads > 1:
        chunk = int(np.clip(blocks.size // threads, _CHUNK_ELEMS, _THREAD_CHUNK_ELEMS))
    step = max(1, chunk // elems)
    starts = range(0, blocks.shape[0], step)

    def work(start: int) -> None:
        out[start:start + step] = fn(blocks[start:start + step])

    threads = min(threads, len(starts))
    if threads <= 1:
        for start in starts:
            work(start)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, starts))  # list() re-raises a worker's exception here
    return out.reshape(*x.shape[:-1], n // elems * nbytes)
