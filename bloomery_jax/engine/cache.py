"""The engine's KV cache: N sequence slots of S positions, one buffer, updated in place.

Layout: ``k, v`` ``[L, N, S, Hkv, Dh]`` (dtype f32 by default, bf16/f16 to halve memory);
slot ``n`` holds one sequence, the key/value of its position ``p`` at index ``p``;
``all_lengths`` int32 ``[N]`` counts each slot's filled positions.

A forward step sees a *window* of ``rows`` consecutive slots starting at ``start`` (a traced
int32, so moving the window never recompiles; ``rows`` is static): row ``b`` of the step's
tokens reads and writes slot ``start + b``. The window offers the interface the model forwards
use (models/kv_cache.py's): ``write(layer, k, v, positions)``, ``layer(i)``, ``mask(positions)``,
``write_one_normed``, ``attend_one(layer, q, positions, scale)``, ``attend_one_prepped``, ``attend_many``,
``with_lengths(positions)``, ``lengths`` and ``max_len``. Positions outside ``[0, S)`` are
padding: nothing is stored for them and the lengths do not move.

The whole cache is one pytree: pass it into the jitted step and donate it, and XLA updates the
buffers in place (the scatter of new keys and the lengths are the only writes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..ops.attention import causal_mask
from ..ops.qmatmul import interpret_kernels
from ..pallas.attention import cache_decode_attention
from ..pallas.attention_prepped import cache_attend_prepped
from ..pallas.attn_prep import cache_qk_prep
from ..pallas.flash_attention import cache_prefill_attention

KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "all_lengths", "start"],
                   meta_fields=["rows"])
@dataclasses.dataclass(frozen=True)
class SlotCache:
    k: jax.Array  # [L, N, S, Hkv, Dh]
    v: jax.Array  # [L, N, S, Hkv, Dh]
    all_lengths: jax.Array  # int32 [N]
    start: jax.Array  # int32 [], first slot of the window
    rows: int  # static: slots in the window (the step's batch B)

    @classmethod
    def create(cls, n_layers: int, n_slots: int, max_len: int, n_kv_heads: int, head_dim: int,
               dtype: str = "float32") -> "SlotCache":
        shape = (n_layers, n_slots, max_len, n_kv_heads, head_dim)
        dt = KV_DTYPES[dtype]
        return cls(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((n_slots,), jnp.int32),
                   jnp.zeros((), jnp.int32), n_slots)

    @classmethod
    def for_config(cls, cfg, n_slots: int, max_len: int, dtype: str = "float32") -> "SlotCache":
        return cls.create(cfg.n_layers, n_slots, max_len, cfg.n_kv_heads, cfg.head_dim, dtype)

    # --- the window -------------------------------------------------------------------------
    def window(self, start, rows: int) -> "SlotCache":
        """The cache seen by a step over slots ``[start, start + rows)`` (start may be traced)."""
        return dataclasses.replace(self, start=jnp.asarray(start, jnp.int32), rows=rows)

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.rows

    @property
    def lengths(self) -> jax.Array:
        """int32 ``[B]``: filled positions of the window's slots."""
        return jax.lax.dynamic_slice_in_dim(self.all_lengths, self.start, self.rows)

    def with_lengths(self, positions: jax.Array) -> "SlotCache":
        """The cache with the window's lengths advanced past this step's valid ``positions [B, T]``."""
        valid = (positions >= 0) & (positions < self.max_len)
        top = jnp.max(jnp.where(valid, positions + 1, 0), axis=1).astype(jnp.int32)  # [B]
        new = jnp.maximum(self.lengths, top)
        return dataclasses.replace(
            self, all_lengths=jax.lax.dynamic_update_slice_in_dim(self.all_lengths, new, self.start, 0))

    def write(self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array) -> "SlotCache":
        """Store one layer's new keys/values ``[B, T, Hkv, Dh]`` at ``positions [B, T]`` of the window."""
        B, T = positions.shape
        slot = jnp.broadcast_to((self.start + jnp.arange(B, dtype=jnp.int32))[:, None], (B, T))  # [B, T]
        # Padding positions go to index S, which mode="drop" discards (never clamped onto a real one).
        pos = jnp.where((positions >= 0) & (positions < self.max_len), positions, self.max_len)
        new_k = self.k.at[layer, slot, pos].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[layer, slot, pos].set(v.astype(self.v.dtype), mode="drop")
        return dataclasses.replace(self, k=new_k, v=new_v)

    def write_one_normed(self, layer: int, qkv: jax.Array, norms, rope,
                         positions: jax.Array) -> tuple[jax.Array, "SlotCache"]:
        """The window's one-token queries and cache by one kernel: as ``KVCache.write_one_normed``
        (models/kv_cache.py), row ``b`` written to slot ``start + b``."""
        return cache_qk_prep(self, layer, self.start, qkv, norms, rope, positions, interpret=interpret_kernels())

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of layer ``i`` for the window: ``[B, S, Hkv, Dh]`` each, as float32."""
        k = jax.lax.dynamic_slice_in_dim(self.k[i], self.start, self.rows, axis=0)
        v = jax.lax.dynamic_slice_in_dim(self.v[i], self.start, self.rows, axis=0)
        return k.astype(jnp.float32), v.astype(jnp.float32)

    def attend_one(self, layer: int, q: jax.Array, positions: jax.Array, scale: float) -> jax.Array:
        """float32 ``[B, Hq, Dh]``: the window's one query a row (``q [B, Hq, Dh]`` at ``positions
        [B]``) attending to its slot's filled positions up to its own, by the Pallas decode kernel
        straight from the cache buffer (no layer copy; padding rows get zeros)."""
        return cache_decode_attention(self.k, self.v, layer, self.start, q, positions, self.lengths, scale,
                                      interpret=interpret_kernels())

    def attend_one_prepped(self, layer: int, qkv: jax.Array, norms, rope, positions: jax.Array, scale: float,
                           tickets: jax.Array) -> tuple[jax.Array, "SlotCache", jax.Array]:
        """The window's ``write_one_normed`` then ``attend_one`` in one launch: as
        ``KVCache.attend_one_prepped`` (models/kv_cache.py), row ``b`` in slot ``start + b``."""
        return cache_attend_prepped(self, layer, self.start, qkv, norms, rope, positions, scale, tickets,
                                    interpret=interpret_kernels())

    def attend_many(self, layer: int, q: jax.Array, positions: jax.Array, scale: float) -> jax.Array:
        """float32 ``[B, T, Hq, Dh]``: the window's T queries a row, by the Pallas prefill kernel
        straight from the cache buffer (as ``attend_one``; queries that see nothing get zeros)."""
        return cache_prefill_attention(self.k, self.v, layer, self.start, q, positions, self.lengths, scale,
                                       interpret=interpret_kernels())

    def mask(self, positions: jax.Array) -> jax.Array:
        """bool ``[B, T, S]``: causal mask of the window's queries over the filled positions.

        A padding query that would see nothing (its slot is empty) sees index 0 instead, so its
        softmax stays finite; its output is never used, but a NaN could reach shared work (the
        routing of an MoE layer) of the real rows.
        """
        m = causal_mask(positions.astype(jnp.int32), self.lengths, self.max_len)  # [B, T, S]
        first = jnp.arange(self.max_len) == 0  # [S]
        return m | (~jnp.any(m, axis=-1, keepdims=True) & first)


# --- slot operations outside the forward (each jitted once, the cache donated) ---------------

@functools.partial(jax.jit, donate_argnums=0)
def set_length(cache: SlotCache, slot, length) -> SlotCache:
    """Truncate (or reset, ``length = 0``) one slot: later positions are masked and overwritten."""
    return dataclasses.replace(cache, all_lengths=cache.all_lengths.at[slot].set(jnp.asarray(length, jnp.int32)))


@functools.partial(jax.jit, donate_argnums=0)
def move_slot(cache: SlotCache, src, dst) -> SlotCache:
    """Copy slot ``src`` (keys, values, length) into slot ``dst`` (used to keep live slots dense)."""
    return dataclasses.replace(
        cache,
        k=cache.k.at[:, dst].set(cache.k[:, src]),
        v=cache.v.at[:, dst].set(cache.v[:, src]),
        all_lengths=cache.all_lengths.at[dst].set(cache.all_lengths[src]),
    )
