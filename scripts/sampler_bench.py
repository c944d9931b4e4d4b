"""The sampler's draw with its cuts found by a sort or by the key search, at Qwen3's vocabulary.

Times ``sample_tokens`` (branch-free, every row sampling with top-k 40 and top-p 0.9) for each
batch size, cut method and search digit width, then a decode step's whole ``sample`` under the
full and the greedy plan; us per call = median over --reps samples of --calls back-to-back
calls. Prints a line each and writes JSON to --json.

  python scripts/sampler_bench.py --json $OUT/sampler.json          # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.engine import sampling as S  # noqa: E402
from moe_decode_bench import median_us  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--digits", default="4,8", help="comma list of SEARCH_DIGIT_BITS for the search")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", default="")
    a = p.parse_args()
    results = []
    for B in map(int, a.batch.split(",")):
        rows = S.make_rows([S.row_arrays(S.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=b), a.vocab)
                            for b in range(B)])
        x = jnp.asarray(np.random.default_rng(B).standard_normal((B, a.vocab)).astype(np.float32) * 3)
        variants = [("sort", None)] + [("search", int(d)) for d in a.digits.split(",")]
        tokens = {}
        for method, digits in variants:
            if digits:
                S.SEARCH_DIGIT_BITS = digits  # read at trace time
            f = jax.jit(lambda x, r, s=(method == "search"): S.sample_tokens(x, r, branch_free=True, search=s))
            tokens[(method, digits)] = np.asarray(f(x, rows))
            r = dict(batch=B, method=method, digit_bits=digits, us=median_us(f, [(x, rows)], a.reps, a.calls),
                     same_tokens_as_sort=bool(np.array_equal(tokens[(method, digits)], tokens[("sort", None)])))
            print(r, flush=True)
            results.append(r)
        # A decode step's whole sampler (tokens, logprobs, top-n) under each plan: the full one
        # (the search's default digits, branch-free, top-20) and the greedy one (argmax alone)
        S.SEARCH_DIGIT_BITS = int(a.digits.split(",")[0])
        for plan in (S.Plan(draw=True, n_top=S.MAX_N_PROBS), S.Plan(draw=False, n_top=0)):
            f = jax.jit(lambda x, r, plan=plan: S.sample(x, r, plan.n_top, plan.draw))
            r = dict(batch=B, method="plan-full" if plan.draw else "plan-greedy", digit_bits=None,
                     us=median_us(f, [(x, rows)], a.reps, a.calls))
            print(r, flush=True)
            results.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), vocab=a.vocab, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
