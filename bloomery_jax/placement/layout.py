"""What placement decides over: the routed experts of each layer and the bytes they take.

An :class:`ExpertLayout` is plain, hashable data: the number of layers and of experts per MoE
layer, the bytes of ONE expert of each layer (gate + up + down rows of that expert, in their
stored ggml types), the names of each layer's routed-expert tensors, and the bytes (and names)
of everything that must stay on the card. Rules (``rules.py``) map a layout to an on-card
table ``[n_layers, n_experts]``; nothing here knows about devices.

Build it from a file (``ExpertLayout.from_file(gf, module.tensor_specs(cfg))``) or, for tests
and offline research, from plain numbers (``ExpertLayout.from_numbers(48, 128, 2_654_208,
1_300_000_000)``).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from ..errors import ConfigError, GGUFError
from ..models.spec import HOST_ELIGIBLE_ROLES, TensorSpec

EXPERT_PARTS = ("gate", "up", "down")
_SIZE_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(n: int) -> str:
    """``1.50 GiB`` / ``12.00 MiB`` / ``512 B``: sizes in messages and descriptions."""
    for unit, scale in _SIZE_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def default_expert_names(layer: int) -> tuple[str, ...]:
    """llama.cpp's names of a layer's routed-expert tensors (``blk.N.ffn_gate_exps.weight`` ...)."""
    return tuple(f"blk.{layer}.ffn_{p}_exps.weight" for p in EXPERT_PARTS)


def default_fixed_names(n_layers: int, moe_layers: Iterable[int]) -> tuple[str, ...]:
    """Qwen3-MoE-like names of the card-only tensors, for layouts built from numbers.

    They let ``override`` rules be checked (a pattern matching ``attn_q`` must fail) without a file.
    """
    moe = set(moe_layers)
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(n_layers):
        b = f"blk.{i}."
        names += [b + n for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                  "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                                  "ffn_norm.weight")]
        if i in moe:
            names.append(b + "ffn_gate_inp.weight")
        else:
            names += [b + f"ffn_{p}.weight" for p in EXPERT_PARTS]
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """The routed experts of a model, as placement sees them.

    Attributes:
      n_layers: blocks of the model (table rows).
      n_experts: routed experts per MoE layer (table columns); 0 for a model without experts.
      expert_bytes: per layer, bytes of one expert (gate + up + down); 0 = no routed experts.
      expert_names: per layer, the names of its routed-expert tensors (empty = none).
      card_fixed_bytes: bytes of every tensor that must stay on the card (every non-expert role).
      fixed_names: the names of those tensors (``override`` refuses patterns that match one).
    """

    n_layers: int
    n_experts: int
    expert_bytes: tuple[int, ...]
    expert_names: tuple[tuple[str, ...], ...]
    card_fixed_bytes: int
    fixed_names: tuple[str, ...] = ()

    def __post_init__(self):
        if not (isinstance(self.n_layers, int) and self.n_layers >= 0):
            raise ConfigError(f"layout: n_layers must be an integer >= 0, got {self.n_layers!r}")
        if not (isinstance(self.n_experts, int) and self.n_experts >= 0):
            raise ConfigError(f"layout: n_experts must be an integer >= 0, got {self.n_experts!r}")
        if len(self.expert_bytes) != self.n_layers or len(self.expert_names) != self.n_layers:
            raise ConfigError(f"layout: expert_bytes and expert_names need one entry per layer "
                              f"({self.n_layers}), got {len(self.expert_bytes)} and {len(self.expert_names)}")
        for i, (b, names) in enumerate(zip(self.expert_bytes, self.expert_names)):
            if not (isinstance(b, int) and b >= 0):
                raise ConfigError(f"layout: layer {i}: one expert's bytes must be an integer >= 0, got {b!r}")
            if (b > 0) != bool(names):
                raise ConfigError(f"layout: layer {i}: an MoE layer needs both expert bytes > 0 and tensor "
                                  f"names, got {b} bytes and names {list(names)}")
            if b > 0 and self.n_experts == 0:
                raise ConfigError(f"layout: layer {i} has expert bytes but n_experts is 0")
        if not (isinstance(self.card_fixed_bytes, int) and self.card_fixed_bytes >= 0):
            raise ConfigError(f"layout: card_fixed_bytes must be an integer >= 0, got {self.card_fixed_bytes!r}")

    # --- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_numbers(cls, n_layers: int, n_experts: int, expert_bytes: int | Sequence[int],
                     card_fixed_bytes: int, *, fixed_names: Sequence[str] | None = None) -> "ExpertLayout":
        """A layout without a file (tests, offline research).

        Args:
          n_layers: blocks of the model.
          n_experts: routed experts per MoE layer (0: a model without experts).
          expert_bytes: bytes of one expert, the same for every layer, or one value per layer
            where 0 marks a layer without routed experts (e.g. DeepSeek's leading dense layers).
          card_fixed_bytes: bytes of the tensors that must stay on the card.
          fixed_names: names of those tensors; None = Qwen3-MoE-like names (``default_fixed_names``).
        Tensor names follow llama.cpp (``blk.N.ffn_{gate,up,down}_exps.weight``).
        """
        if isinstance(expert_bytes, int):
            per_layer = (expert_bytes if n_experts > 0 else 0,) * n_layers
        else:
            per_layer = tuple(int(b) for b in expert_bytes)
        names = tuple(default_expert_names(i) if b > 0 else () for i, b in enumerate(per_layer))
        if fixed_names is None:
            fixed_names = default_fixed_names(n_layers, [i for i, b in enumerate(per_layer) if b > 0])
        return cls(n_layers, n_experts, per_layer, names, int(card_fixed_bytes), tuple(fixed_names))

    @classmethod
    def from_file(cls, gf, specs: Iterable[TensorSpec]) -> "ExpertLayout":
        """The layout of an open GGUF file, from its architecture's ``tensor_specs(cfg)``.

        Roles come from the specs; a tensor of the file that the specs do not name counts as
        card-only (the safe side). Bytes are the stored bytes (``TensorInfo.n_bytes``), so mixed
        quant types (Q4_K_M's Q6_K ``ffn_down_exps`` in some layers) give per-layer sizes.
        Raises GGUFError for a missing expert tensor or an expert tensor whose shape is not
        ``[E, rows, cols]`` with the same E everywhere.
        """
        specs = list(specs)
        role = {s.name: s.role for s in specs}
        layers = [s.layer for s in specs if s.layer is not None]
        n_layers = max(layers) + 1 if layers else 0
        per_layer: dict[int, list[str]] = {}
        n_experts = 0
        for s in specs:
            if s.role not in HOST_ELIGIBLE_ROLES:
                continue
            info = gf.tensors.get(s.name)
            if info is None:
                raise GGUFError(gf.path, "routed-expert tensor is missing", tensor=s.name)
            if s.layer is None or len(info.shape) != 3:
                raise GGUFError(gf.path, f"a routed-expert tensor must be [E, rows, cols] in a block, "
                                         f"got shape {list(info.shape)}", tensor=s.name)
            if n_experts and info.shape[0] != n_experts:
                raise GGUFError(gf.path, f"has {info.shape[0]} experts, other layers {n_experts}", tensor=s.name)
            n_experts = int(info.shape[0])
            per_layer.setdefault(s.layer, []).append(s.name)
        bytes_ = [0] * n_layers
        names: list[tuple[str, ...]] = [()] * n_layers
        for layer, ns in per_layer.items():
            for n in ns:
                info = gf.tensors[n]
                if info.n_bytes % n_experts:
                    raise GGUFError(gf.path, f"{info.n_bytes} bytes do not split into {n_experts} experts", tensor=n)
                bytes_[layer] += info.n_bytes // n_experts
            names[layer] = tuple(ns)
        fixed = [t for t in gf if role.get(t.name) not in HOST_ELIGIBLE_ROLES]
        return cls(n_layers, n_experts, tuple(bytes_), tuple(names),
                   sum(t.n_bytes for t in fixed), tuple(t.name for t in fixed))

    # --- derived numbers ------------------------------------------------------------------------

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers that have routed experts, in order."""
        return tuple(i for i, b in enumerate(self.expert_bytes) if b > 0)

    @property
    def has_experts(self) -> bool:
        return bool(self.moe_layers)

    @property
    def expert_tensor_bytes(self) -> int:
        """Bytes of every routed expert of the model."""
        return sum(self.expert_bytes) * self.n_experts

    @property
    def total_bytes(self) -> int:
        return self.card_fixed_bytes + self.expert_tensor_bytes

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of an on-card table: ``(n_layers, n_experts)``."""
        return (self.n_layers, self.n_experts)

    def tensor_names(self) -> tuple[str, ...]:
        """Every tensor name the layout knows: card-only ones, then each layer's expert tensors."""
        return self.fixed_names + tuple(n for names in self.expert_names for n in names)

