"""Per-call overhead of each host bridge inside a jitted step.

A jitted function chains L layer calls, as the MoE layers of a decode step do: each takes the
previous output, calls the bridge on an [N, D] activation whose experts are all on the card
(an empty host set: the host kernel only zeroes its output), and scales it. The overhead per
call is (time with the bridge calls - time of the same chain without them) / L, median over
repetitions, for each bridge: ``callback`` (jax.pure_callback, host.bridge.HostBridge),
``ffi`` (the XLA FFI custom call, host.ffi.FfiHostBridge, its stream handing each call to the
host by cuLaunchHostFunc) and ``ffi-doorbell`` (the same with the doorbell signal). Run it on the machine whose numbers
you want (the GPU machine for issue 8's 50 us target):

    python scripts/bridge_bench.py --layers 48 --tokens 1 --d-model 2048 --reps 20 [--json OUT]

``--work E`` times real host work instead: a Qwen3-30B-A3B-shaped Q4_K_M layer of E experts (4
quantized, tiled), every routed expert on the host, layer l of the chain routed to experts
(l k .. l k + k - 1) mod E, on ``--threads`` Numba threads; next to it the same calls made
directly from Python (``kernel_ms``: the kernel alone, on the main thread). On a GPU this says
whether the kernel runs as fast inside each bridge as outside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numba
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


def work_layer(n_experts: int):
    from host_bench import make_layer

    return make_layer("q4_k_m", n_experts, 768, 2048, distinct=4)


def routed(experts, layer: int, n_experts: int):
    """Layer ``layer``'s routing: ``experts`` moved on by k experts a layer (NumPy or jax arrays)."""
    return (experts + layer * experts.shape[1]) % n_experts


def chain(bridge, x, experts, weights, on_host, layers: int):
    for l in range(layers):
        y = (bridge.moe(0, x, routed(experts, l, on_host.shape[0]), weights, on_host) if bridge is not None
             else x * jnp.float32(1.0))
        x = (x + y) * jnp.float32(0.5)
    return x


def kernel_alone(lay, inputs, layers: int, reps: int, threads) -> float:
    """Median seconds of the chain's host calls made directly from Python (no bridge, no card)."""
    from bloomery_jax.host import host_moe_swiglu

    x, experts, weights, on_host = (np.asarray(a) for a in inputs)
    if threads:
        numba.set_num_threads(threads)
    calls = [routed(experts, l, on_host.shape[0]) for l in range(layers)]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for layer_experts in calls:
            host_moe_swiglu(x, layer_experts, weights, on_host, lay)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--bridges", default="callback,ffi", help="comma-separated: callback, ffi, ffi-doorbell")
    p.add_argument("--work", type=int, default=0, metavar="E",
                   help="real host work: a Q4_K_M layer of E experts, all on the host (0 = the empty call)")
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default: 1, or Numba's with --work)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    from bloomery_jax.host.bridge import HostBridge
    from bloomery_jax.host.ffi import FfiHostBridge

    kinds = {"callback": HostBridge, "ffi": functools.partial(FfiHostBridge, signal="hostfunc"),
             "ffi-doorbell": functools.partial(FfiHostBridge, signal="doorbell")}
    lay = work_layer(args.work) if args.work else layer(args.d_model)
    n_experts, d_model = lay.n_experts, lay.dims[0]
    threads = args.threads or (None if args.work else 1)
    x = jnp.ones((args.tokens, d_model), jnp.float32)
    experts = jnp.zeros((args.tokens, K), jnp.int32) + jnp.arange(K, dtype=jnp.int32) % n_experts
    weights = jnp.full((args.tokens, K), 1.0 / K, jnp.float32)
    on_host = jnp.full(n_experts, bool(args.work))
    inputs = (x, experts, weights, on_host)
    without = jax.jit(lambda *a: chain(None, *a, args.layers))
    result = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), layers=args.layers,
                  tokens=args.tokens, d_model=d_model, reps=args.reps, work_experts=args.work,
                  threads=threads or numba.config.NUMBA_NUM_THREADS, bridges={})
    if args.work:
        result["kernel_ms"] = kernel_alone(lay, inputs, args.layers, args.reps, threads) * 1e3
    # interleave the variants rep by rep so that a busy spell of the machine hits them all alike
    fns = {"none": without}
    for name in args.bridges.split(","):
        bridge = kinds[name]({0: lay}, threads=threads)
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
            r = result["bridges"][name] = dict(step_ms=t * 1e3, overhead_per_call_us=(t - t_no) / args.layers * 1e6)
            if args.work:  # what a call costs beyond the kernel run directly
                r["overhead_per_call_us"] -= result["kernel_ms"] / args.layers * 1e3
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
