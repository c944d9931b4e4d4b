"""One core's throughput of the host row dots against Q8_K activations, from L2 (compute bound).

For each of Q4_K, Q5_K and Q6_K: 512 rows of 2048 columns (0.6-0.9 MB, inside a core's L2), every row
dotted with one quantized activation vector, by the portable kernel, the AVX2 one and, where the
CPU has AVX-512BW, the zmm one (``bloomery_jax.host.simd``), one after another, median of --reps
calls a round. Prints GB/s of weight bytes and each vector kernel's largest difference from the
portable one (the integer block sums are equal; their float combination is ordered
differently: the vector kernels sum in 8 or 16 lanes).

    python scripts/row_dot_bench.py [--rounds 3 --reps 100]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from bloomery_jax.host import blocks as B
from bloomery_jax.host import simd
from bloomery_jax.quant import quantize


def _rows(dot):
    @njit(nogil=True)
    def run(W, xq, xq8, xd, xb, x16, tab16, out):
        for r in range(W.shape[0]):
            out[r] = dot(W[r], xq, xq8, xd, xb, x16, tab16)
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=100)
    a = p.parse_args(argv)
    if not simd.HAS_AVX2:
        raise SystemExit("this CPU has no AVX2: only the portable kernels exist here")
    rng = np.random.default_rng(0)
    K, R = 2048, 512
    xq, xd, xb = np.empty(K, np.int16), np.empty(K // 256, np.float32), np.empty(K // 32, np.int32)
    B.quantize_q8_k(rng.standard_normal(K).astype(np.float32), xq, xd, xb)
    xq8, x16 = np.empty(K, np.int8), np.empty(K // 16, np.int16)
    B.pack_q8_k(xq, xq8, x16)
    tab16, _ = B.conversion_tables()
    tags = ("portable", "avx2", "avx512") if simd.HAS_AVX512BW else ("portable", "avx2")
    for name, qtype in (("Q4_K", T.Q4_K), ("Q5_K", T.Q5_K), ("Q6_K", T.Q6_K)):
        kernels = [getattr(B, f"_dot_{name.lower()}_q8_{tag}") for tag in tags]
        W = np.asarray(quantize(rng.standard_normal((R, K)).astype(np.float32), qtype)).reshape(R, -1)
        runs = {tag: (_rows(k), np.empty(R, np.float32)) for tag, k in zip(tags, kernels)}
        for run, out in runs.values():
            run(W, xq, xq8, xd, xb, x16, tab16, out)  # compile
        gbs = {tag: [] for tag in runs}
        for _ in range(a.rounds):
            for tag, (run, out) in runs.items():
                ts = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    run(W, xq, xq8, xd, xb, x16, tab16, out)
                    ts.append(time.perf_counter() - t0)
                gbs[tag].append(round(W.nbytes / float(np.median(ts)) / 1e9, 2))
        ref = runs["portable"][1]
        rel = {tag: float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))) for tag, (_, out) in runs.items() if tag != "portable"}
        print(f"{name}: GB/s one core from L2 {gbs}; largest difference from portable / its largest |value| "
              + ", ".join(f"{t} {v:.1e}" for t, v in rel.items()))


if __name__ == "__main__":
    main()
