"""Bit gates of the engine on a synthetic qwen3moe F32 model (CPU, f32).

1. A batched prefill leaves the same cache and logits as feeding one token per step.
2. A sequence decoded beside others gives the same greedy tokens (and log-probabilities) as decoded
   alone, although alone its batch takes the greedy sampler plan and beside sampling rows the full one.
3. Rollback then re-decode equals never having decoded.
4. A decode step's outputs keep their device addresses from step to step (each step donates the
   previous one's), without compiling anything again.
5. Decode blocks launched ahead (before the previous block's tokens are read) give the tokens and
   state of blocks launched after each read, and one that is not taken leaves no trace.

One engine (4 slots, ubatch 16) is shared by the module: it compiles the prefill chunk 16 and
the decode buckets 2 and 4 once.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bloomery_jax.engine.engine import Engine
from bloomery_jax.engine.sampling import Plan, SamplingParams
from bloomery_jax.models.loader import load_model

SHAPE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, n_experts_used=2,
             expert_ff=64, n_vocab=512)
S = 48  # positions per slot
GREEDY = SamplingParams(temperature=0.0)
# a greedy row, a seeded top-k row with logprobs, a seeded top-p row with a repetition penalty
SETTINGS = [GREEDY, SamplingParams(temperature=0.8, top_k=40, seed=5, n_probs=3),
            SamplingParams(temperature=1.1, top_p=0.9, seed=9, repetition_penalty=1.1)]


@pytest.fixture(scope="module")
def engine(synth_model):
    model = load_model(synth_model(seed=3, **SHAPE)[0])
    eng = Engine(model, n_slots=4, max_context=S, ubatch=16, min_chunk=16)
    assert eng.buckets == [2, 4] and eng.chunks == [16]
    return eng


@pytest.fixture
def fresh(engine):
    """The shared engine with no live sequences before and after the test."""
    for s in list(engine.live):
        engine.release(s)
    yield engine
    for s in list(engine.live):
        engine.release(s)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, SHAPE["n_vocab"], n).tolist()


def run_prefill(eng, seq):
    out = None
    while seq.pending > 1:
        out = eng.prefill(seq)
    return out


def slot_kv(eng, slot: int, n: int):
    return np.asarray(eng.cache.k)[:, slot, :n], np.asarray(eng.cache.v)[:, slot, :n]


def rel_err(a, b) -> float:
    """max |a - b| relative to the reference's largest magnitude."""
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_batched_prefill_equals_one_token_per_step(fresh):
    eng = fresh
    T = 13  # one chunk of 16 with 3 padding tokens
    toks = prompt(1, T)
    # (a) the prompt as one prefill chunk in slot 0; the step's logits at every position come
    # from re-running the same chunk with a different sampled index (the writes are identical).
    a = eng.add(toks, GREEDY)
    chunk = np.zeros((1, 16), np.int32)
    chunk[0, :T] = toks
    pos = np.full((1, 16), S, np.int32)
    pos[0, :T] = np.arange(T)
    chunk_logits = []
    for last in range(T):
        eng.cache, eng.sampler, _, lg, _ = eng.steps.prefill(eng.params, eng.cache, eng.sampler, None, chunk, pos,
                                                             np.int32(a.slot), np.int32(last), np.bool_(False))
        chunk_logits.append(np.asarray(lg)[0])
    # (b) the same prompt fed one token per decode step (bucket 2) in slot 1, beside slot 0
    b = eng.add(toks, GREEDY)
    step_logits = []
    for t in range(T):
        tk, ps = np.zeros(2, np.int32), np.full(2, S, np.int32)
        tk[b.slot], ps[b.slot] = toks[t], t
        eng.cache, eng.sampler, _, lg, _ = eng.steps.decode(eng.params, eng.cache, eng.sampler, None, tk, ps,
                                                            np.zeros(2, bool))
        step_logits.append(np.asarray(lg)[b.slot])
    assert eng.slot_lengths()[:2].tolist() == [T, T]
    ka, va = slot_kv(eng, a.slot, T)
    kb, vb = slot_kv(eng, b.slot, T)
    # Layer 0's keys/values come from per-token matmuls of >= 2 rows, which XLA:CPU sums in the
    # same order for any row count: bit for bit.
    assert np.array_equal(ka[0], kb[0]) and np.array_equal(va[0], vb[0])
    # Past the first attention XLA:CPU fuses the [T, S] score/softmax/value reductions
    # differently for T = 16 and T = 1 (measured: the isolated einsums and softmax of
    # ops/attention.py differ in the last bit between those shapes), so the rest is gated
    # at 1e-6 relative to each tensor's largest magnitude.
    assert rel_err(ka, kb) <= 1e-6 and rel_err(va, vb) <= 1e-6
    la, lb = np.stack(chunk_logits), np.stack(step_logits)
    assert rel_err(la, lb) <= 1e-6, rel_err(la, lb)
    assert np.array_equal(la.argmax(1), lb.argmax(1))


