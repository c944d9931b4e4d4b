"""Adaptive residency, the decision half: count routing, choose which experts hold the card slots.

Contract. The card has a fixed number of expert slots per layer (``n_slots[l]``, set at load by
the placement rule); ``slot_of`` int32 ``[L, E]`` (as :class:`~.table.Placement`) says which
expert sits in which slot (-1: the host computes it). Between steps the engine hands the step's
routing to :meth:`ResidencyController.observe`, asks :meth:`ResidencyController.step_plan`
which slots to refill, copies those experts' blocks into the named slots and installs
:attr:`ResidencyController.slot_of`. Nothing here touches a device: this module is NumPy only
(the package imports JAX elsewhere; ``scripts/placement_sweep.py`` loads this file without it).

Policies answer one question per layer, ``desired(counts, layer, resident, n_slots) -> bool [E]``
with exactly ``n_slots`` True; :func:`plan_swaps` turns the answer into the fewest slot
reassignments, capped by a bandwidth budget. Ties always break the same way: the hotter of two
equal experts is the lower id, and a resident beats a host expert it ties with.

Policies are registered with gin (module ``residency``): ``residency.LFU.decay = 0.9``, and
:func:`make_policy` builds one with the bindings in force.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import gin
import numpy as np

GIN_MODULE = "residency"


# --- routing counts ---------------------------------------------------------------------------

def count_routing(experts, n_experts: int, mask=None) -> np.ndarray:
    """Routed calls per (layer, expert) of one step.

    Args:
      experts: int ``[L, ..., k]`` chosen experts (``Routing.experts`` is ``[L, B, T, k]``;
        a trace step is ``[L, N, k]``).
      n_experts: E.
      mask: optional bool over the token axes ``experts.shape[1:-1]``; False rows (padding) are
        not counted and may hold any value.
    Returns:
      int64 ``[L, E]``.
    """
    experts = np.asarray(experts)
    if experts.ndim < 2:
        raise ValueError(f"routing experts must be [L, ..., k], got shape {experts.shape}")
    if not np.issubdtype(experts.dtype, np.integer):
        raise ValueError(f"routing experts must be integers, got {experts.dtype}")
    L = experts.shape[0]
    if mask is not None:
        mask = np.asarray(mask, bool)
        if mask.shape != experts.shape[1:-1]:
            raise ValueError(f"mask shape {mask.shape} does not match the token axes {experts.shape[1:-1]} "
                             f"of routing experts {experts.shape}")
        experts = experts[:, mask]  # [L, n_real, k]
    chosen = experts.reshape(L, -1).astype(np.int64)  # [L, pairs]
    if chosen.size and (chosen.min() < 0 or chosen.max() >= n_experts):
        raise ValueError(f"routing expert ids must lie in [0, {n_experts}), got {chosen.min()}..{chosen.max()}")
    flat = chosen + np.arange(L, dtype=np.int64)[:, None] * n_experts  # [L, pairs] -> ids in L*E
    return np.bincount(flat.ravel(), minlength=L * n_experts).reshape(L, n_experts)


class RoutingCounts:
    """Per-layer, per-expert routed calls, decayed per step, and the step each expert was last used.

    After each :meth:`update`, ``counts = decay * counts + this step's calls`` (``decay`` in
    (0, 1]; 1 keeps plain totals). ``last_used[l, e]`` is the index of the last update (0, 1, ...)
    in which expert e of layer l was routed, -1 if never.
    """

    def __init__(self, n_layers: int, n_experts: int, decay: float = 1.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must lie in (0, 1], got {decay}")
        self.decay = float(decay)
        self.counts = np.zeros((n_layers, n_experts), np.float64)  # [L, E]
        self.last_used = np.full((n_layers, n_experts), -1, np.int64)  # [L, E]
        self.steps = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.counts.shape

    def update(self, experts, mask=None) -> np.ndarray:
        """Fold in one step's routing (see :func:`count_routing`); returns its raw int64 ``[L, E]``."""
        L, E = self.shape
        raw = count_routing(experts, E, mask)
        if raw.shape[0] != L:
            raise ValueError(f"routing has {raw.shape[0]} layers, the counts {L}")
        if self.decay != 1.0:
            self.counts *= self.decay
        self.counts += raw
        self.last_used[raw > 0] = self.steps
        self.steps += 1
        return raw


