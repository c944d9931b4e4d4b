"""Decode GEMV bench: our Pallas qgemv against XLA's fused ``x @ dequantize(W).T`` on the GPU.

For each format (Q8_0, Q4_K, Q5_K, Q6_K) and Qwen3-30B-A3B decode shape (plus an 8192x8192
square) it sweeps the kernel's launch parameters, checks every variant's output against the
float32 reference within the summation-order bound, and reports achieved GB/s of weight bytes
against the card's copy bandwidth measured in the same run. JSON goes to --out after every
measurement, so a run cut short still leaves its numbers.

Timing, two ways. Warm: one jitted call applies the kernel to R distinct copies of the weight
(R <= --max-copies, enough to hold --rotate-mb where that cap allows) and stacks the outputs;
calls are dispatched back to back and the time per GEMV is wall time / (calls * R), which
includes the gaps between kernels a jitted step also pays; when the R copies fit in the 60 MB
L2 the row says l2_resident. Cold (--cupti): the winner and XLA run after a 256 MiB L2 flush
and torch's profiler (CUPTI sees every kernel in the process) reads the kernels' own device
time: that is the decode case, where weights always come from HBM.

  python scripts/kernel_bench.py --out /tmp/kb --plan full --cupti --budget-s 250
  python scripts/kernel_bench.py --plan tiny --interpret   # CPU check of the script itself
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.ops.actquant import quantize_q8_1  # noqa: E402
from bloomery_jax.pallas import qgemv_q8 as q8  # noqa: E402
from bloomery_jax.pallas.qgemv import GemvConfig, pick_config, qgemv, rounding_depth  # noqa: E402
from bloomery_jax.quant import dequantize  # noqa: E402
from bloomery_jax.quant.repack import dequantize_packed, repack, scale_magnitudes  # noqa: E402
from bloomery_jax.synth.blocks import random_blocks  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
U = 2.0 ** -24

# Qwen3-30B-A3B (hidden 2048, 32 q heads and 4 kv heads of 128, expert ff 768, vocab 151936)
SHAPES = {
    "square_8192": (8192, 8192),
    "output": (151936, 2048),
    "attn_q": (4096, 2048),
    "attn_o": (2048, 4096),
    "attn_kv": (512, 2048),
    "expert_gate_up": (768, 2048),
    "expert_down": (2048, 768),
    "tiny": (64, 512),
}
FORMATS = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K]
WEIGHT_STD = 0.02  # random valid weights (synth.blocks.random_blocks); the bound is checked on them too
C = GemvConfig


def rows_big():
    """rows kernel on large matrices: rows per program x chunks per step, 4 warps; then warps."""
    grid = [C(bn, cps, 4, 3) for bn, cps in itertools.product((8, 16, 32), (1, 2, 4))]
    return grid + [C(16, 2, 2, 3), C(16, 2, 8, 3), C(32, 2, 8, 3)]


def rows_small():
    """Few programs, latency-bound: few rows per program, several chunks in flight."""
    return [C(4, 4, 4, 3), C(8, 2, 4, 3), C(8, 4, 4, 3), C(16, 2, 4, 3), C(8, 8, 2, 3)]


# the best planes configs of the first run (benchmarks/kernel_bench_2026-12-02.json, "discover")
PLANES_BEST = {T.Q4_K: C(32, 4, 8, 3), T.Q6_K: C(16, 2, 8, 3), T.Q8_0: C(32, 4, 8, 3), T.Q5_K: C(32, 4, 8, 3)}



def planes_decode():
    """The planes kernel at decode shapes: rows per program, warps, and programs per row tile
    (split_k) for matrices whose row tiles alone leave SMs idle."""
    return [C(32, 4, 8, 3), C(16, 2, 4, 3), C(16, 2, 4, 3, 2), C(16, 2, 4, 3, 4), C(32, 2, 8, 3, 2),
            C(32, 2, 8, 3, 4), C(8, 2, 2, 3), C(8, 2, 2, 3, 2), C(8, 1, 2, 3, 4), C(16, 1, 4, 3, 8)]


def q8_decode():
    """The integer dot-product kernel (``qgemv_q8`` on x already rounded to Q8_1):
    rows per program, warps and split_k."""
    return [C(32, 1, 4, 3), C(32, 1, 4, 3, 2), C(64, 1, 4, 3, 2), C(64, 1, 8, 3, 2), C(16, 1, 2, 3, 2),
            C(16, 1, 4, 3, 4), C(64, 1, 4, 3, 4), C(128, 1, 8, 3, 2), C(32, 1, 2, 3, 8)]


# (shape names, formats, rows sweep, batch sizes for the winner, other kernels: True for the
# planes kernel's best 8192x8192 config, a list of planes configs to sweep, or a dict
# {"planes": [...], "q8": [...]})
PLANS = {
    "square": [(["square_8192"], [T.Q4_K, T.Q6_K], rows_big, [1], False)],
    "q8": [(["attn_q", "attn_kv", "attn_o", "expert_down", "square_8192"], [T.Q4_K, T.Q6_K], list, [1],
            {"planes": [None], "q8": q8_decode()})],
    "planes30b": [(["attn_q", "attn_kv", "attn_o", "expert_down"], [T.Q4_K, T.Q6_K], list, [1], planes_decode())],
    "tiny": [(["tiny"], [T.Q4_K, T.Q6_K], lambda: [C(16, 1, 4, 3), C(32, 2, 4, 3)], [1, 2],
              {"planes": [None], "q8": [C(16, 1, 4, 3, 2)]})],
    "full": [
        (["square_8192"], FORMATS, rows_big, [1, 8], True),
        (["output"], [T.Q6_K, T.Q8_0, T.Q4_K], lambda: rows_big()[1:9:2], [1, 8], False),
        (["attn_q", "attn_kv", "expert_gate_up", "expert_down", "attn_o"], [T.Q4_K, T.Q6_K], rows_small, [1, 8], False),
        (["attn_q", "attn_kv", "expert_gate_up", "expert_down", "attn_o", "output"], [T.Q8_0, T.Q5_K],
         lambda: rows_small()[1:4], [1], False),
    ],
}


def copies(tree, r: int):
    """r distinct device copies of a pytree of arrays (same values, different buffers)."""
    return [tree] + [jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), tree) for _ in range(r - 1)]


def time_calls(fn, args, min_total_s: float, repeats: int = 3) -> tuple[float, list[float]]:
    """Median wall time of one call, with calls dispatched back to back (async)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    calls = max(2, min(200, int(min_total_s / one)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):  # keep only the last output alive: 200 x 1 GiB would not fit
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples), samples


