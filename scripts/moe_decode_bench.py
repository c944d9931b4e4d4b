"""MoE decode bench: one layer's experts for P (token, expert) pairs, three ways, on JAX's default device.

At Qwen3-30B-A3B expert shapes (E=128, gate/up [E, 768, 2048] Q4_K, down [E, 2048, 768]
Q6_K, top-8; P = 8 pairs is one token, 16 is two), each path computes
``out[n] = sum_j w_nj down_e(silu(gate_e(x_n)) * up_e(x_n))`` with distinct random experts:

  moe_gemv       the Pallas kernel (``pallas.moe_gemv``) on planes-repacked weights, for gate,
                 up and down; it reads only the chosen experts' bytes.
  xla_take       ``jnp.take`` of the chosen experts' raw GGUF blocks, ``quant.dequantize``,
                 then an einsum (XLA fuses what it can).
  moe_swiglu_all ``ops.experts.moe_swiglu`` with QTensor weights: the reference path, which
                 dequantizes all E experts every call.

Timing: a sample dispatches --calls calls back to back (each with the next of --sets random
expert sets, so the chosen experts mostly come from HBM, not the L2), waits for the last with
block_until_ready and divides; the median of --reps samples is reported in microseconds per
layer (moe_gemv and xla_take also per projection). GB/s is effective: the chosen experts'
GGUF bytes (P x (gate + up + down) of one expert) over that time. max_rel_diff compares each
path's layer output with moe_swiglu_all. Prints one JSON line.

  python scripts/moe_decode_bench.py                 # GPU: P = 8 and 16, Qwen3-30B-A3B shapes
  python scripts/moe_decode_bench.py --interpret     # CPU smoke run of the script, small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.ops.experts import moe_swiglu, swiglu  # noqa: E402
from bloomery_jax.pallas.moe_gemv import GemvConfig, moe_gemv  # noqa: E402
from bloomery_jax.quant import QTensor, dequantize  # noqa: E402
from bloomery_jax.quant.repack import repack  # noqa: E402
from bloomery_jax.synth.blocks import random_blocks  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
WEIGHT_STD = 0.02  # random weights (synth.blocks.random_blocks): only their speed is measured
QWEN3_30B = dict(experts=128, ff=768, hidden=2048, top_k=8)
SMOKE = dict(experts=8, ff=256, hidden=512, top_k=2)


class Weight:
    """One expert tensor [E, N, K]: its GGUF bytes on the device, the QTensor, the planes repack."""

    def __init__(self, qtype: T, e: int, n: int, k: int, rng):
        raw = random_blocks(qtype, (e, n, k), WEIGHT_STD, rng)
        self.qtype, self.shape, self.raw = qtype, (e, n, k), raw
        self.expert_bytes = raw[0].nbytes
        self.qt = QTensor.from_numpy(raw, qtype, self.shape)
        self.packed = repack(raw, qtype, self.shape)
        assert self.packed.nbytes == raw.nbytes  # the planes layout holds exactly the file's bytes


def build_weights(dims: dict, rng) -> tuple[tuple, float]:
    """gate, up (Q4_K ``[E, F, D]``) and down (Q6_K ``[E, D, F]``) of one layer, and the seconds taken."""
    t0 = time.perf_counter()
    e, f, d = dims["experts"], dims["ff"], dims["hidden"]
    weights = (Weight(T.Q4_K, e, f, d, rng), Weight(T.Q4_K, e, f, d, rng), Weight(T.Q6_K, e, d, f, rng))
    return weights, time.perf_counter() - t0


def pair_proj(path: str, cfg, interpret: bool):
    """(x [P, K], w, experts [P]) -> [P, N] = x @ W[experts]^T for one path; w is the path's form
    of the weight (PackedWeight for moe_gemv, QTensor for xla_take), passed as an argument so
    jit never embeds the weights as constants."""
    if path == "moe_gemv":
        return lambda x, w, ex: moe_gemv(x, w, ex, config=cfg, interpret=interpret)

    def take(x, w, ex):
        _, n, k = w.shape
        blocks = jnp.take(w.data, ex, axis=0)  # [P, N, row_bytes] raw blocks of the chosen experts
        return jnp.einsum("pk,pnk->pn", x, dequantize(blocks, w.qtype, (ex.shape[0], n, k)), precision=HIGHEST)
    return take


def form(path: str, w: Weight):
    return w.packed if path == "moe_gemv" else w.qt


def layer_fn(path: str, cfg, interpret: bool):
    """(x [N, D], experts [N, k], weights [N, k], gate, up, down) -> [N, D] for one path."""
    if path == "moe_swiglu_all":
        return moe_swiglu
    proj = pair_proj(path, cfg, interpret)

    def layer(x, ex, wt, gate, up, down):
        n, k = ex.shape
        flat = ex.reshape(n * k)  # [P] pairs, token-major, as moe_swiglu
        xp = x[jnp.arange(n * k) // k]  # [P, D]
        h = swiglu(proj(xp, gate, flat), proj(xp, up, flat))  # [P, F]
        y = proj(h, down, flat).reshape(n, k, -1) * wt[:, :, None]
        out = y[:, 0]
        for j in range(1, k):  # the reference's order
            out = out + y[:, j]
        return out
    return layer


def median_us(fn, arg_sets, reps: int, calls: int) -> float:
    """Median over reps of (wall time of `calls` back-to-back calls) / calls, in microseconds."""
    jax.block_until_ready(fn(*arg_sets[0]))  # compile
    samples = []
    for r in range(reps):
        t0 = time.perf_counter()
        out = None
        for c in range(calls):
            out = fn(*arg_sets[(r * calls + c) % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples) * 1e6


def run(pairs: int, dims: dict, weights: tuple, a, rng) -> dict:
    e, top_k, d = dims["experts"], dims["top_k"], dims["hidden"]
    if pairs % top_k or pairs > e:
        raise SystemExit(f"--pairs {pairs}: needs a multiple of top_k={top_k}, at most E={e}")
    n_tok = pairs // top_k
    gate, up, down = weights
    cfg = GemvConfig(*a.config) if a.config else None
    x = jnp.asarray(rng.standard_normal((n_tok, d)), jnp.float32)
    wt = jnp.asarray(rng.dirichlet(np.ones(top_k), n_tok), jnp.float32)  # [N, k] routing weights
    sets = [jnp.asarray(rng.permutation(e)[:pairs].reshape(n_tok, top_k), jnp.int32) for _ in range(a.sets)]
    chosen = {"gate": gate.expert_bytes * pairs, "up": up.expert_bytes * pairs, "down": down.expert_bytes * pairs}
    layer_bytes = sum(chosen.values())
    out = dict(pairs=pairs, tokens=n_tok, chosen_bytes=layer_bytes)
    ref = None
    for path in ("moe_swiglu_all", "moe_gemv", "xla_take"):
        fn = jax.jit(layer_fn(path, cfg, a.interpret))
        ws = tuple(form(path, w) for w in weights)
        us = median_us(fn, [(x, s, wt, *ws) for s in sets], a.reps, a.calls)
        row = dict(layer_us=round(us, 2), GBps=round(layer_bytes / us / 1e3, 1))
        y = np.asarray(fn(x, sets[0], wt, *ws), np.float64)
        if ref is None:
            ref = y
        else:
            row["max_rel_diff"] = float(np.abs(y - ref).max() / np.abs(ref).max())
        if path != "moe_swiglu_all":  # each projection alone: [P, K] rows against the chosen experts
            proj = jax.jit(pair_proj(path, cfg, a.interpret))
            for name, w in zip(("gate", "up", "down"), weights):
                xp = jnp.asarray(rng.standard_normal((pairs, w.shape[2])), jnp.float32)
                p_us = median_us(proj, [(xp, form(path, w), s.reshape(-1)) for s in sets], a.reps, a.calls)
                row[f"{name}_us"] = round(p_us, 2)
                row[f"{name}_GBps"] = round(chosen[name] / p_us / 1e3, 1)
        out[path] = row
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="8,16", help="comma list of pair counts P (multiples of top_k)")
    p.add_argument("--reps", type=int, default=20, help="timing samples; the median is reported")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per sample")
    p.add_argument("--sets", type=int, default=16, help="random expert sets the calls cycle through")
    p.add_argument("--config", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
                   help="moe_gemv launch parameters block_n,chunks_per_step,num_warps,num_stages[,split_k] "
                        "(default: qgemv_tuned's pick per shape)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run: Pallas interpreter, small shapes")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    if a.interpret:
        a.reps, a.calls, a.sets = min(a.reps, 3), min(a.calls, 2), min(a.sets, 2)
        if a.pairs == p.get_default("pairs"):
            a.pairs = "2,4"
    dims = SMOKE if a.interpret else QWEN3_30B
    rng = np.random.default_rng(a.seed)
    t0 = time.perf_counter()
    weights, build_s = build_weights(dims, rng)
    e, f, d = dims["experts"], dims["ff"], dims["hidden"]
    runs = [run(int(v), dims, weights, a, rng) for v in a.pairs.split(",")]
    print(json.dumps(dict(
        bench="moe_decode", device=str(jax.devices()[0].device_kind), jax=jax.__version__, interpret=a.interpret,
        shapes=dict(**dims, gate_up=[e, f, d], down=[e, d, f], gate_up_type="Q4_K", down_type="Q6_K"),
        config=a.config, reps=a.reps, calls=a.calls, sets=a.sets, build_s=round(build_s, 1),
        total_s=round(time.perf_counter() - t0, 1), runs=runs)))


if __name__ == "__main__":
    main()
