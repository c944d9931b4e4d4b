"""pallas.route_topk (one kernel) against ops.routing.route_topk (softmax, top_k, gather)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_lowering import triton_kernels

from bloomery_jax.ops.norms import rms_norm
from bloomery_jax.ops.routing import route_topk as reference
from bloomery_jax.pallas.route import (route_topk, router_logits, router_logits_rounds, router_logits_routes,
                                       router_logits_serves)
from bloomery_jax.pallas.tickets import TICKETS


@pytest.mark.parametrize("N, E, k", [(1, 128, 8), (5, 128, 8), (37, 60, 4), (16, 8, 1), (3, 8, 8), (2, 6, 5)])
def test_matches_reference(N, E, k):
    rng = np.random.default_rng(N * 1000 + E + k)
    logits = (rng.standard_normal((N, E)) * 2).astype(np.float32)
    got = [np.asarray(a) for a in route_topk(jnp.asarray(logits), k, interpret=True)]
    ref = [np.asarray(a) for a in reference(jnp.asarray(logits), k)]
    assert got[0].dtype == np.int32 and got[0].shape == (N, k) and got[1].shape == (N, k) and got[2].shape == (N,)
    # the ranked logits are exact values, so the margins are equal bit for bit; where the k-th
    # and (k+1)-th logits are apart the chosen experts are the same, in the same order
    np.testing.assert_array_equal(got[2], ref[2])
    apart = ref[2] > 1e-5
    np.testing.assert_array_equal(got[0][apart], ref[0][apart])
    # weights: the same exponentials and quotient, summed in another order (a few ulps)
    np.testing.assert_allclose(got[1][apart], ref[1][apart], rtol=2e-6, atol=1e-8)


def test_equal_logits_rank_the_lower_id_first():
    """Whole-number logits tie often; jax.lax.top_k puts the lower id first, and so does the kernel."""
    rng = np.random.default_rng(3)
    logits = rng.integers(-3, 3, (24, 128)).astype(np.float32)
    got = route_topk(jnp.asarray(logits), 8, interpret=True)
    ref = reference(jnp.asarray(logits), 8)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=2e-6)
    assert (np.asarray(ref[2]) == 0).any()  # the test does exercise ties at the k-th place


@pytest.mark.parametrize("N, E, k, layer", [(1, 128, 8, 2), (21, 60, 4, 0), (3, 8, 8, 1)])
def test_card_route_is_the_placement_lookup(N, E, k, layer):
    """With a slot table the kernel returns, beside the same routing as without it, each pick's
    card slot (0 for a host expert) and its weight (0 for a host expert): the lookup
    ops.experts.placed_moe_swiglu makes otherwise."""
    rng = np.random.default_rng(N + E)
    logits = jnp.asarray((rng.standard_normal((N, E)) * 2).astype(np.float32))
    on_card = rng.random((3, E)) < 0.5
    table = np.where(on_card, rng.permutation(3 * E).reshape(3, E) % 97, -1).astype(np.int32)
    experts, weights, margin, card = route_topk(logits, k, jnp.asarray(table), layer, interpret=True)
    plain = route_topk(logits, k, interpret=True)
    for a, b in zip((experts, weights, margin), plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    slots = table[layer][np.asarray(experts)]  # [N, k]
    assert (slots < 0).any() and (slots >= 0).any()  # both kinds of pick occur
    np.testing.assert_array_equal(np.asarray(card.slots), np.maximum(slots, 0))
    np.testing.assert_array_equal(np.asarray(card.weights), np.where(slots >= 0, np.asarray(weights), 0.0))


def test_bad_slot_table_raises():
    with pytest.raises(ValueError, match="slot_table must be"):
        route_topk(jnp.zeros((1, 8)), 2, jnp.zeros((2, 6), jnp.int32), 0, interpret=True)
    with pytest.raises(ValueError, match="slot_table must be"):
        route_topk(jnp.zeros((1, 8)), 2, jnp.zeros((2, 8), jnp.int32), 2, interpret=True)


def test_bad_k_raises():
    with pytest.raises(ValueError, match="cannot route to 9 of 8"):
        route_topk(jnp.zeros((1, 8)), 9, interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("N", [1, 512])
def test_lowers_to_triton_for_h200(monkeypatch, N):
    """A verified Triton module for sm_90 at the Qwen3-30B-A3B router shape (128 experts, top 8)."""
    logits = jax.ShapeDtypeStruct((N, 128), jnp.float32)
    assert triton_kernels(monkeypatch, lambda x: route_topk(x, 8), logits) == [("route_topk", 90, True)]
    table = jax.ShapeDtypeStruct((48, 128), jnp.int32)  # with the placement lookup
    placed = triton_kernels(monkeypatch, lambda x, t: route_topk(x, 8, t, 47), logits, table)
    assert placed == [("route_topk", 90, True)]


@pytest.mark.parametrize("N, E, D, block_e, chunk", [(1, 128, 2048, 4, 256), (8, 128, 2048, 16, 256), (3, 60, 64, 8, 256),
                                                     (2, 8, 48, 4, 256), (1, 128, 2048, 4, 2048)])
def test_router_logits_match_the_norm_and_product(N, E, D, block_e, chunk):
    """Each logit within (D / chunk + chunk + 4) * 2^-24 * sum_d |h_d w_d| of rms_norm(x) @ w.T
    in float64 (h: the normed row; chunk: router_logits' D chunk, the largest power of two dividing
    D up to its ``chunk``; 2048: the whole row in one read); a logit of the wrong
    expert's row fails that bound."""
    rng = np.random.default_rng(N * 7 + E + D)
    x = jnp.asarray(rng.standard_normal((N, D)) * 3, jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 2, D), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, D)) * 0.02, jnp.float32)
    got = np.asarray(router_logits(x, norm, 1e-6, w, block_e=block_e, chunk=chunk, interpret=True), np.float64)
    h = np.asarray(rms_norm(x, norm, 1e-6), np.float64)  # [N, D], itself a few ulps from the kernel's
    wf = np.asarray(w, np.float64)
    ref, mag = h @ wf.T, np.abs(h) @ np.abs(wf).T
    chunk = min(chunk, D & -D)
    bound = (D // chunk + chunk + 4) * 2.0 ** -24 * mag
    assert got.shape == (N, E) and (np.abs(got - ref) <= bound).all()
    assert not (np.abs(got - h @ np.roll(wf, 1, axis=0).T) <= bound).all()


@pytest.mark.parametrize("N, E, D, block_e", [(1, 128, 2048, 4), (1, 16, 4096, 4), (3, 8, 512, 4), (2, 8, 96, 1)])
def test_router_logits_rounds_the_normed_rows(N, E, D, block_e):
    """rounded=True: the same logits, and the normed rows as Q8_1 blocks (by rounding programs
    after the logits', of 64 blocks, 64 twice, 16, and 1 three times here) that quantize_q8_1(rms_norm(x)) gives up to the normed row's
    last bits: the same scales but for an f16 ulp, every value within half a step of the normed row
    (the quants divide by the f32 scale, the values multiply the f16 one: up to 127 of its
    rounding errors more), the half-block sums those of the quants, at most 1% of the quants one
    step off."""
    from bloomery_jax.ops.actquant import q8_1_ints, quantize_q8_1

    rng = np.random.default_rng(N * 5 + E + D)
    x = jnp.asarray(rng.standard_normal((N, D)) * 3, jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 2, D), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, D)) * 0.02, jnp.float32)
    assert router_logits_rounds(x.shape, w)
    out = router_logits(x, norm, 1e-6, w, block_e=block_e, rounded=True, interpret=True)
    got = out.x8
    assert out.route is None and out.tickets is None
    np.testing.assert_array_equal(out.logits, router_logits(x, norm, 1e-6, w, block_e=block_e, interpret=True))
    h = rms_norm(x, norm, 1e-6)
    ref = quantize_q8_1(h)
    assert got.qs.shape == ref.qs.shape and got.d.shape == ref.d.shape and got.sums.shape == ref.sums.shape
    np.testing.assert_allclose(got.d, ref.d, rtol=2 ** -10)  # one f16 ulp
    d = np.repeat(np.asarray(got.d, np.float64), 32, axis=-1)  # [N, D]
    assert (np.abs(np.asarray(got.values(), np.float64) - np.asarray(h, np.float64)) <= d * (0.5 + 127 * 2.0 ** -11)).all()
    q, q_ref = np.asarray(q8_1_ints(got.qs)), np.asarray(q8_1_ints(ref.qs))  # [N, D/32, 32]
    np.testing.assert_array_equal(got.sums, q.reshape(N, -1, 16).sum(-1))
    assert np.abs(q - q_ref).max() <= 1 and np.mean(q != q_ref) <= 0.01


