"""Host-resident MoE experts: Numba kernels on the GGUF file's raw blocks.

    from bloomery_jax.host import HostTensor, HostExpertLayer, host_moe_swiglu
    layer = HostExpertLayer(gate, up, down)           # HostTensor views of the file
    y = host_moe_swiglu(x, experts, weights, on_host, layer)   # float32 [N, D]

``blocks`` holds the per-format row dot products and activation quantizers, ``swiglu`` the
layer kernel, ``reference`` the plain NumPy twin the tests compare against.
"""

from . import numba_cache

numba_cache.install()  # before the kernels' modules create their caches

from .swiglu import ACTS, DEFAULT_ACT, KERNEL_FORMATS, HostExpertLayer, HostTensor, host_moe_swiglu  # noqa: E402

__all__ = ["ACTS", "DEFAULT_ACT", "KERNEL_FORMATS", "HostExpertLayer", "HostTensor", "host_moe_swiglu"]
