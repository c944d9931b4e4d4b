"""Compiled quant-tile moe_gemm against the interpreter on small shapes, per format and precision:
max |compiled - interpreted| / max |interpreted|, and a few numbers of each (a GPU probe)."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, "tests")
from test_pallas_moe_gemv import stacked  # noqa: E402

from bloomery_jax.pallas.moe_gemm import GemmConfig, moe_gemm, plan_tiles  # noqa: E402

for qtype in (T.Q8_0, T.Q4_K, T.Q6_K):
    rng = np.random.default_rng(1)
    raw, pw, w64 = stacked(qtype, 4, 64, 512, rng)
    experts = jnp.asarray(rng.integers(0, 4, 64), jnp.int32)
    x = jnp.asarray(rng.standard_normal((64, 512)), jnp.float32)
    exact = np.einsum("pk,pnk->pn", np.asarray(x, np.float64), w64[np.asarray(experts)])
    for prec in ("tf32x3", "q-bf16", "q-bf16x2", "q-int8"):
        cfg = GemmConfig(32, 64, 4, 2, prec)
        plan = plan_tiles(experts, 4, 32)
        got = {}
        for interp in (False, True):
            try:
                y = moe_gemm(x[plan.rows], pw, plan.tile_experts, config=cfg, interpret=interp)[plan.dest]
                got[interp] = np.asarray(y, np.float64)
            except Exception as e:  # noqa: BLE001
                got[interp] = f"{type(e).__name__}: {str(e)[:200]}"
        if isinstance(got[False], str) or isinstance(got[True], str):
            print(qtype.name, prec, got)
            continue
        d = np.abs(got[False] - got[True]).max() / np.abs(got[True]).max()
        e = np.abs(got[False] - exact).max() / np.abs(exact).max()
        print(f"{qtype.name} {prec:9s} compiled-vs-interp {d:.3g}  compiled-vs-exact {e:.3g}  "
              f"c {got[False][0, :3]} i {got[True][0, :3]}", flush=True)