def test_chunked_prefill_through_the_engine_matches_stepwise_tokens(fresh):
    # A 37-token prompt in chunks of 16, 16, 5 gives the same greedy continuation as the prompt
    # fed token by token (each step's sampled token replaced by the next prompt token).
    eng = fresh
    toks = prompt(2, 37)
    a = eng.add(toks, GREEDY)
    first = run_prefill(eng, a)
    ref = [first.token] + [eng.decode([a])[0].token for _ in range(5)]
    b = eng.add(toks[:1], GREEDY)  # a one-token prompt goes straight to decode
    for t in range(1, 37):  # feed toks[t-1], replace its greedy sample by toks[t]
        eng.decode([b])
        b.tokens[-1] = toks[t]
    got = [eng.decode([b])[0].token for _ in range(6)]
    assert got == ref


def test_decoded_beside_others_equals_alone(fresh):
    eng = fresh
    toks = prompt(3, 20)
    alone = eng.add(toks, GREEDY)
    run_prefill(eng, alone)
    # bucket 2: one live row and one padding row; a greedy batch takes the greedy plan (argmax alone)
    alone_out = [eng.decode([alone])[0] for _ in range(8)]
    assert (2, Plan(draw=False, n_top=0)) in eng.steps._spare
    eng.release(alone)
    # Beside three others (one greedy, two sampling, different lengths) in bucket 4.
    others = [eng.add(prompt(10 + i, n), SamplingParams(temperature=t, seed=i, top_p=0.9))
              for i, (n, t) in enumerate([(5, 1.0), (30, 0.0), (9, 0.7)])]
    for o in others:
        run_prefill(eng, o)
    seq = eng.add(toks, GREEDY)
    run_prefill(eng, seq)
    beside_out = [eng.decode(others + [seq])[-1] for _ in range(8)]  # the full plan: two rows sample
    assert (4, eng.steps.full) in eng.steps._spare
    assert [x.token for x in beside_out] == [x.token for x in alone_out]
    np.testing.assert_allclose([x.logprob for x in beside_out], [x.logprob for x in alone_out], rtol=1e-6, atol=1e-6)


def test_cold_plans_take_the_full_sampler(fresh):
    # a plan marked cold (the server's greedy plan before its idle compile) is never picked
    eng = fresh
    seq = eng.add(prompt(6, 5), GREEDY)
    greedy = Plan(draw=False, n_top=0)
    assert eng.sampler_plan([seq]) == greedy
    eng.cold_plans = {greedy}
    try:
        assert eng.sampler_plan([seq]) == eng.steps.full
    finally:
        eng.cold_plans = set()


def test_rollback_then_redecode_equals_never_decoded(fresh):
    eng = fresh
    for params in (GREEDY, SamplingParams(temperature=0.9, top_k=20, seed=77, repetition_penalty=1.2,
                                          frequency_penalty=0.3)):
        seq = eng.add(prompt(4, 12), params)
        run_prefill(eng, seq)
        for _ in range(10):
            eng.decode([seq])
        want_tokens = list(seq.tokens)
        n = len(seq.tokens) - 1  # positions with keys/values
        want_k, want_v = slot_kv(eng, seq.slot, n)
        eng.rollback(seq, 15)  # keep the prompt and 3 generated tokens
        assert eng.slot_lengths()[seq.slot] == 14 and seq.pending == 1
        while len(seq.tokens) < len(want_tokens):
            eng.decode([seq])
        assert seq.tokens == want_tokens
        k, v = slot_kv(eng, seq.slot, n)
        assert np.array_equal(k, want_k) and np.array_equal(v, want_v)  # same step shapes: bit for bit
        eng.release(seq)