@pytest.mark.parametrize("N, E, k, block_e, placed", [(1, 128, 8, 4, False), (1, 128, 8, 4, True), (3, 16, 5, 4, True),
                                                      (8, 8, 8, 2, False)])
def test_router_logits_routes_in_its_last_program(N, E, k, block_e, placed):
    """route_k: the routing route_topk gives on the launch's logits, bit for bit (the same
    kernel code on the same logits), with the placement's card slots; the tickets come back at
    0, and a second launch on them routes again. (The tickets' memory order on a card is checked
    by scripts/route_fused_check.py, not here: the interpreter runs programs one by one.)"""
    from bloomery_jax.pallas.tickets import new_tickets

    rng = np.random.default_rng(N + E + k)
    D = 256
    x = jnp.asarray(rng.standard_normal((N, D)) * 3, jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 2, D), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, D)) * 0.05, jnp.float32)
    table = jnp.asarray(np.where(rng.random((3, E)) < 0.4, -1, rng.integers(0, E, (3, E))), jnp.int32) if placed else None
    kw = dict(slot_table=table, layer=2) if placed else {}
    assert router_logits_routes(N, w, k)
    tickets = new_tickets()
    for _ in range(2):
        out = router_logits(x, norm, 1e-6, w, route_k=k, tickets=tickets, block_e=block_e, **kw, interpret=True)
        assert not np.asarray(out.tickets).any()
        want = route_topk(out.logits, k, *((table, 2) if placed else ()), interpret=True)
        assert len(out.route) == len(want) == (4 if placed else 3)
        for got, exp in zip(jax.tree.leaves(out.route), jax.tree.leaves(want)):
            np.testing.assert_array_equal(got, exp)
        np.testing.assert_array_equal(out.logits, router_logits(x, norm, 1e-6, w, block_e=block_e, interpret=True))
        tickets = out.tickets


