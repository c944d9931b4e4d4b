"""The host bridge: from inside the jitted step to the host experts of one MoE layer and back.

Contract. ``HostBridge(layers)`` holds each MoE layer's expert weights in host memory (views
of the GGUF file, all E experts, so a residency change never re-reads the file).
``bridge.moe(i, h, experts, weights, on_host)`` is traced inside a jitted step: it returns
float32 ``[N, D]``, the weighted SwiGLU sum of the pairs whose expert is on the host, computed
by :func:`host_moe_swiglu` on the CPU. One call per layer carries all of that layer's host
experts.

The portable path is ``jax.pure_callback``. On a GPU its round trip syncs the stream and copies
through pageable memory (~190-225 us a call measured on the H200, DESIGN.md); the host
function's own time is counted in ``stats`` so the bridge overhead can be told apart from the
kernels. A bridge object is static in the step (hashed by identity): one compilation per
bridge, whatever the placement table holds.

``bridge.stream(i, role)`` is the other way round, for prefill: the layer's whole expert tensor
(the file's blocks, all E experts) handed to the step through a callback, so XLA copies it to
the card and the card computes every pair of the layer (``ops.experts.placed_moe_swiglu``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from .memory import host_buffer, resolve_pages
from .swiglu import EXPERT_ROLES, SPANS, HostExpertLayer, host_moe_swiglu


# Cores the host experts leave to the threads that wait on the GPU (the step's, the CUDA driver's,
# XLA's): on the H200 host, n-cpu-moe=36 decode through the FFI bridge ran 24.1 tok/s with 14
# passive workers against 21.3 with 16, and 28.1 against 10.4 with a 10,000-spin wait
# (benchmarks/gpu_2026-12-04-s9).
FREE_CORES = 2


def default_threads() -> int:
    """Numba threads for the host experts when none are asked for: ``NUMBA_NUM_THREADS`` where
    the user set it, else the usable cores but ``FREE_CORES`` (at least one)."""
    import numba

    if "NUMBA_NUM_THREADS" in os.environ:
        return numba.config.NUMBA_NUM_THREADS
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(numba.config.NUMBA_NUM_THREADS, cores - FREE_CORES))


@dataclasses.dataclass
class BridgeStats:
    calls: int = 0
    pairs: int = 0  # (token, expert) pairs computed on the host
    seconds: float = 0.0  # inside host_moe_swiglu
    streamed_bytes: int = 0  # expert bytes handed to steps by ``stream`` (prefill streaming)
    ticks: tuple = (0,) * len(SPANS)  # the kernels' tick spans, summed (swiglu.SPANS)


class HostBridge:
    """Host experts of a model, and the callback that runs them.

    Args:
      layers: MoE layer index → its three expert tensors on the host.
      threads: Numba threads for the host kernels (None = :func:`default_threads`).
      pages: "small" (the experts stay views of the file) or "huge" (copied into memory on
        transparent huge pages); None = ``$BLOOMERY_HOST_PAGES``, else small (``host.memory``).
    """

    # Steps branch around ``moe`` when none of their pairs is on the host: a callback synchronises
    # the stream anyway, so reading the branch's predicate costs nothing more.
    skip_empty_calls = True
    # Steps call ``moe`` whole; a bridge that overlaps calls ``moe_start`` and ``moe_finish``
    # around the layer's card experts instead (FfiHostBridge).
    overlap = False

    def __init__(self, layers: dict[int, HostExpertLayer], threads: int | None = None, pages: str | None = None):
        self.pages = resolve_pages(pages)
        self.layers = {i: self._placed(layer) for i, layer in layers.items()}
        self.threads = int(threads) if threads is not None else default_threads()
        self._stats = BridgeStats()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HostBridge({len(self.layers)} layers)"

    def _placed(self, layer: HostExpertLayer) -> HostExpertLayer:
        """``layer`` in the memory the kernels will read: as given, or copied onto huge pages."""
        return layer.copied(lambda n: host_buffer(n, "huge")) if self.pages == "huge" else layer

    @property
    def stats(self) -> BridgeStats:
        return self._stats

    def has_layer(self, i: int) -> bool:
        return i in self.layers

    def moe(self, i: int, h: jax.Array, experts: jax.Array, weights: jax.Array, on_host: jax.Array) -> jax.Array:
        """Layer ``i``'s host-expert output, traced into the caller's step.

        Args:
          h: float32 ``[N, D]`` normalised FFN input.
          experts: int32 ``[N, k]``; weights: float32 ``[N, k]``.
          on_host: bool ``[E]``, which experts of the layer the host computes.
        Returns:
          float32 ``[N, D]``.
        """
        out = jax.ShapeDtypeStruct(h.shape, jnp.float32)
        return jax.pure_callback(functools.partial(self._run, i), out, h, experts, weights, on_host,
                                 vmap_method="sequential")

    def stream(self, i: int, role: str):
        """Layer ``i``'s ``role`` ("gate", "up" or "down") expert tensor as a QTensor on the step's
        device, traced into the caller's step: the file's data ``[E, rows, row_bytes]`` through a
        callback (no arguments, so XLA may issue it ahead of the layer's compute)."""
        from ..quant import QTensor

        t = getattr(self.layers[i], role)
        data = jax.pure_callback(functools.partial(self._fetch, t), jax.ShapeDtypeStruct(t.data.shape, t.data.dtype))
        return QTensor(data, int(t.qtype), tuple(t.shape))

    def experts_on_card(self, i: int, experts, device) -> jax.Array:
        """The blocks of experts ``experts`` of layer ``i``, for seating them in card slots: one
        flat uint8 array on ``device``, gate's ``[n, rows, row_bytes]`` bytes, then up's, then
        down's (one transfer for the three)."""
        ids = np.asarray(experts, np.int64)
        layer = self.layers[i]
        return jax.device_put(np.concatenate([getattr(layer, r).data[ids].reshape(-1).view(np.uint8)
                                              for r in EXPERT_ROLES]), device)

    def _fetch(self, t) -> np.ndarray:
        with self._lock:
            self._stats.streamed_bytes += int(t.data.nbytes)
        return np.asarray(t.data)

    def _run(self, i, h, experts, weights, on_host):
        import numba

        numba.set_num_threads(self.threads)
        x = np.asarray(h, np.float32)
        experts = np.asarray(experts, np.int32)
        on_host = np.asarray(on_host, bool)
        spans = np.zeros(len(SPANS), np.int64)
        t0 = time.perf_counter()
        y = host_moe_swiglu(x, experts, np.asarray(weights, np.float32), on_host, self.layers[i], spans=spans)
        dt = time.perf_counter() - t0
        with self._lock:
            self._stats.calls += 1
            self._stats.pairs += int(on_host[experts].sum())
            self._stats.seconds += dt
            self._stats.ticks = tuple(int(a + b) for a, b in zip(self._stats.ticks, spans))
        return y
