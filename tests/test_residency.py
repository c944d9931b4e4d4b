"""Adaptive residency (NumPy half): routing counts and decay, the LFU/LRU/Static policies on hand-made
rows, minimal swap plans under a cap, the controller's served/moved accounting on a hand trace,
prompt-time streaming, the trace file format, and the offline sweep script on a synthetic trace."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

from bloomery_jax.placement.residency import (LFU, LRU, ResidencyController, RoutingCounts, Static, Swap,
                                              apply_swaps, count_routing, make_policy, plan_swaps)
from bloomery_jax.placement.trace import DECODE, PREFILL, TraceRecorder, load_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "placement_sweep.py")


def counts_of(rows, decay=1.0) -> RoutingCounts:
    """RoutingCounts whose counts are the given [L, E] rows (last_used from nonzero entries)."""
    rows = np.asarray(rows, np.float64)
    c = RoutingCounts(*rows.shape, decay=decay)
    c.counts[:] = rows
    return c


def one_hot_steps(ids) -> list[np.ndarray]:
    """One routed expert per layer per step: ids [steps, L] -> each step int [L, 1, 1]."""
    return [np.asarray(row, np.int32)[:, None, None] for row in ids]


# --- counts ------------------------------------------------------------------------------------

def test_count_routing_with_padding_mask():
    experts = np.array([[[[0, 1], [2, 1]], [[3, 3], [9, 9]]],   # layer 0, [B=2, T=2, k=2]
                        [[[1, 0], [1, 2]], [[0, 3], [-5, 7]]]])  # layer 1; rows [1, 1] are padding
    mask = np.array([[True, True], [True, False]])
    got = count_routing(experts, 4, mask)
    np.testing.assert_array_equal(got, [[1, 2, 1, 2], [2, 2, 1, 1]])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        count_routing(experts, 4)  # the padding ids are out of range once counted
    with pytest.raises(ValueError, match="mask shape"):
        count_routing(experts, 4, mask[0])


def test_decay_and_last_used():
    c = RoutingCounts(1, 3, decay=0.5)
    for e in (0, 1, 0):
        c.update(np.array([[[e]]]))
    np.testing.assert_allclose(c.counts, [[0.25 + 1.0, 0.5, 0.0]])  # 1*.5*.5 + 1, 1*.5, never
    np.testing.assert_array_equal(c.last_used, [[2, 1, -1]])
    assert c.steps == 3
    flat = RoutingCounts(1, 3)  # decay 1: plain totals
    for e in (0, 1, 0):
        flat.update(np.array([[[e]]]))
    np.testing.assert_array_equal(flat.counts, [[2, 1, 0]])
    with pytest.raises(ValueError, match="decay"):
        RoutingCounts(1, 3, decay=0.0)


# --- policies ----------------------------------------------------------------------------------

def test_lfu_keeps_the_hottest_subject_to_hysteresis():
    c = counts_of([[5, 1, 3, 0]])
    resident = np.array([False, True, False, True])
    chosen = lambda pol: np.flatnonzero(pol.desired(c, 0, resident, 2)).tolist()  # noqa: E731
    assert chosen(LFU(hysteresis=1.0, margin=0.0)) == [0, 2]
    assert chosen(LFU(hysteresis=2.0, margin=0.0)) == [0, 2]  # 5 > 2*0 and 3 > 2*1
    assert chosen(LFU(hysteresis=4.0, margin=0.0)) == [0, 1]  # 3 > 4*1 fails: only the first pair swaps
    assert chosen(LFU(hysteresis=1.0, margin=5.0)) == [1, 3]  # nothing clears the margin
    # ties never swap, and among equal host experts the lower id comes in first
    tie = counts_of([[2, 2, 2, 2]])
    assert np.flatnonzero(LFU(hysteresis=1.0, margin=0.0).desired(tie, 0, resident, 2)).tolist() == [1, 3]
    assert np.flatnonzero(LFU().desired(counts_of([[1, 1, 0, 0]]), 0, np.zeros(4, bool), 1)).tolist() == [0]


def test_hysteresis_stops_thrash_on_alternating_experts():
    steps = one_hot_steps([[0], [1]] * 10)  # L=1: expert 0, 1, 0, 1, ...
    swaps = {}
    for h in (1.0, 1.25):
        ctrl = ResidencyController(np.array([[-1, -1, 0]]), LFU(decay=0.9, hysteresis=h, margin=0.0))
        for s in steps:
            ctrl.observe(s)
            ctrl.step_plan()
        swaps[h] = ctrl.swaps_total
    assert swaps[1.0] == 20  # every step flips the slot
    assert swaps[1.25] == 1  # expert 0 comes in once and stays


@pytest.mark.parametrize("policy", [LFU(), LRU(), Static()])
def test_policies_at_zero_and_all_slots(policy):
    c = counts_of([[3, 0, 1]])
    c.last_used[:] = [[2, -1, 5]]
    assert not policy.desired(c, 0, np.zeros(3, bool), 0).any()
    assert policy.desired(c, 0, np.ones(3, bool), 3).all()
    with pytest.raises(ValueError, match="n_slots"):
        policy.desired(c, 0, np.ones(3, bool), 4)


def test_lru_most_recent_then_count_then_id():
    c = counts_of([[9, 1, 4, 4, 0]])
    c.last_used[:] = [[0, 3, 3, 3, -1]]
    resident = np.array([True, False, False, False, True])
    assert np.flatnonzero(LRU().desired(c, 0, resident, 2)).tolist() == [2, 3]  # step 3, then count 4 over 1
    assert np.flatnonzero(LRU().desired(c, 0, resident, 3)).tolist() == [1, 2, 3]
    assert np.flatnonzero(LRU().desired(c, 0, resident, 4)).tolist() == [0, 1, 2, 3]


def test_static_never_changes():
    resident = np.array([False, True, True])
    np.testing.assert_array_equal(Static().desired(counts_of([[9, 0, 0]]), 0, resident, 2), resident)
    with pytest.raises(ValueError, match="residents"):
        Static().desired(counts_of([[9, 0, 0]]), 0, resident, 1)


def test_make_policy_reads_gin():
    try:
        gin.parse_config(["LFU.decay = 0.5", "residency.LFU.hysteresis = 2.0"])
        p = make_policy("lfu")
        assert p == LFU(decay=0.5, hysteresis=2.0) and type(p) is LFU
    finally:
        gin.clear_config()
    assert make_policy("LFU") == LFU()
    with pytest.raises(ValueError, match="unknown residency policy"):
        make_policy("fifo")


# --- swaps -------------------------------------------------------------------------------------

def test_plan_swaps_is_minimal_and_keeps_slots():
    rng = np.random.default_rng(0)
    for _ in range(20):
        E, n = 12, int(rng.integers(0, 13))
        on = np.zeros(E, bool)
        on[rng.permutation(E)[:n]] = True
        row = np.full(E, -1)
        row[on] = rng.permutation(n)
        want = np.zeros(E, bool)
        want[rng.permutation(E)[:n]] = True
        swaps = plan_swaps(row, want)
        assert len(swaps) == int((want & ~on).sum())  # one swap per incoming expert: no fewer will do
        new = apply_swaps(row[None], 0, swaps)[0]
        np.testing.assert_array_equal(new >= 0, want)
        np.testing.assert_array_equal(new[on & want], row[on & want])  # stayers keep their slots
        assert sorted(new[new >= 0].tolist()) == list(range(n))


def test_plan_swaps_cap_takes_hottest_in_and_coldest_out():
    row = np.array([0, 1, 2, -1, -1, -1])
    want = np.array([False, False, True, False, True, True])
    counts = np.array([5.0, 1.0, 9.0, 2.0, 7.0, 3.0])
    assert plan_swaps(row, want, max_swaps=1, counts=counts) == [Swap(slot=1, out_expert=1, in_expert=4)]
    assert plan_swaps(row, want, 2, counts) == [Swap(1, 1, 4), Swap(0, 0, 5)]
    assert plan_swaps(row, want, 0, counts) == []
    with pytest.raises(ValueError, match="card slots"):
        plan_swaps(row, np.ones(6, bool))


def test_apply_swaps_is_pure_and_checks():
    table = np.array([[0, -1, 1], [0, 1, -1]], np.int32)
    new = apply_swaps(table, 1, [Swap(1, 1, 2)])
    np.testing.assert_array_equal(new, [[0, -1, 1], [0, -1, 1]])
    np.testing.assert_array_equal(table, [[0, -1, 1], [0, 1, -1]])
    with pytest.raises(ValueError, match="does not fit"):
        apply_swaps(table, 0, [Swap(0, 0, 2)])  # expert 2 already has a slot


# --- controller --------------------------------------------------------------------------------

def test_controller_served_fraction_on_a_hand_trace():
    # layer 0: one slot, expert 0 on it; layer 1: every expert on the card (never swaps)
    slot_of = np.array([[0, -1, -1, -1], [0, 1, 2, 3]])
    ctrl = ResidencyController(slot_of, LFU(decay=1.0, hysteresis=1.0, margin=0.0), expert_bytes=[100, 7], window=3)
    per_step = []
    for s in one_hot_steps([[1, 0], [1, 1], [2, 2], [1, 3]]):
        per_step.append(ctrl.observe(s))
        ctrl.step_plan()
    # layer 0: step 0 routes host expert 1, which then takes the slot; step 2's expert 2 (count 1) loses to 1 (2)
    assert per_step == [(1, 2), (2, 2), (1, 2), (2, 2)]
    assert ctrl.served_fraction == 6 / 8
    assert ctrl.window_fraction == 5 / 6  # the last 3 steps
    assert (ctrl.swaps_total, ctrl.swaps_last, ctrl.bytes_moved) == (1, 0, 100)
    np.testing.assert_array_equal(ctrl.slot_of, [[-1, 0, -1, -1], [0, 1, 2, 3]])
    assert ctrl.stats()["steps"] == 4
    # padding rows are not counted
    padded = np.array([[[[3], [1]]], [[[0], [0]]]])  # [L=2, B=1, T=2, k=1]
    assert ctrl.observe(padded, mask=np.array([[False, True]])) == (2, 2)


def test_controller_rejects_a_bad_table():
    with pytest.raises(ValueError, match="once each"):
        ResidencyController(np.array([[0, 0, -1]]))
    with pytest.raises(ValueError, match="once each"):
        ResidencyController(np.array([[1, -1, -1]]))


def test_prompt_plan_seats_the_prompt_hottest():
    ctrl = ResidencyController(np.array([[0, 1, -1, -1, -1, -1]]), LFU(margin=100.0))
    prompt = np.array([3] * 5 + [4] * 3 + [0] * 3 + [5])[None, :, None]  # [L=1, T=12, k=1]
    ctrl.observe(prompt)
    assert ctrl.step_plan() == {}  # the margin keeps the residents
    before = ctrl.counts.counts.copy()
    plan = ctrl.prompt_plan(prompt)
    # expert 3 (5 calls) first; 0 and 4 tie at 3 calls and the resident 0 stays
    assert plan == {0: [Swap(slot=1, out_expert=1, in_expert=3)]}
    np.testing.assert_array_equal(ctrl.slot_of, [[0, -1, -1, 1, -1, -1]])
    np.testing.assert_array_equal(ctrl.counts.counts, before)  # prompt_plan does not count
    ctrl2 = ResidencyController(np.array([[0, 1, 2, -1, -1, -1]]))
    assert ctrl2.prompt_plan(prompt, max_swaps_per_layer=1) == {0: [Swap(slot=2, out_expert=2, in_expert=3)]}
    # with a bar: 3 (5 calls) clears 1.5 x resident 1 (0 calls); 4 (3 calls) against 2 (0) needs
    # the margin below 3; nothing displaces the resident 0 (3 calls) at 1.5x
    for hysteresis, margin, moved in ((1.5, 0.0, [3, 4]), (1.5, 3.0, [3]), (2.0, 5.0, [])):
        ctrl3 = ResidencyController(np.array([[0, 1, 2, -1, -1, -1]]))
        plan = ctrl3.prompt_plan(prompt, hysteresis=hysteresis, margin=margin)
        assert sorted(s.in_expert for s in plan.get(0, [])) == moved, (hysteresis, margin, plan)


# --- trace files -------------------------------------------------------------------------------

def test_trace_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    rec = TraceRecorder(3, 10, metadata=dict(model="m.gguf", placement="n-cpu-moe=2"))
    prefill = rng.integers(0, 10, (3, 2, 4, 2))  # [L, B, T, k]
    mask = np.array([[True, True, False, False], [True, True, True, False]])
    rec.append(prefill, "prefill", mask=mask)
    decode = rng.integers(0, 10, (3, 2, 1, 2))
    rec.append(decode, DECODE)
    rec.append(np.zeros((3, 0, 2), int), "decode")  # an empty step survives
    rec.save(tmp_path / "t.npz")
    tr = load_trace(tmp_path / "t.npz")
    assert (tr.n_layers, tr.n_experts, tr.k, tr.n_steps, len(tr)) == (3, 10, 2, 3, 3)
    assert tr.experts.dtype == np.int16 and tr.metadata == dict(model="m.gguf", placement="n-cpu-moe=2")
    np.testing.assert_array_equal(tr.step_offsets, [0, 5, 7, 7])
    steps = list(tr)
    assert [s.kind for s in steps] == [PREFILL, DECODE, DECODE]
    np.testing.assert_array_equal(steps[0].experts, prefill[:, mask])
    np.testing.assert_array_equal(steps[1].experts, decode.reshape(3, 2, 2))
    assert steps[2].experts.shape == (3, 0, 2)
    np.testing.assert_array_equal(tr.counts(), count_routing(prefill, 10, mask) + count_routing(decode, 10))


def _write(path, **overrides):
    arrays = dict(experts=np.zeros((4, 2, 1), np.int16), step_offsets=np.array([0, 3, 4]),
                  step_kind=np.array([0, 1], np.uint8), n_experts=np.int64(8), n_layers=np.int64(2),
                  metadata=np.array("{}"))
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


@pytest.mark.parametrize("overrides, message", [
    (dict(step_kind=None), "missing step_kind"),
    (dict(experts=np.zeros((4, 2), np.int16)), "experts must be int"),
    (dict(experts=np.zeros((4, 3, 1), np.int16)), "does not match n_layers"),
    (dict(experts=np.full((4, 2, 1), 8, np.int16)), r"ids must lie in \[0, 8\)"),
    (dict(step_offsets=np.array([0, 3, 5])), "step_offsets must rise"),
    (dict(step_offsets=np.array([0, 4])), "disagree on the number of steps"),
    (dict(step_kind=np.array([0, 2], np.uint8)), "step_kind must be 0"),
    (dict(metadata=np.array("{oops")), "metadata is not JSON"),
    (dict(n_experts=np.array([8])), "integer scalar"),
])
def test_malformed_trace_files(tmp_path, overrides, message):
    assert load_trace(_write(tmp_path / "ok.npz")).n_steps == 2
    with pytest.raises(ValueError, match=message):
        load_trace(_write(tmp_path / "bad.npz", **overrides))


def test_not_a_trace_file(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="not a routing trace"):
        load_trace(tmp_path / "x.npz")
    np.save(tmp_path / "y.npy", np.zeros(3))
    with pytest.raises(ValueError, match="single array"):
        load_trace(tmp_path / "y.npy")


# --- the sweep script --------------------------------------------------------------------------

SMALL = ["--synthetic", "--layers", "6", "--experts", "32", "--k", "4", "--prompt", "128", "--decode", "40",
         "--ubatch", "64", "--edge", "8", "--zipf", "1.2"]


@pytest.fixture(scope="module")
def sweep_module():
    spec = importlib.util.spec_from_file_location("placement_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_lfu_beats_static_uniform(sweep_module, capsys):
    assert sweep_module.main(SMALL + ["--budgets", "0.25", "--json", "--expert-bytes", "1KiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    res = {r["rule"]: r for r in out["results"]}
    assert out["trace"]["decode_steps"] == 40 and out["trace"]["prompt_tokens"] == 128
    assert set(res) == set(sweep_module.DEFAULT_RULES)
    assert {r["n_card"] for r in res.values()} == {round(0.25 * 6 * 32)}
    for r in res.values():
        assert all(0.0 <= r[key] <= 1.0 for key in ("all", "prompt", "decode", "first", "last"))
        assert r["bytes_moved"] == r["swaps"] * 1024
    static = [r for name, r in res.items() if name.startswith("static")]
    assert all(r["swaps"] == 0 for r in static)
    assert res["static-oracle"]["all"] >= max(r["all"] for r in static)  # the static upper bound
    assert res["lfu"]["decode"] > res["static-uniform"]["decode"]
    assert res["lfu"]["last"] > res["static-uniform"]["last"]
    assert res["lfu+stream"]["first"] >= res["lfu"]["first"]  # streaming starts decode warm
    assert res["lfu+stream"]["prompt_swaps"] > 0 and res["lfu"]["swaps_per_decode_step"] <= 2 * 6


def test_sweep_text_table_and_gin(sweep_module, capsys, tmp_path):
    try:
        sweep_module.main(SMALL + ["--budgets", "0.1,0.5", "--rules", "static-uniform,lfu",
                                   "--gin_param", "LFU.decay = 0.5", "--save-trace", str(tmp_path / "s.npz")])
    finally:
        gin.clear_config()
    text = capsys.readouterr().out
    assert "static-uniform" in text and "lfu" in text and len(text.strip().splitlines()) == 2 + 4
    sweep_module.main([str(tmp_path / "s.npz"), "--budgets", "0.5", "--rules", "lfu", "--json", "--edge", "8"])
    out = json.loads(capsys.readouterr().out)
    assert out["results"][0]["policy"] == repr(LFU())  # the binding was cleared
    assert out["trace"]["metadata"]["source"] == "synthetic"


def test_sweep_script_imports_no_jax():
    code = f"import runpy, sys; runpy.run_path({SCRIPT!r}); assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
