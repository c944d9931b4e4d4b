"""Decode attention bench: the Pallas split-K kernel against the jnp reference, one layer, one token a sequence.

At Qwen3-30B-A3B attention shapes (32 query heads, 4 kv heads of 128; f32 cache) for each
cache length S, batch B, programs per query head along the cache and query heads per program:
median microseconds over --reps samples of --calls back-to-back calls, GB/s of the cache bytes
read (visible slots of k and v), and max |diff| against ``ops.attention.gqa_attention``. Each
query sees --visible slots (default: the whole cache). Prints one JSON line.

  python scripts/attention_bench.py                          # GPU
  python scripts/attention_bench.py --interpret              # CPU smoke run, small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.ops.attention import gqa_attention  # noqa: E402
from bloomery_jax.pallas.attention import decode_attention  # noqa: E402
from moe_decode_bench import median_us  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="641,4096,32768", help="comma list of cache lengths S")
    p.add_argument("--batch", default="1,2", help="comma list of batch sizes B")
    p.add_argument("--splits", default="0,4,16,64",
                   help="comma list of programs per query head along the cache (0: the kernel's default)")
    p.add_argument("--visible", type=int, default=0,
                   help="slots each query sees (0: the whole cache; e.g. 640 in a 4096 cache, as tg128 after pp512)")
    p.add_argument("--heads-per-program", default="1,8", help="comma list of query heads per program")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run: Pallas interpreter, small shapes")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    hq, hkv, dh = (8, 2, 32) if a.interpret else (32, 4, 128)
    if a.interpret:
        a.lengths, a.batch, a.splits, a.heads_per_program, a.reps, a.calls = "100", "2", "0,3", "1,4", 2, 1
    scale = float(1 / np.sqrt(dh))
    rng = np.random.default_rng(0)
    rows = []
    for S in map(int, a.lengths.split(",")):
        for B in map(int, a.batch.split(",")):
            q = jnp.asarray(rng.standard_normal((B, hq, dh)), jnp.float32)
            k = jnp.asarray(rng.standard_normal((B, S, hkv, dh)), jnp.float32)
            v = jnp.asarray(rng.standard_normal((B, S, hkv, dh)), jnp.float32)
            seen = min(a.visible or S, S)
            vis = jnp.full((B,), seen, jnp.int32)
            mask = jnp.broadcast_to(jnp.arange(S) < seen, (B, 1, S))
            ref_fn = jax.jit(lambda q, k, v: gqa_attention(q[:, None], k, v, mask, scale)[:, 0])
            ref = np.asarray(ref_fn(q, k, v))
            cache_bytes = 2 * B * seen * hkv * dh * 4
            us = median_us(ref_fn, [(q, k, v)], a.reps, a.calls)
            row = dict(S=S, B=B, visible=seen, reference_us=round(us, 1),
                       reference_GBps=round(cache_bytes / us / 1e3, 1))
            for split in map(int, a.splits.split(",")):
                for per in map(int, a.heads_per_program.split(",")):
                    fn = jax.jit(lambda q, k, v, split=split, per=per: decode_attention(
                        q, k, v, vis, scale, splits=split or None, heads_per_program=per, interpret=a.interpret))
                    got = np.asarray(fn(q, k, v))
                    us = median_us(fn, [(q, k, v)], a.reps, a.calls)
                    key = f"splits{split or 'default'}_p{per}"  # programs along the cache, query heads a program
                    row[f"{key}_us"] = round(us, 1)
                    row[f"{key}_GBps"] = round(cache_bytes / us / 1e3, 1)
                    row[f"{key}_max_diff"] = float(np.abs(got - ref).max())
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(json.dumps(dict(bench="decode_attention", device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                          interpret=a.interpret, heads=[hq, hkv, dh], reps=a.reps, calls=a.calls, rows=rows)))


if __name__ == "__main__":
    main()