def hot_order(counts_row, resident=None) -> np.ndarray:
    """Expert ids hottest first: larger count, then resident (if given), then lower id."""
    c = np.asarray(counts_row, np.float64)
    ids = np.arange(c.shape[0])
    if resident is None:
        return np.lexsort((ids, -c))
    return np.lexsort((ids, ~np.asarray(resident, bool), -c))


# --- policies ----------------------------------------------------------------------------------

def _check_request(resident, n_slots: int) -> np.ndarray:
    resident = np.asarray(resident, bool)
    if resident.ndim != 1:
        raise ValueError(f"resident must be bool [E], got shape {resident.shape}")
    if not 0 <= n_slots <= resident.shape[0]:
        raise ValueError(f"n_slots must lie in [0, {resident.shape[0]}], got {n_slots}")
    return resident


def _top(order: np.ndarray, n: int, n_experts: int) -> np.ndarray:
    want = np.zeros(n_experts, bool)
    want[order[:n]] = True
    return want


def _displace(counts_row, want, order, hysteresis: float, margin: float) -> None:
    """In place on bool ``want [E]``: hottest non-wanted experts against coldest wanted ones (by
    ``order``, ids hottest first), the longest run of pairs whose count beats ``hysteresis``
    times the other's plus ``margin`` changes sides."""
    host_hot = order[~want[order]]  # host experts, hottest first
    res_cold = order[::-1][want[order[::-1]]]  # residents, coldest first
    m = min(host_hot.shape[0], res_cold.shape[0])
    # Host counts fall and resident counts rise along the pairs, so the winners are a prefix.
    wins = counts_row[host_hot[:m]] > hysteresis * counts_row[res_cold[:m]] + margin  # [m]
    n = m if wins.all() else int(np.argmin(wins))
    want[host_hot[:n]] = True
    want[res_cold[:n]] = False


class Policy:
    """Chooses a layer's card experts. ``decay`` is the per-step decay its counts should use."""

    decay: float = 1.0

    def desired(self, counts: RoutingCounts, layer: int, resident, n_slots: int) -> np.ndarray:
        """bool ``[E]`` with exactly ``n_slots`` True: the experts that should hold the card slots.

        Args:
          counts: the controller's routing counts.
          layer: which row of ``counts``.
          resident: bool ``[E]``, the experts on the card now (normally ``n_slots`` of them).
          n_slots: the layer's slot count, 0..E.
        """
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LFU(Policy):
    """Keep the ``n_slots`` experts with the largest decayed counts, with hysteresis.

    A host expert h replaces a resident r only if ``count[h] > hysteresis * count[r] + margin``;
    pairs are matched hottest host against coldest resident, so the rule swaps the longest run
    of pairs that all clear the bar. With ``hysteresis=1, margin=0`` a strictly hotter expert
    always wins; a tie never swaps.
    """

    decay: float = 0.95
    hysteresis: float = 1.25
    # Evidence a swap needs beyond the ratio: decayed counts of a few calls are mostly noise.
    # Replaying the synthetic 48-layer trace at a quarter budget (scripts/placement_sweep.py
    # --synthetic --budgets 0.25), margin 0 swapped 24.8 experts a decode step for 0.647 of the
    # routed calls on the card, margin 4 swapped 0.9 for 0.639; on the H200 that churn (68 swaps
    # a step, ~200 MB) held decode at 6.0 tok/s against 18.7 static (benchmarks/gpu_2026-12-04-s9).
    margin: float = 4.0

    def __post_init__(self):
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"LFU.decay must lie in (0, 1], got {self.decay}")
        if self.hysteresis < 1.0 or self.margin < 0.0:
            raise ValueError(f"LFU needs hysteresis >= 1 and margin >= 0, got {self.hysteresis}, {self.margin}")

    def desired(self, counts, layer, resident, n_slots):
        resident = _check_request(resident, n_slots)
        c = counts.counts[layer]  # [E]
        E = c.shape[0]
        order = hot_order(c, resident)  # [E], hottest first
        want = resident.copy()
        # A resident set of the wrong size (not the controller's case) is first trimmed or filled.
        extra = int(want.sum()) - n_slots
        if extra > 0:
            cold_res = order[::-1][want[order[::-1]]]
            want[cold_res[:extra]] = False
        elif extra < 0:
            want[order[~want[order]][:-extra]] = True
        if n_slots in (0, E):
            return want
        _displace(c, want, order, self.hysteresis, self.margin)
        return want


