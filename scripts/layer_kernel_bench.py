"""Launch parameters of one decode layer's GEMV launches, swept at Qwen3-30B-A3B shapes on the GPU.

The launches a decode step makes per layer (and the output head once), each timed under a list
of ``GemvConfig`` variants, the first being what the code picks today (``pick_config`` /
``pick_many_config``):

  qkv      ``qgemv_many(x, (q, k, v), norm=w)``: q Q4_K [4096, 2048], k Q4_K and v Q6_K [512, 2048]
  o        ``qgemv(x, o)``: Q4_K [2048, 4096]
  gate_up  ``moe_gemv_many(x, (gate, up), experts, pairs_per_row=8)``: Q4_K [128, 768, 2048] each
  down     ``moe_gemv(g, down, experts, up=u)``: Q6_K [128, 2048, 768], SwiGLU formed in-kernel
  down_q4k the same for a Q4_K down projection (half the layers of a Q4_K_M file)
  output   ``qgemv(x, output)``: Q6_K [151936, 2048]
  gate_up_q8, down_q8, down_q4k_q8, qkv_q8, o_q8, output_q8
           the same launches on integer dot products (``qgemv_q8``, weights in the "ggml" layout,
           ``kernels=pallas-q8``) as the step makes them: on float x, each program rounding its
           own blocks to Q8_1 (down: of SwiGLU formed from gate and up side by side; q/k/v and,
           since the thirtieth session, gate/up: of the normed x)
  gate_up_q8_pre, down_q8_pre, output_q8_pre
           the twentieth session's form: a Q8_1 rounding launch before the launch (down: of
           ``silu(g) * u``), timed together (output_q8 rounds in every program, whatever
           ``qgemv_q8``'s rule would pick)
  gate_up_q8_given, down_q8_given, down_q4k_q8_given, qkv_q8_given, o_q8_given
           the launch alone on x already rounded to Q8_1 (of the normed x, of SwiGLU) outside
           the timed call: what the launch costs where the kernel before it leaves its output
           rounded (the thirtieth session's question)
  router   ``route.router_logits(x, norm, eps, w)``: the router's F32 [128, 2048] with the
           norm formed in-kernel; the config's block_n is its block_e, chunks_per_step its chunk
           in units of 256 columns and num_warps its warps (its other fields unused; not written
           to --tuned-out); router_rounded: the same launch also rounding the normed x to Q8_1
           for the experts (``rounded=True``)

Timing: one jitted call makes the launch R times back to back, each on its own weight copy (the
dense families, enough copies to outgrow the 60 MB L2) or its own set of 8 random experts (the
MoE families); us per launch = median over --reps samples of wall time / (calls x R). The gaps
between launches inside one executable are counted, as a step pays them. Each variant's outputs
are compared with the first variant's: only the summation order differs, so a difference above
1e-4 of the outputs' scale means a broken launch and is reported as an error. Weights are random
valid blocks (``synth.blocks.random_blocks``): only speed is measured. Prints a line a variant and
writes JSON to --json after each.

With ``--tuned-out FILE`` the winner of each family (the current pick unless another config is
faster by more than --margin) is written in the form ``BLOOMERY_GEMV_TUNED`` reads
(``pallas.qgemv_tuned.measured_here``), so the engine can run this card's launch configs.

  python scripts/layer_kernel_bench.py --json $OUT/layer_kernels.json --tuned-out $OUT/tuned.json  # GPU
  python scripts/layer_kernel_bench.py --small --reps 1 --max-copies 2       # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.ops.actquant import quantize_q8_1  # noqa: E402
from bloomery_jax.ops.experts import swiglu  # noqa: E402
from bloomery_jax.ops.norms import rms_norm  # noqa: E402
from bloomery_jax.ops.qmatmul import interpret_kernels  # noqa: E402
from bloomery_jax.pallas.moe_gemv import moe_gemv, moe_gemv_many  # noqa: E402
from bloomery_jax.pallas.qgemv import qgemv, qgemv_many  # noqa: E402
from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8, moe_gemv_q8_many, qgemv_q8, qgemv_q8_many  # noqa: E402
from bloomery_jax.pallas.qgemv_tuned import GemvConfig as C, pick_config, pick_many_config  # noqa: E402
from bloomery_jax.pallas.route import LOGITS_BLOCK_E, LOGITS_CHUNK, LOGITS_WARPS, router_logits  # noqa: E402
from bloomery_jax.quant.repack import repack  # noqa: E402
from bloomery_jax.synth.blocks import random_blocks  # noqa: E402

WEIGHT_STD = 0.02
L2_BYTES = 60 * 2 ** 20
INTERP = interpret_kernels()  # off the GPU the kernels run in the Pallas interpreter
QWEN3_30B = dict(hidden=2048, q_rows=4096, kv_rows=512, experts=128, ff=768, top_k=8, vocab=151936)
SMOKE = dict(hidden=256, q_rows=256, kv_rows=64, experts=8, ff=256, top_k=2, vocab=512)

# Variants after the current pick: rows per program, chunks per loop step, warps, stages, split-K
SWEEPS = {
    "qkv": [C(8, 1, 8, 3, 2), C(32, 2, 8, 3, 1), C(32, 2, 4, 3, 2), C(16, 2, 4, 3, 2), C(16, 1, 4, 3, 4),
            C(32, 1, 4, 3, 4), C(64, 2, 8, 3, 2), C(32, 2, 8, 3, 4), C(32, 2, 8, 3, 8), C(16, 2, 4, 3, 4)],
    # around the H100 winners of 2026-12-05 (the current picks): other tile heights, warps, splits
    "gate_up": [C(32, 2, 8, 3, 2), C(32, 2, 4, 3, 2), C(16, 2, 4, 3, 2), C(16, 1, 4, 3, 4), C(64, 2, 8, 3, 2),
                C(16, 1, 2, 3, 8), C(32, 1, 2, 3, 4), C(16, 1, 2, 3, 4), C(32, 1, 4, 3, 8), C(64, 1, 4, 3, 4),
                C(32, 1, 8, 3, 4), C(32, 1, 4, 2, 4)],
    "down": [C(16, 1, 4, 3, 3), C(8, 1, 2, 3, 3), C(16, 1, 2, 3, 3), C(64, 1, 8, 3, 3), C(16, 3, 4, 3, 1),
             C(64, 3, 8, 3, 1), C(8, 3, 2, 3, 1), C(32, 3, 4, 3, 1), C(32, 1, 4, 3, 1), C(32, 3, 8, 2, 1)],
    "down_q4k": [C(16, 1, 4, 3, 3), C(32, 1, 4, 3, 3), C(8, 1, 2, 3, 3), C(16, 1, 1, 3, 3), C(32, 1, 2, 3, 3),
                 C(16, 3, 2, 3, 1), C(16, 1, 2, 3, 1), C(8, 1, 1, 3, 3), C(32, 3, 8, 3, 1)],
    "o": [C(16, 1, 4, 3, 4), C(32, 1, 4, 3, 8), C(16, 2, 4, 3, 8), C(8, 1, 2, 3, 8), C(32, 2, 8, 3, 4)],
    "output": [C(32, 2, 8, 3), C(32, 4, 8, 3), C(64, 4, 8, 3), C(128, 2, 8, 3), C(64, 1, 8, 3), C(64, 2, 4, 3),
               C(128, 1, 8, 3), C(64, 2, 8, 2)],
}
# the q8 kernels take no chunks_per_step; around their default (32, -, 2, 3, 8)
# (the Q8_1 rounding in the launch is paid per chunk and row tile: taller tiles round less)
_Q8 = [C(32, 1, 2, 3, 4), C(32, 1, 4, 3, 4), C(32, 1, 4, 3, 2), C(16, 1, 2, 3, 4), C(64, 1, 4, 3, 2),
       C(64, 1, 4, 3, 4), C(32, 1, 2, 3, 1), C(16, 1, 1, 3, 8), C(32, 1, 4, 3, 1), C(64, 1, 8, 3, 1),
       C(128, 1, 4, 3, 4), C(128, 1, 8, 3, 2), C(64, 1, 4, 3, 8), C(64, 1, 2, 3, 8)]
SWEEPS["output_q8"] = [C(64, 1, 4, 3, 1), C(128, 1, 4, 3, 1), C(128, 1, 8, 3, 1), C(64, 1, 2, 3, 1), C(32, 1, 2, 3, 1),
                       C(64, 1, 8, 3, 1), C(128, 1, 4, 3, 2), C(32, 1, 4, 3, 1)]
SWEEPS["output_q8_pre"] = SWEEPS["output_q8"]
# router_logits: (block_e, chunk / 256, warps, stages, -); the current pick is ROUTER_PICK
ROUTER_PICK = C(LOGITS_BLOCK_E, LOGITS_CHUNK // 256, LOGITS_WARPS, 2, 1)
# whole rows in one read (chunk 2048 = D) beside the 256-column walk
SWEEPS["router"] = SWEEPS["router_rounded"] = [
    C(4, 8, 4, 2, 1), C(2, 8, 4, 2, 1), C(1, 8, 4, 2, 1), C(4, 8, 8, 2, 1), C(2, 8, 2, 2, 1), C(1, 8, 2, 2, 1),
    C(8, 8, 8, 2, 1), C(4, 4, 4, 2, 1), C(2, 4, 4, 2, 1), C(1, 1, 4, 2, 1), C(8, 1, 4, 2, 1)]
SWEEPS.update(gate_up_q8=_Q8, down_q8=_Q8, down_q4k_q8=_Q8, gate_up_q8_pre=_Q8, down_q8_pre=_Q8, o_q8=_Q8,
              qkv_q8=[C(128, 1, 4, 3, 4), C(128, 1, 8, 3, 2), C(64, 1, 4, 3, 8), C(128, 1, 4, 3, 8), C(64, 1, 8, 3, 4),
                      C(32, 1, 4, 3, 8), C(16, 1, 2, 3, 8)])
# on given blocks nothing is rounded per row tile, so short tiles and many programs are back in play
_GIVEN = [C(16, 1, 2, 3, 4), C(16, 1, 4, 3, 4), C(32, 1, 2, 3, 2), C(32, 1, 4, 3, 1), C(16, 1, 2, 3, 8),
          C(8, 1, 1, 3, 4), C(8, 1, 2, 3, 8), C(64, 1, 4, 3, 2), C(32, 1, 4, 3, 8), C(16, 1, 1, 3, 2)]
SWEEPS.update({f"{f}_q8_given": _Q8[:6] + _GIVEN for f in ("gate_up", "down", "down_q4k", "qkv", "o")})


def packed(qtype: T, shape: tuple, rng, layout: str = "planes"):
    return repack(random_blocks(qtype, shape, WEIGHT_STD, rng), qtype, shape, layout)


def copies(tree, r: int):
    """r distinct device copies of a pytree of arrays (same values, different buffers)."""
    return [tree] + [jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), tree) for _ in range(r - 1)]


def n_copies(nbytes: int, cap: int) -> int:
    """Copies of a weight so that R calls read more than the L2 holds (1 if one already does)."""
    return max(1, min(cap, -(-2 * L2_BYTES // nbytes)))


def family(name: str, dims: dict, rng, max_copies: int):
    """(launch(cfg) -> fn(args) -> outputs, args, weight bytes read a launch, the launch's key:
    ("single", layout, type, N, K) or ("many", layout, [(type, N), ...], K), as a tuned-config
    file names it and as ``current_pick`` looks it up)."""
    d, k = dims["hidden"], dims["top_k"]
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.float32)
    if name.startswith("router"):
        rounded = name == "router_rounded"
        w = jnp.asarray(rng.standard_normal((dims["experts"], d)) * WEIGHT_STD, jnp.float32)
        norm = jnp.asarray(rng.uniform(0.5, 2, d), jnp.float32)
        sets = copies(w, n_copies(w.nbytes, max_copies))

        def launch(cfg):
            return jax.jit(lambda x, sets: [jax.tree.leaves(router_logits(x, norm, 1e-6, ws, block_e=cfg.block_n,
                                                                          num_warps=cfg.num_warps, rounded=rounded,
                                                                          chunk=256 * cfg.chunks_per_step,
                                                                          interpret=INTERP)) for ws in sets])
        return launch, (x, sets), w.nbytes, None
    pre = name.endswith("_pre")  # the Q8_1 rounding in a launch of its own first
    given = name.endswith("_given")  # x rounded outside the timed call
    base = name.removesuffix("_given").removesuffix("_pre").removesuffix("_q8")
    if base in ("qkv", "o", "output"):
        q8 = "_q8" in name
        layout, tuning = ("ggml", "q8-given" if given else "q8") if q8 else ("planes", "planes")
        if base == "qkv":
            ws = (packed(T.Q4_K, (dims["q_rows"], d), rng, layout), packed(T.Q4_K, (dims["kv_rows"], d), rng, layout),
                  packed(T.Q6_K, (dims["kv_rows"], d), rng, layout))
            norm = jnp.asarray(rng.uniform(0.5, 2, d), jnp.float32)
            key = ("many", tuning, [(T(w.qtype).name, w.shape[0]) for w in ws], d)
            many = qgemv_q8_many if q8 else qgemv_many
            if given:
                x = quantize_q8_1(rms_norm(x, norm, 1e-6))
                one = lambda cfg: lambda x, w: many(x, w, config=cfg, interpret=INTERP)  # noqa: E731
            else:
                one = lambda cfg: lambda x, w: many(x, w, norm=norm, eps=1e-6, config=cfg, interpret=INTERP)  # noqa: E731
        else:  # one weight [N, K]: the attention output projection (x: the attention's [1, Hq * Dh]) or the head
            qtype, n, width = (T.Q4_K, d, dims["q_rows"]) if base == "o" else (T.Q6_K, dims["vocab"], d)
            if base == "o":
                x = jnp.asarray(rng.standard_normal((1, width)), jnp.float32)
            ws = packed(qtype, (n, width), rng, layout)
            key = ("single", tuning, qtype.name, n, width)
            if not q8:
                one = lambda cfg: lambda x, w: (qgemv(x, w, config=cfg, interpret=INTERP),)  # noqa: E731
            elif given:
                x = quantize_q8_1(x)
                one = lambda cfg: lambda x, w: (qgemv_q8(x, w, config=cfg, interpret=INTERP),)  # noqa: E731
            elif pre:
                one = lambda cfg: lambda x, w: (qgemv_q8(quantize_q8_1(x), w, config=cfg, interpret=INTERP),)  # noqa: E731
            else:
                one = lambda cfg: lambda x, w: (qgemv_q8(x, w, config=cfg, round_first=False, interpret=INTERP),)  # noqa: E731
        nbytes = sum(w.nbytes for w in jax.tree_util.tree_leaves(ws))
        sets = copies(ws, n_copies(nbytes, max_copies))

        def launch(cfg):
            f = one(cfg)
            return jax.jit(lambda x, sets: [f(x, w) for w in sets])
        return launch, (x, sets), nbytes, key
    e, f_rows = dims["experts"], dims["ff"]
    n_sets = max(1, min(max_copies, 16))
    experts = [jnp.asarray(rng.permutation(e)[:k], jnp.int32) for _ in range(n_sets)]  # [P] each, one token
    q8 = "_q8" in name
    layout = "ggml" if q8 else "planes"
    if name.startswith("gate_up"):
        ws = (packed(T.Q4_K, (e, f_rows, d), rng, layout), packed(T.Q4_K, (e, f_rows, d), rng, layout))
        key = ("many", "q8-given" if given else "q8" if q8 else "planes", [("Q4_K", f_rows)] * 2, d)
        nbytes = sum(w.nbytes for w in ws) // e * k
        many = moe_gemv_q8_many if q8 else moe_gemv_many
        norm = jnp.asarray(rng.uniform(0.5, 2, d), jnp.float32)
        if given:
            x = quantize_q8_1(rms_norm(x, norm, 1e-6))
        # as the step makes it: the norm formed in the launch (pre: in the rounding launch)
        first = (lambda x: quantize_q8_1(rms_norm(x, norm, 1e-6))) if pre else (lambda x: x)
        kw = dict(norm=norm, eps=1e-6) if not (pre or given) else {}

        def launch(cfg):
            return jax.jit(lambda x, ws, sets: [many(first(x), ws, ex, pairs_per_row=k, config=cfg, **kw, interpret=INTERP)
                                                for ex in sets])
        return launch, (x, ws, experts), nbytes, key
    down_type = T.Q4_K if name.startswith("down_q4k") else T.Q6_K
    down = packed(down_type, (e, d, f_rows), rng, layout)
    g, u = (jnp.asarray(rng.standard_normal((k, f_rows)), jnp.float32) for _ in range(2))
    key = ("single", "q8-given" if given else "q8" if q8 else "planes", down_type.name, d, f_rows)

    def launch(cfg):
        if given:
            return jax.jit(lambda h, w, sets: [(moe_gemv_q8(h, w, ex, config=cfg, interpret=INTERP),) for ex in sets])
        if pre:
            return jax.jit(lambda g, u, w, sets: [(moe_gemv_q8(quantize_q8_1(swiglu(g, u)), w, ex, config=cfg, interpret=INTERP),)
                                                  for ex in sets])
        if q8:  # gu: gate and up side by side, as moe_gemv_q8_many(..., joined=True) leaves them
            return jax.jit(lambda gu, w, sets: [(moe_gemv_q8(gu, w, ex, swiglu_halves=True, config=cfg, interpret=INTERP),)
                                                for ex in sets])
        return jax.jit(lambda g, u, w, sets: [(moe_gemv(g, w, ex, up=u, config=cfg, interpret=INTERP),) for ex in sets])
    if given:
        x_side = (quantize_q8_1(swiglu(g, u)),)
    else:
        x_side = (jnp.concatenate([g, u], axis=1),) if q8 and not pre else (g, u)
    return launch, (*x_side, down, experts), down.nbytes // e * k, key


def time_us(fn, args, launches: int, reps: int, min_total_s: float) -> tuple[float, list[float]]:
    """Median us a launch: samples of back-to-back calls (only the last output kept alive)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(2, min(500, int(min_total_s / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls / launches * 1e6)
    return statistics.median(samples), samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="gate_up,down,down_q4k,qkv,output",
                   help="comma-separated; NAME:current times only that family's current pick")
    p.add_argument("--json", default="")
    p.add_argument("--tuned-out", default="", help="write each family's winner here (BLOOMERY_GEMV_TUNED's form)")
    p.add_argument("--margin", type=float, default=0.03, help="a config replaces the current pick only if this much faster")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-total-s", type=float, default=0.05, help="wall time of one sample")
    p.add_argument("--max-copies", type=int, default=16, help="weight copies / expert sets a timed call walks")
    p.add_argument("--budget-s", type=float, default=400.0, help="start no new variant after this")
    p.add_argument("--small", action="store_true", help="small shapes (a CPU smoke run, kernels interpreted)")
    p.add_argument("--current-only", action="store_true", help="time only what the code picks today (under ncu)")
    a = p.parse_args(argv)
    dims = SMOKE if a.small else QWEN3_30B
    t_start = time.time()
    out = dict(meta=dict(argv=sys.argv, date=time.strftime("%Y-%m-%d %H:%M:%S"), jax=jax.__version__,
                         device=str(jax.devices()[0].device_kind), dims=dims), results=[])
    tuned = dict(single=[], many=[])
    for name in a.families.split(","):
        name, _, only = name.partition(":")
        launch, args, nbytes, key = family(name, dims, np.random.default_rng(len(name)), a.max_copies)
        current = current_pick(key)
        launches = len(args[-1])
        ref = None
        sweep = [] if a.current_only or only == "current" else [c for c in SWEEPS[name] if c != current]
        for i, cfg in enumerate([current] + sweep):
            if time.time() - t_start > a.budget_s:
                break
            row = dict(family=name, config=list(cfg.__dict__.values()), current=i == 0, weight_bytes=nbytes,
                       launches_per_call=launches)
            try:
                fn = launch(cfg)
                got = [np.asarray(y) for ys in jax.device_get(fn(*args)) for y in ys]
                if ref is None:
                    ref = got
                scale = max(float(np.abs(r).max()) for r in ref)
                row["max_diff_rel"] = max(float(np.abs(g - r).max()) for g, r in zip(got, ref)) / scale
                if row["max_diff_rel"] > 1e-4:
                    raise AssertionError(f"outputs differ from the current config's by {row['max_diff_rel']:.2g}")
                us, samples = time_us(fn, args, launches, a.reps, a.min_total_s)
                row.update(us=round(us, 2), GBps=round(nbytes / us / 1e3, 1), samples_us=[round(s, 2) for s in samples])
            except Exception as err:  # a config the lowering or the check refuses: record it, go on
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            out["results"].append(row)
            print(f"{name:8} {str(row['config']):22} {'(current)' if i == 0 else '         '} "
                  f"{row.get('us', float('nan')):8.2f} us {row.get('GBps', float('nan')):7.1f} GB/s {row.get('error', '')}",
                  flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=1)
        if a.tuned_out and key is not None:
            winner = pick_winner([r for r in out["results"] if r["family"] == name], a.margin)
            if winner is not None:
                tuned[key[0]].append([*key[1:], winner])
                with open(a.tuned_out, "w") as f:
                    json.dump(tuned, f, indent=1)
    return 0


def current_pick(key: tuple | None) -> C:
    """What the code picks today for a launch ``key`` (``family``'s; None: the router)."""
    if key is None:
        return ROUTER_PICK
    return (pick_config if key[0] == "single" else pick_many_config)(*key[1:])


def pick_winner(rows: list[dict], margin: float) -> list | None:
    """The config of a family's fastest row if it beats the current pick's time by more than
    ``margin`` (a fraction), else the current pick's; None if the current pick was not timed."""
    timed = [r for r in rows if "us" in r]
    current = next((r for r in timed if r["current"]), None)
    if current is None:
        return None
    best = min(timed, key=lambda r: r["us"])
    return best["config"] if best["us"] < current["us"] * (1 - margin) else current["config"]


if __name__ == "__main__":
    sys.exit(main())
