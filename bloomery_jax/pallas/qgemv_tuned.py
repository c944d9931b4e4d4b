"""Launch parameters of the GEMV kernels as data.

``TUNED[(layout, type, N, K)]`` and ``DEFAULTS[(layout, type)]`` hold (block_n,
chunks_per_step, num_warps, num_stages[, split_k]), filled from ``scripts/kernel_bench.py`` runs on the
H200 (benchmarks/, docs/LOG.md). They change speed only, never results.

A card other than the one measured can carry its own: ``scripts/layer_kernel_bench.py
--tuned-out FILE`` writes the winners of its sweep, and ``BLOOMERY_GEMV_TUNED=FILE`` makes the
picks below take them before these tables (read once per process).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: rows per program, K-chunks per loop step, Triton warps and stages,
    and the number of programs that share one row tile's K range (``split_k``; planes layout:
    each writes a partial sum, added after the launch; more programs for matrices with few rows)."""

    block_n: int = 32
    chunks_per_step: int = 2
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


# "planes": best of the 2026-12-02 sweep at 8192x8192 (benchmarks/kernel_bench_2026-12-02.json);
# Q8_0 and Q5_K were not reached in that run and take the Q4_K winner
DEFAULTS: dict[tuple[str, str], tuple[int, int, int, int]] = {
    ("planes", "Q8_0"): (32, 4, 8, 3),
    ("planes", "Q4_K"): (32, 4, 8, 3),
    ("planes", "Q5_K"): (32, 4, 8, 3),
    ("planes", "Q6_K"): (16, 2, 8, 3),
    # "rows": not yet measured on the GPU (the 2026-12-02 run of it died in the bench's own
    # copy-bandwidth step); a guess in the middle of the planned sweep
    ("rows", "Q8_0"): (16, 2, 4, 3),
    ("rows", "Q4_K"): (16, 2, 4, 3),
    ("rows", "Q5_K"): (16, 2, 4, 3),
    ("rows", "Q6_K"): (16, 2, 4, 3),
    # "q8" (qgemv_q8, integer dot products; chunks_per_step unused): the config that won or came
    # within ~15% at every shape of the 2026-12-03 sweep (benchmarks/gpu_2026-12-03-s4/kernel_bench_q8.json:
    # 8192x8192 Q4_K 24.7 us, Q6_K 36.4 us); Q8_0 and Q5_K were not timed and take it too
    ("q8", "Q8_0"): (32, 1, 2, 3, 8),
    ("q8", "Q4_K"): (32, 1, 2, 3, 8),
    ("q8", "Q5_K"): (32, 1, 2, 3, 8),
    ("q8", "Q6_K"): (32, 1, 2, 3, 8),
}

TUNED: dict[tuple[str, str, int, int], tuple[int, int, int, int]] = {
    # measured 2026-12-02 on the H200 (21-24 variants each): 46.0 us (821 GB/s), 61.5 us (895 GB/s)
    ("planes", "Q4_K", 8192, 8192): (32, 4, 8, 3),
    ("planes", "Q6_K", 8192, 8192): (16, 2, 8, 3),
    # Qwen3-30B-A3B attention, measured 2026-12-03 (benchmarks/gpu_2026-12-03-s4, plan planes30b,
    # 10 variants each): split_k is what pays on these few-row matrices (attn_o Q4_K 23.4 -> 8.6 us)
    ("planes", "Q4_K", 4096, 2048): (32, 2, 8, 3, 2),  # q: 7.7 us
    ("planes", "Q6_K", 4096, 2048): (16, 1, 4, 3, 8),  # 8.3 us
    ("planes", "Q4_K", 2048, 4096): (16, 1, 4, 3, 8),  # o: 8.6 us
    ("planes", "Q6_K", 2048, 4096): (16, 2, 4, 3, 4),  # 9.8 us
    ("planes", "Q4_K", 512, 2048): (8, 1, 2, 3, 4),  # k, v: 6.0 us
    ("planes", "Q6_K", 512, 2048): (16, 1, 4, 3, 8),  # 6.6 us
    # the decode layer's MoE down projections (moe_gemv, 8 pairs, SwiGLU formed in-kernel) and the
    # output head, measured 2026-12-05 on an H100 (benchmarks/gpu_2026-12-05-s16/trace,
    # scripts/layer_kernel_bench.py): down Q6_K 24.3 -> 18.0 us, Q4_K 18.0 -> 13.0, head 172.9 -> 147.2
    ("planes", "Q6_K", 2048, 768): (32, 3, 8, 3, 1),
    ("planes", "Q4_K", 2048, 768): (16, 1, 2, 3, 3),
    ("planes", "Q6_K", 151936, 2048): (64, 2, 8, 3, 1),
    # q8 where another config beat the default by more than 15% (same sweep, rounding included)
    ("q8", "Q4_K", 4096, 2048): (64, 1, 4, 3, 4),  # 6.6 us (default 8.0)
    # q8 with the Q8_1 rounding inside the launch, measured 2026-12-07 on an H100
    # (benchmarks/gpu_2026-12-07-s28, layer_kernel_bench.py; the rounding is paid per row tile, so
    # taller tiles win): down Q6_K 13.2 -> 9.0 us (the planes down: 18.1), Q4_K 10.4 -> 8.2, o
    # 11.4 -> 10.4, the output head 635 -> 214 us (the default had made pallas-q8's head 4.6x the
    # planes head's, 652 against 143 us a token in the decode profile)
    ("q8", "Q6_K", 2048, 768): (128, 1, 8, 3, 2),
    ("q8", "Q4_K", 2048, 768): (128, 1, 8, 3, 2),
    # the next session's sweep (benchmarks/gpu_2026-12-07-s29/call1, another H100): o 10.9 -> 8.6
    # us; the head, with x rounded before the launch (qgemv_q8.ROUND_FIRST_PROGRAMS), 187 us
    # rounding in every program -> 161 rounding first at the old config -> 150 at this one
    ("q8", "Q4_K", 2048, 4096): (64, 1, 4, 3, 8),
    ("q8", "Q6_K", 151936, 2048): (32, 1, 4, 3, 1),
}


