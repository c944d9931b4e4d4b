"""Placement rules: which routed experts live on the card, as plain, hashable data.

A rule maps an :class:`~.layout.ExpertLayout` to a bool table ``on_card [n_layers, n_experts]``
(True = on the card). Rows of layers without routed experts are all True. Rules are
deterministic, and ``str(rule)`` is the canonical rule string (``parse_rule(str(r)) == r``).

Rule strings (``RuntimeSettings.placement``, ``--place``):

    card                 every expert on the card (the default)
    cpu-moe              every routed expert on the host (llama.cpp ``--cpu-moe``)
    n-cpu-moe=N          experts of the first N MoE layers on the host (llama.cpp ``--n-cpu-moe N``)
    last-cpu-moe=N       experts of the last N MoE layers on the host
    budget=SIZE          fit the card into SIZE bytes (``20GiB``, ``1.5GiB``, ``24000MB``)
    override=REGEX[=CPU] tensors whose names match go to the host (llama.cpp ``-ot REGEX=CPU``)

Choices:
- ``n-cpu-moe=N`` counts MoE layers, not blocks: on a model whose first blocks are dense it
  skips them (llama.cpp counts blocks; the two agree when every block is MoE, as in qwen3moe).
  N above the number of MoE layers is an error.
- ``budget``: the card first holds every non-expert tensor plus ``reserve_bytes`` (KV cache and
  scratch, given by the caller); the rest fills with experts. Without routing statistics all
  experts of a layer are alike, so it fills in a fixed order: MoE layers from the first on, each
  layer's experts by id, stopping at the first expert that does not fit. So at most one layer is
  split (its first experts by id on the card), the host keeps the last layers, as with
  ``last-cpu-moe``, and less than one expert's bytes of the budget stay unused. A budget below the
  fixed part is an error giving both sizes.
- ``override`` uses ``re.search`` on full tensor names (``blk.3.ffn_up_exps.weight``), as
  llama.cpp does. A layer's experts move together, so a pattern matching some but not all of a
  layer's expert tensors is an error, and so is one matching a card-only tensor or nothing at all.
  llama.cpp's comma-separated lists of overrides are not accepted: use one regex with ``|``.
- On a model without routed experts (gemma3) every rule is a no-op (all-card table of shape
  ``[n_layers, 0]``), ``cpu-moe`` and ``n-cpu-moe=N`` included, so one config line serves a
  family. Two checks stay: ``budget`` still refuses a card too small for the weights, and
  ``override`` still refuses a pattern that matches a card-only tensor.

Adding a rule (research scripts): subclass :class:`PlacementRule` as a frozen dataclass, set the
class attributes ``name`` and ``form``, implement ``decide(layout, reserve_bytes)`` (and
``from_arg``/``__str__`` when it takes an argument), and decorate it with :func:`register_rule`.
``parse_rule`` then accepts its string and gin can build it (``@placement.MyRule()``)::

    @register_rule
    @dataclasses.dataclass(frozen=True)
    class EvenOnHost(PlacementRule):
        name: ClassVar[str] = "even-on-host"
        form: ClassVar[str] = "even-on-host"

        def decide(self, layout, reserve_bytes):
            on_card = all_card(layout)
            on_card[list(layout.moe_layers), ::2] = False
            return on_card

Every rule class is registered with gin (module ``placement``) through
``gin.external_configurable``, which leaves the class itself untouched: a gin binding
``RuntimeSettings.placement = @placement.NCpuMoe()`` with ``placement.NCpuMoe.n = 36`` gives
the same object as the string ``'n-cpu-moe=36'``; :func:`parse_rule` accepts either.
"""

from __future__ import annotations

import dataclasses
import decimal
import re
from typing import ClassVar

import gin
import numpy as np

from ..errors import ConfigError
from .layout import ExpertLayout, format_bytes

RULES: dict[str, type["PlacementRule"]] = {}  # rule name -> class; register_rule adds to it
GIN_MODULE = "placement"


def accepted_forms() -> str:
    return " | ".join(cls.form for cls in RULES.values())


