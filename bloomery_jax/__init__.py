"""bloomery_jax: a compiled JAX inference engine for Mixture-of-Experts GGUF models."""

import os

# The host expert kernels run on Numba's OpenMP workers, which by default spin after each
# parallel region. They share the cores with threads that busy-wait on the GPU (the step's
# waiting thread, the CUDA driver's host-function thread), and spinning workers then take the
# cores the late ones need: on the H200 host, 16 spinning workers ran the FFI bridge's host
# calls ~20x slower (8-layer decode 5.5 against 108 tok/s passive). Set before Numba starts
# OpenMP, which reads it once; a policy or spin count the user set stays.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"