def test_router_logits_refuses_what_it_cannot_serve():
    w = jnp.zeros((128, 2048), jnp.float32)
    assert router_logits_serves(8, w) and not router_logits_serves(9, w)
    assert not router_logits_serves(1, w.astype(jnp.bfloat16)) and not router_logits_serves(1, w[:126])
    with pytest.raises(ValueError, match="router_logits: needs"):
        router_logits(jnp.zeros((9, 2048)), jnp.ones(2048), 1e-6, w, interpret=True)
    # rounded: rows of whole Q8_1 blocks
    assert router_logits_rounds((1, 2048), w) and not router_logits_rounds((9, 2048), w)
    assert router_logits_serves(1, w[:, :48]) and not router_logits_rounds((1, 48), w[:, :48])
    with pytest.raises(ValueError, match="rows of 48 are not Q8_1 blocks"):
        router_logits(jnp.ones((1, 48)), jnp.ones(48), 1e-6, w[:, :48], rounded=True, interpret=True)
    # route_k: E a power of two, and tickets
    assert router_logits_routes(1, w, 8) and not router_logits_routes(1, w[:96], 8) and not router_logits_routes(1, w, 0)
    with pytest.raises(ValueError, match="needs E a power of two"):
        router_logits(jnp.ones((1, 2048)), jnp.ones(2048), 1e-6, w, route_k=8, interpret=True)
    with pytest.raises(ValueError, match="and route_k > 0"):
        router_logits(jnp.ones((1, 2048)), jnp.ones(2048), 1e-6, w, slot_table=jnp.zeros((2, 128), jnp.int32),
                      interpret=True)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("N, rounded, chunk", [(1, False, 256), (8, False, 256), (1, True, 256), (8, True, 2048)])