def _bad(text: str, problem: str) -> ConfigError:
    return ConfigError(f"placement rule {text!r}: {problem} (accepted: {accepted_forms()})")


class PlacementRule:
    """Base of every rule. Subclasses are frozen dataclasses (hashable, comparable)."""

    name: ClassVar[str] = ""  # the rule string's name part
    form: ClassVar[str] = ""  # how the string looks, for messages: "n-cpu-moe=N"

    @classmethod
    def from_arg(cls, arg: str | None) -> "PlacementRule":
        """Build the rule from the text after ``name=`` (None: there was no ``=``)."""
        if arg is not None:
            raise _bad(f"{cls.name}={arg}", f"{cls.name} takes no argument")
        return cls()

    def __str__(self) -> str:
        return self.name

    def check(self, layout: ExpertLayout) -> None:
        """Raise ConfigError when the rule cannot apply to ``layout``."""

    def decide(self, layout: ExpertLayout, reserve_bytes: int) -> np.ndarray:
        """The on-card table ``[n_layers, n_experts]`` bool; subclasses implement this."""
        raise NotImplementedError

    def place(self, layout: ExpertLayout, reserve_bytes: int = 0) -> np.ndarray:
        """Where each expert lives: bool ``[n_layers, n_experts]``, True = on the card.

        Args:
          layout: the model's experts and sizes.
          reserve_bytes: card bytes needed besides the weights (KV cache, scratch); only rules
            that budget the card use it.
        Raises:
          ConfigError: the rule cannot apply to this model (see the module docstring).
        """
        if not (isinstance(reserve_bytes, (int, np.integer)) and reserve_bytes >= 0):
            raise ConfigError(f"reserve_bytes must be an integer >= 0, got {reserve_bytes!r}")
        self.check(layout)
        on_card = np.asarray(self.decide(layout, int(reserve_bytes)))
        if on_card.dtype != np.bool_ or on_card.shape != layout.shape:
            raise ValueError(f"rule {self}: decide() returned {on_card.dtype} {on_card.shape}, "
                             f"want bool {layout.shape}")
        dense = [i for i in range(layout.n_layers) if layout.expert_bytes[i] == 0]
        if dense and not on_card[dense].all():  # a bug in the rule, not bad input
            raise ValueError(f"rule {self}: put experts of layers without routed experts on the host")
        return on_card


def register_rule(cls: type[PlacementRule]) -> type[PlacementRule]:
    """Add a rule class to RULES (by its ``name``) and to gin; returns the class (a decorator).

    Registering the same class twice is a no-op; another class under a taken name is an error.
    """
    if not cls.name or not re.fullmatch(r"[a-z][a-z0-9-]*", cls.name):
        raise ConfigError(f"rule class {cls.__name__}: name must be lowercase letters, digits and '-', "
                          f"got {cls.name!r}")
    held = RULES.get(cls.name)
    if held is cls:
        return cls
    if held is not None:
        raise ConfigError(f"placement rule name {cls.name!r} is taken by {held.__module__}.{held.__qualname__}")
    gin.external_configurable(cls, module=GIN_MODULE)
    RULES[cls.name] = cls
    return cls


def all_card(layout: ExpertLayout) -> np.ndarray:
    """Every expert on the card: bool ``[n_layers, n_experts]`` of True."""
    return np.ones(layout.shape, dtype=bool)


def host_layers(layout: ExpertLayout, layers) -> np.ndarray:
    """Every expert of ``layers`` on the host, the rest on the card."""
    on_card = all_card(layout)
    on_card[list(layers)] = False
    return on_card


def _count(text: str, arg: str | None, name: str) -> int:
    """The N of ``name=N``: a whole number >= 0."""
    if arg is None or not arg.strip():
        raise _bad(text, f"{name} needs N: {name}=N with N a whole number >= 0")
    arg = arg.strip()
    if re.fullmatch(r"-\s*\d+", arg):
        raise _bad(text, f"N must be >= 0, got {arg}")
    if not re.fullmatch(r"\d+", arg):
        raise _bad(text, f"N must be a whole number >= 0, got {arg!r}")
    return int(arg)


