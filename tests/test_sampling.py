"""On-device sampler against a float64 NumPy reference of each rule, plus reproducibility.

Tolerances: the sampler runs in f32, the reference in f64. Processed logits agree to 1e-5
relative (a few f32 roundings of values of size ~10); probabilities to 2e-6 absolute (f32 exp and
sum over V = 64). Keep/drop decisions must agree exactly, so the random cases are drawn away
from the top-p and min-p boundaries (a margin of 1e-4, far above f32 cumsum error ~1e-7).
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax.engine import sampling as S
from bloomery_jax.errors import ConfigError

V = 64
B = 8
_probs = jax.jit(S.sampling_probs, static_argnames="search")
_processed = jax.jit(S.processed_logits)
_sample = jax.jit(S.sample, static_argnames=("n_top", "draw"))


def ref_processed(logits, p: S.SamplingParams, prompt, generated):
    x = logits.astype(np.float64).copy()
    for t, b in p.logit_bias.items():
        x[t] += b
    c = np.bincount(np.asarray(generated, int), minlength=V).astype(np.float64)
    seen = np.zeros(V, bool)
    seen[list(prompt)] = True
    hit = seen | (c > 0)
    r = p.repetition_penalty
    x = np.where(hit, np.where(x > 0, x / r, x * r), x)
    return x - p.presence_penalty * (c > 0) - p.frequency_penalty * c


def ref_probs(logits, p: S.SamplingParams, prompt=(), generated=()):
    """(probabilities [V], smallest distance of any keep decision from its boundary)."""
    x = ref_processed(logits, p, prompt, generated)
    if p.temperature <= 0:
        out = np.zeros(V)
        out[np.argmax(x)] = 1.0
        return out, np.inf
    order = np.argsort(-x, kind="stable")
    s = x[order]
    rank = np.arange(V)
    keep = np.ones(V, bool) if p.top_k <= 0 else rank < p.top_k
    e = np.where(keep, np.exp(s - s[0]), 0.0)
    q = e / e.sum()
    before = np.cumsum(q) - q
    margin = np.inf
    if p.top_p < 1:
        margin = min(margin, np.min(np.abs(before[keep][1:] - p.top_p), initial=np.inf))
    keep &= (p.top_p >= 1) | (before < p.top_p) | (rank == 0)
    if p.min_p > 0:
        margin = min(margin, np.min(np.abs(s[keep][1:] - s[0] - np.log(p.min_p)), initial=np.inf))
        keep &= (s - s[0] >= np.log(p.min_p)) | (rank == 0)
    z = np.where(keep, s / p.temperature, -np.inf)
    w = np.exp(z - z.max())
    out = np.zeros(V)
    out[order] = w / w.sum()
    return out, margin


def rows_of(cases):
    return S.make_rows([S.row_arrays(p, V, pr, gen) for p, pr, gen in cases])


def random_cases(rng, make_params, n=B, margin=1e-4):
    """n (logits, params, prompt, generated) cases whose keep decisions are margin away from boundaries."""
    cases = []
    while len(cases) < n:
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        p = make_params(rng)
        prompt = rng.integers(0, V, rng.integers(0, 10)).tolist()
        gen = rng.integers(0, V, rng.integers(0, 10)).tolist()
        if ref_probs(logits, p, prompt, gen)[1] > margin:
            cases.append((logits, p, prompt, gen))
    return cases


def check_probs(cases, search):
    logits = jnp.asarray(np.stack([c[0] for c in cases]))
    rows = rows_of([c[1:] for c in cases])
    got = np.asarray(_probs(logits, rows, search=search))
    for b, (lg, p, pr, gen) in enumerate(cases):
        want, _ = ref_probs(lg, p, pr, gen)
        np.testing.assert_allclose(got[b], want, rtol=0, atol=2e-6, err_msg=f"row {b}: {p}")
        # exact support: a dropped token is exactly 0, a kept one is > 0 unless its probability
        # is below f32's range (1e-30: exp underflows for logit gaps > ~88 at low temperature)
        assert (got[b][want == 0] == 0).all(), f"row {b}: a dropped token has mass ({p})"
        assert (got[b][want > 1e-30] > 0).all(), f"row {b}: a kept token has no mass ({p})"


RULES = {
    "temperature": lambda r: S.SamplingParams(temperature=float(r.uniform(0.2, 2.0))),
    "top_k": lambda r: S.SamplingParams(temperature=1.0, top_k=int(r.integers(0, 12))),
    "top_p": lambda r: S.SamplingParams(temperature=0.8, top_p=float(r.uniform(0.05, 1.0))),
    "min_p": lambda r: S.SamplingParams(temperature=1.3, min_p=float(r.uniform(0.0, 0.6))),
    "penalties": lambda r: S.SamplingParams(
        temperature=1.0, repetition_penalty=float(r.uniform(0.5, 2.0)),
        presence_penalty=float(r.uniform(-1, 1)), frequency_penalty=float(r.uniform(-1, 1))),
    "logit_bias": lambda r: S.SamplingParams(
        temperature=1.0, logit_bias={int(t): float(r.uniform(-5, 5)) for t in r.integers(0, V, 5)}
        | {int(r.integers(0, V)): -np.inf}),
    "greedy": lambda r: S.SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),
    "all": lambda r: S.SamplingParams(
        temperature=float(r.uniform(0.3, 1.5)), top_k=int(r.integers(0, 20)), top_p=float(r.uniform(0.3, 1)),
        min_p=float(r.uniform(0, 0.2)), repetition_penalty=float(r.uniform(0.8, 1.3)),
        presence_penalty=float(r.uniform(0, 0.5)), frequency_penalty=float(r.uniform(0, 0.5)),
        logit_bias={int(r.integers(0, V)): 2.0}),
}


@pytest.mark.parametrize("search", [False, True], ids=["sort", "search"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_matches_reference(rule, search):
    rng = np.random.default_rng(zlib.crc32(rule.encode()))
    check_probs(random_cases(rng, RULES[rule]), search)


def test_processed_logits_match_reference():
    rng = np.random.default_rng(1)
    cases = random_cases(rng, RULES["all"])
    logits = jnp.asarray(np.stack([c[0] for c in cases]))
    got = np.asarray(_processed(logits, rows_of([c[1:] for c in cases])))
    for b, (lg, p, pr, gen) in enumerate(cases):
        np.testing.assert_allclose(got[b], ref_processed(lg, p, pr, gen), rtol=1e-5, atol=1e-6)


def test_greedy_takes_lowest_id_among_ties():
    logits = np.zeros((B, V), np.float32)
    logits[:, 7] = logits[:, 3] = 2.0
    rows = rows_of([(S.SamplingParams(temperature=0.0), (), ())] * B)
    assert np.asarray(_sample(jnp.asarray(logits), rows, n_top=0).token).tolist() == [3] * B


def test_draws_follow_the_distribution():
    # M rows with one seed and steps 0..M-1 are M independent draws; each token's frequency
    # must lie within 5 binomial standard deviations (+1/M for rounding) of its probability.
    M = 4000
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal(V) * 1.5).astype(np.float32)
    p = S.SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=1234)
    base = S.row_arrays(p, V)
    rows = S.make_rows([base | {"step": np.int32(i)} for i in range(M)])
    tok = np.asarray(jax.jit(S.sample_tokens)(jnp.asarray(np.tile(logits, (M, 1))), rows))
    want, _ = ref_probs(logits, p)
    freq = np.bincount(tok, minlength=V) / M
    assert (freq[want == 0] == 0).all(), "drew a filtered-out token"
    bound = 5 * np.sqrt(want * (1 - want) / M) + 1 / M
    assert (np.abs(freq - want) <= bound).all(), np.max(np.abs(freq - want) - bound)


def test_seed_reproducible_and_batch_independent():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    cases = [(S.SamplingParams(temperature=1.0, top_p=0.95, seed=10 + b, n_probs=3), (), ()) for b in range(B)]
    batch = _sample(jnp.asarray(logits), rows_of(cases), n_top=4)
    again = _sample(jnp.asarray(logits), rows_of(cases), n_top=4)
    assert np.array_equal(batch.token, again.token)
    # the same seed drawn alone, or inside a batch of other rows, gives the same outputs
    for b in (0, 5):
        alone = _sample(jnp.asarray(logits[b : b + 1]), rows_of([cases[b]]), n_top=4)
        assert int(alone.token[0]) == int(batch.token[b])
        assert np.array_equal(alone.top_ids[0], batch.top_ids[b])
        assert np.array_equal(alone.logprob[0], batch.logprob[b])
    # different seeds give different streams: over 64 steps of a flat distribution, not all equal
    flat = jnp.zeros((64, V))
    seqs = []
    for seed in (1, 2):
        r = S.make_rows([S.row_arrays(S.SamplingParams(seed=seed), V) | {"step": np.int32(i)} for i in range(64)])
        seqs.append(np.asarray(jax.jit(S.sample_tokens)(flat, r)))
    assert not np.array_equal(seqs[0], seqs[1])


def test_greedy_rows_unchanged_by_sampling_rows_beside_them():
    # An all-greedy batch takes the cheap branch; a mixed batch the full one. Same greedy tokens.
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32))
    greedy = [(S.SamplingParams(temperature=0.0), (), ())] * B
    mixed = [greedy[0] if b % 2 == 0 else (S.SamplingParams(temperature=1.0, seed=b), (), ()) for b in range(B)]
    a = np.asarray(_sample(logits, rows_of(greedy), n_top=0).token)
    m = np.asarray(_sample(logits, rows_of(mixed), n_top=0).token)
    assert np.array_equal(a[::2], m[::2])
    assert np.array_equal(a, np.argmax(np.asarray(logits), axis=1))


def test_greedy_plan_takes_the_full_plans_tokens():
    """The greedy plan (argmax alone) against the full sampler, with bias and penalties in play:
    the same tokens and the same chosen logprobs, no top-n report."""
    rng = np.random.default_rng(6)
    raw = rng.standard_normal((B, V)).astype(np.float32) * 2
    logits, top = jnp.asarray(raw), np.argmax(raw, axis=1)
    # each row's raw argmax loses: banned, penalised as a prompt token (and generated), or outbid
    cases = [(S.SamplingParams(temperature=0.0, logit_bias={int(top[b]): -np.inf}), (), ()) if b % 3 == 0 else
             (S.SamplingParams(temperature=0.0, repetition_penalty=4.0, presence_penalty=2.0),
              [int(top[b])], [int(top[b])]) if b % 3 == 1 else
             (S.SamplingParams(temperature=0.0, logit_bias={(int(top[b]) + 1) % V: 10.0}), (), ())
             for b in range(B)]
    full = _sample(logits, rows_of(cases), n_top=4)
    assert not np.any(np.asarray(full.token) == top)
    greedy = _sample(logits, rows_of(cases), n_top=0, draw=False)
    assert np.array_equal(greedy.token, full.token)
    assert np.array_equal(greedy.logprob, full.logprob)
    assert greedy.top_ids.shape == (B, 0) and greedy.top_logprobs.shape == (B, 0)
    x = np.stack([ref_processed(np.asarray(logits)[b], *cases[b]) for b in range(B)])
    assert np.array_equal(greedy.token, np.argmax(x, axis=1))


@pytest.mark.parametrize("settings, greedy", [
    ([dict(temperature=0.0)] * 3, True),
    ([dict(temperature=0.0), dict(temperature=0.0, top_k=5, top_p=0.5)], True),  # cuts unused when greedy
    ([dict(temperature=0.0), dict(temperature=0.7)], False),
    ([dict(temperature=0.0, n_probs=1)], False),  # a top-n report needs the full plan
])
def test_plan_for_a_batch(settings, greedy):
    plan = S.plan_for([S.SamplingParams(**k) for k in settings], n_top=20)
    assert plan == (S.Plan(draw=False, n_top=0) if greedy else S.Plan(draw=True, n_top=20))


@pytest.mark.parametrize("greedy_rows", [B, B // 2])
def test_branch_free_sampler_draws_the_same_tokens(greedy_rows):
    # The GPU's sampler (no conditional) against the branching one, all-greedy and mixed batches.
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32))
    cases = [(S.SamplingParams(temperature=0.0 if b < greedy_rows else 0.8, top_k=40, top_p=0.9, seed=b), (), ())
             for b in range(B)]
    rows = rows_of(cases)
    fn = jax.jit(S.sample_tokens, static_argnames="branch_free")
    assert np.array_equal(np.asarray(fn(logits, rows, branch_free=True)), np.asarray(fn(logits, rows, branch_free=False)))


def test_logprobs_report_raw_distribution():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    cases = [(S.SamplingParams(temperature=0.0, logit_bias={b: 50.0}), (), ()) for b in range(B)]
    out = _sample(jnp.asarray(logits), rows_of(cases), n_top=5)
    lp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
    assert np.asarray(out.token).tolist() == list(range(B))  # the bias chose the token...
    # ...but the reported logprobs are the model's own (atol 1e-5: f32 log_softmax of |x| < 15)
    np.testing.assert_allclose(out.logprob, lp[np.arange(B), np.arange(B)], atol=1e-5)
    order = np.argsort(-lp, axis=1, kind="stable")[:, :5]
    assert np.array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lp, order, 1), atol=1e-5)


def test_advance_counts_and_steps_only_active_rows():
    rows = rows_of([(S.SamplingParams(), (), (1, 1))] * 4)  # N = 4 state rows
    new = jax.jit(S.advance)(rows, jnp.array([1, 2], jnp.int32), jnp.array([True, False]))
    assert np.asarray(new.counts)[:, :3].tolist() == [[0, 3, 0], [0, 2, 0], [0, 2, 0], [0, 2, 0]]
    assert np.asarray(new.step).tolist() == [3, 2, 2, 2]


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=1.5), dict(min_p=-0.1),
    dict(repetition_penalty=0.0), dict(n_probs=21), dict(top_k=2.5), dict(logit_bias={V: 1.0}),
    dict(logit_bias={0: float("inf")}), dict(presence_penalty=float("inf")),
])
def test_impossible_values_raise(bad):
    with pytest.raises(ConfigError, match=next(iter(bad)).split("_")[0]):
        S.SamplingParams(**bad).validate(V)


@pytest.mark.parametrize("rows,vocab,k,tile", [(2, 1000, 20, 64), (1, 151936, 20, 512), (3, 300, 7, 16), (1, 50, 20, 512)])
def test_top_k_tree_is_lax_top_k(rows, vocab, k, tile):
    """Same values, indices and order as lax.top_k, ties included (values drawn from a few
    integers, so most of the top k tie; the lower index must come first)."""
    rng = np.random.default_rng(vocab)
    x = jnp.asarray(rng.integers(-3, 4, (rows, vocab)), jnp.float32)
    x = x.at[0, vocab - 1].set(9.0)  # the largest value in the last, padded tile
    got_v, got_i = S.top_k_tree(x, k, tile)
    want_v, want_i = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    assert got_i.dtype == jnp.int32 and int(got_i[0, 0]) == vocab - 1


_filtered = jax.jit(S.filtered_logits, static_argnames="search")


def midway_top_p(x: np.ndarray, top_k: int, rng) -> float:
    """A top-p halfway between two steps of the f64 mass before each rank of x (after top-k), so
    that both f32 forms decide every token the same way."""
    s = x[np.argsort(-x, kind="stable")].astype(np.float64)
    e = np.exp(s - s[0])
    if top_k > 0:
        e[top_k:] = 0
    steps = np.unique(np.cumsum(e / e.sum()))[:-1]
    i = rng.integers(0, len(steps) - 1) if len(steps) > 1 else 0
    return float((steps[i] + steps[i + 1]) / 2) if len(steps) > 1 else 1.0


@pytest.mark.parametrize("vocab", [64, 151936])
def test_search_keeps_the_sort_s_tokens_ties_included(vocab):
    """The sort-free cuts keep exactly the sort's tokens: logits drawn from a few values, so
    the cuts fall inside runs of equal logits, where the lower ids must be the ones kept."""
    rng = np.random.default_rng(vocab)
    n = 6
    x = rng.integers(-4, 3, (n, vocab)).astype(np.float32) * 0.5
    x[1, ::3] = -np.inf  # banned tokens (logit bias -inf)
    x[2, 5] = -0.0  # ties +0.0
    ks = [0, 1, 7, int(rng.integers(2, vocab)), vocab, vocab + 5]
    cases = []
    for b in range(n):
        ps = S.SamplingParams(temperature=0.7, top_k=ks[b], top_p=midway_top_p(x[b], ks[b], rng) if b % 2 else 1.0,
                              min_p=0.05 if b == 3 else 0.0)
        cases.append((ps, (), ()))
    rows = rows_of(cases)
    got = np.isfinite(np.asarray(_filtered(jnp.asarray(x), rows, search=True)))
    want = np.isfinite(np.asarray(_filtered(jnp.asarray(x), rows, search=False)))
    for b in range(n):
        assert np.array_equal(got[b], want[b]), (b, cases[b][0].top_k, cases[b][0].top_p, got[b].sum(), want[b].sum())
    assert 0 < want[2].sum() < vocab and want[3].sum() < vocab  # the cuts did cut


def test_search_draws_the_sort_s_tokens():
    rng = np.random.default_rng(6)
    cases = random_cases(rng, RULES["all"], n=B)
    logits = jnp.asarray(np.stack([c[0] for c in cases]))
    rows = rows_of([c[1:] for c in cases])
    fn = jax.jit(S.sample_tokens, static_argnames=("branch_free", "search"))
    for step in range(8):
        r = rows._replace(step=rows.step + step)
        assert np.array_equal(np.asarray(fn(logits, r, search=True)), np.asarray(fn(logits, r, search=False)))


def test_gpu_sampler_lowers_without_long_sorts_or_branches(monkeypatch):
    """What a CUDA graph can hold: the GPU's sampler (cuts by search, no branch, the top-20 by
    stages of 512) lowers for an H200 with no sort, no conditional and no top-k over a row longer
    than a stage. XLA makes a sort of a long row a cub custom call, which no graph node holds, and
    a conditional makes the host wait for the card: either keeps a decode block's loop on the host."""
    from triton_lowering import lowered_for_h200

    monkeypatch.setattr(S, "SEARCH_PLATFORMS", ("gpu", jax.default_backend()))
    monkeypatch.setattr(S, "BRANCH_FREE_PLATFORMS", ("gpu", jax.default_backend()))
    vocab = 151936
    rows = S.make_rows([S.row_arrays(S.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=b), vocab)
                        for b in range(4)])
    text = lowered_for_h200(S.sample, jax.ShapeDtypeStruct((4, vocab), jnp.float32), rows)
    for op in ("stablehlo.sort", "stablehlo.case", "stablehlo.if", "stablehlo.while", "custom_call"):
        assert op not in text, op
    widths = [int(m) for m in re.findall(r"chlo\.top_k\(%\w+, k = \d+\) : tensor<[\dx]*?(\d+)xf32>", text)]
    assert widths and max(widths) <= S.TOP_K_TILE, widths


