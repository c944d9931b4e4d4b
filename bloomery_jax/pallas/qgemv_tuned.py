"""Launch parameters of ``qgemv`` as data: (type, N, K) -> (block_n, chunks_per_step,
num_warps, num_stages), and a default per type.

Filled from ``scripts/kernel_bench.py`` runs on the H200 (benchmarks/, docs/LOG.md); a shape
not listed uses its type's default. These values change speed only, never results.
"""

from __future__ import annotations

# placeholders until the first bench run
DEFAULTS = {
    "Q8_0": (32, 2, 4, 3),
    "Q4_K": (32, 2, 4, 3),
    "Q5_K": (32, 2, 4, 3),
    "Q6_K": (32, 2, 4, 3),
}

TUNED: dict[tuple[str, int, int], tuple[int, int, int, int]] = {}
