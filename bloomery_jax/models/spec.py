"""The declarative tensor table every architecture module provides.

A ``TensorSpec`` names a GGUF tensor, its logical shape (NumPy order) and its role. Roles are
what placement, inspection and synthesis reason about: ``expert`` tensors may live on the
host, every other role stays on the card.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from ..errors import GGUFError

ROLES = ("embed", "output", "norm", "attn", "router", "expert", "shared_expert", "ffn")
HOST_ELIGIBLE_ROLES = frozenset({"expert"})


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str
    layer: int | None = None  # block index for blk.N.* tensors
    optional: bool = False  # e.g. output.weight, absent when tied to the embeddings

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown tensor role {self.role!r}")


def embedding_specs(n_vocab: int, d_model: int) -> list[TensorSpec]:
    """Token embeddings, final norm and the (optional, tied when absent) output projection."""
    return [
        TensorSpec("token_embd.weight", (n_vocab, d_model), "embed"),
        TensorSpec("output_norm.weight", (d_model,), "norm"),
        TensorSpec("output.weight", (n_vocab, d_model), "output", optional=True),
    ]


def attention_specs(cfg, i: int) -> list[TensorSpec]:
    """Layer ``i``'s pre-norm, q/k/v/o projections and per-head q/k norms (llama.cpp names).

    ``cfg`` needs d_model, q_dim, kv_dim and head_dim.
    """
    b, D = f"blk.{i}.", cfg.d_model
    return [
        TensorSpec(b + "attn_norm.weight", (D,), "norm", i),
        TensorSpec(b + "attn_q.weight", (cfg.q_dim, D), "attn", i),
        TensorSpec(b + "attn_k.weight", (cfg.kv_dim, D), "attn", i),
        TensorSpec(b + "attn_v.weight", (cfg.kv_dim, D), "attn", i),
        TensorSpec(b + "attn_output.weight", (D, cfg.q_dim), "attn", i),
        TensorSpec(b + "attn_q_norm.weight", (cfg.head_dim,), "norm", i),
        TensorSpec(b + "attn_k_norm.weight", (cfg.head_dim,), "norm", i),
    ]


def check_tensors(gf, specs: Iterable[TensorSpec], *, allow_extra: bool = False) -> None:
    """Check that a file holds every required tensor with the expected shape.

    Raises GGUFError naming the first tensor that is missing, mis-shaped, or (unless
    ``allow_extra``) not part of the architecture — llama.cpp refuses those too.
    """
    specs = list(specs)
    names = {s.name for s in specs}
    for s in specs:
        info = gf.tensors.get(s.name)
        if info is None:
            if s.optional:
                continue
            raise GGUFError(gf.path, "required tensor is missing", tensor=s.name)
        if tuple(info.shape) != tuple(s.shape):
            raise GGUFError(
                gf.path, f"has shape {list(info.shape)}, the config expects {list(s.shape)}", tensor=s.name
            )
    if not allow_extra:
        for name in gf.tensors:
            if name not in names:
                raise GGUFError(gf.path, f"tensor is not used by architecture {gf.architecture!r}", tensor=name)
