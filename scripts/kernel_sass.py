"""What a decode GEMV launch compiles to on an H100, without a GPU: registers, spills and the
instruction mix of its SASS, for changes to a kernel's body that want counting before a device
hold (issue 7; the twenty-seventh session's count of the gate/up launch is in docs/LOG.md).

Two steps in two interpreters, because the compiler is not one of the project's dependencies:

1. ``lower`` (the project's environment): lowers one ``layer_kernel_bench.py`` family at a launch
   config for CUDA on this CPU machine (JAX's Pallas lowering asks the GPU for its compute
   capability; this script answers sm_90 for it) and writes each Pallas kernel's Triton IR.
2. ``compile`` (an environment with the ``triton`` package, e.g. ``python3 -m venv /tmp/tv &&
   /tmp/tv/bin/pip install triton``): compiles that IR for sm_90 at the config's warps and stages
   with upstream Triton, which is not the Triton inside jaxlib, so small differences from the
   card's binary are possible (on the H200, jaxlib's gate/up took 60 registers, upstream's 126);
   prints registers, stack, local (spilled) and shared memory, and the SASS's instruction counts
   (triton's bundled cuobjdump).

    python scripts/kernel_sass.py lower --family gate_up --config 32,1,4,3,4 --out /tmp/sass
    /tmp/tv/bin/python scripts/kernel_sass.py compile --out /tmp/sass
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def lower(family_name: str, config: list[int], out: str) -> None:
    sys.path[:0] = [HERE, os.path.join(HERE, "..")]
    import jax
    import numpy as np
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration as registration

    import layer_kernel_bench as lkb
    from bloomery_jax.pallas.qgemv_tuned import GemvConfig

    sm90 = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    registration.gpu_info_lib.get_gpu_info = lambda: sm90  # no GPU here to ask
    to_triton = lowering.lower_jaxpr_to_triton_module
    kernels = []

    def keep(*args, **kwargs):
        result = to_triton(*args, **kwargs)
        path = os.path.join(out, f"kernel{len(kernels)}.ttir")
        with open(path, "w") as f:
            f.write(result.module.operation.get_asm(enable_debug_info=False))
        kernels.append(dict(path=path, grid=list(result.grid)))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep
    lkb.INTERP = False  # the family's launches read it when traced
    launch, args, nbytes, _ = lkb.family(family_name, lkb.QWEN3_30B, np.random.default_rng(len(family_name)), 1)
    cfg = GemvConfig(*config)
    jax.jit(launch(cfg)).trace(*args).lower(lowering_platforms=("cuda",))
    meta = dict(family=family_name, config=config, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                weight_bytes=nbytes, kernels=kernels)
    with open(os.path.join(out, "lowered.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta, indent=1))


_SASS = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_all(out: str) -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as ptxas fuses by default; the kernels count on FMA
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    with open(os.path.join(out, "lowered.json")) as f:
        meta = json.load(f)
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = dict(num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for k in meta["kernels"]:
        ctx = ir.context()
        ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        module = ir.parse_mlir_module(k["path"], ctx)
        module.context = ctx
        # compile() takes a .ttir file as already through these passes; JAX's is not
        module = backend.make_ttir(module, {}, backend.parse_options(options), 90)
        stem = k["path"][:-len(".ttir")]
        with open(stem + ".opt.ttir", "w") as f:
            f.write(str(module))
        compiled = triton.compile(stem + ".opt.ttir", target=target, options=options)
        with open(stem + ".cubin", "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(stem + ".ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", stem + ".cubin"],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", stem + ".cubin"],
                              capture_output=True, text=True).stdout
        with open(stem + ".sass", "w") as f:
            f.write(sass)
        ops = collections.Counter(m.group(1) for m in map(_SASS.search, sass.splitlines()) if m)
        print(f"{k['path']}: grid {k['grid']}, {meta['family']} at {meta['config']}")
        print("  " + " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", usage)))
        print(f"  {sum(ops.values())} SASS instructions (straight-line count, loops once):")
        for op, n in ops.most_common(24):
            print(f"    {n:5d} {op}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("lower", "compile"))
    p.add_argument("--family", default="gate_up", help="a layer_kernel_bench.py family")
    p.add_argument("--config", default="32,1,4,3,4", help="block_n, chunks a step, warps, stages, split-K")
    p.add_argument("--out", default="/tmp/sass")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.step == "lower":
        lower(a.family, [int(v) for v in a.config.split(",")], a.out)
    else:
        compile_all(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
