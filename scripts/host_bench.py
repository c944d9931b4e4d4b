"""Benchmark the host expert kernels (bloomery_jax.host) against the machine's read bandwidth.

    .venv/bin/python scripts/host_bench.py                       # Qwen3-30B-A3B expert shapes
    .venv/bin/python scripts/host_bench.py --tokens 1,8 --threads 1,2 --reps 5 --out host.json
    .venv/bin/python scripts/host_bench.py --asm                 # packed-SIMD mix of each row kernel

For each weight set (``q4_k_m``: Q4_K gate/up + Q6_K down, as in a Q4_K_M file; ``q8_0``), each
token count N and thread count, one layer call routes N tokens to k of E experts, all on the
host, once per activation variant (f32, q8; interleaved call by call so that a noisy machine
disturbs them alike). It reports the median time over ``--reps`` routings after ``--warmup``,
and GB/s = bytes of the distinct experts the call touched / time, next to a Numba parallel sum
over a large float32 array timed between the calls with the same threads (the read bandwidth:
the median of one sum a repetition, under the calls' conditions), and their ratio. "work GB/s"
counts an expert's bytes once per (token, expert) pair: the rate of the dot products themselves,
above GB/s once tokens share experts (an expert with ``multi_min`` tokens or more decodes each
row once for all of them; fewer, and each pair reads the rows again, from cache).
``--multi-min`` sets host_moe_swiglu's threshold (default: its own; a large value turns the
multi-token path off, for a before/after in one run). Routing changes every call (every
variant's too) and walks through all E experts, so the weights come from DRAM, not from the
last call's cache. "empty ms" is the same call with no expert on the host: what a call costs
before any dot product.

Weights: ``--distinct`` experts are quantized from random normals with the repo's quantizer and
tiled to E experts (distinct memory, the same values: quantizing all 128 would take minutes).
``--memory`` reads them from other kinds of host memory too (``in_memory``): NumPy's own (huge
pages where the kernel allows), anonymous memory on small or huge pages (the FFI bridge's two
``BLOOMERY_HOST_PAGES`` settings), or a file's page cache (the callback bridge's GGUF views).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import re
import shutil
import tempfile
import time
from collections import Counter

import numba
import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from bloomery_jax.host import HostExpertLayer, HostTensor, host_moe_swiglu
from bloomery_jax.host.memory import host_buffer, huge_page_bytes
from bloomery_jax.host import blocks as B
from bloomery_jax.host.swiglu import CHUNKSIZE, PREFETCH_BYTES, ROWS_PER_ITEM
from bloomery_jax.quant import quantize

WEIGHT_SETS = {"q4_k_m": (T.Q4_K, T.Q6_K), "q8_0": (T.Q8_0, T.Q8_0), "q5_k": (T.Q5_K, T.Q5_K),
               "q6_k": (T.Q6_K, T.Q6_K), "f16": (T.F16, T.F16)}


@njit(parallel=True, fastmath=True, cache=True)
def _parallel_sum(a):
    s = np.float32(0)
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def _timed_sum(a: np.ndarray) -> float:
    """Seconds of one Numba parallel sum over ``a``."""
    t0 = time.perf_counter()
    _parallel_sum(a)
    return time.perf_counter() - t0


def read_bandwidth(a: np.ndarray, reps: int) -> tuple[float, int]:
    """GB/s of a Numba parallel float32 sum over ``a`` (median of ``reps`` after a warm-up), and
    how many of the array's bytes sit on huge pages."""
    _parallel_sum(a)
    ts = [_timed_sum(a) for _ in range(reps)]
    return a.nbytes / float(np.median(ts)) / 1e9, huge_page_bytes(a)