def ceilings(mib: int) -> dict:
    """Copy (read + write) and read-only bandwidth of the card, bytes per second."""
    n = mib * 2 ** 20 // 4
    a = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)
    read = jax.jit(lambda v: jnp.sum(v))
    t_copy, s_copy = time_calls(copy, (a,), 0.05, 5)
    t_read, s_read = time_calls(read, (a,), 0.05, 5)
    return dict(bytes=4 * n, copy_Bps=2 * 4 * n / t_copy, read_Bps=4 * n / t_read,
                copy_samples_s=s_copy, read_samples_s=s_read)


def cold_kernel_us(one_call, x, w, flush, pattern: str, copy_bps: float, reps: int = 6):
    """Device time of one GEMV with the L2 flushed before it, from CUPTI (torch's profiler).

    Each GEMV follows a read+write of a 256 MiB buffer (4x the L2), chained through a
    data dependence so XLA keeps the order. Kernels whose name contains ``pattern`` are
    summed per GEMV ("" = every kernel except the flush's and the chaining ones).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    def body(x, w, buf):
        ys = []
        for _ in range(reps):
            buf = buf + 1.0  # the flush
            xi = x + buf[0] * 0.0  # order: flush, then GEMV
            y = one_call(xi, w)
            buf = buf.at[0].add(y.reshape(-1)[0] * 0.0)
            ys.append(y)
        return jnp.stack(ys), buf

    fn = jax.jit(body)
    torch.zeros(1, device="cuda")
    out = jax.block_until_ready(fn(x, w, flush))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = jax.block_until_ready(fn(x, w, flush))
    del out
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    names = {}
    for e in kernels:
        names.setdefault(e.name, []).append(e.device_time)
    # the flush: the kernel run once a GEMV whose time is nearest 2 * 256 MiB / copy bandwidth
    expect = 2 * flush.nbytes / copy_bps
    flush_name = min((k for k, v in names.items() if len(v) == reps),
                     key=lambda k: abs(statistics.median(names[k]) - expect))
    big = statistics.median(names[flush_name])
    if pattern:
        picked = [t for k, v in names.items() if pattern in k for t in v]
    else:  # XLA's own GEMV: everything but the flush and the tiny chaining fusions
        picked = [t for k, v in names.items() if k != flush_name for t in v if t > 0.8]
    summary = {k: (len(v), round(statistics.median(v), 2)) for k, v in names.items()}
    return sum(picked) / reps, dict(flush_kernel=flush_name, flush_us=round(big, 1), kernels=summary)


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.t_start = time.time()
        self.meta = dict(argv=sys.argv, date=time.strftime("%Y-%m-%d %H:%M:%S"), jax=jax.__version__,
                         device=str(jax.devices()[0].device_kind), platform=platform.platform(),
                         interpret=args.interpret)
        self.flush = None

    def over_budget(self) -> bool:
        return time.time() - self.t_start > self.args.budget_s

    def save(self, extra=None):
        if extra:
            self.meta.update(extra)
        if self.args.out:
            os.makedirs(self.args.out, exist_ok=True)
            with open(os.path.join(self.args.out, "kernel_bench.json"), "w") as f:
                json.dump(dict(meta=self.meta, results=self.rows), f, indent=1)

    def record(self, **row):
        row["elapsed_s"] = round(time.time() - self.t_start, 1)
        self.rows.append(row)
        print(f"{row['format']:5} {row['shape']:15} B={row['B']} {row['impl']:11} {str(row.get('config')):16} "
              f"{row.get('us', float('nan')):9.2f} us {row.get('GBps', float('nan')):7.0f} GB/s "
              f"err/bound {row.get('err_ratio', float('nan')):.2g} {row.get('error', '')}", flush=True)
        self.save()

    def run_case(self, qtype, shape_name, sweep, batches, with_planes):
        a = self.args
        n, k = SHAPES[shape_name]
        rng = np.random.default_rng(n * 31 + k + int(qtype))
        raw = random_blocks(qtype, (n, k), WEIGHT_STD, rng)
        wbytes = raw.nbytes
        others = with_planes if isinstance(with_planes, dict) else {
            "planes": with_planes if isinstance(with_planes, list) else [PLANES_BEST[qtype]]} if with_planes else {}
        packed = {"rows": repack(raw, qtype, (n, k), "rows")}
        for impl in others:
            packed[impl] = repack(raw, qtype, (n, k), "ggml" if impl == "q8" else impl)
        # float64 truth; the magnitudes sum_k |x| (|s q| + |m|) every error bound scales with
        wf = np.asarray(dequantize_packed(packed["rows"]), np.float64)
        mag = np.asarray(scale_magnitudes(packed["rows"]), np.float64)
        r = 1 if a.interpret else max(1, min(a.max_copies, -(-a.rotate_mb * 2 ** 20 // wbytes)))
        xs = {b: rng.standard_normal((b, k)).astype(np.float32) for b in sorted(set(batches) | {1})}
        truth = {b: (xb.astype(np.float64) @ wf.T, np.abs(xb.astype(np.float64)) @ mag.T) for b, xb in xs.items()}
        if "q8" in others:
            # the q8 kernel takes the rounded rows (Q8Act) made once here, so its check sees only
            # the kernel's arithmetic and its time leaves out the rounding (one small fusion a step,
            # shared by the weights that read the same x); truth: the rounded values' product, with
            # the magnitudes of the terms it forms (stored quants and offsets)
            xq = {b: quantize_q8_1(jnp.asarray(xb)) for b, xb in xs.items()}
            mag_q8 = np.asarray(scale_magnitudes(packed["q8"], stored_quants=True), np.float64)
            truth_q8 = {b: (v @ wf.T, np.abs(v) @ mag_q8.T)
                        for b, v in ((b, np.asarray(x.values(), np.float64)) for b, x in xq.items())}
        del wf, mag
        stacks = {lay: copies(pw, r) for lay, pw in packed.items()}
        stacks["xla"] = copies(jnp.asarray(raw), r)
        common = dict(format=qtype.name, shape=shape_name, N=n, K=k, weight_bytes=wbytes, copies=r,
                      l2_resident=bool(r * wbytes < 120e6), bytes_read={lay: pw.nbytes for lay, pw in packed.items()})

        def one(impl, cfg):
            if impl == "xla":
                return lambda x, w: jnp.einsum("bk,nk->bn", x, dequantize(w, qtype, (n, k)), precision=HIGHEST)
            if impl == "q8":
                return lambda x, w: q8.qgemv_q8(x, w, config=cfg, interpret=a.interpret)
            return lambda x, w: qgemv(x, w, config=cfg, interpret=a.interpret)

        def measure(impl, b, cfg):
            fn1 = one(impl, cfg)
            fn = jax.jit(lambda x, ws: jnp.stack([fn1(x, w) for w in ws]))
            ws = stacks[impl]
            x = xq[b] if impl == "q8" else jnp.asarray(xs[b])
            t0 = time.perf_counter()
            tag = dict(B=b, impl=impl, config=cfg and dataclasses.astuple(cfg))
            try:
                out = jax.block_until_ready(fn(x, ws))
            except Exception as e:  # a variant Triton cannot build is a result, not a crash
                self.record(**common, **tag, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                return None
            compile_s = time.perf_counter() - t0
            depth = k if impl == "xla" else q8.rounding_depth(qtype, k, cfg) if impl == "q8" else rounding_depth(
                impl, qtype, k, cfg or pick_config(impl, qtype.name, n, k))
            want, m = (truth_q8 if impl == "q8" else truth)[b]
            ratio = float((np.abs(np.asarray(out[0], np.float64) - want) / (depth * U * m * 1.01 + 1e-30)).max())
            t, samples = time_calls(fn, (x, ws), a.min_total_s)
            gbps = wbytes / (t / r) / 1e9
            self.record(**common, **tag, us=t / r * 1e6, GBps=gbps, frac_copy=gbps * 1e9 / self.meta.get("copy_Bps", np.nan),
                        err_ratio=ratio, depth=depth, compile_s=round(compile_s, 2),
                        samples_us=[v / r * 1e6 for v in samples])
            return t / r * 1e6

        best = None
        for cfg in dict.fromkeys(sweep):
            if self.over_budget():
                break
            us = measure("rows", 1, cfg)
            if us is not None and (best is None or us < best[0]):
                best = (us, cfg)
        if best and not a.interpret and not self.over_budget():  # pipelining depth on the winner
            cfg = dataclasses.replace(best[1], num_stages=1)
            us = measure("rows", 1, cfg)
            if us is not None and us < best[0]:
                best = (us, cfg)
        if (with_planes or best is None) and not self.over_budget():
            if "planes" not in stacks:  # the rows kernel failed to build: keep a kernel in the table
                stacks["planes"] = copies(repack(raw, qtype, (n, k), "planes"), r)
            for impl, cfgs in (others or {"planes": [PLANES_BEST[qtype]]}).items():
                for cfg in cfgs:
                    if not self.over_budget():
                        measure(impl, 1, cfg)
        for b in batches:
            if self.over_budget():
                break
            if b != 1 and best:
                measure("rows", b, best[1])
            measure("xla", b, None)
        if a.cupti and best and not a.interpret and not self.over_budget():
            x = jnp.asarray(xs[1])
            for impl, cfg, pattern in (("rows", best[1], "qgemv"), ("xla", None, "")):
                try:
                    us, info = cold_kernel_us(one(impl, cfg), x, stacks[impl][0], self.flush, pattern,
                                              self.meta["copy_Bps"] / 1e6)
                    self.record(**common, B=1, impl=impl + "_cold", config=cfg and dataclasses.astuple(cfg), us=us,
                                GBps=wbytes / (us * 1e-6) / 1e9, frac_copy=wbytes / (us * 1e-6) / self.meta["copy_Bps"],
                                **info)
                except Exception as e:
                    self.record(**common, B=1, impl=impl + "_cold", config=None, error=f"{type(e).__name__}: {e}"[:300])


def table(rows, copy_bps):
    """Best time per (format, shape, B, impl); one line per case, GB/s of GGUF weight bytes."""
    best = {}
    for r in rows:
        if "us" not in r:
            continue
        key = (r["format"], r["shape"], r["B"], r["impl"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    impls = ["rows", "planes", "q8", "xla", "rows_cold", "xla_cold"]
    print(f"\ncopy bandwidth {copy_bps / 1e9:.0f} GB/s (read+write); cells: us / GB/s; "
          f"*_cold: CUPTI kernel time after an L2 flush; L2: the warm timing fit in L2")
    print(f"{'format':6} {'shape':15} {'B':>2} {'MB':>7} " + " ".join(f"{i:>16}" for i in impls)
          + "  best rows config")
    for fmt, shape, b in sorted({k[:3] for k in best}):
        base = next(best[(fmt, shape, b, i)] for i in impls if (fmt, shape, b, i) in best)
        cells = []
        for i in impls:
            r = best.get((fmt, shape, b, i))
            cells.append(f"{r['us']:8.1f}/{r['GBps']:6.0f}" + ("L" if r.get("l2_resident") and "cold" not in i else " ")
                         if r else f"{'-':>16}")
        cfg = best.get((fmt, shape, b, "rows"), {}).get("config")
        print(f"{fmt:6} {shape:15} {b:2} {base['weight_bytes'] / 1e6:7.2f} " + " ".join(cells) + f"  {cfg}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", choices=sorted(PLANS), default="full")
    p.add_argument("--formats", default="", help="comma list to restrict, e.g. Q4_K,Q6_K")
    p.add_argument("--out", default="")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no new variant after this")
    p.add_argument("--rotate-mb", type=int, default=256, help="bytes of weight copies a timed call reads")
    p.add_argument("--max-copies", type=int, default=16, help="cap: each copy is one more kernel to build")
    p.add_argument("--min-total-s", type=float, default=0.02, help="wall time per timing sample")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--cupti", action="store_true", help="also read kernel device times via torch.profiler")
    p.add_argument("--interpret", action="store_true", help="run kernels in the Pallas interpreter (CPU)")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    bench = Bench(a)
    if not a.interpret:
        bench.save(ceilings(a.copy_mib))
        print(f"copy {bench.meta['copy_Bps'] / 1e9:.0f} GB/s, read {bench.meta['read_Bps'] / 1e9:.0f} GB/s", flush=True)
    if a.cupti and not a.interpret:
        bench.flush = jnp.zeros((64 * 2 ** 20,), jnp.float32)  # 256 MiB, 4x the L2
    wanted = {T[f] for f in a.formats.split(",") if f} or None
    for shapes, formats, sweep, batches, with_planes in PLANS[a.plan]:
        for shape in shapes:
            for qtype in formats:
                if wanted and qtype not in wanted:
                    continue
                if bench.over_budget():
                    print(f"budget spent: skipping {qtype.name} {shape}", flush=True)
                    continue
                bench.run_case(qtype, shape, sweep(), batches, with_planes)
    bench.save(dict(total_s=round(time.time() - bench.t_start, 1)))
    table(bench.rows, bench.meta.get("copy_Bps", float("nan")))


if __name__ == "__main__":
    main()
