"""Tickets: a launch's last program to finish a share of the work does what needs all of it.

A decode step is bound by launches, not bytes: a kernel of its own for a small epilogue (a top-k
over the router's logits, a weighted sum of the experts' rows) costs ~1.5-2.5 us on the H100,
mostly its launch. Instead each program of the launch that makes the inputs takes a ticket from
a counter after storing its share, and the one that draws the last ticket does the epilogue.

Memory order (the GPU's, PTX's model): a barrier first, so every thread's stores come before
the ticket; the ticket is an atomic add with acquire-release semantics at GPU scope (Pallas'
Triton lowering's default), which releases them, and for the last holder acquires the others';
that program then reads the shares with volatile loads, past its own L1. No program waits on
another, so it needs no co-residency. The holder sets the counter back to 0, so one buffer
serves every launch of a step in turn: the model threads it through its layers (each launch
takes it as an input aliased to an output), one zeroing a step.

The interpreter runs programs one by one, in grid order: there the last program takes the last
ticket, and the barrier is skipped (it has no CPU rule). Only a card checks the order
(``scripts/route_fused_check.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TICKETS = 2048  # counters in a buffer (a launch uses the first few: one per share it counts)
__all__ = ["TICKETS", "new_tickets", "take_ticket", "when_last", "read_shared"]


def new_tickets() -> jax.Array:
    """A counter buffer: int32 ``[TICKETS]`` zeros."""
    return jnp.zeros((TICKETS,), jnp.int32)


def take_ticket(ref, index, interpret: bool) -> jax.Array:
    """After this program's stores: its ticket (counter ``index``'s value before the add)."""
    if not interpret:
        plgpu.debug_barrier()
    return plgpu.atomic_add(ref, (jnp.asarray(index, jnp.int32),), jnp.int32(1))


def when_last(ref, index, holders: int, interpret: bool):
    """Decorator: run the body in the program that draws counter ``index``'s last ticket of
    ``holders``, then set the counter back to 0."""

    def run(body):
        ticket = take_ticket(ref, index, interpret)

        @pl.when(ticket == holders - 1)
        def _():
            body()
            ref[pl.ds(index, 1)] = jnp.zeros((1,), jnp.int32)

    return run


def read_shared(ref) -> jax.Array:
    """Another program's stores of this launch, read after the last ticket (volatile: past L1)."""
    return plgpu.load(ref, volatile=True)
