"""Hybrid placement: experts computed on the host give the all-on-card results.

For every placement rule and for random placements, a synthetic qwen3moe model's logits over a
48-token prompt equal the all-on-card logits within a stated tolerance at every position not
at or after a router near-tie, and greedy decoding gives the same tokens. A placement change
(permuting which card slot holds which expert) never recompiles the step.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from bloomery_jax.engine.engine import Engine
from bloomery_jax.engine.sampling import SamplingParams
from bloomery_jax.errors import ConfigError
from bloomery_jax.eval.runner import sequence_logits
from bloomery_jax.models import qwen3moe
from bloomery_jax.models.loader import load_model
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models.registry import module_for_file
from bloomery_jax.placement import Budget, ExpertLayout, Placement, slot_table

# K-quant rows need multiples of 256 in both expert dimensions.
SHAPE = dict(n_layers=3, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, n_experts_used=2,
             expert_ff=256, n_vocab=512)
T = 48
# The host kernels sum in another order than XLA's dot: f32 rounding differences of ~1e-6
# relative per expert output. 1e-4 x the logits' standard deviation leaves a wide guard above
# that and stays far below any real error (a wrong expert moves logits by ~the std).
TOL = 1e-4
# A router whose k-th and (k+1)-th logits are closer than this may pick another expert after a
# 1e-6 relative perturbation; positions at or after such a near-tie are not compared.
NEAR_TIE = 1e-4
RULES = ["cpu-moe", "n-cpu-moe=1", "last-cpu-moe=2", r"override=blk\.1\.ffn_.*_exps", "budget"]


def budget_rule(path) -> Budget:
    """A budget holding the non-expert weights and one and a half layers of experts."""
    gf = GGUFFile(path)
    module = module_for_file(gf)
    layout = ExpertLayout.from_file(gf, module.tensor_specs(module.Config.from_gguf(gf)))
    E = SHAPE["n_experts"]
    return Budget(layout.card_fixed_bytes + layout.expert_bytes[0] * (E + E // 2))


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A placement rule that returns a given table (what a research script would write)."""

    mask: tuple  # nested tuples of bools [L][E]

    def place(self, layout, reserve_bytes=0):
        return np.array(self.mask, bool)


def prompt(seed=0):
    return np.random.default_rng(seed).integers(0, SHAPE["n_vocab"], T)


def compared_positions(path, tokens) -> np.ndarray:
    """bool [T]: positions before the first router near-tie of the all-on-card run."""
    model = load_model(path)
    cache = model.init_cache(1, T)
    _, _, routing = qwen3moe.forward(model.params, model.cfg, tokens[None], np.arange(T)[None], cache)
    ties = (np.asarray(routing.margin[:, 0]) < NEAR_TIE).any(axis=0)  # [T]
    first = int(np.argmax(ties)) if ties.any() else T
    assert first >= T // 2, f"router near-tie at position {first}: choose another seed"
    keep = np.zeros(T, bool)
    keep[:first] = True
    return keep


@pytest.fixture(scope="module", params=["F32", "Q8_0", "Q4_K_M", "Q5_K"])
def model_file(request, synth_model):
    path, _ = synth_model(qtype=request.param, seed=11, **SHAPE)
    tokens = prompt()
    reference = sequence_logits(load_model(path), tokens, ubatch=16)
    return path, tokens, reference, compared_positions(path, tokens)


def assert_matches(path, place, tokens, reference, keep, host_act="f32", act_rounding="none"):
    model = load_model(path, place=place, host_act=host_act)
    ours = sequence_logits(model, tokens, ubatch=16, act_rounding=act_rounding)
    err = np.abs(ours - reference)[keep].max()
    bound = TOL * reference[keep].std()
    print(f"{place} ({host_act}): max |dlogit| {err:.3g}, bound {bound:.3g}, {int((~keep).sum())} positions excluded")
    assert err <= bound
    return model


@pytest.mark.parametrize("rule", RULES)
def test_rule_matches_card(model_file, rule):
    path, tokens, reference, keep = model_file
    model = assert_matches(path, budget_rule(path) if rule == "budget" else rule, tokens, reference, keep)
    slot_of = np.asarray(model.placement.slot_of)
    assert (slot_of < 0).any(), "the rule should put some experts on the host"
    assert model.placement.host.stats.calls > 0