def test_router_logits_lower_to_triton_for_h200(monkeypatch, N, rounded, chunk):
    x = jax.ShapeDtypeStruct((N, 2048), jnp.float32)
    norm = jax.ShapeDtypeStruct((2048,), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 2048), jnp.float32)
    assert triton_kernels(monkeypatch, lambda x, n, w: router_logits(x, n, 1e-6, w, chunk=chunk, rounded=rounded), x, norm, w) == [
        ("router_logits", 90, True)]


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("N, placed", [(1, True), (3, True), (8, False)])
def test_router_logits_with_routing_lower_to_triton_for_h200(monkeypatch, N, placed):
    x = jax.ShapeDtypeStruct((N, 2048), jnp.float32)
    norm = jax.ShapeDtypeStruct((2048,), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 2048), jnp.float32)
    table = jax.ShapeDtypeStruct((48, 128), jnp.int32) if placed else None
    tickets = jax.ShapeDtypeStruct((TICKETS,), jnp.int32)

    def launch(x, n, w, table, tickets):
        kw = dict(slot_table=table, layer=47) if placed else {}
        return router_logits(x, n, 1e-6, w, rounded=True, route_k=8, tickets=tickets, **kw)

    assert triton_kernels(monkeypatch, launch, x, norm, w, table, tickets) == [("router_logits", 90, True)]


def test_model_routing_pallas_matches_xla(synth_model):
    """A qwen3moe model routed by the kernel: the same experts as the jnp routing and logits
    within rounding (weights differ by ulps), for a prefill and a decode step."""
    from test_hybrid import SHAPE, prompt

    from bloomery_jax.models.loader import load_model
    from bloomery_jax.models.qwen3moe import forward

    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    tokens = jnp.asarray(prompt()[None, :9])
    outs = {}
    for routing in ("xla", "pallas"):
        model = load_model(path, routing=routing)
        cache = model.init_cache(1, 9)
        pre, cache, r1 = forward(model.params, model.cfg, tokens[:, :8], jnp.arange(8)[None], cache)
        dec, _, r2 = forward(model.params, model.cfg, tokens[:, 8:], jnp.array([[8]]), cache)
        outs[routing] = [np.asarray(a) for a in (pre, dec, r1.experts, r2.experts, r1.margin)]
    x, p = outs["xla"], outs["pallas"]
    assert (x[4] > 1e-4).all()  # no near-tie: the same experts must be chosen
    np.testing.assert_array_equal(p[2], x[2])
    np.testing.assert_array_equal(p[3], x[3])
    for a, b in ((p[0], x[0]), (p[1], x[1])):
        assert np.abs(a - b).max() <= 1e-5 * b.std()


def test_placed_model_routing_pallas_matches_xla(synth_model):
    """With a placement (some experts of each layer on the host) the kernel's card lookup feeds
    the card experts: the same experts and logits within rounding as the jnp routing."""
    from test_hybrid import SHAPE, prompt

    from bloomery_jax.models.loader import load_model
    from bloomery_jax.models.qwen3moe import forward

    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    tokens = jnp.asarray(prompt()[None, :8])
    outs = {}
    for routing in ("xla", "pallas"):
        model = load_model(path, routing=routing, place=f"card-experts={SHAPE['n_experts'] // 2}")
        logits, _, r = forward(model.params, model.cfg, tokens, jnp.arange(8)[None], model.init_cache(1, 8),
                               model.placement)
        outs[routing] = [np.asarray(a) for a in (logits, r.experts, r.margin)]
        assert model.placement.host.stats.calls > 0  # host experts did take part
    x, p = outs["xla"], outs["pallas"]
    assert (x[2] > 1e-4).all()
    np.testing.assert_array_equal(p[1], x[1])
    assert np.abs(p[0] - x[0]).max() <= 1e-5 * x[0].std()
