"""Lower a jitted function for an abstract H200 (no GPU needed) and list the Triton kernels built.

Each Pallas call must become a Triton module that verifies, for compute capability 9.0
(``args[3]`` of the lowering hook). The hook is a private JAX function: test-only.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh


def triton_kernels(monkeypatch, fn, *args) -> list[tuple[str, int, bool]]:
    """(kernel name, compute capability, module verifies) for every Pallas call of ``fn(*args)``;
    args are ShapeDtypeStructs or arrays. Also checks the lowered program calls Triton."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    built = []
    original = reg.lowering.lower_jaxpr_to_triton_module

    def verified(*a, **kw):
        result = original(*a, **kw)
        op = result.module.operation
        built.append((str(op.attributes["sym_name"]).strip('"'), a[3], op.verify()))
        return result

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", verified)
    jax.clear_caches()  # a lowering cached by an earlier test would skip the hook
    assert "__gpu$xla.gpu.triton" in lowered_for_h200(fn, *args)
    return built


def lowered_for_h200(fn, *args) -> str:
    """The StableHLO text of ``jax.jit(fn)(*args)`` lowered for an abstract H200."""
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=h200)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
