"""The model provider: loads the model and runs the engine; the handlers talk only to it.

Contract. ``Provider(options).start()`` loads in a background thread (the model file, its
tokenizer and chat template, an :class:`~bloomery_jax.engine.engine.Engine` with
``options.parallel`` slots, compiling its decode steps with the full sampler and its shortest
prefill chunk (the longer chunks and the greedy sampler's decode steps compile in the worker
while it is idle, greedy batches taking the full sampler until then; or all before ready with
``full_warmup``), and a
:class:`~bloomery_jax.engine.scheduler.Scheduler`), then starts the worker thread that steps the scheduler whenever there is work.
``state`` is ``loading``, ``ready`` or ``failed`` (``error`` says why).

From the event loop: :meth:`Provider.submit` queues a prepared request and returns a
:class:`~bloomery_jax.server.jobs.Job` (503 with ``Retry-After`` when ``parallel + queue``
requests are already in flight, never blocking); :meth:`Provider.cancel` frees its slot before the next step. The worker forwards
each request's events to its job, cancels jobs past their time limit, and keeps the metrics.
An engine failure fails every job in flight and marks the provider ``failed``; nothing a
single request sends reaches the engine unvalidated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import sys
import threading
import time
import traceback
from typing import Callable

from ..chat import CHATML_TEMPLATE, ChatTemplate
from ..engine.sampling import SamplingParams, plan_for
from ..engine.scheduler import Event, QueueFullError, Scheduler, resolve_decode_block
from ..errors import ConfigError
from ..settings import RuntimeSettings
from .errors import APIError, unavailable
from .jobs import Job
from .metrics import Metrics
from .prompts import ModelBundle, Prepared


@dataclasses.dataclass(frozen=True)
class ProviderOptions:
    """What to serve and how.

    Args:
      model: GGUF path; None = the embedded default model.
      settings: the gin RuntimeSettings (max_context, ubatch, kv_dtype, ...).
      parallel: sequence slots (None = settings.parallel).
      queue: most requests waiting for a slot beyond the running ones.
      time_limit: seconds a request may take, queue wait included.
      alias: another name clients may use in ``model``.
    """

    model: str | None = None
    settings: RuntimeSettings = dataclasses.field(default_factory=RuntimeSettings)
    parallel: int | None = None
    queue: int = 16
    time_limit: float = 600.0
    alias: str | None = None
    full_warmup: bool = False  # compile every prefill chunk before ready (else the longer ones while idle)
    residency: str = "off"  # off | lfu | lru: swap experts between card slots and the host as routing is counted
    prompt_streaming: bool = True  # with residency: seat a prompt's hottest experts when it ends
    max_swaps: int | None = None  # with residency: most swaps per layer per decode step


def _log(msg: str) -> None:
    print(f"bloomery_jax.serve: {msg}", file=sys.stderr, flush=True)


class Provider:
    def __init__(self, options: ProviderOptions, log: Callable[[str], None] = _log):
        self.options = options
        self.log = log
        self.state = "loading"
        self.error: str | None = None
        self.bundle: ModelBundle | None = None
        self.engine = None
        self.scheduler: Scheduler | None = None
        self.metrics = Metrics()
        self.model_path: str | None = None
        self.load_seconds: float | None = None
        self.ready = threading.Event()  # set when the state leaves "loading"
        self._jobs: dict[int, Job] = {}  # scheduler request id -> job
        self._jobs_lock = threading.Lock()
        self._work = threading.Event()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._cold_chunks: list[int] = []  # prefill chunk lengths not compiled yet
        self._last_busy = 0.0  # monotonic time of the last scheduler step

    # --- loading ----------------------------------------------------------------------------
    def start(self) -> "Provider":
        threading.Thread(target=self._load_guarded, name="bloomery-load", daemon=True).start()
        return self

    def _load_guarded(self) -> None:
        try:
            self._load()
        except Exception as e:  # a bad file or setting: say it in one line, /health answers 500
            self.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.state = "failed"
            self.log(f"loading failed: {self.error}")
            if not isinstance(e, (ConfigError, ValueError, OSError)):
                traceback.print_exc()
        finally:
            self.ready.set()

    def _load(self) -> None:
        # Imported here: jax and the model code load in this thread while the server already answers.
        from .. import default_model
        from ..engine.engine import Engine
        from ..engine.startup import make_residency
        from ..models.loader import load_model
        from ..tokenizer import Tokenizer

        t0 = time.perf_counter()
        opts, st = self.options, self.options.settings
        is_default = opts.model is None
        path = str(default_model.default_model_path()) if is_default else opts.model
        self.model_path = path
        self.log(f"loading {path}")
        model = load_model(path, place=st.placement, weights=st.weights, kernels=st.kernels, attention=st.attention,
                           bridge=st.bridge, routing=st.routing)
        tok = Tokenizer.from_gguf(model.gguf)
        source = tok.vocab.chat_template
        if source is None:
            source = default_model.CHAT_TEMPLATE if is_default else CHATML_TEMPLATE
            if not is_default:
                self.log("the file has no tokenizer.chat_template: chat requests use ChatML")
        template = ChatTemplate.from_tokenizer(tok, source)
        n_ctx = min(st.max_context, int(getattr(model.cfg, "context_length", st.max_context)))
        if model.placement is not None and model.placement.host is not None:
            from ..placement import describe_placement

            self.log(f"placement {st.placement}: {describe_placement(model)}")
        parallel = opts.parallel or st.parallel
        residency = make_residency(model, opts.residency, prompt_streaming=opts.prompt_streaming,
                                   max_swaps=opts.max_swaps)
        engine = Engine(model, n_slots=parallel, max_context=n_ctx, ubatch=min(st.ubatch, n_ctx),
                        kv_dtype=st.kv_dtype, residency=residency)
        # Each shape costs seconds of tracing and compiling on a CPU; the decode buckets and the
        # shortest prefill chunk are enough to serve, the longer chunks compile while idle.
        first = engine.chunks if opts.full_warmup else engine.chunks[:1]
        self._cold_chunks = [] if opts.full_warmup else list(engine.chunks[1:])
        block = resolve_decode_block(st.decode_block)
        # the full sampler serves every batch; the greedy plan only makes greedy ones faster
        samplers = None if opts.full_warmup else [SamplingParams(n_probs=1)]
        secs = engine.warmup(progress=self.log, chunks=first, decode_block=block, samplers=samplers)
        if not opts.full_warmup:
            engine.cold_plans = {plan_for([SamplingParams(temperature=0.0)], engine.n_top)}
        later = ([f"{len(self._cold_chunks)} longer prefill chunks"] if self._cold_chunks else []) + \
            (["the greedy sampler's decode steps"] if engine.cold_plans else [])
        self.log(f"compiled {len(first)} prefill and {len(engine.buckets)} decode shapes in {secs:.1f} s"
                 + (f" ({' and '.join(later)} compile while idle)" if later else ""))
        self.engine = engine
        # The bound is enforced in submit() on the requests in flight (see there); the scheduler's
        # own bound, on requests not yet admitted, is only a backstop.
        self.scheduler = Scheduler(engine, detokenizer=tok.detokenizer, max_queue=opts.queue + parallel,
                                   decode_block=block)
        self._first_request(tok)
        name = os.path.basename(path)
        model_id = opts.alias or (name[: -len(".gguf")] if name.endswith(".gguf") else name)
        names = {model_id, name, os.path.splitext(name)[0], path} | ({opts.alias} if opts.alias else set())
        self.bundle = ModelBundle(model_id=model_id, names=frozenset(names), tokenizer=tok, template=template,
                                  n_ctx=n_ctx, n_vocab=tok.n_vocab)
        self._worker = threading.Thread(target=self._run_guarded, name="bloomery-engine", daemon=True)
        self._worker.start()
        self.load_seconds = time.perf_counter() - t0
        self.state = "ready"

    def _first_request(self, tok) -> None:
        """Run two short requests through the scheduler, so the slot operations the warmup does
        not touch (row resets; a slot move when the first ends while the second is live) are
        compiled before the server says it is ready."""
        from ..engine.sampling import SamplingParams
        from ..engine.stops import StopConditions

        first = tok.bos_id if tok.bos_id is not None else 0
        reqs = [self.scheduler.submit([first, first], SamplingParams(temperature=0.0), StopConditions.build(n))
                for n in (1, 3)]
        self.scheduler.run_until_idle()
        for req in reqs:
            last = list(req)[-1]  # its events are all queued by now
            if last.finish_reason == "error":
                raise ConfigError(f"the warm-up request failed: {last.error}")

    # --- from the event loop ----------------------------------------------------------------
    def require_ready(self) -> ModelBundle:
        if self.state == "loading":
            raise unavailable("the model is still loading", retry_after=5)
        if self.state == "failed":
            raise APIError(500, f"the model failed: {self.error}", code="model_failed")
        return self.bundle

    def submit(self, prepared: Prepared, loop: asyncio.AbstractEventLoop, prefix: str) -> Job:
        self.require_ready()
        # Bound = slots + queue over the jobs in flight, not the scheduler's waiting list alone: a
        # request arriving just after another finished must not be refused because the worker
        # has not yet moved a waiting one into the freed slot. Only this thread adds jobs.
        with self._jobs_lock:
            in_flight = len(self._jobs)
        try:
            if in_flight >= self.engine.n_slots + self.options.queue:
                raise QueueFullError(f"{in_flight} requests in flight")
            req = self.scheduler.submit(prepared.prompt, prepared.params, prepared.stop)
        except QueueFullError:
            self.metrics.on_reject("queue_full")
            raise unavailable(f"the server is busy: {self.engine.n_slots} slots and a queue of "
                              f"{self.options.queue} are full; retry later") from None
        except ConfigError as e:
            self.metrics.on_reject("bad_request")
            raise APIError(400, str(e), code="invalid_value") from None
        limit = min(self.options.time_limit, prepared.time_limit or self.options.time_limit)
        job = Job(req, prepared, loop, limit, prefix)
        with self._jobs_lock:
            self._jobs[req.id] = job
        self._work.set()
        return job

    def cancel(self, job: Job) -> None:
        if not job.finished and self.scheduler is not None:
            self.scheduler.cancel(job.request)
            self._work.set()

    def close(self) -> None:
        self._stop.set()
        self._work.set()
        if self._worker is not None:
            self._worker.join(timeout=10)

    # --- the worker thread ------------------------------------------------------------------
    def _run_guarded(self) -> None:
        try:
            self._run()
        except Exception as e:  # the engine broke: nothing can run on it any more
            self.error = f"engine step failed: {type(e).__name__}: {e}".splitlines()[0]
            self.state = "failed"
            self.log(self.error)
            traceback.print_exc()
            self._fail_all(self.error)

    def _run(self) -> None:
        sched = self.scheduler
        while not self._stop.is_set():
            # Forward first: a job registered just after the step that finished it still gets its events.
            self._forward()
            if not sched.has_work():
                # Idle for a second (not between the requests of a busy client): compile the next chunk.
                if self._cold_chunks and time.monotonic() - self._last_busy > 1.0:
                    T = self._cold_chunks.pop(0)
                    secs = self.engine.warmup(chunks=[T], buckets=[])
                    self.log(f"compiled prefill {T} while idle in {secs:.1f} s")
                    continue
                if self.engine.cold_plans and time.monotonic() - self._last_busy > 1.0:
                    secs = self.engine.warmup(chunks=[], decode_block=self.scheduler.decode_block,
                                              samplers=[SamplingParams(temperature=0.0)])
                    self.engine.cold_plans.clear()
                    self.log(f"compiled the greedy sampler's decode steps while idle in {secs:.1f} s")
                    continue
                self._work.wait(timeout=0.5)
                self._work.clear()
                continue
            self._expire()
            sched.step()
            self._last_busy = time.monotonic()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._jobs_lock:
            late = [j for j in self._jobs.values() if not j.timed_out and now > j.deadline]
        for job in late:
            job.timed_out = True
            self.scheduler.cancel(job.request)

    def _forward(self) -> None:
        """Move every request's new events to its job; account tokens and finished requests."""
        with self._jobs_lock:
            jobs = list(self._jobs.items())
        now = time.perf_counter()
        for rid, job in jobs:
            while True:
                try:
                    ev = job.request.events.get_nowait()
                except queue.Empty:
                    break
                if ev.token is not None:
                    self.metrics.on_token(now)
                if ev.finish_reason is None:
                    job.push(ev)
                    continue
                # Out of the job table before the client can see the end: its next request must
                # find this one's place free (the bound counts the table).
                with self._jobs_lock:
                    self._jobs.pop(rid, None)
                self.metrics.on_finish("time_limit" if job.timed_out else ev.finish_reason, job.request.timings)
                job.push(ev)
                break

    def _fail_all(self, message: str) -> None:
        with self._jobs_lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.push(Event(job.request.id, None, "", finish_reason="error", error=message))

    # --- introspection ----------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        """(requests running, requests waiting)."""
        s = self.scheduler
        return (s.n_running, s.n_waiting) if s is not None else (0, 0)

    def slots(self) -> list[dict]:
        """One entry per engine slot (llama-server's /slots shape, reduced)."""
        if self.engine is None:
            return []
        with self._jobs_lock:
            by_slot = {}
            for job in self._jobs.values():
                seq = job.request.seq
                if seq is not None and seq.slot >= 0:
                    by_slot[seq.slot] = job
        out = []
        for i in range(self.engine.n_slots):
            job = by_slot.get(i)
            entry = {"id": i, "n_ctx": self.engine.max_context, "is_processing": job is not None}
            if job is not None:
                r, p = job.request, job.prepared.params
                seq = r.seq
                entry.update(
                    id_task=job.id, n_prompt_tokens=len(r.prompt), n_decoded=len(r.tokens),
                    state="reading prompt" if seq is not None and seq.pending > 1 else "generating",
                    params={"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                            "seed": p.seed, "n_probs": p.n_probs, "max_tokens": r.stop.max_tokens,
                            "stop": list(r.stop.stop_strings)})
            out.append(entry)
        return out

    def in_flight(self) -> int:
        """Jobs submitted whose finishing event has not been forwarded yet."""
        with self._jobs_lock:
            return len(self._jobs)

    def placement_counters(self) -> dict | None:
        """Expert-call counters of an engine with host experts (None otherwise)."""
        eng = self.engine
        if eng is None or eng.placement is None or eng.placement.host is None:
            return None
        out = {"routed_calls": eng.routed_calls, "card_calls": eng.card_calls}
        if eng.residency is not None:
            out.update(eng.residency.controller.stats())
        return out

    def kv_usage(self) -> float:
        """Filled fraction of the slots' positions (from the running requests' lengths)."""
        if self.engine is None:
            return 0.0
        with self._jobs_lock:
            used = sum(len(j.request.prompt) + len(j.request.tokens) for j in self._jobs.values()
                       if j.request.seq is not None)
        return used / (self.engine.n_slots * self.engine.max_context)