@dataclasses.dataclass(frozen=True)
class LRU(Policy):
    """Keep the ``n_slots`` most recently routed experts; ties by count, then resident, then id."""

    decay: float = 1.0

    def desired(self, counts, layer, resident, n_slots):
        resident = _check_request(resident, n_slots)
        c, last = counts.counts[layer], counts.last_used[layer]
        ids = np.arange(c.shape[0])
        order = np.lexsort((ids, ~resident, -c, -last))
        return _top(order, n_slots, c.shape[0])


@dataclasses.dataclass(frozen=True)
class Static(Policy):
    """Never changes: the residents stay."""

    decay: float = 1.0

    def desired(self, counts, layer, resident, n_slots):
        resident = _check_request(resident, n_slots)
        if int(resident.sum()) != n_slots:
            raise ValueError(f"Static: layer {layer} has {int(resident.sum())} residents for {n_slots} slots")
        return resident.copy()


POLICIES: dict[str, type[Policy]] = {"lfu": LFU, "lru": LRU, "static": Static}
for _cls in POLICIES.values():
    gin.external_configurable(_cls, module=GIN_MODULE)  # re-registering the same class is a no-op


def make_policy(name: str) -> Policy:
    """The policy ``name`` (lfu, lru, static) with the gin bindings in force, as a plain instance."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown residency policy {name!r}; known: {', '.join(POLICIES)}") from None
    configured = gin.get_configurable(cls)()  # an instance of gin's subclass, bindings applied
    return cls(**{f.name: getattr(configured, f.name) for f in dataclasses.fields(cls)})


# --- swaps -------------------------------------------------------------------------------------

class Swap(NamedTuple):
    """Card slot ``slot`` of a layer stops holding ``out_expert`` and takes ``in_expert``."""

    slot: int
    out_expert: int
    in_expert: int


def plan_swaps(slot_of_row, desired, max_swaps: int | None = None, counts=None) -> list[Swap]:
    """The fewest slot reassignments that make a layer's resident set equal ``desired``.

    Residents that stay keep their slots; each incoming expert takes the slot of one leaving
    expert, so the plan has exactly ``|desired - resident|`` swaps. Hottest incoming go first,
    paired with the coldest leaving (by ``counts``, or by id when None); ``max_swaps`` keeps the
    first ones (the bandwidth budget per layer and step).

    Args:
      slot_of_row: int ``[E]``, slot per expert or -1.
      desired: bool ``[E]`` with as many True as the row has slots.
      max_swaps: cap, None for no cap.
      counts: optional float ``[E]`` ranking the experts.
    """
    row = np.asarray(slot_of_row)
    desired = np.asarray(desired, bool)
    if row.ndim != 1 or desired.shape != row.shape:
        raise ValueError(f"slot_of_row and desired must both be [E], got {row.shape} and {desired.shape}")
    resident = row >= 0
    if int(desired.sum()) != int(resident.sum()):
        raise ValueError(f"desired has {int(desired.sum())} experts for {int(resident.sum())} card slots")
    return _swaps_in_order(row, desired, max_swaps, hot_order(np.zeros(row.shape[0]) if counts is None else counts))


def _swaps_in_order(row, desired, max_swaps, order) -> list[Swap]:
    """plan_swaps with the ranking given as ids hottest first."""
    if max_swaps is not None and max_swaps < 0:
        raise ValueError(f"max_swaps must be >= 0 or None, got {max_swaps}")
    resident = row >= 0
    incoming = order[(desired & ~resident)[order]]  # hottest first
    outgoing = order[::-1][(resident & ~desired)[order[::-1]]]  # coldest first
    n = incoming.shape[0] if max_swaps is None else min(incoming.shape[0], max_swaps)
    return [Swap(int(row[o]), int(o), int(i)) for i, o in zip(incoming[:n], outgoing[:n])]


def _apply_inplace(slot_of: np.ndarray, layer: int, swaps) -> None:
    row = slot_of[layer]
    for s in swaps:
        if row[s.out_expert] != s.slot or row[s.in_expert] != -1:
            raise ValueError(f"layer {layer}: {s} does not fit the table (slot of out {row[s.out_expert]}, "
                             f"of in {row[s.in_expert]})")
        row[s.out_expert] = -1
        row[s.in_expert] = s.slot


def apply_swaps(slot_of, layer: int, swaps) -> np.ndarray:
    """A new int32 ``[L, E]`` table with ``swaps`` applied in order to ``layer`` (input unchanged)."""
    out = np.array(slot_of, np.int32, copy=True)
    _apply_inplace(out, layer, swaps)
    return out


def check_slot_table(slot_of) -> np.ndarray:
    """Validate a slot table (each layer's slots are 0..n-1, once each); returns n_slots int64 ``[L]``."""
    slot_of = np.asarray(slot_of)
    if slot_of.ndim != 2 or not np.issubdtype(slot_of.dtype, np.integer):
        raise ValueError(f"slot_of must be int [L, E], got {slot_of.dtype} {slot_of.shape}")
    n_slots = (slot_of >= 0).sum(axis=1)
    for l in range(slot_of.shape[0]):
        slots = np.sort(slot_of[l][slot_of[l] >= 0])
        if (slot_of[l] < -1).any() or not np.array_equal(slots, np.arange(n_slots[l])):
            raise ValueError(f"slot_of row {l} must hold slots 0..{n_slots[l] - 1} once each and -1 elsewhere")
    return n_slots.astype(np.int64)


# --- the controller ----------------------------------------------------------------------------

class ResidencyController:
    """Counts routing and decides slot swaps between steps; keeps the served/moved counters.

    Per step: run with :attr:`slot_of`; :meth:`observe` the step's routing (a routed pair counts
    as served when its expert had a slot in that table); then :meth:`step_plan` (decode) or
    :meth:`prompt_plan` (after a prompt) returns ``{layer: [Swap]}`` and moves the table on.
    Layers whose slot count is 0 or E never swap.

    Args:
      slot_of: int ``[L, E]`` at load.
      policy: a :class:`Policy` (default ``LFU()``).
      expert_bytes: bytes one expert's blocks take, a number or ``[L]`` (for ``bytes_moved``).
      window: steps in the sliding served fraction.
      decay: count decay; default the policy's.
    """

    def __init__(self, slot_of, policy: Policy | None = None, *, expert_bytes=None, window: int = 16,
                 decay: float | None = None):
        self.n_slots = check_slot_table(slot_of)  # [L]
        self._slot_of = np.array(slot_of, np.int32, copy=True)  # [L, E]
        L, E = self._slot_of.shape
        self.policy = LFU() if policy is None else policy
        self.counts = RoutingCounts(L, E, self.policy.decay if decay is None else decay)
        self.expert_bytes = (np.zeros(L, np.int64) if expert_bytes is None
                             else np.broadcast_to(np.asarray(expert_bytes, np.int64), (L,)).copy())
        self.adaptive_layers = [l for l in range(L) if 0 < self.n_slots[l] < E]
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._window = collections.deque(maxlen=window)  # (served, routed) per observed step
        self.served_calls = 0
        self.routed_calls = 0
        self.swaps_total = 0
        self.swaps_last = 0
        self.bytes_moved = 0
        self.bytes_last = 0

    @property
    def slot_of(self) -> np.ndarray:
        """The current int32 ``[L, E]`` table (a copy)."""
        return self._slot_of.copy()

    def observe(self, routing_experts, mask=None) -> tuple[int, int]:
        """Count one step's routing; returns (served, routed) pairs of that step."""
        raw = self.counts.update(routing_experts, mask)  # [L, E]
        served = int(raw[self._slot_of >= 0].sum())
        routed = int(raw.sum())
        self._window.append((served, routed))
        self.served_calls += served
        self.routed_calls += routed
        return served, routed

    @property
    def served_fraction(self) -> float:
        """Card-served share of every routed pair observed (1.0 before any)."""
        return self.served_calls / self.routed_calls if self.routed_calls else 1.0

    @property
    def window_fraction(self) -> float:
        """Card-served share over the last ``window`` observed steps."""
        served = sum(s for s, _ in self._window)
        routed = sum(r for _, r in self._window)
        return served / routed if routed else 1.0

    def _commit(self, plan: dict[int, list[Swap]]) -> dict[int, list[Swap]]:
        for l, swaps in plan.items():
            _apply_inplace(self._slot_of, l, swaps)
        self.swaps_last = sum(len(s) for s in plan.values())
        self.bytes_last = int(sum(len(s) * int(self.expert_bytes[l]) for l, s in plan.items()))
        self.swaps_total += self.swaps_last
        self.bytes_moved += self.bytes_last
        return plan

    def step_plan(self, max_swaps_per_layer: int | None = None) -> dict[int, list[Swap]]:
        """Ask the policy for every adaptive layer; apply and return the swaps (layers with none left out)."""
        plan = {}
        if not isinstance(self.policy, Static):
            for l in self.adaptive_layers:
                row = self._slot_of[l]
                want = np.asarray(self.policy.desired(self.counts, l, row >= 0, int(self.n_slots[l])), bool)
                swaps = plan_swaps(row, want, max_swaps_per_layer, self.counts.counts[l])
                if swaps:
                    plan[l] = swaps
        return self._commit(plan)

    def prompt_plan(self, routing_experts, mask=None, max_swaps_per_layer: int | None = None,
                    hysteresis: float = 1.0, margin: float = 0.0) -> dict[int, list[Swap]]:
        """Prompt-time streaming: seat each layer's experts the prompt routed most, at once.

        Ranks by the prompt's own counts (ties: resident first, then the decayed counts, then id).
        A host expert displaces a resident when the prompt used it more than ``hysteresis`` times
        as often plus ``margin`` (the defaults: any more often), matched hottest against coldest
        as :class:`LFU` does; :class:`~.slots.LiveResidency` passes its LFU policy's hysteresis
        (not its margin, which counts decayed decode calls), so that a prompt like the last one
        re-seats fewer experts (on a synthetic 48-layer trace at a quarter budget, four 512-token
        prompts with 128 decode steps each: 75-112 swaps a later prompt against 142-163, the
        same served fraction, 0.69).
        Does not count the routing: :meth:`observe` the prompt's steps as usual.
        """
        L, E = self._slot_of.shape
        prompt = count_routing(routing_experts, E, mask)  # [L, E]
        if prompt.shape[0] != L:
            raise ValueError(f"routing has {prompt.shape[0]} layers, the table {L}")
        ids = np.arange(E)
        plan = {}
        for l in self.adaptive_layers:
            row = self._slot_of[l]
            resident = row >= 0
            order = np.lexsort((ids, -self.counts.counts[l], ~resident, -prompt[l]))  # hottest first
            want = resident.copy()
            _displace(prompt[l], want, order, hysteresis, margin)
            swaps = _swaps_in_order(row, want, max_swaps_per_layer, order)
            if swaps:
                plan[l] = swaps
        return self._commit(plan)

    def stats(self) -> dict:
        """Counters for metrics."""
        return dict(served_fraction=self.served_fraction, window_fraction=self.window_fraction,
                    served_calls=self.served_calls, routed_calls=self.routed_calls,
                    swaps_total=self.swaps_total, swaps_last=self.swaps_last,
                    bytes_moved=self.bytes_moved, bytes_last=self.bytes_last, steps=self.counts.steps)
