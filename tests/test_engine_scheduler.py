"""The scheduler: continuous batching, chunked prompts, stops, cancellation, bad input.

Uses the model and engine settings of test_engine_gates.py (same file, same shapes), so the
compiled steps are shared within a pytest session.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bloomery_jax.engine.engine import Engine
from bloomery_jax.engine.sampling import SamplingParams
from bloomery_jax.engine.scheduler import QueueFullError, Scheduler, resolve_decode_block
from bloomery_jax.engine.stops import StopConditions
from bloomery_jax.errors import ConfigError
from bloomery_jax.models.loader import load_model
from bloomery_jax.tokenizer import Tokenizer

SHAPE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, n_experts_used=2,
             expert_ff=64, n_vocab=512)
S = 48
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(synth_model):
    return load_model(synth_model(seed=3, **SHAPE)[0])


@pytest.fixture(scope="module")
def tokenizer(model):
    return Tokenizer.from_gguf(model.gguf)


@pytest.fixture(params=[1, 3], ids=["step", "block3"])
def sched(model, tokenizer, request):
    """One decode step a call, or blocks of three while only generating (the tokens, stops and
    finish reasons must not change)."""
    return Scheduler(Engine(model, n_slots=4, max_context=S, ubatch=16, min_chunk=16),
                     detokenizer=tokenizer.detokenizer, decode_block=request.param)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, SHAPE["n_vocab"], n).tolist()


def alone(sched, p, params, n):
    req = sched.submit(p, params, StopConditions.build(max_tokens=n))
    return [ev.token for ev in sched.drive(req) if ev.token is not None]


def test_requests_join_and_leave_and_match_running_alone(sched, tokenizer):
    specs = [(prompt(1, 7), GREEDY, 6), (prompt(2, 40), SamplingParams(temperature=0.8, seed=5), 5),
             (prompt(3, 3), SamplingParams(temperature=1.0, top_k=8, seed=9), 9)]
    want = [alone(sched, *spec) for spec in specs]
    # All three at once: the first generates while the 40-token prompt is read in 3 chunks.
    reqs = [sched.submit(p, params, StopConditions.build(max_tokens=n)) for p, params, n in specs]
    per_step = []
    while sched.has_work():
        per_step.append({ev.request_id for ev in sched.step() if ev.token is not None})
    assert [r.tokens for r in reqs] == want
    assert all(r.finish_reason == "length" for r in reqs)
    # While the long prompt was read (chunks at steps 1-3, after request 0's prefill at step 0),
    # request 0 got a token
    # every step: a long prompt never stalls the others.
    first_long = next(i for i, ids in enumerate(per_step) if reqs[1].id in ids)
    assert first_long == 3 and all(reqs[0].id in per_step[i] for i in range(first_long + 1))
    text = "".join(ev.text for ev in _drain(reqs[0]))
    assert text == tokenizer.decode(reqs[0].tokens)
    assert sched.engine.live == []


def _drain(req):
    out = []
    while not req.events.empty():
        out.append(req.events.get())
    return out


def test_stop_token_stop_string_and_context_full(sched, tokenizer):
    p = prompt(4, 10)
    ref = alone(sched, p, GREEDY, 8)
    # a stop token: generation ends on it, its text is not emitted
    req = sched.submit(p, GREEDY, StopConditions.build(max_tokens=8, stop_tokens=[ref[3]]))
    evs = list(sched.drive(req))
    assert req.tokens == ref[: ref.index(ref[3]) + 1] and req.finish_reason == "stop"
    assert "".join(e.text for e in evs) == tokenizer.decode(req.tokens[:-1])
    # a stop string made of the text of tokens 2..4 (split across tokens): text ends before it
    full = tokenizer.decode(ref)
    cut = len(tokenizer.decode(ref[:2]))
    stop = full[cut : len(tokenizer.decode(ref[:5]))]
    assert len(stop) >= 2 and full.index(stop) < cut + 1
    req = sched.submit(p, GREEDY, StopConditions.build(max_tokens=8, stop_strings=[stop]))
    text = "".join(e.text for e in sched.drive(req))
    assert req.finish_reason == "stop" and text == full[: full.index(stop)]
    assert len(req.tokens) <= 5  # it stopped as soon as the string was complete
    # the context: a 40-token prompt in 48 positions generates 48 - 40 + 1 tokens, then "length"
    req = sched.submit(prompt(5, 40), GREEDY, StopConditions.build(max_tokens=100))
    list(sched.drive(req))
    assert len(req.tokens) == 9 and req.finish_reason == "length"


def test_cancel_frees_the_slot_and_others_continue(sched):
    a = sched.submit(prompt(6, 5), GREEDY, StopConditions.build(max_tokens=12))
    b = sched.submit(prompt(7, 5), GREEDY, StopConditions.build(max_tokens=20))
    sched.step()
    sched.step()
    sched.cancel(b)
    sched.step()
    assert b.finish_reason == "cancelled" and b.seq is None and len(sched.engine.live) == 1
    sched.run_until_idle()
    assert a.finish_reason == "length" and len(a.tokens) == 12
    assert a.tokens == alone(sched, prompt(6, 5), GREEDY, 12)


def test_bad_requests_raise_at_submit_and_queue_bound(model):
    sched = Scheduler(Engine(model, n_slots=4, max_context=S, ubatch=16), max_queue=1)
    with pytest.raises(ConfigError, match="does not fit the context"):
        sched.submit(prompt(8, S))
    with pytest.raises(ConfigError, match="temperature"):
        sched.submit([1, 2], SamplingParams(temperature=-1))
    with pytest.raises(ConfigError, match="not in"):
        sched.submit([1, 10_000])
    with pytest.raises(ConfigError, match="max_tokens"):
        StopConditions.build(max_tokens=0)
    sched.submit([1, 2])
    with pytest.raises(QueueFullError):
        sched.submit([3, 4])
    assert sched.n_waiting == 1


def test_serve_forever_in_a_thread(sched):
    stop = threading.Event()
    t = threading.Thread(target=sched.serve_forever, args=(stop,), daemon=True)
    t.start()
    try:
        reqs = [sched.submit(prompt(9 + i, 4 + i), GREEDY, StopConditions.build(max_tokens=4)) for i in range(2)]
        results = [[ev.token for ev in r if ev.token is not None] for r in reqs]  # blocking iteration
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive()
    assert [len(r) for r in results] == [4, 4]
    assert results[0] == reqs[0].tokens and reqs[0].timings.decode_tps is not None


def test_decode_block_setting_resolves_per_device():
    # 0 is the device's default: 1 on the CPU these tests run on (8 on a GPU); others stand.
    assert resolve_decode_block(0) == 1 and resolve_decode_block(3) == 3
    with pytest.raises(ConfigError, match="decode_block must be >= 0"):
        resolve_decode_block(-1)

