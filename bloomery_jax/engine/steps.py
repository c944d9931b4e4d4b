"""The jitted step functions: a prefill chunk of one sequence, a decode step of a batch bucket.

Contract. Both wrap a model forward ``forward(params, cfg, tokens [B, T], positions [B, T],
cache, placement, logits_at=None | [B, R]) -> (logits [B, T, V] | [B, R, V], cache, routing)``
whose cache argument is a :class:`~bloomery_jax.engine.cache.SlotCache` window, sample on the
device, and return the cache and sampler state, which are donated (updated in place):

- ``prefill(params, cache, sampler, placement, tokens [1, T], positions [1, T], slot, last,
  final)``: one chunk of slot ``slot``'s pending tokens, padded to T with positions ``S``;
  samples from the logits of chunk index ``last`` and, when ``final``, records the token.
- ``decode(params, cache, sampler, placement, tokens [b], positions [b], active [b])``: one
  token for each of slots ``[0, b)``; rows with ``active`` False are padding (position ``S``,
  nothing stored, sampler row untouched).
- ``decode_block(..., n)``: n decode steps in one call, each step's sampled token the next
  one's input (a ``lax.scan`` of the decode step, on the device): the same tokens and state as n
  ``decode`` calls, with the host's per-call work (argument handling, input copies, reading
  the token back) paid once for n tokens. Its outputs have a leading step axis.

Each returns ``(cache, sampler, SampleOut, logits of the sampled positions, routing)``. Shapes
are static per chunk length T and bucket b; slots, positions and flags are traced, so requests
coming and going never recompile. The decode steps take a static sampler plan
(:class:`~bloomery_jax.engine.sampling.Plan`): a batch of greedy rows without logprobs takes the
argmax alone, any other batch the full sampler, so each bucket compiles at most twice. Prefill
samples one row a prompt and always takes the full plan.

A decode step's outputs (SampleOut, logits, routing) live until the next decode step of the
same bucket, which donates their buffers to hold its own: every output then keeps one device
address from step to step. Why: the step runs as a CUDA graph, and XLA re-records every graph
node whose buffers moved since the last run (on the H200, 106 of an 8-layer step's 266 nodes,
0.5-0.9 ms a step, while the outputs were fresh buffers: docs/LOG.md, 2026-12-04). Read what you
need from one step (the engine copies the token and the routing to the host) before the next.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import sampling
from .cache import SlotCache


class StepFunctions:
    """The compiled prefill and decode steps of one model.

    The jitted functions are module-level with ``forward``, ``cfg`` and the sampler plan static,
    so every Engine over the same model shares one compilation per shape and plan.

    Args:
      forward: the architecture's forward function.
      cfg: its static (hashable) Config.
      n_top: width of the top log-probability report (static): the full plan's.
    """

    def __init__(self, forward, cfg, n_top: int):
        self.forward = forward
        self.cfg = cfg
        self.full = sampling.Plan(draw=True, n_top=n_top)
        self._spare: dict = {}  # (bucket or block key, plan) -> the last decode's outputs, donated to the next

    def prefill(self, params, cache, sampler, placement, tokens, positions, slot, last, final):
        return _prefill(self.forward, self.cfg, self.full, params, cache, sampler, placement,
                        tokens, positions, slot, last, final)

    def decode(self, params, cache, sampler, placement, tokens, positions, active, plan=None):
        """One decode step under ``plan`` (None: the full sampler)."""
        plan = plan or self.full
        args = (params, cache, sampler, placement, tokens, positions, active)
        key = (int(np.shape(tokens)[0]), plan)
        spare = self._take_spare(key, lambda *a: _decode_step(self.forward, self.cfg, plan, *a)[2:], args)
        cache, sampler, out, logits, routing = _decode(self.forward, self.cfg, plan, *args, spare)
        self._spare[key] = (out, logits, routing)
        return cache, sampler, out, logits, routing

    def decode_block(self, params, cache, sampler, placement, tokens, positions, active, n: int, plan=None,
                     parity: int = 0):
        """n decode steps: ``(cache, sampler, SampleOut [n, ...], routing [n, ...])``.

        ``parity`` picks one of two output sets: a block launched while the one before it is still
        unread (the engine's lookahead) must not take that one's buffers, so lookahead alternates."""
        plan = plan or self.full
        args = (params, cache, sampler, placement, tokens, positions, active)
        key = ("block", int(np.shape(tokens)[0]), n, plan, parity)
        twin = self._spare.get(key[:-1] + (1 - parity,))
        if key not in self._spare and twin is not None:  # the other set's shapes: no trace of the step
            self._spare[key] = jax.tree.map(lambda a: jnp.zeros_like(a, device=a.sharding), twin)
        spare = self._take_spare(key, lambda *a: _decode_steps(self.forward, self.cfg, plan, n, *a)[2:], args)
        cache, sampler, out, routing = _decode_block(self.forward, self.cfg, plan, n, *args, spare)
        self._spare[key] = (out, routing)
        return cache, sampler, out, routing

    def _take_spare(self, key, outputs, args):
        """The last outputs of the step ``key`` names, to donate; its first call gets zeros of the
        shapes ``outputs(*args)`` has, committed like the real outputs (so nothing compiles twice)."""
        spare = self._spare.pop(key, None)
        if spare is None:
            shapes = jax.eval_shape(outputs, *args)
            sharding = jax.tree.leaves(args[1])[0].sharding  # the cache's
            spare = jax.device_put(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), sharding)
        return spare

    @staticmethod
    def set_row(sampler, slot, row):
        return _set_row(sampler, slot, row)

    @staticmethod
    def move_row(sampler, src, dst):
        return _move_row(sampler, src, dst)


_STATIC = ("forward", "cfg", "plan")
_DONATE = ("cache", "sampler")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=_DONATE)
def _prefill(forward, cfg, plan, params, cache: SlotCache, sampler, placement, tokens, positions, slot, last,
             final):
    n_slots = cache.n_slots
    # Only row ``last`` is sampled: the model computes logits for that row alone, not [1, T, V].
    logits, view, routing = forward(params, cfg, tokens, positions, cache.window(slot, 1), placement,
                                    logits_at=jnp.reshape(last, (1, 1)))  # [1, 1, V]
    row_logits = logits[0]  # [1, V]
    out = sampling.sample(row_logits, sampling.take_rows(sampler, slot, 1), plan.n_top, plan.draw)
    sampler = sampling.advance(sampler, out.token, jnp.reshape(final, (1,)), start=slot)
    return view.window(0, n_slots), sampler, out, row_logits, routing


def _decode_step(forward, cfg, plan, params, cache: SlotCache, sampler, placement, tokens, positions, active):
    b = tokens.shape[0]
    n_slots = cache.n_slots
    logits, view, routing = forward(params, cfg, tokens[:, None], positions[:, None], cache.window(0, b), placement)
    step_logits = logits[:, 0]  # [b, V]
    out = sampling.sample(step_logits, sampling.take_rows(sampler, 0, b), plan.n_top, plan.draw)
    sampler = sampling.advance(sampler, out.token, active, start=0)
    return view.window(0, n_slots), sampler, out, step_logits, routing


# ``spare``: the previous step's outputs, unread; donated so that XLA writes this step's outputs
# into them. jit drops unread arguments unless told to keep them, and a dropped one aliases nothing.
@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=_DONATE + ("spare",), keep_unused=True)
def _decode(forward, cfg, plan, params, cache: SlotCache, sampler, placement, tokens, positions, active, spare):
    del spare
    return _decode_step(forward, cfg, plan, params, cache, sampler, placement, tokens, positions, active)


def _decode_steps(forward, cfg, plan, n, params, cache, sampler, placement, tokens, positions, active):
    def step(carry, _):
        cache, sampler, tokens, positions = carry
        cache, sampler, out, _, routing = _decode_step(forward, cfg, plan, params, cache, sampler, placement,
                                                       tokens, positions, active)
        # padding rows stay at position S (never stored); real rows feed their token back
        return (cache, sampler, out.token, jnp.where(active, positions + 1, positions)), (out, routing)

    (cache, sampler, _, _), (outs, routings) = jax.lax.scan(step, (cache, sampler, tokens, positions), length=n)
    return cache, sampler, outs, routings  # outs, routings: a leading [n] axis


@functools.partial(jax.jit, static_argnames=_STATIC + ("n",), donate_argnames=_DONATE + ("spare",),
                   keep_unused=True)
def _decode_block(forward, cfg, plan, n, params, cache: SlotCache, sampler, placement, tokens, positions, active,
                  spare):
    del spare  # as for _decode: the last block's outputs, so this block's keep their addresses
    return _decode_steps(forward, cfg, plan, n, params, cache, sampler, placement, tokens, positions, active)


_set_row = jax.jit(sampling.set_row, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def _move_row(rows: sampling.SamplerRows, src, dst) -> sampling.SamplerRows:
    return sampling.SamplerRows(*(x.at[dst].set(x[src]) for x in rows))


def chunk_lengths(ubatch: int, min_chunk: int) -> list[int]:
    """Padded prefill chunk lengths: powers of two from ``min_chunk`` below ``ubatch``, then ``ubatch``."""
    out = []
    n = min_chunk
    while n < ubatch:
        out.append(n)
        n *= 2
    return out + [ubatch]


def decode_buckets(n_slots: int, min_rows: int) -> list[int]:
    """Decode batch sizes: powers of two from ``min_rows`` up to the first one >= ``n_slots``."""
    out = [min_rows]
    while out[-1] < n_slots:
        out.append(out[-1] * 2)
    return out


@functools.lru_cache(maxsize=None)
def _bucket_for(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def bucket_for(buckets, n: int) -> int:
    """The smallest bucket holding n rows or tokens."""
    return _bucket_for(tuple(buckets), n)
