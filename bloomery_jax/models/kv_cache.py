"""A plain KV cache for B sequences of up to S positions: enough for prefill and greedy decode.

Layout: ``k, v`` float32 ``[L, B, S, Hkv, Dh]``; the key/value of position ``p`` of sequence
``b`` lives in slot ``p``; ``lengths`` int32 ``[B]`` counts the filled slots (one past the
highest position written). A step writes its tokens' keys/values first and then attends,
so a token sees itself. Positions outside ``[0, S)`` are not written (padding tokens can
use position ``S``).

It is a pytree passed into and returned from the jitted step (donate it). The engine issue
replaces it with a paged cache behind the same operations the model uses:
``write(layer, k, v, positions)``, ``layer(i)``, ``mask(positions)`` and, for one-token steps
with the Pallas attention, ``write_one_normed``, ``attend_one(layer, q, positions, scale)`` (or
both in one launch, ``attend_one_prepped``) and, for prefill, ``attend_many``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..ops.attention import causal_mask
from ..ops.qmatmul import interpret_kernels
from ..pallas.attention import cache_decode_attention
from ..pallas.attention_prepped import cache_attend_prepped
from ..pallas.attn_prep import cache_qk_prep
from ..pallas.flash_attention import cache_prefill_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # float32 [L, B, S, Hkv, Dh]
    v: jax.Array  # float32 [L, B, S, Hkv, Dh]
    lengths: jax.Array  # int32 [B]

    @classmethod
    def create(cls, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int) -> "KVCache":
        shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
        return cls(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((batch,), jnp.int32))

    @classmethod
    def for_config(cls, cfg, batch: int, max_len: int) -> "KVCache":
        """An empty cache shaped for a model config (``n_layers``, ``n_kv_heads``, ``head_dim``)."""
        return cls.create(cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def with_lengths(self, positions: jax.Array) -> "KVCache":
        """The cache with ``lengths`` advanced past this step's valid positions ``[B, T]``."""
        valid = (positions >= 0) & (positions < self.max_len)
        top = jnp.max(jnp.where(valid, positions + 1, 0), axis=1).astype(jnp.int32)  # [B]
        return dataclasses.replace(self, lengths=jnp.maximum(self.lengths, top))

    def write(self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array) -> "KVCache":
        """Store one layer's new keys/values ``[B, T, Hkv, Dh]`` at slots ``positions [B, T]``."""
        B, T = positions.shape
        b = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))  # [B, T]
        # Out-of-range slots (padding) are dropped rather than clamped onto a real slot.
        slot = jnp.where((positions >= 0) & (positions < self.max_len), positions, self.max_len)
        new_k = self.k.at[layer, b, slot].set(k.astype(jnp.float32), mode="drop")
        new_v = self.v.at[layer, b, slot].set(v.astype(jnp.float32), mode="drop")
        return dataclasses.replace(self, k=new_k, v=new_v)

    def write_one_normed(self, layer: int, qkv: jax.Array, norms, rope,
                         positions: jax.Array) -> tuple[jax.Array, "KVCache"]:
        """A one-token step's queries and cache by one kernel (``pallas.attn_prep``): from ``qkv``
        (``[P, B, (Hq + 2 Hkv) Dh]``, partial sums of q, k and v side by side), q and k RMS-normed
        per head (``norms = (q_norm, k_norm, eps)``) and NeoX-rotated (``rope = (cos, sin)``,
        ``[B, Dh/2]``), k and v stored at ``positions [B]`` as ``write`` stores them. Returns
        float32 ``[B, Hq, Dh]`` queries and the cache."""
        return cache_qk_prep(self, layer, 0, qkv, norms, rope, positions, interpret=interpret_kernels())

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of layer ``i``: float32 ``[B, S, Hkv, Dh]`` each."""
        return self.k[i], self.v[i]

    def attend_one(self, layer: int, q: jax.Array, positions: jax.Array, scale: float) -> jax.Array:
        """float32 ``[B, Hq, Dh]``: one query a sequence (``q [B, Hq, Dh]`` at ``positions [B]``)
        over its filled positions up to its own, by the Pallas decode kernel straight from the
        cache buffer (padding rows get zeros)."""
        return cache_decode_attention(self.k, self.v, layer, 0, q, positions, self.lengths, scale,
                                      interpret=interpret_kernels())

    def attend_one_prepped(self, layer: int, qkv: jax.Array, norms, rope, positions: jax.Array, scale: float,
                           tickets: jax.Array) -> tuple[jax.Array, "KVCache", jax.Array]:
        """``write_one_normed`` then ``attend_one`` in one launch (``pallas.attention_prepped``,
        which combines its splits by ``tickets``, the step's counter buffer). Returns the
        attention output float32 ``[B, Hq, Dh]``, the cache and the tickets."""
        return cache_attend_prepped(self, layer, 0, qkv, norms, rope, positions, scale, tickets,
                                    interpret=interpret_kernels())

    def attend_many(self, layer: int, q: jax.Array, positions: jax.Array, scale: float) -> jax.Array:
        """float32 ``[B, T, Hq, Dh]``: T queries a sequence (``q [B, T, Hq, Dh]`` at ``positions
        [B, T]``), each over its filled positions up to its own, by the Pallas prefill kernel
        straight from the cache buffer (queries that see nothing get zeros)."""
        return cache_prefill_attention(self.k, self.v, layer, 0, q, positions, self.lengths, scale,
                                       interpret=interpret_kernels())

    def mask(self, positions: jax.Array) -> jax.Array:
        """bool ``[B, T, S]``: causal mask of queries at ``positions`` over the filled slots."""
        return causal_mask(positions.astype(jnp.int32), self.lengths, self.max_len)

    def reset(self) -> "KVCache":
        """The same buffers with every sequence emptied (old values are masked out by length)."""
        return dataclasses.replace(self, lengths=jnp.zeros_like(self.lengths))
