"""Throughput of bloomery_jax.quant.quantize: MB/s of float32 input for each type.

    .venv/bin/python scripts/quant_bench.py                  # 4096 x 4096, every type, 1 thread
    .venv/bin/python scripts/quant_bench.py --threads 1 16   # and with 16 threads
    .venv/bin/python scripts/quant_bench.py --types Q4_K Q6_K --rows 1024
    .venv/bin/python scripts/quant_bench.py --threads 1 16 --processes 16   # QuantizePool too

Reports wall-clock MB/s (best of --repeat runs) and, for one thread, CPU-time MB/s too:
on a shared machine the CPU time is the steadier number. Also prints the round-trip
relative RMS error, as a check that the run did real work.
"""

from __future__ import annotations

import argparse
import sys
import time

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from bloomery_jax.quant import QUANTIZE_TYPES, QuantizePool, quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--types", nargs="*", default=None, help="ggml type names (default: all)")
    ap.add_argument("--threads", nargs="*", type=int, default=[1])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--chunk", type=int, nargs="*", default=None,
                    help="elements per work chunk to sweep (default: the module's)")
    ap.add_argument("--processes", type=int, nargs="*", default=[],
                    help="also time a QuantizePool of each of these sizes")
    args = ap.parse_args()
    qmod = sys.modules["bloomery_jax.quant.quantize"]
    chunks = args.chunk or [0]  # 0: the module's own chunk sizes
    defaults = qmod._CHUNK_ELEMS, qmod._THREAD_CHUNK_ELEMS
    pools = {p: QuantizePool(p) for p in args.processes}
    for pool in pools.values():  # start the workers before timing
        pool.quantize(np.zeros((1024, 4096), np.float32), T.Q8_0)
    types = [T[n] for n in args.types] if args.types else sorted(QUANTIZE_TYPES)
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    mb = x.nbytes / 1e6
    print(f"input f32 [{args.rows}, {args.cols}] = {mb:.0f} MB")
    runs = [(q, c, t) for q in types for c in chunks for t in args.threads]
    runs += [(q, 0, -p) for q in types for p in args.processes]  # negative: processes
    for qtype, chunk, threads in runs:
        qmod._CHUNK_ELEMS, qmod._THREAD_CHUNK_ELEMS = (chunk, chunk) if chunk else defaults
        wall, cpu = [], []
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            if threads < 0:
                raw = pools[-threads].quantize(x, qtype)
            else:
                raw = quantize(x, qtype, threads=threads)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        y = raw.view(np.float32) if qtype == T.F32 else gguf.quants.dequantize(raw, qtype)
        err = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
        how = f"processes {-threads:3d}" if threads < 0 else f"threads {threads:3d}"
        line = f"{qtype.name:5s} chunk {chunk or 'auto':>7} {how}  {mb / min(wall):8.1f} MB/s wall"
        if threads == 1:
            line += f"  {mb / min(cpu):8.1f} MB/s cpu"
        print(f"{line}   rel RMS {err:.5f}", flush=True)
    for pool in pools.values():
        pool.close()


if __name__ == "__main__":
    main()