def _tensor(w: np.ndarray, qtype, E: int) -> HostTensor:
    raw = quantize(w, qtype)  # [distinct, rows, row_bytes]
    reps = -(-E // raw.shape[0])
    raw = np.ascontiguousarray(np.tile(raw, (reps, 1, 1))[:E])
    data = raw.view(np.float16) if qtype == T.F16 else raw
    return HostTensor(data, qtype, (E, w.shape[1], w.shape[2]))


MEMORIES = ("numpy", "small", "huge", "file")


def in_memory(layer: HostExpertLayer, memory: str, tmpdir: str, copy: bool = False) -> HostExpertLayer:
    """``layer`` copied into one kind of host memory: "numpy" as built (NumPy asks large arrays
    for huge pages), "small" / "huge" anonymous memory on 4 KiB / 2 MiB pages (``host.memory``:
    the FFI bridge's pinned memory by default / with BLOOMERY_HOST_PAGES=huge), "file" a memmap of
    a file written with its bytes (the page cache, as the callback bridge reads the GGUF)."""
    if memory == "numpy":
        return layer.copied(lambda n: np.empty(n, np.uint8)) if copy else layer
    if memory == "file":
        def alloc(n: int) -> np.ndarray:
            with tempfile.NamedTemporaryFile(dir=tmpdir, suffix=".bin", delete=False) as f:
                f.truncate(n)
            return np.memmap(f.name, np.uint8, mode="r+", shape=(n,))

        return layer.copied(alloc)
    return layer.copied(lambda n: host_buffer(n, memory))


def make_layer(name: str, E: int, F: int, D: int, distinct: int, seed: int = 0) -> HostExpertLayer:
    gu, dn = WEIGHT_SETS[name]
    rng = np.random.default_rng(seed)
    w = [rng.standard_normal(s).astype(np.float32) * 0.02 for s in ((distinct, F, D), (distinct, F, D), (distinct, D, F))]
    return HostExpertLayer(_tensor(w[0], gu, E), _tensor(w[1], gu, E), _tensor(w[2], dn, E))


def routings(rng, N: int, k: int, E: int, count: int):
    """``count`` routings [N, k]; consecutive calls start at different experts so that the
    experts of one call are rarely still cached from the previous ones."""
    out = []
    for c in range(count):
        base = (c * k * N) % E
        rows = []
        for n in range(N):
            if n == 0:
                rows.append((base + np.arange(k)) % E)
            else:
                rows.append(rng.choice(E, k, replace=False))
        out.append(np.stack(rows).astype(np.int32))
    return out


def bench_case(layers: list, acts: list[str], N: int, k: int, reps: int, warmup: int, seed: int = 0,
               chunksize: int = CHUNKSIZE, multi_min: int | None = None,
               layouts: tuple[tuple[int, int], ...] = ((ROWS_PER_ITEM, PREFETCH_BYTES),),
               bw_array: np.ndarray | None = None) -> tuple[dict[tuple, dict], list[float]]:
    """Time one layer call per routing for each variant (activation, rows per work item,
    prefetch bytes ahead), interleaved (variant after variant, the order rotating each repetition),
    so that a noisy machine disturbs the variants alike. Every call has a routing of its own: a
    variant run on the routing the previous one just read would find up to a whole call's experts
    (24.5 MB at one token) in the last-level cache (the twenty-fifth session's 3,456-byte "win" was
    such a second variant). Calls cycle through ``layers`` (copies in memory of their own) as a
    decode step cycles through its layers, so that an expert comes back only after more bytes
    than the last-level cache holds (the twenty-sixth session's H100 host showed 300 MiB of L3;
    one layer of 128 experts is 392 MB). Where ``bw_array`` is given, each repetition also times
    one parallel sum over it: the read bandwidth under the same conditions as the calls. Returns, keyed
    (act, rows_per_item, prefetch_bytes), each variant's times, and the bandwidth samples (GB/s)."""
    E = layers[0].n_experts
    D, F = layers[0].dims
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, D)).astype(np.float32)
    w = rng.dirichlet(np.ones(k), N).astype(np.float32)
    on_host = np.ones(E, bool)
    ts = {(act, rpi, pf): [] for act in acts for rpi, pf in layouts}
    variants = list(ts)
    routes = iter(routings(rng, N, k, E, (warmup + reps) * len(variants)))
    per_expert = layers[0].expert_bytes()
    nbytes, bw = [], []
    calls = itertools.count()
    for i in range(warmup + reps):
        for j in range(len(variants)):
            act, rpi, pf = variants[(i + j) % len(variants)]
            ex = next(routes)
            t0 = time.perf_counter()
            host_moe_swiglu(x, ex, w, on_host, layers[next(calls) % len(layers)], act=act, chunksize=chunksize,
                            multi_min=multi_min, rows_per_item=rpi, prefetch_bytes=pf)
            dt = time.perf_counter() - t0
            if i >= warmup:
                ts[(act, rpi, pf)].append(dt)
                nbytes.append(len(np.unique(ex)) * per_expert)
        if bw_array is not None and i >= warmup:
            bw.append(bw_array.nbytes / _timed_sum(bw_array) / 1e9)
    # The same call with no pair on the host: argument checks, Numba dispatch, grouping, return.
    none_on_host = np.zeros(E, bool)
    empty = []
    for ex in routings(rng, N, k, E, reps):
        t0 = time.perf_counter()
        host_moe_swiglu(x, ex, w, none_on_host, layers[0], chunksize=chunksize, multi_min=multi_min)
        empty.append(time.perf_counter() - t0)
    empty_ms = float(np.median(empty)) * 1e3
    gb = float(np.median(nbytes)) / 1e9
    work = N * k * per_expert / 1e9  # weight bytes the dot products run through (once per pair)
    out = {}
    for key, times in ts.items():
        t, best = float(np.median(times)), float(np.min(times))
        out[key] = {"rows_per_item": key[1], "prefetch_bytes": key[2], "ms": t * 1e3, "ms_min": best * 1e3, "GB": gb, "GBps": gb / t, "GBps_best": gb / best,
                    "pairs": N * k, "work_GBps": work / t, "empty_ms": empty_ms}
    return out, bw


