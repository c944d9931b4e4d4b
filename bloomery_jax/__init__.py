"""bloomery_jax: a compiled JAX inference engine for Mixture-of-Experts GGUF models."""

__version__ = "0.1.0"
