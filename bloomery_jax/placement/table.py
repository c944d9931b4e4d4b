"""The placement table: where each routed expert is computed, as data handed to the jitted step.

Contract. ``Placement.slot_of`` is int32 ``[L, E]``: the card slot of expert e of layer l
(its row in that layer's card expert buffers ``[n_slots_l, ...]``), or -1 when the host
computes it. ``host`` (static) is the :class:`~bloomery_jax.host.bridge.HostBridge` holding
every layer's expert weights in host memory, or None when nothing runs there.

Changing which expert sits in which slot changes ``slot_of`` and the buffers' contents, never
a shape: nothing recompiles. The number of slots per layer is fixed by the buffers' shapes,
chosen once at load from the placement rule.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Placement:
    slot_of: jax.Array  # int32 [L, E]; -1 = host
    host: object = dataclasses.field(default=None, metadata=dict(static=True))  # HostBridge | None


def slot_table(on_card: np.ndarray) -> np.ndarray:
    """Slots for a static placement: the card experts of each layer fill slots 0.. in id order.

    Args:
      on_card: bool ``[L, E]``.
    Returns:
      int32 ``[L, E]``: slot index, -1 for host experts.
    """
    on_card = np.asarray(on_card, bool)
    slots = np.cumsum(on_card, axis=1, dtype=np.int64) - 1  # [L, E]
    return np.where(on_card, slots, -1).astype(np.int32)


def card_calls(slot_of: np.ndarray, experts: np.ndarray) -> tuple[int, int]:
    """(card-served, routed) (token, expert) calls of some routing.

    Args:
      slot_of: int32 ``[L, E]``.
      experts: int ``[L, ..., k]`` (``Routing.experts``, or only its real tokens ``[L, N, k]``).
    """
    slot_of = np.asarray(slot_of)
    chosen = np.asarray(experts).reshape(slot_of.shape[0], -1)  # [L, pairs]
    return int((np.take_along_axis(slot_of, chosen, axis=1) >= 0).sum()), int(chosen.size)


def card_fraction(slot_of: np.ndarray, experts: np.ndarray) -> float:
    """Fraction of routed (token, expert) calls that the card serves (1.0 for none)."""
    card, routed = card_calls(slot_of, experts)
    return card / routed if routed else 1.0


def describe_placement(model) -> str:
    """One line for load messages: how many experts each side computes."""
    slot_of = np.asarray(model.placement.slot_of)
    on_host = slot_of < 0  # [L, E]
    layers = int(on_host.any(axis=1).sum())
    return (f"{int((~on_host).sum())} experts on the card, {int(on_host.sum())} on the host "
            f"({layers} of {slot_of.shape[0]} layers have host experts)")