def test_greedy_plan_lowers_to_a_few_reductions(monkeypatch):
    """The greedy plan on the GPU: no random bits, no top-k, and three reductions over the row
    (argmax, and log_softmax's max and sum) where the full plan launches dozens: most of the
    ~0.25 ms of an 8-layer decode token on the H100 (2026-12-05 trace) after the output head."""
    from triton_lowering import lowered_for_h200

    monkeypatch.setattr(S, "SEARCH_PLATFORMS", ("gpu", jax.default_backend()))
    monkeypatch.setattr(S, "BRANCH_FREE_PLATFORMS", ("gpu", jax.default_backend()))
    vocab = 151936
    rows = S.make_rows([S.row_arrays(S.SamplingParams(temperature=0.0), vocab)] * 4)
    logits = jax.ShapeDtypeStruct((4, vocab), jnp.float32)
    # reductions whose operand is a whole row (a gather's bounds check reduces a [4, 1, 1] too)
    reductions = lambda text: len(re.findall(rf"stablehlo\.reduce\(.*tensor<4x{vocab}x", text))  # noqa: E731
    greedy = lowered_for_h200(lambda x, r: S.sample(x, r, n_top=0, draw=False), logits, rows)
    full = lowered_for_h200(lambda x, r: S.sample(x, r, n_top=20), logits, rows)
    for op in ("threefry", "chlo.top_k"):
        assert op not in greedy and op in full, op
    # text, not launches: the full plan's digit search is one function called per digit
    assert reductions(greedy) == 3 < reductions(full), (reductions(greedy), reductions(full))
