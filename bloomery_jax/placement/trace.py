"""Routing traces: what the routers chose at every layer for every real token of recorded steps.

File format (``.npz``, read with ``allow_pickle=False``):

    experts       int16 [total_tokens, L, k]  chosen experts, steps one after another
    step_offsets  int64 [n_steps + 1]         step s holds tokens step_offsets[s]:step_offsets[s+1]
    step_kind     uint8 [n_steps]             0 prefill (a prompt ubatch), 1 decode
    n_experts     int64 scalar                E; every id lies in [0, E)
    n_layers      int64 scalar                L
    metadata      str scalar                  a JSON object (model path, placement rule, ...)
    version       int64 scalar                1

Padding rows are never stored (record with a mask). A step of a batch of sequences holds all
their real tokens. NumPy only, like :mod:`.residency`, so offline scripts run without JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, NamedTuple

import numpy as np

PREFILL, DECODE = 0, 1
VERSION = 1
_KINDS = {"prefill": PREFILL, "decode": DECODE, PREFILL: PREFILL, DECODE: DECODE}
_ARRAYS = ("experts", "step_offsets", "step_kind", "n_experts", "n_layers", "metadata")


class TraceStep(NamedTuple):
    index: int
    kind: int  # PREFILL or DECODE
    experts: np.ndarray  # int [L, N, k], the controller's layout


@dataclasses.dataclass(frozen=True)
class Trace:
    """A loaded (or recorded) routing trace; iterate for :class:`TraceStep` in order."""

    experts: np.ndarray  # int16 [total_tokens, L, k]
    step_offsets: np.ndarray  # int64 [n_steps + 1]
    step_kind: np.ndarray  # uint8 [n_steps]
    n_experts: int
    metadata: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _validate(self.experts, self.step_offsets, self.step_kind, self.n_experts, self.experts.shape[1], "trace")

    @property
    def n_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def n_steps(self) -> int:
        return int(self.step_kind.shape[0])

    def __len__(self) -> int:
        return self.n_steps

    def step(self, s: int) -> TraceStep:
        a, b = self.step_offsets[s], self.step_offsets[s + 1]
        return TraceStep(s, int(self.step_kind[s]), self.experts[a:b].transpose(1, 0, 2))  # [L, N, k]

    def __iter__(self) -> Iterator[TraceStep]:
        return (self.step(s) for s in range(self.n_steps))

    def tokens(self, kind: int | None = None) -> int:
        """Stored tokens, of one kind or all."""
        n = np.diff(self.step_offsets)  # [n_steps]
        return int(n.sum() if kind is None else n[self.step_kind == kind].sum())

    def counts(self) -> np.ndarray:
        """Routed calls per (layer, expert) over the whole trace: int64 ``[L, E]``."""
        L, E = self.n_layers, self.n_experts
        flat = self.experts.astype(np.int64) + np.arange(L, dtype=np.int64)[None, :, None] * E  # [N, L, k]
        return np.bincount(flat.ravel(), minlength=L * E).reshape(L, E)

    def save(self, path) -> None:
        np.savez_compressed(path, experts=self.experts, step_offsets=self.step_offsets, step_kind=self.step_kind,
                            n_experts=np.int64(self.n_experts), n_layers=np.int64(self.n_layers),
                            metadata=np.array(json.dumps(self.metadata)), version=np.int64(VERSION))


def _validate(experts, offsets, kind, n_experts, n_layers, where: str) -> None:
    def bad(msg):
        raise ValueError(f"{where}: {msg}")

    if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer):
        bad(f"experts must be int [tokens, L, k], got {experts.dtype} {experts.shape}")
    if experts.shape[1] != n_layers or experts.shape[2] < 1:
        bad(f"experts shape {experts.shape} does not match n_layers={n_layers} and k >= 1")
    if not 0 < n_experts <= np.iinfo(np.int16).max:
        bad(f"n_experts must lie in [1, 32767], got {n_experts}")
    if experts.size and (experts.min() < 0 or experts.max() >= n_experts):
        bad(f"expert ids must lie in [0, {n_experts}), got {experts.min()}..{experts.max()}")
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        bad(f"step_offsets must be int [n_steps + 1], got {offsets.dtype} {offsets.shape}")
    if kind.ndim != 1 or offsets.shape[0] != kind.shape[0] + 1:
        bad(f"step_kind {kind.shape} and step_offsets {offsets.shape} disagree on the number of steps")
    if offsets[0] != 0 or offsets[-1] != experts.shape[0] or (np.diff(offsets) < 0).any():
        bad(f"step_offsets must rise from 0 to {experts.shape[0]} tokens, got {offsets[0]}..{offsets[-1]}")
    if kind.size and not np.isin(kind, (PREFILL, DECODE)).all():
        bad(f"step_kind must be 0 (prefill) or 1 (decode), got {sorted(set(kind.tolist()))}")


def load_trace(path) -> Trace:
    """Read and check a trace file; a malformed one raises ValueError naming what is wrong."""
    where = os.fspath(path)
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except Exception as e:  # a bad zip, pickled data, a truncated file: all say "not a trace"
        raise ValueError(f"{where}: not a routing trace (.npz): {type(e).__name__}: {e}") from e
    if not hasattr(z, "files"):
        raise ValueError(f"{where}: not a routing trace (.npz): it holds a single array")
    with z:
        missing = [a for a in _ARRAYS if a not in z.files]
        if missing:
            raise ValueError(f"{where}: not a routing trace, missing {', '.join(missing)} "
                             f"(has {', '.join(z.files) or 'nothing'})")
        try:
            arrays = {a: z[a] for a in _ARRAYS}
            version = z["version"] if "version" in z.files else np.int64(VERSION)
        except Exception as e:  # an object array, a corrupt member
            raise ValueError(f"{where}: unreadable array: {type(e).__name__}: {e}") from e
    if version.shape != () or not np.issubdtype(version.dtype, np.integer) or int(version) != VERSION:
        raise ValueError(f"{where}: trace version {version!r}, this reader knows {VERSION}")
    for a in ("n_experts", "n_layers"):
        if arrays[a].shape != () or not np.issubdtype(arrays[a].dtype, np.integer):
            raise ValueError(f"{where}: {a} must be an integer scalar, got {arrays[a].dtype} {arrays[a].shape}")
    try:
        metadata = json.loads(str(arrays["metadata"]))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: metadata is not JSON: {e}") from e
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: metadata must be a JSON object, got {type(metadata).__name__}")
    experts, offsets, kind = arrays["experts"], arrays["step_offsets"], arrays["step_kind"]
    n_experts, n_layers = int(arrays["n_experts"]), int(arrays["n_layers"])
    _validate(experts, offsets, kind, n_experts, n_layers, where)
    return Trace(experts.astype(np.int16), offsets.astype(np.int64), kind.astype(np.uint8), n_experts, metadata)


class TraceRecorder:
    """Collects steps' routing; :meth:`trace` or :meth:`save` when done.

    Args:
      n_layers, n_experts: L and E of the model.
      metadata: JSON-able dict stored with the trace (model path, placement rule, ...).
    """

    def __init__(self, n_layers: int, n_experts: int, metadata: dict | None = None):
        if not 0 < n_experts <= np.iinfo(np.int16).max:
            raise ValueError(f"n_experts must lie in [1, 32767], got {n_experts}")
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.metadata = dict(metadata or {})
        json.dumps(self.metadata)  # fail now, not at save
        self._steps: list[np.ndarray] = []  # each int16 [N, L, k]
        self._kinds: list[int] = []

    def append(self, step_experts, kind, mask=None) -> None:
        """Record one step.

        Args:
          step_experts: int ``[L, ..., k]`` (``Routing.experts`` ``[L, B, T, k]`` or ``[L, N, k]``).
          kind: ``PREFILL``/``DECODE`` or ``"prefill"``/``"decode"``.
          mask: optional bool over the token axes; only True (real) tokens are kept.
        """
        if kind not in _KINDS:
            raise ValueError(f"step kind must be prefill/decode or 0/1, got {kind!r}")
        x = np.asarray(step_experts)
        if x.ndim < 2 or x.shape[0] != self.n_layers or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"step experts must be int [L={self.n_layers}, ..., k], got {x.dtype} {x.shape}")
        if self._steps and x.shape[-1] != self._steps[0].shape[2]:
            raise ValueError(f"k changed from {self._steps[0].shape[2]} to {x.shape[-1]}")
        if mask is not None:
            mask = np.asarray(mask, bool)
            if mask.shape != x.shape[1:-1]:
                raise ValueError(f"mask shape {mask.shape} does not match the token axes {x.shape[1:-1]}")
            x = x[:, mask]  # [L, N, k]
        x = x.reshape(self.n_layers, -1, x.shape[-1])  # [L, N, k]
        if x.size and (x.min() < 0 or x.max() >= self.n_experts):
            raise ValueError(f"expert ids must lie in [0, {self.n_experts}), got {x.min()}..{x.max()}")
        self._steps.append(x.transpose(1, 0, 2).astype(np.int16))  # [N, L, k]
        self._kinds.append(_KINDS[kind])

    def __len__(self) -> int:
        return len(self._steps)

    def trace(self) -> Trace:
        k = self._steps[0].shape[2] if self._steps else 1
        experts = (np.concatenate(self._steps) if self._steps
                   else np.zeros((0, self.n_layers, k), np.int16))  # [total_tokens, L, k]
        offsets = np.zeros(len(self._steps) + 1, np.int64)
        offsets[1:] = np.cumsum([s.shape[0] for s in self._steps])
        return Trace(experts, offsets, np.asarray(self._kinds, np.uint8), self.n_experts, dict(self.metadata))

    def save(self, path) -> None:
        self.trace().save(path)
