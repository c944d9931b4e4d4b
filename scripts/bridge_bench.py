"""Per-call overhead of each host bridge inside a jitted step.

A jitted function chains L layer calls, as the MoE layers of a decode step do: each takes the
previous output, calls the bridge on an [N, D] activation whose experts are all on the card
(an empty host set: the host kernel only zeroes its output), and scales it. The overhead per
call is (time with the bridge calls - time of the same chain without them) / L, median over
repetitions, for each bridge: ``callback`` (jax.pure_callback, host.bridge.HostBridge) and
``ffi`` (the XLA FFI custom call, host.ffi.FfiHostBridge). Run it on the machine whose numbers
you want (the GPU machine for issue 8's 50 us target):

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
from gguf import GGMLQuantizationType as T

E, F, K = 8, 256, 8  # a small Q8_0 layer: only its shapes matter, no pair runs on the host


def layer(d_model: int):
    from bloomery_jax.host import HostExpertLayer, HostTensor
    from bloomery_jax.quant import quantize

    rng = np.random.default_rng(0)
    shapes = ((E, F, d_model), (E, F, d_model), (E, d_model, F))
    return HostExpertLayer(*(HostTensor(quantize(rng.standard_normal(s).astype(np.float32), T.Q8_0, threads=1),
                                        T.Q8_0, s) for s in shapes))


def chain(bridge, x, experts, weights, on_host, layers: int):
    for _ in range(layers):
        y = bridge.moe(0, x, experts, weights, on_host) if bridge is not None else x * jnp.float32(1.0)
        x = (x + y) * jnp.float32(0.5)
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--bridges", default="callback,ffi", help="comma-separated: callback, ffi")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    from bloomery_jax.host.bridge import HostBridge
    from bloomery_jax.host.ffi import FfiHostBridge

    kinds = {"callback": HostBridge, "ffi": FfiHostBridge}
    lay = layer(args.d_model)
    x = jnp.ones((args.tokens, args.d_model), jnp.float32)
    experts = jnp.zeros((args.tokens, K), jnp.int32) + jnp.arange(K, dtype=jnp.int32) % E
    weights = jnp.full((args.tokens, K), 1.0 / K, jnp.float32)
    on_host = jnp.zeros(E, bool)
    inputs = (x, experts, weights, on_host)
    without = jax.jit(lambda *a: chain(None, *a, args.layers))
    result = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), layers=args.layers,
                  tokens=args.tokens, d_model=args.d_model, reps=args.reps, bridges={})
    # interleave the variants rep by rep so that a busy spell of the machine hits them all alike
    fns = {"none": without}
    for name in args.bridges.split(","):
        bridge = kinds[name]({0: lay}, threads=1)
        fns[name] = jax.jit(lambda *a, b=bridge: chain(b, *a, args.layers))
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn(*inputs).block_until_ready()  # compile and warm up
    for _ in range(args.reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(*inputs).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    t_no = statistics.median(times["none"])
    result["step_without_ms"] = t_no * 1e3
    for name in fns:
        if name != "none":
            t = statistics.median(times[name])
            result["bridges"][name] = dict(step_ms=t * 1e3, overhead_per_call_us=(t - t_no) / args.layers * 1e6)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
