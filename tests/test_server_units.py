"""Server parts without a model: body parsing, field paths, Prometheus text, engine failure,
the order in which a finished job leaves the admission bound.

The engine-failure test drives the provider's worker loop with a scheduler whose step raises
(the one path the HTTP tests cannot reach without breaking a real engine): every job in flight
must get an ``error`` event and the provider must say it failed.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from bloomery_jax.engine.scheduler import Event, Timings
from bloomery_jax.server.errors import APIError
from bloomery_jax.server.jobs import Job
from bloomery_jax.server.metrics import Metrics
from bloomery_jax.server.prompts import Prepared
from bloomery_jax.server.provider import Provider, ProviderOptions
from bloomery_jax.server.schemas import ChatRequest, field_path, parse, parse_json


@pytest.mark.parametrize("raw", [b"", b"{", b"NaN", b'{"a": Infinity}', b'{"a": 1e999}', b"\xff", b"[1]", b'"s"'])
def test_parse_json_refuses_what_is_not_a_json_object(raw):
    with pytest.raises(APIError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"


def test_field_path_drops_union_member_names():
    assert field_path(("messages", 1, "content", "list[TextPart]", 0, "text")) == "messages[1].content[0].text"
    assert field_path(("stop", "list[str]", 2)) == "stop[2]"
    assert field_path(()) == "body"


def test_parse_names_the_deepest_bad_field():
    body = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}'
    with pytest.raises(APIError) as e:
        parse(ChatRequest, body)
    assert e.value.param == "messages[0].content[0].text"
    ok = parse(ChatRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                             b'{"type": "text", "text": "b"}]}], "unknown_field": 1}')
    assert ok.messages[0].text() == "ab"


def test_metrics_text_is_prometheus_exposition():
    m = Metrics()
    t = Timings(n_prompt=10, n_generated=5, t_submit=0.0, t_admit=0.0, t_first=0.5, t_end=1.5)
    for _ in range(5):
        m.on_token(1.0)
    m.on_finish("length", t)
    m.on_reject("queue_full")
    text = m.render(running=1, queued=2, slots=2, queue_bound=4, kv_used=0.25, in_flight=3)
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.split()[1] in ("HELP", "TYPE")
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    assert samples["bloomery_prompt_tokens_total"] == 10
    assert samples["bloomery_prompt_tokens_per_second"] == 20.0  # 10 tokens in 0.5 s
    assert samples["bloomery_predicted_tokens_per_second"] == 4.0  # 4 tokens after the first in 1 s
    assert samples['bloomery_requests_finished_total{reason="length"}'] == 1
    assert samples['bloomery_requests_rejected_total{reason="queue_full"}'] == 1
    assert samples["bloomery_requests_deferred"] == 2 and samples["bloomery_requests_in_flight"] == 3


class _BrokenScheduler:
    """Has work, and its step raises as a broken device would."""

    def has_work(self):
        return True

    def step(self):
        raise RuntimeError("device lost")

    def cancel(self, req):
        pass


class _Req:
    def __init__(self, rid):
        self.id = rid
        self.events = queue.SimpleQueue()


def test_engine_failure_fails_every_job_and_the_provider():
    logs = []
    p = Provider(ProviderOptions(), log=logs.append)
    p.scheduler = _BrokenScheduler()
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(_Req(i), Prepared([1], None, None, False, False, False), loop, 60.0, "t") for i in (1, 2)]
        p._jobs = {j.request.id: j for j in jobs}
        worker = threading.Thread(target=p._run_guarded)
        worker.start()
        worker.join(timeout=10)
        assert not worker.is_alive()
        events = [loop.run_until_complete(asyncio.wait_for(j.next(), 5)) for j in jobs]
    finally:
        loop.close()
    assert all(ev.finish_reason == "error" and "device lost" in ev.error for ev in events)
    assert p.state == "failed" and "device lost" in p.error
    with pytest.raises(APIError) as e:
        p.require_ready()
    assert e.value.status == 500


class _WatchedJob:
    """A job whose pushes record how many jobs the provider counted in flight at that moment."""

    def __init__(self, provider, rid):
        self.request = _Req(rid)
        self.request.timings = Timings()
        self.timed_out = False
        self.provider, self.seen = provider, []

    def push(self, ev):
        self.seen.append((ev.finish_reason, self.provider.in_flight(),
                          dict(self.provider.metrics.finished)))


def test_a_finished_job_leaves_the_bound_before_its_client_sees_the_end():
    """A client at the queue's bound sends its next request the moment one ends (the soak's
    8 clients on 2 slots + 6 queued): when the finishing event reaches the client, the job must
    already be out of the count that admission checks, and counted as finished in /metrics."""
    p = Provider(ProviderOptions())
    jobs = [_WatchedJob(p, i) for i in (1, 2)]
    p._jobs = {j.request.id: j for j in jobs}
    jobs[0].request.events.put(Event(1, 7, "a"))
    jobs[0].request.events.put(Event(1, 8, "b", finish_reason="length"))
    jobs[1].request.events.put(Event(2, 9, "c"))
    p._forward()
    token, last = jobs[0].seen
    assert token[:2] == (None, 2)  # still running: both jobs count
    assert last[:2] == ("length", 1) and last[2]["length"] == 1
    assert jobs[1].seen[0][:2] == (None, 1) and p.in_flight() == 1
