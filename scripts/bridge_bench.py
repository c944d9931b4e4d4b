"""Per-call overhead of the host bridge inside a jitted step (jax.pure_callback).

A jitted function chains L host calls (each takes the previous output, as the MoE layers of a
decode step do) on an [N, D] float32 activation; the host function only copies its input. The
overhead per call is (time with callbacks - time of the same chain without them) / L, median
over repetitions. Run it on the machine whose numbers you want (CPU here, the GPU machine for
the design's 190-225 us figure):

    python scripts/bridge_bench.py --layers 48 --tokens 1 --d-model 2048 --reps 20 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def host_copy(x):
    return np.asarray(x, np.float32) * np.float32(1.0)


def chain(x, layers: int, bridge: bool):
    for _ in range(layers):
        if bridge:
            x = x + jax.pure_callback(host_copy, jax.ShapeDtypeStruct(x.shape, jnp.float32), x,
                                      vmap_method="sequential")
        else:
            x = x + x * jnp.float32(1.0)
        x = x * jnp.float32(0.5)
    return x


def time_fn(fn, x, reps: int) -> list[float]:
    fn(x).block_until_ready()  # compile and warm up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    x = jnp.ones((args.tokens, args.d_model), jnp.float32)
    with_cb = jax.jit(lambda v: chain(v, args.layers, True))
    without = jax.jit(lambda v: chain(v, args.layers, False))
    t_cb = statistics.median(time_fn(with_cb, x, args.reps))
    t_no = statistics.median(time_fn(without, x, args.reps))
    per_call_us = (t_cb - t_no) / args.layers * 1e6
    result = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), layers=args.layers,
                  tokens=args.tokens, d_model=args.d_model, reps=args.reps, step_with_bridge_ms=t_cb * 1e3,
                  step_without_ms=t_no * 1e3, overhead_per_call_us=per_call_us)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
