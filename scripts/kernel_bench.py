"""Decode GEMV bench: our Pallas qgemv against XLA's fused ``x @ dequantize(W).T`` on the GPU.

For each format (Q8_0, Q4_K, Q5_K, Q6_K) and Qwen3-30B-A3B decode shape (plus an 8192x8192
square) it sweeps the kernel's launch parameters, checks every variant's output against the
float32 reference within the summation-order bound, and reports achieved GB/s of weight bytes
against the card's copy bandwidth measured in the same run. JSON goes to --out after every
measurement, so a run cut short still leaves its numbers.

Timing: one jitted call applies the kernel to R distinct copies of the weight (R copies hold at
least --rotate-mb, so each call reads from HBM, not the 60 MB L2) and stacks the outputs; calls
are dispatched back to back and the time per GEMV is wall time / (calls * R). That includes
the gaps between kernels a jitted decode step also pays. With --cupti, torch's profiler also
reads the kernels' own device durations.

  python scripts/kernel_bench.py --out /tmp/kb --plan square --budget-s 200
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.pallas.qgemv import GemvConfig, qgemv  # noqa: E402
from bloomery_jax.quant import dequantize  # noqa: E402
from bloomery_jax.quant.repack import repack  # noqa: E402

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
F16_FIELDS = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def big_sweep():
    """The launch grid for large matrices: rows per program x chunks per step x warps."""
    return [GemvConfig(bn, cps, nw, 3) for bn, cps, nw in itertools.product((16, 32, 64), (2, 4, 8), (4, 8))]


def small_sweep():
    """Few programs, latency-bound: fewer rows per program, more chunks in flight."""
    return [GemvConfig(bn, cps, nw, 3) for bn, cps, nw in itertools.product((8, 16, 32), (2, 8), (4, 8))]


PLANS = {
    # (shape names, formats, sweep, batch sizes for the best config)
    "tiny": [(["tiny"], [T.Q4_K, T.Q6_K], lambda: [GemvConfig(16, 1, 4, 3), GemvConfig(32, 2, 4, 3)], [1, 2])],
    "square": [(["square_8192"], FORMATS, big_sweep, [1, 8])],
    "rest": [(["output"], FORMATS, lambda: big_sweep()[::2], [1, 8]),
             (["attn_q", "attn_o", "attn_kv", "expert_gate_up", "expert_down"], FORMATS, small_sweep, [1, 8])],
}
PLANS["full"] = PLANS["square"] + PLANS["rest"]
# a first look: the headline square for the two formats of a Q4_K_M file, then a little of each rest
PLANS["discover"] = [
    (["square_8192"], [T.Q4_K, T.Q6_K], big_sweep, [1, 8]),
    (["square_8192"], [T.Q8_0, T.Q5_K], lambda: big_sweep()[1::3], [1]),
    (["attn_kv", "expert_gate_up"], [T.Q4_K], small_sweep, [1]),
]


def random_blocks(qtype: T, n: int, k: int, rng) -> np.ndarray:
    """Random GGUF bytes [n, row_bytes] with finite f16 scales (random quants and sub-scales)."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * (k // elems), nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = rng.uniform(1e-3, 1e-2, raw.shape[0]).astype("<f2").view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


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
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
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


