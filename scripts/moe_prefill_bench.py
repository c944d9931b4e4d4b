"""MoE prefill bench: one layer's experts for T tokens routed top-k, the grouped GEMM against the reference.

At Qwen3-30B-A3B expert shapes (E=128, gate/up [E, 768, 2048] Q4_K, down [E, 2048, 768] Q6_K,
top-8), T tokens each routed to k distinct random experts (P = T k pairs):

  reference   ``ops.experts.moe_swiglu`` on QTensor weights: every expert dequantized, then
              ``ragged_dot_general`` in f32 at HIGHEST (the path prefill took before moe_gemm).
  moe_gemm    ``ops.experts._moe_swiglu_gemm`` on repacked weights (--layout planes, the
              default, or ggml, what kernels=pallas-q8 loads), one row per launch
              configuration (block_m, block_n, num_warps, num_stages, precision).
  moe_gemv    where T k <= ``MOE_GEMV_MAX_PAIRS`` (decode sizes): ``_moe_swiglu_gemv``, what the
              engine takes there, on planes weights: is a GEMM on quant tiles (tensor cores,
              ~4 ALU ops a weight) faster than the GEMV's ~7 a weight even at 1-8 tokens?

Each row: median layer time over --reps samples of --calls back-to-back calls (cycling through
--sets routings), TFLOP/s of the pairs' useful work (P x 3 projections x 2 D F), and
max_rel_diff = max |y - y_ref| / max |y_ref| against the reference on the same routing.
Prints one JSON line.

  python scripts/moe_prefill_bench.py                       # GPU: T = 512, the default sweep
  python scripts/moe_prefill_bench.py --tokens 128,512,2048 --configs 32,64,4,2,tf32x3
  python scripts/moe_prefill_bench.py --interpret           # CPU smoke run, small shapes
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from moe_decode_bench import QWEN3_30B, SMOKE, build_weights, median_us
from bloomery_jax.ops.experts import MOE_GEMV_MAX_PAIRS, _moe_swiglu_gemm, _moe_swiglu_gemv, moe_swiglu
from bloomery_jax.pallas.moe_gemm import GemmConfig
from bloomery_jax.quant.repack import repack

# (block_m, block_n, num_warps, num_stages, precision[, wide]): the f32-tile picks measured on
# 2026-12-03 (benchmarks/gpu_2026-12-03-s3: tf32x3 2.54 ms at 64 x 64, tf32 1.02 at 32 x 64),
# the whole-chunk tiles never timed, then quant tiles (q-bf16, q-bf16x2, q-int8) over tile shapes
DEFAULT_SWEEP = [
    (64, 64, 4, 2, "tf32x3"), (32, 64, 4, 2, "tf32"), (64, 64, 4, 2, "tf32x3", True), (64, 64, 4, 2, "tf32", True),
    (32, 64, 4, 2, "q-bf16"), (64, 64, 4, 2, "q-bf16"), (64, 128, 8, 2, "q-bf16"),
    (32, 64, 4, 2, "q-bf16x2"), (64, 64, 4, 2, "q-bf16x2"), (64, 64, 8, 2, "q-bf16x2"), (64, 128, 8, 2, "q-bf16x2"),
    (128, 64, 8, 2, "q-bf16x2"), (64, 64, 4, 3, "q-bf16x2"), (16, 64, 4, 2, "q-bf16x2"), (64, 32, 4, 2, "q-bf16x2"),
    (32, 64, 4, 2, "q-int8"), (64, 64, 4, 2, "q-int8"), (64, 128, 8, 2, "q-int8"), (128, 64, 8, 2, "q-int8"),
]


def parse_config(text: str) -> GemmConfig:
    """block_m,block_n,num_warps,num_stages,precision[,wide]"""
    bm, bn, warps, stages, precision, *wide = text.split(",")
    return GemmConfig(int(bm), int(bn), int(warps), int(stages), precision, wide == ["wide"])


def run(n_tok: int, dims: dict, weights: tuple, configs: list[GemmConfig], a, rng) -> dict:
    e, top_k, d, f = dims["experts"], dims["top_k"], dims["hidden"], dims["ff"]
    pairs = n_tok * top_k
    flop = pairs * 3 * 2 * d * f
    x = jnp.asarray(rng.standard_normal((n_tok, d)), jnp.float32)
    wt = jnp.asarray(rng.dirichlet(np.ones(top_k), n_tok), jnp.float32)  # [T, k]
    sets = [jnp.asarray(np.stack([rng.permutation(e)[:top_k] for _ in range(n_tok)]), jnp.int32)
            for _ in range(a.sets)]
    out = dict(tokens=n_tok, pairs=pairs, gflop=round(flop / 1e9, 2))
    ref_fn = jax.jit(moe_swiglu)
    qts = tuple(w.qt for w in weights)
    ref = np.asarray(ref_fn(x, sets[0], wt, *qts), np.float64)
    if not a.skip_reference:
        us = median_us(ref_fn, [(x, s, wt, *qts) for s in sets], a.reps, a.calls)
        out["reference"] = dict(layer_ms=round(us / 1e3, 3), TFLOPs=round(flop / us / 1e6, 2))
    rows = []
    if pairs <= MOE_GEMV_MAX_PAIRS and a.layout == "planes":
        fn = jax.jit(lambda x, ex, wt, g, u, dn: _moe_swiglu_gemv(x, ex, wt, g, u, dn, "none", None))
        planes = tuple(w.packed for w in weights)
        y = np.asarray(fn(x, sets[0], wt, *planes), np.float64)
        us = median_us(fn, [(x, s, wt, *planes) for s in sets], a.reps, a.calls)
        out["moe_gemv"] = dict(layer_ms=round(us / 1e3, 4), max_rel_diff=float(np.abs(y - ref).max() / np.abs(ref).max()))
        print(json.dumps(dict(moe_gemv=out["moe_gemv"], tokens=n_tok)), flush=True)
    packed = tuple(w.packed if a.layout == "planes" else repack(w.raw, w.qtype, w.shape, "ggml") for w in weights)
    for cfg in configs:
        row = dict(config=[cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.precision]
                   + (["wide"] if cfg.wide else []), layout=a.layout)
        try:
            fn = jax.jit(lambda x, ex, wt, g, u, dn, cfg=cfg: _moe_swiglu_gemm(x, ex, wt, g, u, dn, "none", cfg))
            y = np.asarray(fn(x, sets[0], wt, *packed), np.float64)
            us = median_us(fn, [(x, s, wt, *packed) for s in sets], a.reps, a.calls)
            row.update(layer_ms=round(us / 1e3, 3), TFLOPs=round(flop / us / 1e6, 2),
                       max_rel_diff=float(np.abs(y - ref).max() / np.abs(ref).max()))
        except Exception as err:  # a launch configuration the compiler refuses: say so, go on
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    out["moe_gemm"] = rows
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="512", help="comma list of token counts T")
    p.add_argument("--configs", nargs="*", default=None,
                   help="launch configurations block_m,block_n,num_warps,num_stages,precision[,wide] "
                        "(default: a sweep of precisions and tiles)")
    p.add_argument("--reps", type=int, default=10, help="timing samples; the median is reported")
    p.add_argument("--calls", type=int, default=5, help="back-to-back calls per sample")
    p.add_argument("--sets", type=int, default=4, help="random routings the calls cycle through")
    p.add_argument("--skip-reference", action="store_true", help="do not time the reference (it is slow)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run: Pallas interpreter, small shapes")
    p.add_argument("--layout", choices=("planes", "ggml"), default="planes", help="the experts' repack layout")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    configs = [parse_config(c) for c in a.configs] if a.configs else [GemmConfig(*c) for c in DEFAULT_SWEEP]
    if a.interpret:
        a.reps, a.calls, a.sets = min(a.reps, 2), min(a.calls, 1), min(a.sets, 1)
        if a.tokens == p.get_default("tokens"):
            a.tokens = "16"
        if not a.configs:
            configs = [GemmConfig(16, 32, 4, 2, "ieee")]
    dims = SMOKE if a.interpret else QWEN3_30B
    rng = np.random.default_rng(a.seed)
    t0 = time.perf_counter()
    weights, build_s = build_weights(dims, rng)
    e, f, d = dims["experts"], dims["ff"], dims["hidden"]
    runs = [run(int(v), dims, weights, configs, a, rng) for v in a.tokens.split(",")]
    print(json.dumps(dict(
        bench="moe_prefill", device=str(jax.devices()[0].device_kind), jax=jax.__version__, interpret=a.interpret,
        shapes=dict(**dims, gate_up=[e, f, d], down=[e, d, f], gate_up_type="Q4_K", down_type="Q6_K"),
        reps=a.reps, calls=a.calls, sets=a.sets, build_s=round(build_s, 1),
        total_s=round(time.perf_counter() - t0, 1), runs=runs)))


if __name__ == "__main__":
    main()