def asm_mix(top: int = 8) -> dict[str, list]:
    """The most frequent ymm/zmm instructions in each row kernel's machine code (standalone
    compilations with the kernel's argument types; inside the layer kernel they are inlined)."""
    K = 512
    tab16, tabbf = B.conversion_tables()
    x, xs, xd = np.zeros(K, np.float32), np.zeros(K // 32, np.float32), np.zeros(K // 32, np.float32)
    xq, xb = np.zeros(K, np.int16), np.zeros(K // 32, np.int32)
    row = lambda n: np.zeros(n, np.uint8)  # noqa: E731
    xq8, x16 = np.zeros(K, np.int8), np.zeros(K // 16, np.int16)
    calls = {"dot_q4_k_f32": (row(288), x, xs, tab16), "dot_q4_k_q8": (row(288), xq, xq8, xd, xb, x16, tab16),
             "dot_q5_k_f32": (row(352), x, xs, tab16), "dot_q5_k_q8": (row(352), xq, xq8, xd, xb, x16, tab16),
             "dot_q6_k_f32": (row(420), x, tab16), "dot_q6_k_q8": (row(420), xq, xq8, xd, xb, x16, tab16),
             "dot_q8_0_f32": (row(544), x, tab16), "dot_q8_0_q8": (row(544), xq, xd, tab16),
             "dot_f32": (row(4 * K), x), "dot_f16": (row(2 * K), x, tab16)}
    # the multi-token path: one row decoded into buffers, then dotted with several tokens
    wq, wsc, wm, wdm, wf = (np.zeros(K, np.int16), np.zeros(K // 32 + 1, np.float32), np.zeros(K // 32 + 1, np.int16),
                            np.zeros(K // 256 + 1, np.float32), np.zeros(K, np.float32))
    X, XQ, XD, XB = np.zeros((4, K), np.float32), np.zeros((4, K), np.int16), np.zeros((4, K // 32), np.float32), np.zeros((4, K // 32), np.int32)
    calls["decode_row"] = (B.Q4_K, 1, row(288), wq, wsc, wm, wdm, wf, tab16, tabbf)
    calls["mdot"] = (B.Q4_K, 1, wq, wsc, wm, wdm, wf, np.arange(4), X, XQ, XD, XB, XQ, XD, np.zeros(4, np.float32))
    out = {}
    for name, args in calls.items():
        fn = njit(fastmath=True, nogil=True)(getattr(B, name).py_func)  # uncached: Numba can't inspect cached code
        fn(*args)
        asm = "\n".join(fn.inspect_asm().values())
        ops = Counter(f"{op}:{reg}" for op, reg in re.findall(r"\b(v\w+)\s+[^\n]*?\b(ymm|zmm)", asm))
        out[name] = ops.most_common(top)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d", type=int, default=2048, help="model width D (Qwen3-30B-A3B: 2048)")
    p.add_argument("--f", type=int, default=768, help="expert hidden width F (768)")
    p.add_argument("--experts", type=int, default=128, help="experts per layer E (128)")
    p.add_argument("--k", type=int, default=8, help="experts per token (8)")
    p.add_argument("--tokens", default="1,2,8,64", help="token counts N, comma separated")
    p.add_argument("--threads", default=str(numba.config.NUMBA_NUM_THREADS), help="thread counts, comma separated")
    p.add_argument("--weights", default="q4_k_m,q8_0", help=f"weight sets ({', '.join(WEIGHT_SETS)})")
    p.add_argument("--acts", default="f32,q8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunksize", type=int, default=CHUNKSIZE, help="host_moe_swiglu's chunksize (0: static)")
    p.add_argument("--multi-min", type=int, default=None,
                   help="host_moe_swiglu's multi_min (default: its own; 1000000 turns the multi-token path off)")
    p.add_argument("--layouts", default=f"{ROWS_PER_ITEM}:{PREFETCH_BYTES}",
                   help="work-item layouts to compare, comma separated ROWS_PER_ITEM:PREFETCH_BYTES "
                        "(e.g. 16:0,16:2,64:0,64:2)")
    p.add_argument("--memory", default="numpy",
                   help=f"host memory kinds the weights are read from, comma separated ({', '.join(MEMORIES)})")
    p.add_argument("--distinct", type=int, default=4, help="experts quantized, then tiled to E")
    p.add_argument("--layers", type=int, default=4,
                   help="copies of the layer the calls cycle through (bytes between an expert's reads: this times E)")
    p.add_argument("--bw-mib", type=int, default=1024, help="array size of the read-bandwidth sum")
    p.add_argument("--asm", action="store_true", help="print each row kernel's packed-SIMD mix (after the run)")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)

    tokens = [int(s) for s in a.tokens.split(",")]
    threads = [int(s) for s in a.threads.split(",")]
    layouts = tuple(tuple(int(v) for v in s.split(":")) for s in a.layouts.split(","))
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "numba": numba.__version__,
                           "threading_layer": None, "cores": numba.config.NUMBA_NUM_THREADS},
               "shape": {"D": a.d, "F": a.f, "E": a.experts, "k": a.k}, "layers": a.layers, "bandwidth": {}, "runs": []}
    layers = {}
    tmpdir = tempfile.mkdtemp(prefix="host_bench_")
    for name in a.weights.split(","):
        t0 = time.perf_counter()
        built = make_layer(name, a.experts, a.f, a.d, a.distinct)
        print(f"{name}: {built.expert_bytes() / 1e6:.2f} MB an expert, "
              f"{built.expert_bytes() * a.experts / 1e9:.2f} GB a layer (built in {time.perf_counter() - t0:.1f} s)")
        for memory in a.memory.split(","):
            copies = [in_memory(built, memory, tmpdir, copy=c > 0) for c in range(a.layers)]
            key = name if memory == "numpy" else f"{name}@{memory}"
            layers[key] = copies
            huge = sum(huge_page_bytes(t.data) for layer in copies for t in (layer.gate, layer.up, layer.down))
            results.setdefault("memory", {})[key] = dict(kind=memory, huge_page_bytes=huge)
            print(f"  {key}: {huge / 2**20:.0f} MiB of its mappings on huge pages")
    bw_array = np.ones(a.bw_mib * (1 << 20) // 4, np.float32)
    for th in threads:
        numba.set_num_threads(th)
        # The read bandwidth: a sum before the kernels, one between each repetition's calls (the
        # ratio's denominator: the conditions the calls ran under) and one after. On the
        # twenty-fifth session's host one process read 76.1 GB/s where the next read 131.8.
        before, huge = read_bandwidth(bw_array, max(5, a.reps // 2))
        between = []
        print(f"\nthreads {th}: read bandwidth (numba parallel sum, {a.bw_mib} MiB f32, "
              f"{huge / 2**20:.0f} MiB on huge pages) {before:.1f} GB/s before the kernels")
        print(f"{'weights':14s} {'act':4s} {'rpi:bytes':9s} {'N':>4s} {'ms':>8s} {'MB':>7s} {'GB/s':>6s} "
              f"{'best GB/s':>9s} {'work GB/s':>9s} {'empty ms':>8s}")
        runs = []
        for name, copies in layers.items():
            for N in tokens:
                case, samples = bench_case(copies, a.acts.split(","), N, a.k, a.reps, a.warmup, chunksize=a.chunksize,
                                           multi_min=a.multi_min, layouts=layouts, bw_array=bw_array)
                between += samples
                for (act, rpi, pf), r in case.items():
                    r.update(weights=name, act=act, N=N, threads=th, memory=results["memory"][name]["kind"])
                    runs.append(r)
                    print(f"{name:14s} {act:4s} {rpi:3d}:{pf:<5d} {N:4d} {r['ms']:8.3f} {r['GB'] * 1e3:7.1f} {r['GBps']:6.2f} "
                          f"{r['GBps_best']:9.2f} {r['work_GBps']:9.2f} {r['empty_ms']:8.3f}")
        after, _ = read_bandwidth(bw_array, max(5, a.reps // 2))
        bw = results["bandwidth"][th] = float(np.median(between))
        results.setdefault("bandwidth_samples", {})[th] = dict(
            before=before, between=between, after=after, huge_page_bytes=huge)
        for r in runs:
            r["ratio"] = r["GBps"] / bw
        results["runs"] += runs
        print(f"threads {th}: read bandwidth between the calls {bw:.1f} GB/s (median of {len(between)}, "
              f"{min(between):.1f}-{max(between):.1f}), after {after:.1f}; ratio (GB/s to it): "
              + ", ".join(f"{r['weights']} {r['act']} {r['rows_per_item']}:{r['prefetch_bytes']} N={r['N']} {r['ratio']:.2f}" for r in runs))
    results["machine"]["threading_layer"] = numba.threading_layer()
    print(f"\nnumba threading layer: {results['machine']['threading_layer']}")
    if a.asm:
        results["asm"] = asm_mix()
        for name, ops in results["asm"].items():
            print(f"{name:14s} " + ", ".join(f"{op} x{n}" for op, n in ops))
    shutil.rmtree(tmpdir, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
