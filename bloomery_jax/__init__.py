"""bloomery_jax: a compiled JAX inference engine for Mixture-of-Experts GGUF models."""

import os

# The host expert kernels run on Numba's OpenMP workers, which by default spin 300,000 times
# after each parallel region. They share the cores with threads that busy-wait on the GPU (the
# step's waiting thread, the CUDA driver's host-function thread), and long-spinning workers take
# the cores the late ones need: on the H200 host, 16 such workers ran the FFI bridge's host calls
# ~20x slower (8-layer decode 5.5 against 108 tok/s passive). A short spin still bridges the gaps
# between one call's regions, which sleeping workers pay to wake from: n-cpu-moe=36 decode with
# 14 workers ran 28.1 tok/s at 10,000 spins against 24.1 passive (benchmarks/gpu_2026-12-04-s9).
# Set before Numba starts OpenMP, which reads it once; a policy or spin count the user set stays.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

__version__ = "0.1.0"
