"""Full-size Qwen3-30B-A3B shapes through ``jax.eval_shape`` of the forward (no memory used).

48 layers, 128 experts (top-8), hidden 2048, expert FF 768, 32 query / 4 kv heads of 128,
vocabulary 151936; experts in Q4_K, attention Q4_K, output Q6_K, embeddings Q4_K, norms F32
(the usual Q4_K_M layout). Abstract QTensors carry the byte shapes of those blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.models import qwen3moe
from bloomery_jax.models.kv_cache import KVCache
from bloomery_jax.quant import QTensor, row_bytes

CFG = qwen3moe.Config(n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128,
                      n_experts_used=8, expert_ff=768, n_vocab=151936, rope_base=1e6)


def _abstract(spec) -> QTensor:
    qtype = {"norm": T.F32, "output": T.Q6_K}.get(spec.role, T.Q4_K)
    if qtype == T.F32:
        data = jax.ShapeDtypeStruct(spec.shape, jnp.float32)
    else:
        data = jax.ShapeDtypeStruct((*spec.shape[:-1], row_bytes(qtype, spec.shape[-1])), jnp.uint8)
    return QTensor(data, int(qtype), spec.shape)


@pytest.mark.parametrize("B,T_,S", [(1, 512, 4096), (4, 1, 4096)], ids=["prefill", "decode"])
def test_30b_a3b_forward_shapes(B, T_, S):
    params = {s.name: _abstract(s) for s in qwen3moe.tensor_specs(CFG)}
    assert len(params) == 3 + 12 * 48
    cache = KVCache(*(jax.ShapeDtypeStruct((48, B, S, 4, 128), jnp.float32) for _ in range(2)),
                    jax.ShapeDtypeStruct((B,), jnp.int32))
    tok = jax.ShapeDtypeStruct((B, T_), jnp.int32)
    logits, new_cache, routing = jax.eval_shape(
        lambda p, t, pos, c: qwen3moe.forward(p, CFG, t, pos, c), params, tok, tok, cache)
    assert logits.shape == (B, T_, 151936) and logits.dtype == jnp.float32
    assert new_cache.k.shape == new_cache.v.shape == (48, B, S, 4, 128)
    assert new_cache.lengths.shape == (B,)
    assert routing.experts.shape == (48, B, T_, 8) and routing.experts.dtype == jnp.int32
    assert routing.weights.shape == (48, B, T_, 8) and routing.weights.dtype == jnp.float32
    assert routing.margin.shape == (48, B, T_)
