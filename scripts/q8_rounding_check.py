"""On the GPU: the q8 GEMV launches that round x to Q8_1 inside them against the same launches on
blocks rounded before them (``quantize_q8_1``), at Qwen3-30B-A3B decode shapes.

The in-kernel rounding is ``quantize_q8_1``'s bit for bit (division as ``div.rn.f32``), and the
dot products then run the same code on the same blocks, so on plain x the outputs must be equal
bit for bit; any difference means the rounding or its barrier is wrong on the card (the CPU tests
run the interpreter, which has neither inline PTX nor a barrier). With the norm or SwiGLU formed
in-kernel, the rows rounded differ from XLA's in the last bits, so a rare quant moves by one:
the check prints the largest difference in units of the outputs' scale and the share of
outputs that are equal.

    python scripts/q8_rounding_check.py     # GPU; --interpret for a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.ops.actquant import quantize_q8_1  # noqa: E402
from bloomery_jax.ops.experts import swiglu  # noqa: E402
from bloomery_jax.ops.norms import rms_norm  # noqa: E402
from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8, moe_gemv_q8_many, qgemv_q8, qgemv_q8_many  # noqa: E402
from bloomery_jax.quant.repack import repack  # noqa: E402
from bloomery_jax.synth.blocks import random_blocks  # noqa: E402


def compare(name: str, got, want, exact: bool) -> dict:
    got, want = (np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(t)]) for t in (got, want))
    scale = float(np.abs(want).max()) or 1.0
    row = dict(check=name, outputs=got.size, equal=float(np.mean(got == want)),
               max_diff_of_scale=float(np.abs(got - want).max() / scale), must_be_exact=exact)
    row["ok"] = bool(row["equal"] == 1.0) if exact else bool(row["max_diff_of_scale"] < 1e-2)
    print(json.dumps(row))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interpret", action="store_true", help="the Pallas interpreter, small shapes (CPU)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    small = a.interpret
    d, q_rows, kv, e, f, k = (256, 256, 64, 4, 256, 2) if small else (2048, 4096, 512, 128, 768, 8)
    rng = np.random.default_rng(0)
    packed = lambda qtype, shape: repack(random_blocks(qtype, shape, 0.02, rng), qtype, shape, "ggml")  # noqa: E731
    kw = dict(interpret=a.interpret)
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 2.0, d), jnp.float32)
    experts = jnp.asarray(rng.permutation(e)[:k], jnp.int32)
    rows = []
    qkv = (packed(T.Q4_K, (q_rows, d)), packed(T.Q4_K, (kv, d)), packed(T.Q6_K, (kv, d)))
    rows.append(compare("qkv, plain x", qgemv_q8_many(x, qkv, **kw), qgemv_q8_many(quantize_q8_1(x), qkv, **kw), True))
    normed = rms_norm(x, norm, 1e-6)
    rows.append(compare("qkv, norm in-kernel", qgemv_q8_many(x, qkv, norm=norm, eps=1e-6, **kw),
                        qgemv_q8_many(quantize_q8_1(normed), qkv, **kw), False))
    o = packed(T.Q4_K, (d, q_rows))
    xo = jnp.asarray(rng.standard_normal((1, q_rows)), jnp.float32)
    rows.append(compare("o, plain x", qgemv_q8(xo, o, **kw), qgemv_q8(quantize_q8_1(xo), o, **kw), True))
    gu = (packed(T.Q4_K, (e, f, d)), packed(T.Q4_K, (e, f, d)))
    rows.append(compare("gate/up, plain x", moe_gemv_q8_many(x, gu, experts, pairs_per_row=k, **kw),
                        moe_gemv_q8_many(quantize_q8_1(x), gu, experts, pairs_per_row=k, **kw), True))
    rows.append(compare("gate/up, norm in-kernel",
                        moe_gemv_q8_many(x, gu, experts, pairs_per_row=k, norm=norm, eps=1e-6, **kw),
                        moe_gemv_q8_many(quantize_q8_1(normed), gu, experts, pairs_per_row=k, **kw), False))
    halves = jnp.asarray(rng.standard_normal((k, 2 * f)), jnp.float32)  # gate | up of each pair
    h = swiglu(halves[:, :f], halves[:, f:])
    for qtype in (T.Q6_K, T.Q4_K):
        down = packed(qtype, (e, d, f))
        rows.append(compare(f"down {qtype.name}, plain x", moe_gemv_q8(h, down, experts, **kw),
                            moe_gemv_q8(quantize_q8_1(h), down, experts, **kw), True))
        rows.append(compare(f"down {qtype.name}, SwiGLU in-kernel", moe_gemv_q8(halves, down, experts, swiglu_halves=True, **kw),
                            moe_gemv_q8(quantize_q8_1(h), down, experts, **kw), False))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), fh, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