def bound(x, wf, k, width):
    """Allowed |ours - ref_f32|: our (K/W + W) u plus the reference's K u, times sum|x||w|."""
    mag = np.abs(np.asarray(x, np.float64)) @ np.abs(wf).T  # [B, N]
    return ((k / width + width) + k) * U * mag * 1.01 + 1e-30


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.t_start = time.time()
        self.meta = dict(argv=sys.argv, date=time.strftime("%Y-%m-%d %H:%M:%S"), jax=jax.__version__,
                         device=str(jax.devices()[0].device_kind), platform=platform.platform(),
                         interpret=args.interpret)

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
        cfg = row.get("config")
        print(f"{row['format']:5} {row['shape']:15} B={row['B']} {row['impl']:6} {str(cfg):28} "
              f"{row.get('us', float('nan')):9.2f} us {row.get('GBps', float('nan')):8.1f} GB/s "
              f"err/bound {row.get('err_ratio', float('nan')):.3g} {row.get('error', '')}", flush=True)
        self.save()

    def run_case(self, qtype, shape_name, sweep, batches):
        a = self.args
        n, k = SHAPES[shape_name]
        rng = np.random.default_rng(n * 31 + k + int(qtype))
        raw = random_blocks(qtype, n, k, rng)
        wbytes = raw.nbytes
        pw = repack(raw, qtype, (n, k))
        assert pw.nbytes == wbytes
        wf = np.asarray(jax.jit(lambda r: dequantize(r, qtype, (n, k)))(raw), np.float64)
        r = 1 if a.interpret else max(1, min(a.max_copies, -(-a.rotate_mb * 2 ** 20 // wbytes)))
        packed = copies(pw, r)
        raws = copies(jnp.asarray(raw), r)
        width = 16 if qtype == T.Q6_K else 32
        xs = {b: rng.standard_normal((b, k)).astype(np.float32) for b in sorted(set(batches) | {1})}
        common = dict(format=qtype.name, shape=shape_name, N=n, K=k, weight_bytes=wbytes, copies=r)
        # float64 answers and allowed errors, once per batch size
        truth = {b: (xb.astype(np.float64) @ wf.T, bound(xb, wf, k, width)) for b, xb in xs.items()}
        del wf

        def measure(impl, b, cfg, fn, ws):
            x = jnp.asarray(xs[b])
            t0 = time.perf_counter()
            try:
                out = jax.block_until_ready(fn(x, ws))
            except Exception as e:  # a variant Triton cannot build is a result, not a crash
                self.record(**common, B=b, impl=impl, config=cfg and dataclasses.astuple(cfg),
                            error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                return None
            compile_s = time.perf_counter() - t0
            want, allowed = truth[b]
            ratio = float((np.abs(np.asarray(out[0], np.float64) - want) / allowed).max())
            t, samples = time_calls(fn, (x, ws), a.min_total_s)
            us = t / r * 1e6
            gbps = wbytes / (t / r) / 1e9
            self.record(**common, B=b, impl=impl, config=cfg and dataclasses.astuple(cfg), us=us, GBps=gbps,
                        frac_copy=gbps * 1e9 / self.meta.get("copy_Bps", float("nan")),
                        err_ratio=ratio, compile_s=round(compile_s, 2),
                        samples_us=[s / r * 1e6 for s in samples])
            return us

        def ours(cfg):
            return jax.jit(lambda x, ws: jnp.stack([qgemv(x, w, config=cfg, interpret=a.interpret) for w in ws]))

        ref = jax.jit(lambda x, ws: jnp.stack([
            jnp.einsum("bk,nk->bn", x, dequantize(w, qtype, (n, k)), precision=HIGHEST) for w in ws]))
        best = None
        for cfg in dict.fromkeys(sweep):
            if self.over_budget():
                break
            us = measure("pallas", 1, cfg, ours(cfg), packed)
            if us is not None and (best is None or us < best[0]):
                best = (us, cfg)
        if best and not a.interpret:  # pipelining depth only on the winner
            for st in (1, 2, 4):
                if self.over_budget():
                    break
                cfg = dataclasses.replace(best[1], num_stages=st)
                us = measure("pallas", 1, cfg, ours(cfg), packed)
                if us is not None and us < best[0]:
                    best = (us, cfg)
        for b in batches:
            if self.over_budget():
                break
            if b != 1 and best:
                measure("pallas", b, best[1], ours(best[1]), packed)
            measure("xla", b, None, ref, raws)
        if best and a.cupti and not a.interpret:
            self.cupti(common, best[1], ours(best[1]), packed, jnp.asarray(xs[1]), r)

    def cupti(self, common, cfg, fn, ws, x, r):
        """Kernel-only device time from torch's profiler (CUPTI sees every kernel in the process)."""
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            torch.zeros(1, device="cuda")
            jax.block_until_ready(fn(x, ws))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    out = fn(x, ws)
                jax.block_until_ready(out)
            kern = [e for e in prof.key_averages() if "qgemv" in e.key]
            rows = [dict(name=e.key, count=e.count, avg_us=e.device_time_total / max(e.count, 1))
                    for e in prof.key_averages()]
            rows.sort(key=lambda d: -d["avg_us"] * d["count"])
            us = statistics.fmean([e.device_time_total / e.count for e in kern]) if kern else float("nan")
            self.record(**common, B=1, impl="cupti", config=dataclasses.astuple(cfg), us=us,
                        GBps=common["weight_bytes"] / (us * 1e-6) / 1e9, kernels=rows[:8])
        except Exception as e:
            self.record(**common, B=1, impl="cupti", config=None, error=f"{type(e).__name__}: {e}"[:300])


def table(rows, copy_bps):
    best = {}
    for r in rows:
        if "us" not in r or r["impl"] == "cupti":
            continue
        key = (r["format"], r["shape"], r["B"], r["impl"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print(f"\ncopy bandwidth {copy_bps / 1e9:.0f} GB/s (read+write)\n"
          f"{'format':6} {'shape':15} {'B':>2} {'MB':>7} {'ours us':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'xla us':>8} {'GB/s':>7} {'x':>5}  best config (bn, chunks/step, warps, stages)")
    for (fmt, shape, b, impl), r in sorted(best.items()):
        if impl != "pallas":
            continue
        x = best.get((fmt, shape, b, "xla"))
        xus = x["us"] if x else float("nan")
        print(f"{fmt:6} {shape:15} {b:2} {r['weight_bytes'] / 1e6:7.2f} {r['us']:8.2f} {r['GBps']:7.0f} "
              f"{100 * r['GBps'] * 1e9 / copy_bps:6.1f} {xus:8.2f} "
              f"{(x['GBps'] if x else float('nan')):7.0f} {xus / r['us']:5.2f}  {r['config']}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", choices=sorted(PLANS), default="full")
    p.add_argument("--formats", default="", help="comma list to restrict, e.g. Q4_K,Q6_K")
    p.add_argument("--out", default="")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no new variant after this")
    p.add_argument("--rotate-mb", type=int, default=256, help="bytes of weight copies a timed call reads")
    p.add_argument("--max-copies", type=int, default=256)
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
    wanted = {T[f] for f in a.formats.split(",") if f} or None
    for shapes, formats, sweep, batches in PLANS[a.plan]:
        for shape in shapes:
            for qtype in formats:
                if wanted and qtype not in wanted:
                    continue
                if bench.over_budget():
                    print(f"budget spent: skipping {qtype.name} {shape}", flush=True)
                    continue
                bench.run_case(qtype, shape, sweep(), batches)
    bench.save(dict(total_s=round(time.time() - bench.t_start, 1)))
    table(bench.rows, bench.meta.get("copy_Bps", float("nan")))


if __name__ == "__main__":
    main()