def _check_count(rule, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"{type(rule).__name__}.n must be a whole number >= 0, got {n!r} "
                          f"(accepted: {rule.form})")


# --- the rules -----------------------------------------------------------------------------------


@register_rule
@dataclasses.dataclass(frozen=True)
class Card(PlacementRule):
    """Every expert on the card."""

    name: ClassVar[str] = "card"
    form: ClassVar[str] = "card"

    def decide(self, layout, reserve_bytes):
        return all_card(layout)


@register_rule
@dataclasses.dataclass(frozen=True)
class CpuMoe(PlacementRule):
    """Every routed expert on the host (llama.cpp ``--cpu-moe``); a no-op without experts."""

    name: ClassVar[str] = "cpu-moe"
    form: ClassVar[str] = "cpu-moe"

    def decide(self, layout, reserve_bytes):
        return host_layers(layout, layout.moe_layers)


@dataclasses.dataclass(frozen=True)
class _LayerCount(PlacementRule):
    n: int = 0

    def __post_init__(self):
        _check_count(self, self.n)

    @classmethod
    def from_arg(cls, arg):
        return cls(_count(f"{cls.name}={arg}" if arg is not None else cls.name, arg, cls.name))

    def __str__(self):
        return f"{self.name}={self.n}"

    def check(self, layout):
        moe = len(layout.moe_layers)
        if moe and self.n > moe:
            raise ConfigError(f"placement rule {str(self)!r}: the model has {moe} MoE layers "
                              f"(accepted: {self.name}=N with 0 <= N <= {moe})")


@register_rule
@dataclasses.dataclass(frozen=True)
class NCpuMoe(_LayerCount):
    """Experts of the first ``n`` MoE layers on the host (llama.cpp ``--n-cpu-moe``)."""

    name: ClassVar[str] = "n-cpu-moe"
    form: ClassVar[str] = "n-cpu-moe=N"

    def decide(self, layout, reserve_bytes):
        return host_layers(layout, layout.moe_layers[:self.n])


@register_rule
@dataclasses.dataclass(frozen=True)
class LastCpuMoe(_LayerCount):
    """Experts of the last ``n`` MoE layers on the host."""

    name: ClassVar[str] = "last-cpu-moe"
    form: ClassVar[str] = "last-cpu-moe=N"

    def decide(self, layout, reserve_bytes):
        moe = layout.moe_layers
        return host_layers(layout, moe[len(moe) - self.n:] if self.n else ())


@register_rule
@dataclasses.dataclass(frozen=True)
class CardExperts(_LayerCount):
    """``n`` experts of every MoE layer on the card (the first by id), the rest on the host.

    The starting table for adaptive residency: every layer has card slots to swap into, where
    the layer rules leave whole layers with none.
    """

    name: ClassVar[str] = "card-experts"
    form: ClassVar[str] = "card-experts=N"

    def check(self, layout):
        if layout.has_experts and self.n > layout.n_experts:
            raise ConfigError(f"placement rule {str(self)!r}: the model has {layout.n_experts} experts per layer "
                              f"(accepted: {self.name}=N with 0 <= N <= {layout.n_experts})")

    def decide(self, layout, reserve_bytes):
        on_card = all_card(layout)
        on_card[list(layout.moe_layers), self.n:] = False
        return on_card


# Sizes: decimal units are powers of 1000, binary ones of 1024; the unit is case-insensitive.
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_CANONICAL_UNITS = ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB")
SIZE_HELP = ("a size with a unit, e.g. 20GiB, 1.5GiB or 24000MB; units B, KB, MB, GB, TB (powers of 1000) "
             "and KiB, MiB, GiB, TiB (powers of 1024), case-insensitive")