@pytest.mark.parametrize("rule", ["cpu-moe", "n-cpu-moe=1"])
def test_prefill_streams_host_experts(model_file, rule):
    # steps of 32 tokens (STREAM_MIN_TOKENS; the 48 tokens go as two chunks, the second padded to
    # 32) stream each host layer's experts to the card and compute them there, not on the host
    path, tokens, reference, keep = model_file
    model = load_model(path, place=rule, host_act="f32")
    ours = sequence_logits(model, tokens, ubatch=32)
    assert np.abs(ours - reference)[keep].max() <= TOL * reference[keep].std()
    bridge = model.placement.host
    per_step = sum(getattr(layer, role).data.nbytes for layer in bridge.layers.values() for role in ("gate", "up", "down"))
    assert bridge.stats.streamed_bytes == 2 * per_step and bridge.stats.calls == 0


def test_card_served_counts_streamed_prefill_as_card(synth_model):
    # a 32-token prefill chunk streams every host expert to the card: all its calls are card-served;
    # the decode steps after it run host experts on the host
    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    eng = Engine(load_model(path, place="cpu-moe"), n_slots=1, max_context=64, ubatch=32, min_chunk=32)
    seq = eng.add(prompt(2)[:33].tolist(), SamplingParams(temperature=0.0))
    eng.prefill(seq)
    routed = 32 * SHAPE["n_experts_used"] * SHAPE["n_layers"]
    assert eng.card_calls == eng.routed_calls == routed
    eng.decode([seq])
    assert eng.card_calls == routed and eng.routed_calls == routed + SHAPE["n_experts_used"] * SHAPE["n_layers"]


def test_random_placements_match_card(model_file):
    path, tokens, reference, keep = model_file
    rng = np.random.default_rng(5)
    L, E = SHAPE["n_layers"], SHAPE["n_experts"]
    for _ in range(3):
        mask = rng.random((L, E)) < 0.5
        mask[0] = True  # one layer all on card, the others mixed or empty
        assert_matches(path, Fixed(tuple(map(tuple, mask.tolist()))), tokens, reference, keep)


# 8-bit activations: where the host's f32 sum order differs from the card's by one ulp next to
# a rounding boundary, one activation moves by a whole rounding step (max|x| / 127 of its block)
# and that position's logits move by up to a few 1e-2 x std (measured: at most 4.8e-2 on these
# files; a wrong expert or block moves them by ~1 std). Every other position must match as
# tightly as the f32 comparison, and the flips may not change any top-1 token.
Q8_FLIP_TOL = 0.1
Q8_MIN_EXACT = 0.8  # share of compared positions within the f32 bound (measured 0.875-1.0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M", "Q5_K"])
def test_q8_host_activations_match_ggml_rounding_card(synth_model, qtype):
    """Host experts with 8-bit activations (the default) against a card that rounds activations
    the same way (llama.cpp's CPU backend rule, ``act_rounding="ggml-cpu"``)."""
    path, _ = synth_model(qtype=qtype, seed=11, **SHAPE)
    tokens = prompt()
    reference = sequence_logits(load_model(path), tokens, ubatch=16, act_rounding="ggml-cpu")
    keep = compared_positions(path, tokens)
    std = reference[keep].std()
    for place in ("cpu-moe", "n-cpu-moe=2"):
        model = load_model(path, place=place, host_act="q8")
        ours = sequence_logits(model, tokens, ubatch=16, act_rounding="ggml-cpu")
        err = np.abs(ours - reference)[keep].max(axis=1)  # [positions]
        exact = float(np.mean(err <= TOL * std))
        print(f"{qtype} {place} (q8): {exact:.2%} of positions within {TOL} std, worst {err.max() / std:.3g} std")
        assert exact >= Q8_MIN_EXACT
        assert err.max() <= Q8_FLIP_TOL * std
        np.testing.assert_array_equal(ours[keep].argmax(-1), reference[keep].argmax(-1))


