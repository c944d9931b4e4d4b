"""Expert placement: which routed experts live on the card and which on the host.

``layout`` describes what placement decides over (``ExpertLayout``), ``rules`` maps a layout to
an on-card table ``[n_layers, n_experts]`` (``parse_rule("n-cpu-moe=36").place(layout)``),
``table`` turns that into the slot table handed to the jitted step (``Placement``).
"""

from .layout import ExpertLayout, format_bytes
from .rules import (RULES, Budget, Card, CardExperts, CpuMoe, LastCpuMoe, NCpuMoe, Override, PlacementRule,
                    accepted_forms, all_card, describe, host_layers, parse_rule, parse_size, register_rule, size_string)
from .table import Placement, card_calls, card_fraction, describe_placement, slot_table

__all__ = [
    "ExpertLayout", "format_bytes",
    "RULES", "PlacementRule", "Card", "CardExperts", "CpuMoe", "NCpuMoe", "LastCpuMoe", "Budget", "Override",
    "accepted_forms", "all_card", "describe", "host_layers", "parse_rule", "parse_size", "register_rule",
    "size_string", "Placement", "card_calls", "card_fraction", "describe_placement", "slot_table",
]