def parse_size(text: str) -> int:
    """Bytes of ``20GiB`` / ``1.5 GiB`` / ``24000mb`` (fractions of a byte are dropped)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]+)\s*", text or "")
    if m is None or m.group(2).lower() not in SIZE_UNITS:
        raise ConfigError(f"size {text!r} is not {SIZE_HELP}")
    return int(decimal.Decimal(m.group(1)) * SIZE_UNITS[m.group(2).lower()])


def size_string(n: int) -> str:
    """The shortest exact unit form of ``n`` bytes: ``20GiB``, ``1.5GiB``, ``24GB``, ``123B``."""
    for unit in _CANONICAL_UNITS:
        value = decimal.Decimal(n) / SIZE_UNITS[unit.lower()]
        if value >= 1 and value == value.quantize(decimal.Decimal("0.001")):
            return f"{value.normalize():f}{unit}"
    return f"{n}B"


@register_rule
@dataclasses.dataclass(frozen=True)
class Budget(PlacementRule):
    """Fit the card into ``bytes``: card-only tensors and the reserve first, then experts in order.

    ``bytes`` may be given as a size string (``Budget("20GiB")``, handy in gin); it is stored as int.
    """

    name: ClassVar[str] = "budget"
    form: ClassVar[str] = "budget=SIZE (e.g. 20GiB)"
    bytes: int = 0

    def __post_init__(self):
        if isinstance(self.bytes, str):
            object.__setattr__(self, "bytes", parse_size(self.bytes))
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, (int, np.integer)) or self.bytes <= 0:
            raise ConfigError(f"Budget.bytes must be a whole number of bytes > 0, got {self.bytes!r}")

    @classmethod
    def from_arg(cls, arg):
        if arg is None or not arg.strip():
            raise _bad(cls.name if arg is None else f"{cls.name}={arg}", f"budget needs {SIZE_HELP}")
        try:
            n = parse_size(arg)
        except ConfigError as e:
            raise _bad(f"{cls.name}={arg}", str(e)) from None
        if n <= 0:
            raise _bad(f"{cls.name}={arg}", "the budget must be more than 0 bytes")
        return cls(n)

    def __str__(self):
        return f"budget={size_string(self.bytes)}"

    def decide(self, layout, reserve_bytes):
        fixed = layout.card_fixed_bytes + reserve_bytes
        if self.bytes < fixed:
            raise ConfigError(
                f"placement rule {str(self)!r}: the budget {format_bytes(self.bytes)} is smaller than what must "
                f"stay on the card, {format_bytes(fixed)} (non-expert weights {format_bytes(layout.card_fixed_bytes)}"
                f" + reserve {format_bytes(reserve_bytes)}); accepted: a budget of at least {format_bytes(fixed)}")
        moe = list(layout.moe_layers)
        E = layout.n_experts
        # Fill order: MoE layers in order, each layer's experts by id; the card keeps a prefix.
        cost = np.repeat(np.asarray([layout.expert_bytes[i] for i in moe], dtype=np.int64), E)  # [M*E]
        n_fit = int(np.searchsorted(np.cumsum(cost), self.bytes - fixed, side="right"))
        order = np.zeros(len(moe) * E, dtype=bool)
        order[:n_fit] = True
        on_card = all_card(layout)
        on_card[moe] = order.reshape(len(moe), E)
        return on_card


@register_rule
@dataclasses.dataclass(frozen=True)
class Override(PlacementRule):
    """Tensors whose names match ``pattern`` (``re.search``) go to the host (llama.cpp ``-ot``).

    ``pattern`` may carry llama.cpp's ``=CPU`` suffix; it is dropped (the host is the only target).
    """

    name: ClassVar[str] = "override"
    form: ClassVar[str] = "override=REGEX[=CPU]"
    pattern: str = ""

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise ConfigError(f"Override.pattern must be a string, got {self.pattern!r}")
        pattern = self.pattern
        if pattern.lower().endswith("=cpu"):
            pattern = pattern[:-4]
        else:
            target = re.search(r"=([A-Za-z][A-Za-z0-9_]*)\Z", pattern)
            if target:
                raise _bad(f"override={self.pattern}", f"the only target accepted is CPU (the host), got "
                                                       f"{target.group(1)!r}; experts stay on the card by default")
        if not pattern:
            raise _bad(f"override={self.pattern}", "override needs a regex of tensor names, e.g. override=exps")
        try:
            re.compile(pattern)
        except re.error as e:
            raise _bad(f"override={self.pattern}", f"bad regex {pattern!r}: {e}") from None
        object.__setattr__(self, "pattern", pattern)

    @classmethod
    def from_arg(cls, arg):
        if arg is None:
            raise _bad(cls.name, "override needs a regex of tensor names, e.g. override=exps")
        return cls(arg)

    def __str__(self):
        return f"override={self.pattern}"

    def decide(self, layout, reserve_bytes):
        rx = re.compile(self.pattern)
        wrong = [n for n in layout.fixed_names if rx.search(n)]
        if wrong:
            more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
            raise ConfigError(f"placement rule {str(self)!r}: only routed-expert tensors can live on the host; "
                              f"{', '.join(wrong[:3])}{more} matched")
        on_card = all_card(layout)
        for i in layout.moe_layers:
            names = layout.expert_names[i]
            hit = [n for n in names if rx.search(n)]
            if hit and len(hit) < len(names):
                miss = [n for n in names if n not in hit]
                raise ConfigError(
                    f"placement rule {str(self)!r}: a layer's experts move together, but the pattern matches "
                    f"{', '.join(hit)} and not {', '.join(miss)}; match all of them (e.g. blk\\.{i}\\.ffn_.*_exps)")
            if hit:
                on_card[i] = False
        if layout.has_experts and on_card.all():
            example = layout.expert_names[layout.moe_layers[0]][0]
            raise ConfigError(f"placement rule {str(self)!r}: the pattern matches no tensor of this model "
                              f"(routed-expert tensors are named like {example})")
        return on_card


# --- parsing and describing ----------------------------------------------------------------------


def parse_rule(text, layout: ExpertLayout | None = None) -> PlacementRule:
    """The rule of a rule string (``n-cpu-moe=36``); a rule object is returned as it is.

    Whitespace around the string is trimmed; the name is exact (lowercase). With ``layout``, also
    check that the rule applies to that model (N within its MoE layers).
    Raises ConfigError naming the problem and listing the accepted forms.
    """
    if isinstance(text, PlacementRule):
        rule = text
    elif isinstance(text, str):
        s = text.strip()
        name, eq, arg = s.partition("=")
        name = name.strip()
        cls = RULES.get(name)
        if cls is None:
            raise _bad(text, f"unknown rule name {name!r}" if name else "empty rule")
        rule = cls.from_arg(arg if eq else None)
    else:
        raise ConfigError(f"a placement rule must be a string or a rule object, got {type(text).__name__} "
                          f"{text!r} (accepted: {accepted_forms()})")
    if layout is not None:
        rule.check(layout)
    return rule


def describe(on_card: np.ndarray, layout: ExpertLayout) -> dict:
    """Counts and bytes of a placement, for CLIs to print.

    Returns ``card_experts``, ``host_experts``, ``host_layers`` (layers with a host expert),
    ``card_bytes`` (card-only tensors + card experts; no reserve), ``host_bytes``, ``text``.
    """
    on_card = np.asarray(on_card, dtype=bool)
    if on_card.shape != layout.shape:
        raise ValueError(f"on_card has shape {on_card.shape}, the layout {layout.shape}")
    moe = list(layout.moe_layers)
    sub = on_card[moe]  # [M, E]
    per = np.asarray([layout.expert_bytes[i] for i in moe], dtype=np.int64)  # [M]
    card_expert_bytes = int((sub.sum(axis=1) * per).sum())
    host_bytes = int(((~sub).sum(axis=1) * per).sum())
    card_experts, host_experts = int(sub.sum()), int((~sub).sum())
    host_layers = int((~sub).any(axis=1).sum())
    card_bytes = layout.card_fixed_bytes + card_expert_bytes
    text = (f"experts {card_experts} on card, {host_experts} on host ({host_layers} of {len(moe)} MoE layers "
            f"touch the host); card {format_bytes(card_bytes)}, host {format_bytes(host_bytes)}")
    return {"card_experts": card_experts, "host_experts": host_experts, "host_layers": host_layers,
            "card_bytes": card_bytes, "host_bytes": host_bytes, "text": text}
