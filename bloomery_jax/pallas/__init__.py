"""Pallas GPU kernels (Triton lowering): quantized GEMV for decode, dense and MoE.

Importing this package imports ``jax.experimental.pallas.fuser`` first. That module registers a
JAX config state that is part of every jit's tracing context, and JAX imports it lazily the
first time a Pallas call is traced or interpreted: a jitted step traced before that would
compile again on its next call (the context grew by one value). Importing it up front keeps
the context fixed from the start.
"""

import jax.experimental.pallas.fuser  # noqa: F401  (see above)
