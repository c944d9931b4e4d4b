"""Adaptive residency on a running engine (CPU): swaps change where experts run, never the tokens.

A synthetic qwen3moe Q8_0 model with skewed routing and a quarter of each layer's experts on
the card: greedy tokens are identical with the controller off, with the swap rule, and with
prompt streaming too; swaps happen; nothing recompiles after warm-up; and the card serves more
of the routed calls with the controller than without.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bloomery_jax.engine.engine import Engine
from bloomery_jax.engine.sampling import SamplingParams
from bloomery_jax.engine.steps import _decode, _decode_block, _prefill
from bloomery_jax.models.loader import load_model
from bloomery_jax.placement.residency import LFU
from bloomery_jax.placement.slots import LiveResidency
from bloomery_jax.placement.table import card_fraction

SHAPE = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=16, n_experts_used=2,
             expert_ff=256, n_vocab=512)
N_NEW = 20
GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class FirstPerLayer:
    """The first ``n`` experts of every layer on the card (a research-script style rule)."""

    n: int

    def place(self, layout, reserve_bytes=0):
        on_card = np.zeros(layout.shape, bool)
        on_card[:, : self.n] = True
        return on_card


@pytest.fixture(scope="module")
def path(synth_model):
    return synth_model(qtype="Q8_0", seed=4, route_skew=3.0, **SHAPE)[0]


def run(path, residency: str, kernels: str = "reference", block: int = 1, ahead: bool = False):
    """Greedy tokens of two prompts decoded together, ``block`` steps a call (``ahead``: each
    launched before the previous one's tokens are read), and the card-served fraction of each
    call's last step."""
    model = load_model(path, place=FirstPerLayer(SHAPE["n_experts"] // 4), kernels=kernels)
    live = None
    if residency != "off":
        live = LiveResidency.for_model(model, LFU(decay=0.9, hysteresis=1.0, margin=0.0), prompt_streaming=residency == "stream")
    eng = Engine(model, n_slots=2, max_context=64, ubatch=16, min_chunk=16, residency=live)
    eng.warmup(decode_block=block)
    compiled = (_prefill._cache_size(), _decode._cache_size(), _decode_block._cache_size())
    rng = np.random.default_rng(0)
    seqs = [eng.add(rng.integers(0, SHAPE["n_vocab"], n).tolist(), GREEDY) for n in (21, 9)]
    for s in seqs:
        while s.pending > 1:
            eng.prefill(s)
    fractions = []
    for i in range(N_NEW // block):
        table = np.asarray(eng.placement.slot_of)
        eng.decode_block(seqs, block, ahead=ahead and i + 1 < N_NEW // block)
        fractions.append(card_fraction(table, np.asarray(eng.last_routing.experts)[:, :2]))
    assert (_prefill._cache_size(), _decode._cache_size(), _decode_block._cache_size()) == compiled, \
        "a placement change recompiled"
    return [s.tokens for s in seqs], np.array(fractions), live


def test_tokens_identical_with_and_without_residency(path):
    tokens_off, frac_off, _ = run(path, "off")
    tokens_swap, frac_swap, live_swap = run(path, "swap")
    tokens_stream, frac_stream, live_stream = run(path, "stream")
    assert tokens_swap == tokens_off
    assert tokens_stream == tokens_off
    assert live_swap.controller.swaps_total > 0 and live_stream.controller.swaps_total > 0
    print(f"card-served fraction, mean over {N_NEW} decode steps: off {frac_off.mean():.3f}, "
          f"swap {frac_swap.mean():.3f}, swap+stream {frac_stream.mean():.3f}")
    # Skewed routing: counting it must seat the hot experts the static first-quarter misses.
    assert frac_swap[-8:].mean() > frac_off[-8:].mean()
    assert frac_stream[:4].mean() >= frac_swap[:4].mean()


def test_residency_swaps_between_decode_blocks(path):
    """Blocks of four decode steps a call: the block's routing is counted step by step and the
    swaps are seated after it; the tokens stay those of the engine without residency."""
    tokens_off, _, _ = run(path, "off")
    for ahead in (False, True):  # with lookahead a block's swaps are seated while the next one runs
        tokens_block, _, live = run(path, "swap", block=4, ahead=ahead)
        assert live.controller.swaps_total > 0
        assert 0 < live.stats()["layer_seats"] <= SHAPE["n_layers"] * (N_NEW // 4 + 2)  # after blocks (and prompts) only
        assert tokens_block == tokens_off


def test_residency_needs_host_experts(path):
    with pytest.raises(ValueError, match="host experts"):
        LiveResidency.for_model(load_model(path))


def test_residency_with_pallas_kernels(path):
    """Seating into repacked card slots (repacked on the device as they arrive) keeps the tokens."""
    tokens_off, _, _ = run(path, "off")
    tokens_pallas, _, live = run(path, "stream", kernels="pallas")
    assert live.controller.swaps_total > 0
    assert tokens_pallas == tokens_off


@pytest.mark.parametrize("bridge", ["callback", "ffi"])
def test_decode_block_with_host_experts(path, bridge):
    """A block of decode steps in one call runs the host experts inside the device loop, through
    either bridge: the same greedy tokens and card-served counters as one decode call a step,
    with each block launched after the previous one's read or ahead of it."""
    model = load_model(path, place=FirstPerLayer(SHAPE["n_experts"] // 4), bridge=bridge)
    results = []
    for block, ahead in ((1, False), (5, False), (5, True)):
        eng = Engine(model, n_slots=2, max_context=64, ubatch=16, min_chunk=16)
        rng = np.random.default_rng(0)
        seqs = [eng.add(rng.integers(0, SHAPE["n_vocab"], n).tolist(), GREEDY) for n in (21, 9)]
        for s in seqs:
            while s.pending > 1:
                eng.prefill(s)
        for i in range(N_NEW // block):
            eng.decode_block(seqs, block, ahead=ahead and i + 1 < N_NEW // block)
        results.append(([s.tokens for s in seqs], eng.card_calls, eng.routed_calls))
    assert results[1] == results[0] and results[2] == results[0]
    assert 0 < results[0][1] < results[0][2]  # some calls on the card, some on the host
