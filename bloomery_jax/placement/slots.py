"""Seating experts in card slots between steps: the device half of residency.

Contract. :func:`seat_experts` copies the blocks of the given experts from the host's copy
(the GGUF file's bytes, held by the HostBridge) into the given slots of one layer's card
expert buffers, in place: the buffers are donated to one jitted update, so no second copy of
the layer's card experts is ever allocated. The slot table is the caller's to change.

A layer's seat is one transfer (the three tensors' blocks in one buffer) and one device call
(repack and row writes of all three), so a step's swaps cost a call per layer, not per field.
The number of rows written is padded up to a power of two (repeating the last pair, which
writes the same bytes twice), so a handful of shapes compile, whatever the swap count.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from ..host.swiglu import EXPERT_ROLES
from ..quant.repack import PackedWeight, repack_on_device


def _padded(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnums=3, donate_argnums=0)
def _seat(weights: tuple, slots: jax.Array, blocks: jax.Array, forms: tuple) -> tuple:
    """``weights`` (the layer's gate, up, down: QTensor or PackedWeight) with rows ``slots`` [n]
    replaced by the experts in ``blocks``: flat uint8, each tensor's ``[n, *shape]`` in turn, for
    its ``(shape, dtype)`` in ``forms``."""
    n = slots.shape[0]
    out, at = [], 0
    for w, (shape, dtype) in zip(weights, forms):
        itemsize = np.dtype(dtype).itemsize
        size = n * int(np.prod(shape)) * itemsize
        raw = blocks[at:at + size]
        at += size
        if itemsize == 1:
            b = raw.reshape(n, *shape).view(dtype)  # [n, rows, row_bytes] blocks
        else:  # f32 / f16 / bf16 bits experts
            b = jax.lax.bitcast_convert_type(raw.reshape(n, *shape, itemsize), dtype)
        if isinstance(w, PackedWeight):  # kernels=pallas: repack the experts on the card, then write each field
            new = repack_on_device(b, w.qtype, (n, *w.shape[1:]), layout=w.layout)
            out.append(dataclasses.replace(w, **{f: getattr(w, f).at[slots].set(getattr(new, f))
                                                 for f in ("qs", "d", "sc", "qh") if getattr(w, f) is not None}))
        else:
            out.append(dataclasses.replace(w, data=w.data.at[slots].set(b)))
    return tuple(out)


def seat_experts(params: dict, host, layer: int, slots, experts) -> int:
    """Write experts ``experts[j]`` of ``layer`` into card slots ``slots[j]`` (in place).

    Args:
      params: the engine's parameter dict (GGUF name → QTensor or PackedWeight); its three expert entries of
        the layer are replaced by the updated buffers.
      host: the model's HostBridge (``host.layers[layer].gate.data`` is ``[E, rows, bytes]``).
      layer: the MoE layer.
      slots, experts: int sequences of equal length.
    Returns:
      bytes copied to the card (without padding).
    """
    slots = np.asarray(slots, np.int32)
    experts = np.asarray(experts, np.int64)
    if slots.size == 0:
        return 0
    n = _padded(slots.size)
    pad = n - slots.size
    slots = np.concatenate([slots, np.repeat(slots[-1:], pad)])
    experts = np.concatenate([experts, np.repeat(experts[-1:], pad)])
    names = [f"blk.{layer}.ffn_{role}_exps.weight" for role in EXPERT_ROLES]
    weights = tuple(params[name] for name in names)
    first = weights[0]
    device = (first.qs if isinstance(first, PackedWeight) else first.data).device
    forms = tuple((t.data.shape[1:], t.data.dtype.str) for t in (getattr(host.layers[layer], r) for r in EXPERT_ROLES))
    blocks = host.experts_on_card(layer, experts, device)
    params.update(zip(names, _seat(weights, slots, blocks, forms)))
    return blocks.nbytes // n * (n - pad)


class LiveResidency:
    """Adaptive residency on a running engine: count routing, swap experts between steps.

    After each step the engine calls :meth:`after_step` with that step's routing; the
    controller (``residency.ResidencyController``) chooses swaps, :func:`seat_experts` writes
    the blocks, and the engine's placement table is replaced. With ``prompt_streaming`` the
    end of a prompt seats the experts that prompt routed most (its whole routing, every chunk),
    so decode starts warm. Nothing recompiles: only buffer contents and the table change.

    Args:
      controller: a ``ResidencyController`` built from the model's load-time slot table.
      host: the model's HostBridge (source of the expert blocks).
      prompt_streaming: seat a prompt's hottest experts when it ends.
      max_swaps_per_layer: cap on swaps per layer per decode step (None = no cap).
    """

    def __init__(self, controller, host, *, prompt_streaming: bool = True, max_swaps_per_layer: int | None = None):
        self.controller = controller
        self.host = host
        self.prompt_streaming = prompt_streaming
        self.max_swaps_per_layer = max_swaps_per_layer
        self._prompt: dict[int, list[np.ndarray]] = {}  # sequence key -> routing of its prompt chunks [L, n, k]
        self.seconds = 0.0  # spent seating experts
        self.layer_seats = 0  # seat_experts calls (one a layer with swaps, a device call each)

    @classmethod
    def for_model(cls, model, policy=None, **kwargs) -> "LiveResidency":
        from .residency import ResidencyController

        placement = model.placement
        if placement is None or placement.host is None:
            raise ValueError("residency needs a model with host experts (a placement rule other than 'card')")
        layers = placement.host.layers
        expert_bytes = np.zeros(np.asarray(placement.slot_of).shape[0], np.int64)
        for i, hl in layers.items():
            expert_bytes[i] = hl.expert_bytes()
        controller = ResidencyController(np.asarray(placement.slot_of), policy, expert_bytes=expert_bytes)
        return cls(controller, placement.host, **kwargs)

    def after_step(self, engine, routing_experts, mask, *, prompt_key: int | None = None,
                   prompt_done: bool = False, swap: bool = True) -> None:
        """Observe a step and apply the resulting swaps to ``engine`` (params and placement).

        Args:
          routing_experts: int ``[L, B, T, k]`` (host copy or device array).
          mask: bool ``[B, T]``, the real (non-padding) tokens.
          prompt_key: for a prefill chunk, a key of the sequence whose prompt it belongs to.
          prompt_done: this chunk ended that prompt.
          swap: for a decode step, plan and seat swaps now (False inside a decode block: the
            block's steps all ran with one placement, so it swaps after the last).
        """
        import time

        t0 = time.perf_counter()
        experts = np.asarray(routing_experts)
        mask = np.asarray(mask, bool)
        self.controller.observe(experts, mask)
        if prompt_key is not None:
            chunk = experts[:, mask].reshape(experts.shape[0], -1, experts.shape[-1])  # [L, n, k]
            self._prompt.setdefault(prompt_key, []).append(chunk)
            if not prompt_done:
                return
            prompt = np.concatenate(self._prompt.pop(prompt_key), axis=1)
            if not self.prompt_streaming:
                return
            # an LFU's ratio applies to the prompt's counts too (its margin is in decayed calls)
            plan = self.controller.prompt_plan(prompt, hysteresis=getattr(self.controller.policy, "hysteresis", 1.0))
        elif swap:
            plan = self.controller.step_plan(self.max_swaps_per_layer)
        else:
            plan = {}
        if plan:
            self.layer_seats += len(plan)
            for layer, swaps in plan.items():
                seat_experts(engine.params, self.host, layer, [s.slot for s in swaps], [s.in_expert for s in swaps])
            from .table import Placement

            table = jax.device_put(self.controller.slot_of, jax.devices()[0])
            engine.placement = engine.model.placement = Placement(table, self.host)
        self.seconds += time.perf_counter() - t0

    def forget(self, prompt_key: int) -> None:
        """Drop the prompt routing of a sequence released before its prompt ended."""
        self._prompt.pop(prompt_key, None)

    def stats(self) -> dict:
        return dict(self.controller.stats(), seat_seconds=self.seconds, layer_seats=self.layer_seats)