def greedy_tokens(model, ids: list[int], n_new: int, n_slots: int = 2, max_context: int = 64) -> list[int]:
    """The first ``n_new`` greedy tokens after ``ids`` (the prompt's last chunk samples the first)."""
    eng = Engine(model, n_slots=n_slots, max_context=max_context, ubatch=16, min_chunk=16)
    seq = eng.add(ids, SamplingParams(temperature=0.0))
    out = []
    while seq.pending > 1:
        sampled = eng.prefill(seq)
        if sampled is not None:
            out.append(sampled.token)
    while len(out) < n_new:
        out.append(eng.decode([seq])[0].token)
    return out


def test_greedy_tokens_same_as_card(synth_model):
    path, _ = synth_model(qtype="Q4_K_M", seed=11, **SHAPE)
    ids = prompt(1)[:20].tolist()
    assert greedy_tokens(load_model(path, place="n-cpu-moe=2"), ids, 12) == greedy_tokens(load_model(path), ids, 12)


def test_slot_permutation_does_not_recompile(synth_model):
    """Moving card experts between slots changes data only: same logits, no new compilation."""
    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    model = load_model(path, place="last-cpu-moe=1")
    tokens, pos = prompt()[None, :16], np.arange(16)[None]
    fwd = qwen3moe.jit_forward
    ref, _, _ = fwd(model.params, model.cfg, tokens, pos, model.init_cache(1, 16), model.placement)
    n_compiled = fwd._cache_size()
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]  # committed like the loader's arrays: jit keys committed and uncommitted apart
    params = dict(model.params)
    slot_of = np.asarray(model.placement.slot_of).copy()
    for layer in range(SHAPE["n_layers"]):
        card = np.flatnonzero(slot_of[layer] >= 0)
        if card.size == 0:
            continue
        perm = rng.permutation(card.size)  # new slot of the expert now in slot s: perm[s]
        for which in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{which}_exps.weight"
            q = params[name]
            data = np.asarray(q.data)
            moved = np.empty_like(data)
            moved[perm] = data
            params[name] = dataclasses.replace(q, data=jax.device_put(moved, dev))
        slot_of[layer, card] = perm[slot_of[layer, card]]
    placement = Placement(jax.device_put(slot_of, dev), model.placement.host)
    got, _, _ = fwd(params, model.cfg, tokens, pos, model.init_cache(1, 16), placement)
    assert fwd._cache_size() == n_compiled
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_slot_table():
    on_card = np.array([[True, False, True, True], [False] * 4])
    np.testing.assert_array_equal(slot_table(on_card), [[0, -1, 1, 2], [-1, -1, -1, -1]])


def test_bad_rule_is_a_config_error(tiny_model):
    with pytest.raises(ConfigError):
        load_model(tiny_model, place="n-cpu-moe=x")


def test_host_call_only_when_a_pair_is_on_the_host(synth_model):
    """One token whose chosen experts are all on the card makes no host call (the step skips the
    round trip), with the all-card logits; moving one chosen expert of one layer to the host
    makes exactly that layer's call."""
    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    tok, pos = prompt()[None, :1], np.arange(1)[None]
    card = load_model(path)
    ref, _, routing = qwen3moe.forward(card.params, card.cfg, tok, pos, card.init_cache(1, 1))
    chosen = np.asarray(routing.experts)[:, 0, 0]  # [L, k]
    mask = np.zeros((SHAPE["n_layers"], SHAPE["n_experts"]), bool)
    for layer, ex in enumerate(chosen):
        mask[layer, ex] = True  # only the chosen experts on the card
    calls = []
    for m in (mask, np.where(np.arange(SHAPE["n_layers"])[:, None] == 1, mask & (np.arange(SHAPE["n_experts"]) != chosen[1, 0]), mask)):
        model = load_model(path, place=Fixed(tuple(map(tuple, m.tolist()))), host_act="f32")
        got, _, _ = qwen3moe.forward(model.params, model.cfg, tok, pos, model.init_cache(1, 1), model.placement)
        assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= TOL * np.asarray(ref).std()
        calls.append(model.placement.host.stats.calls)
    assert calls == [0, 1]