def test_release_keeps_slots_dense_and_moved_sequence_intact(fresh):
    eng = fresh
    seqs = [eng.add(prompt(20 + i, 6 + i), GREEDY) for i in range(3)]
    for s in seqs:
        run_prefill(eng, s)
    ref = [list(s.tokens) for s in seqs]
    for _ in range(4):
        eng.decode(seqs)
    cont = list(seqs[2].tokens)
    eng.release(seqs[0])  # seqs[2] moves from slot 2 into slot 0
    assert seqs[2].slot == 0 and seqs[1].slot == 1 and len(eng.live) == 2
    eng.rollback(seqs[2], len(ref[2]))  # back to right after its prefill, then decode again
    for _ in range(4):
        eng.decode([seqs[1], seqs[2]])
    assert seqs[2].tokens[: len(cont)] == cont


def test_decode_outputs_keep_their_addresses(fresh):
    """The CUDA-graph reason (engine/steps.py): outputs that move make XLA re-record the nodes that
    write them. Every output buffer of a bucket-2 decode step is the previous step's, and no step
    compiles again. (Steps called directly: on the CPU, reading an output on the host maps its
    buffer into NumPy, and a mapped buffer cannot be donated, so the engine's own steps move the
    four small SampleOut buffers here; a GPU read copies. The gates above run through the
    donating steps too, so their values are checked there.)"""
    from bloomery_jax.engine.steps import _decode

    eng = fresh
    seq = eng.add(prompt(5, 9), GREEDY)
    run_prefill(eng, seq)
    tokens, positions = np.array([seq.tokens[-1], 0], np.int32), np.array([seq.n_cached, S], np.int32)
    active = np.array([True, False])
    addresses = []
    for i in range(4):
        eng.cache, eng.sampler, *_ = eng.steps.decode(eng.params, eng.cache, eng.sampler, None, tokens,
                                                      positions + i, active)
        addresses.append([x.unsafe_buffer_pointer() for x in jax.tree.leaves(eng.steps._spare[(2, eng.steps.full)])])
        if i == 0:
            compiled = _decode._cache_size()
    assert len(addresses[0]) >= 5 and all(a == addresses[0] for a in addresses[1:]), addresses
    assert _decode._cache_size() == compiled
    eng.rollback(seq, len(seq.tokens))  # the slot's length back to what the engine knows