# "q8-given": the q8 launches on x rounded to Q8_1 before them (a Q8Act, e.g. by the router's
# launch): nothing is rounded per row tile, so shorter tiles than "q8"'s win. A weight with no
# entry of its own there takes its "q8" pick.
FALLBACK = {"q8-given": "q8"}


@functools.cache
def measured_here() -> tuple[dict, dict]:
    """``(TUNED-like, TUNED_MANY-like)`` entries of the file ``BLOOMERY_GEMV_TUNED`` names
    (``{"single": [[layout, type, N, K, config]], "many": [[layout, [[type, N], ...], K,
    config]]}``, config a list in ``GemvConfig`` order); empty dicts without one. A file that
    cannot be read is an error naming it: a tuning asked for must not silently fall away."""
    path = os.environ.get("BLOOMERY_GEMV_TUNED")
    if not path:
        return {}, {}
    try:
        with open(path) as f:
            data = json.load(f)
        single = {(lay, typ, int(n), int(k)): tuple(cfg) for lay, typ, n, k, cfg in data.get("single", [])}
        many = {(lay, tuple((typ, int(n)) for typ, n in ws), int(k)): tuple(cfg) for lay, ws, k, cfg in data.get("many", [])}
        for cfg in (*single.values(), *many.values()):
            GemvConfig(*cfg)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"BLOOMERY_GEMV_TUNED={path}: not a tuned-config file ({err})") from err
    return single, many


def pick_config(layout: str, type_name: str, n: int, k: int) -> GemvConfig:
    """The tuned launch parameters for this weight, else the layout's default for its type."""
    key = (layout, type_name, n, k)
    row = measured_here()[0].get(key) or TUNED.get(key)
    if row is None and layout in FALLBACK:
        return pick_config(FALLBACK[layout], type_name, n, k)
    row = row or DEFAULTS.get((layout, type_name))
    return GemvConfig(*row) if row else GemvConfig()


# Launches over several weights (``qgemv_many``: q, k, v; ``moe_gemv_many``: gate, up), keyed by
# (layout, ((type, N), ...), K) in the launch's weight order, timed at the decode shapes by
# ``scripts/layer_kernel_bench.py``: Qwen3-30B-A3B's, 2026-12-05 on an H100 (same run as above).
TUNED_MANY: dict[tuple, tuple[int, ...]] = {
    ("planes", (("Q4_K", 768), ("Q4_K", 768)), 2048): (32, 1, 4, 3, 4),  # gate/up, 8 pairs: 19.6 -> 16.9 us
    ("planes", (("Q4_K", 4096), ("Q4_K", 512), ("Q6_K", 512)), 2048): (32, 2, 8, 3, 4),  # q/k/v with the norm
    # 2026-12-07, H100, the Q8_1 rounding in the launch (as above): gate/up 33.6 -> 15.1 us (planes: 19.7)
    ("q8", (("Q4_K", 768), ("Q4_K", 768)), 2048): (128, 1, 4, 3, 4),
    # 2026-12-07, H100 (benchmarks/gpu_2026-12-07-s30/c1): gate/up on the router's rounded x, 12.3
    # us at the "q8" pick -> 11.2 (and 15.1 rounding in the launch)
    ("q8-given", (("Q4_K", 768), ("Q4_K", 768)), 2048): (16, 1, 1, 3, 2),
}


def pick_many_config(layout: str, weights: list[tuple[str, int]], k: int) -> GemvConfig:
    """Launch parameters of one launch over several ``[N, K]`` weights (``(type name, N)`` each):
    the tuned entry, else the config of the weight with the most rows (the launch's time is
    mostly its programs). The 2026-12-04 H200 trace showed why not the smallest ``block_n`` of
    all, as before: q, k and v of a Qwen3-30B-A3B layer ran in 15-20 us in 1,280 programs of
    8 rows, where q alone at its own config took 7.7 us."""
    key = (layout, tuple(weights), k)
    row = measured_here()[1].get(key) or TUNED_MANY.get(key)
    if row:
        return GemvConfig(*row)
    if layout in FALLBACK:
        return pick_many_config(FALLBACK[layout], weights, k)
    type_name, n = max(weights, key=lambda w: w[1])
    return pick_config(layout, type_name, n, k)
