"""Random float weights for synthetic models, and the route-skew construction.

Contract: :func:`tensor_rng` gives each tensor (and each expert slice) its own generator
derived from (seed, name, index), so a tensor's values never depend on which other tensors
exist or on the order they are written in; :class:`RouteSkew` holds the persistent residual
direction and the hot experts; :func:`float_values` draws one tensor (or one expert slice).

Why the scales (the per-architecture plug-in chooses them, these are the principles):
  * Every block reads the residual stream through an RMSNorm, so what a layer sees has RMS ≈ 1
    whatever the stream's own scale; the stream's scale only sets how much each layer's
    output (attention output, expert down projection) moves it relative to the embeddings.
  * The logits are ``output @ rmsnorm(x)``: with rows of std ``s`` over ``D`` inputs of RMS 1
    the logits have std ``s*sqrt(D)``. A logit std of ~5 puts the top token far above the
    rest (mean max-prob ≈ 0.55 at V=512, ≈ 0.3 at V=151936, against 1/V uniform).
  * Router logits ``W_r @ rmsnorm(x)`` likewise have std ``s_r*sqrt(D)``. A std of ~3 gives
    decisive but not one-hot gates. Near-ties between the k-th and (k+1)-th expert cannot be
    removed by scale (a rounding perturbation scales with the logits too); their rate falls
    with the spacing of order statistics, ~std/E, so tests must still detect and skip them.

Route skew (``A >= 0``): the embeddings get a shared mean ``mu*u`` along a unit direction
``u``, which every RMSNorm'd block input inherits (``h·u ≈ mu/rms(x)``). Router rows are made
orthogonal to ``u`` (so cold experts get no systematic bias), then the rows of a few hot
experts per layer get ``+b*u`` with ``b = A*sigma_r/mu``: their logits rise by ≈ ``A`` router
standard deviations on every token. ``A = 0`` adds nothing (uniform routing).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from ..models.spec import TensorSpec

SKEW_MEAN = 4.0  # |mean| of the embeddings along u, in units of the per-component std (1)


def tensor_rng(seed: int, name: str, index: int = -1) -> np.random.Generator:
    """The generator of tensor ``name`` (``index`` >= 0: of its ``index``-th expert slice)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), index + 1])


@dataclasses.dataclass(frozen=True)
class RouteSkew:
    """The persistent residual direction and the hot experts of each layer."""

    strength: float  # A, in router-logit standard deviations
    direction: np.ndarray  # u, f32 [D], unit norm
    hot: tuple[tuple[int, ...], ...]  # hot expert ids per layer

    @classmethod
    def make(cls, strength: float, seed: int, d_model: int, n_layers: int, n_experts: int,
             n_hot: int) -> "RouteSkew":
        rng = np.random.default_rng([seed, zlib.crc32(b"route_skew")])
        u = rng.standard_normal(d_model)
        u = (u / np.linalg.norm(u)).astype(np.float32)
        hot = tuple(tuple(sorted(int(e) for e in rng.choice(n_experts, n_hot, replace=False)))
                    for _ in range(n_layers))
        return cls(float(strength), u, hot)

    @property
    def active(self) -> bool:
        return self.strength > 0


def parts(spec: TensorSpec, row_chunk: int = 4096) -> list[tuple[int, tuple[int, ...]]]:
    """How a tensor is drawn and written: (part index, part shape) in file order.

    3-D tensors go one expert slice at a time, big 2-D tensors (embeddings, output) in fixed
    row blocks, the rest whole (index -1). The split is fixed by the shape alone, so values
    never depend on memory limits or write order.
    """
    shape = spec.shape
    if len(shape) == 3:
        return [(e, shape[1:]) for e in range(shape[0])]
    if len(shape) == 2 and shape[0] > row_chunk and spec.role != "router":
        return [(i, (min(row_chunk, shape[0] - r), shape[1])) for i, r in enumerate(range(0, shape[0], row_chunk))]
    return [(-1, shape)]


def float_values(spec: TensorSpec, index: int, shape: tuple[int, ...], std: float, seed: int, *,
                 center: float = 0.0, skew: RouteSkew | None = None) -> np.ndarray:
    """The float32 values of one part of a tensor (see :func:`parts`).

    Args:
      spec: the tensor; its ``role`` picks the skew treatment (embed / router).
      index, shape: the part, as :func:`parts` gives it.
      std: standard deviation of the random part.
      seed: the file's seed.
      center: added to every value (norm weights are ``center + std * noise``).
      skew: the route skew, applied when active.
    Returns:
      f32 ``shape``.
    """
    rng = tensor_rng(seed, spec.name, index)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)
    if center:
        x += np.float32(center)
    if skew is not None and skew.active:
        u = skew.direction
        if spec.role == "embed":
            x += np.float32(SKEW_MEAN) * u  # [V, D] + [D]
        elif spec.role == "router":
            assert index == -1, "router tensors are drawn whole"
            x -= np.outer(x @ u, u)  # [E, D]: drop every row's component along u
            b = skew.strength * std * np.sqrt(spec.shape[-1]) / SKEW_MEAN
            x[list(skew.hot[spec.layer])] += np.float32(b) * u
    return x