def test_decode_block_equals_single_steps(fresh):
    """n decode steps in one call (a scan on the device, each step's token fed to the next) give
    the tokens, log-probabilities, cache and sampler state of n decode calls: greedy and sampled
    rows beside a padding row (bucket 4, three live)."""
    eng = fresh

    def run(block: int):
        seqs = [eng.add(prompt(40 + i, 7 + 3 * i), p) for i, p in enumerate(SETTINGS)]
        for s in seqs:
            run_prefill(eng, s)
        steps = []
        for _ in range(6 // block):
            steps += eng.decode_block(seqs, block) if block > 1 else [eng.decode(seqs)]
        state = _engine_state(eng, seqs)
        for s in seqs:
            eng.release(s)
        return steps, state

    single, (tokens1, kv1, sampler1, lengths1) = run(1)
    for block in (3, 6):
        steps, (tokens, kv, sampler, lengths) = run(block)
        assert tokens == tokens1 and np.array_equal(lengths, lengths1)
        assert [[x.token for x in step] for step in steps] == [[x.token for x in step] for step in single]
        for step, want in zip(steps, single):
            for got, ref in zip(step, want):
                np.testing.assert_allclose(got.logprob, ref.logprob, rtol=1e-6, atol=1e-6)
                assert [i for i, _ in got.top] == [i for i, _ in ref.top]
        for (k, v), (k1, v1) in zip(kv, kv1):
            np.testing.assert_allclose(k, k1, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(v, v1, rtol=1e-6, atol=1e-6)
        for got, ref in zip(sampler, sampler1):
            np.testing.assert_array_equal(got, ref)  # counts, step indices: integers


def _engine_state(eng, seqs):
    return ([list(s.tokens) for s in seqs], [slot_kv(eng, s.slot, s.n_cached) for s in seqs],
            jax.device_get(eng.sampler), eng.slot_lengths().copy())


def _assert_same_state(got, want):
    tokens, kv, sampler, lengths = got
    assert tokens == want[0] and np.array_equal(lengths, want[3])
    for (k, v), (k1, v1) in zip(kv, want[1]):
        np.testing.assert_array_equal(k, k1)
        np.testing.assert_array_equal(v, v1)
    for a, b in zip(sampler, want[2]):
        np.testing.assert_array_equal(a, b)  # counts, step indices


def test_lookahead_blocks_equal_blocks_read_in_turn(fresh):
    """Each block launched before the previous one's tokens are read, fed its tokens on the
    device: the same tokens, log-probabilities, cache and sampler state as blocks launched after
    each read, nothing compiled again, and every ahead block taken by the next call."""
    from bloomery_jax.engine.steps import _decode_block

    eng = fresh

    def run(ahead: bool):
        seqs = [eng.add(prompt(40 + i, 7 + 3 * i), p) for i, p in enumerate(SETTINGS)]
        for s in seqs:
            run_prefill(eng, s)
        steps, pending = [], []
        for i in range(3):
            steps += eng.decode_block(seqs, 3, ahead=ahead and i < 2)
            pending.append(eng._ahead is not None)
        state = _engine_state(eng, seqs)
        for s in seqs:
            eng.release(s)
        return steps, state, pending

    want_steps, want, pending = run(False)
    assert pending == [False] * 3
    compiled = _decode_block._cache_size()
    steps, got, pending = run(True)
    assert pending == [True, True, False]
    assert _decode_block._cache_size() == compiled, "the token fed on the device compiled the block again"
    _assert_same_state(got, want)
    for step, ref in zip(steps, want_steps):
        assert [(x.token, x.logprob, x.top) for x in step] == [(x.token, x.logprob, x.top) for x in ref]


@pytest.mark.parametrize("then", ["decode", "rollback", "release", "other block"])
def test_dropped_lookahead_block_leaves_no_trace(fresh, then):
    """A block launched ahead that the next call does not take (a single step, a rollback, a
    release, a block of another length) is dropped: the sequences go on as if it had never run,
    the random streams of sampled rows included."""
    eng = fresh

    def run(ahead: bool):
        seqs = [eng.add(prompt(50 + i, 6 + 2 * i), p) for i, p in enumerate(SETTINGS)]
        for s in seqs:
            run_prefill(eng, s)
        eng.decode_block(seqs, 3, ahead=ahead)
        assert (eng._ahead is not None) == ahead
        if then == "decode":
            eng.decode(seqs)
        elif then == "rollback":
            eng.rollback(seqs[1], len(seqs[1].tokens) - 2)
            eng.decode([seqs[1]])
            eng.decode(seqs)
        elif then == "release":
            eng.release(seqs.pop(0))
        for _ in range(2):
            eng.decode_block(seqs, 2 if then == "other block" else 3)
        state = _engine_state(eng, seqs)
        for s in seqs:
            eng.release(s)
        return state

    _assert_same_state(run(True), run(False))


def test_decode_block_needs_room_for_every_step(fresh):
    eng = fresh
    from bloomery_jax.errors import ConfigError

    seq = eng.add(prompt(6, S - 4), GREEDY)
    run_prefill(eng, seq)  # the prompt cached, its sampled token pending: room for 4 more positions
    assert seq.n_cached == S - 4 and seq.pending == 1
    with pytest.raises(ConfigError, match="no room for 5 more"):
        eng.decode_block([seq], 5)
    assert [len(step) for step in eng.decode_block([seq], 4)] == [1] * 4 and seq.n_cached == S
