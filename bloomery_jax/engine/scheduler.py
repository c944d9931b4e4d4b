"""Continuous batching: requests join and leave between engine steps.

Contract. ``Scheduler(engine, detokenizer=tok.detokenizer)``; ``submit(prompt_ids, params,
stop)`` validates at once (ConfigError for a prompt over the context, an impossible sampling
value, bad stop conditions) and returns a :class:`Request` whose events arrive on
``request.events`` (a thread-safe queue) and through iteration. Each :class:`Event` carries one
generated token (id, text delta, raw logprob, top-n list) or none, and the last one a
``finish_reason``: ``stop`` (stop token or string), ``length`` (max tokens or the context
full), ``cancelled`` (``cancel``) or ``error``. ``cancel`` may be called at any time, from any
thread; the request's slot is freed before the next step.

``step()`` is one iteration: apply cancellations, admit waiting requests into free slots,
feed one prefill chunk (at most ``ubatch`` tokens) of the oldest sequence still reading its
prompt, then one decode step of every sequence that is generating. A long prompt therefore
delays the others by one chunk per token they generate, never by its whole length. The
server runs ``serve_forever`` in a thread; a CLI calls ``drive(request)``.

``decode_block`` n > 1: when no prompt is being read, none is waiting and every generating
sequence has n tokens of ``max_tokens`` and n positions left, they decode n steps in one device
call (``Engine.decode_block``); a sequence that stops inside the block drops the tokens after
its stop, and a cancellation or a new request waits for the block to end. The settings' 0 is
:func:`resolve_decode_block`'s choice for the device. With ``lookahead`` (the default), a block
after which the same sequences will still have n tokens and positions left launches the next
block before its own tokens are read (``Engine.decode_block(ahead=True)``): the card does not
wait for the host between blocks. A stop, a cancellation or a new request drops that block.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections import deque
from typing import Callable, Iterator, Sequence

from ..errors import BloomeryError, ConfigError
from .engine import Engine, Sampled
from .sampling import SamplingParams
from .stops import StopConditions


class QueueFullError(BloomeryError):
    """The waiting queue is at its bound (the server answers 503)."""


@dataclasses.dataclass(frozen=True)
class Event:
    request_id: int
    token: int | None  # None: an event that only ends the request
    text: str  # text delta safe to show (stop strings and unfinished characters held back)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass
class Timings:
    n_prompt: int = 0
    n_generated: int = 0
    t_submit: float = 0.0
    t_admit: float | None = None  # a slot was assigned
    t_first: float | None = None  # the first token was sampled (prompt read)
    t_end: float | None = None

    @property
    def prompt_s(self) -> float | None:
        return None if self.t_first is None or self.t_admit is None else self.t_first - self.t_admit

    @property
    def decode_s(self) -> float | None:
        return None if self.t_end is None or self.t_first is None else self.t_end - self.t_first

    @property
    def prompt_tps(self) -> float | None:
        s = self.prompt_s
        return self.n_prompt / s if s else None

    @property
    def decode_tps(self) -> float | None:
        # The first token comes from the prefill; decode speed counts the tokens after it.
        s = self.decode_s
        return (self.n_generated - 1) / s if s and self.n_generated > 1 else None


class Request:
    """One submitted request: its settings, its event queue, its timings."""

    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, stop: StopConditions, detok):
        self.id = rid
        self.prompt = prompt
        self.params = params
        self.stop = stop
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.timings = Timings(n_prompt=len(prompt), t_submit=time.perf_counter())
        self.tokens: list[int] = []  # generated token ids
        self.finish_reason: str | None = None
        self.seq = None  # the engine Sequence while it holds a slot
        self._detok = detok
        self._cancel = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def __iter__(self) -> Iterator[Event]:
        """Blocking iteration over the events until the finishing one (another thread steps)."""
        while True:
            ev = self.events.get()
            yield ev
            if ev.finish_reason is not None:
                return


# On a GPU the host's per-call work is a third of a card token: the H200's 48-layer tg128 went
# 104 -> 147 tok/s with blocks of 8 (benchmarks/gpu_2026-12-04-s10). On a CPU a token's compute
# dwarfs it (Gemma 3 270M: 13.0 -> 13.5 tok/s) while a new request would wait for a whole block.
AUTO_DECODE_BLOCK = {"gpu": 8}


def resolve_decode_block(n: int, name: str = "decode_block") -> int:
    """Decode steps per device call for a setting ``n``: itself, or for 0 the default block of
    the default backend's platform (8 on a GPU, 1 elsewhere). ``name``: the setting's name in
    the error a negative ``n`` raises."""
    if n < 0:
        raise ConfigError(f"{name} must be >= 0 (0: the device's default), got {n}")
    if n:
        return n
    import jax

    return AUTO_DECODE_BLOCK.get(jax.default_backend(), 1)


class Scheduler:
    """Continuous batching of requests over one Engine.

    Args:
      engine: the Engine (its ``n_slots`` sequences run together).
      detokenizer: factory of incremental detokenizers (``Tokenizer.detokenizer``): objects with
        ``add(id) -> str`` and ``flush() -> str``; None = events carry no text.
      max_queue: most requests waiting for a slot (None = unbounded); beyond it submit raises
        QueueFullError.
      prefill_chunk: most prompt tokens fed per iteration (default and at most engine.ubatch).
      decode_block: decode steps a device call while only generating sequences run.
      lookahead: launch each decode block before the previous one's tokens are read, where the
        sequences have room for both (module docstring).
    """

    def __init__(self, engine: Engine, detokenizer: Callable[[], object] | None = None,
                 max_queue: int | None = None, prefill_chunk: int | None = None, decode_block: int = 1,
                 lookahead: bool = True):
        if decode_block < 1:
            raise ConfigError(f"decode_block must be >= 1, got {decode_block}")
        self.engine = engine
        self.decode_block = decode_block
        self.lookahead = lookahead
        self.detokenizer = detokenizer
        self.max_queue = max_queue
        self.prefill_chunk = min(prefill_chunk or engine.ubatch, engine.ubatch)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order

    # --- from any thread --------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None,
               stop: StopConditions | None = None) -> Request:
        """Queue a request. Raises ConfigError on bad input, QueueFullError when the queue is full."""
        params = params or SamplingParams()
        stop = stop or StopConditions.build(max_tokens=self.engine.max_context)
        prompt = self.engine.check_request(prompt, params)
        detok = self.detokenizer() if self.detokenizer else None
        with self._wake:
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the queue holds {len(self._waiting)} waiting requests (its bound)")
            req = Request(next(self._ids), prompt, params, stop, detok)
            self._waiting.append(req)
            self._wake.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request; it gets a final ``cancelled`` event before the next step runs."""
        with self._wake:
            req._cancel = True
            self._wake.notify()

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    # --- the stepping thread ----------------------------------------------------------------
    def step(self) -> list[Event]:
        """One iteration (see the module docstring). Returns the events it produced."""
        events: list[Event] = []
        with self._lock:
            cancelled = [r for r in list(self._waiting) + self._running if r._cancel and not r.done]
            for r in cancelled:
                if r in self._waiting:
                    self._waiting.remove(r)
            admit = []
            while self._waiting and self.engine.free_slots - len(admit) > 0:
                admit.append(self._waiting.popleft())
        for r in cancelled:
            events.append(self._finish(r, "cancelled"))
        for r in admit:
            try:
                r.seq = self.engine.add(r.prompt, r.params)
            except ConfigError as e:  # validated at submit; kept so one bad request never stops the loop
                events.append(self._finish(r, "error", str(e)))
                continue
            r.timings.t_admit = time.perf_counter()
            self._running.append(r)

        reading = [r for r in self._running if r.seq.pending > 1]
        if reading:
            r = reading[0]
            sampled = self.engine.prefill(r.seq, self.prefill_chunk)
            if sampled is not None:
                events += self._on_token(r, sampled)
        # Sequences with one pending token: generating, just done reading, or a 1-token prompt.
        generating = [r for r in self._running if r.seq.pending == 1]
        if generating:
            n = self._block(generating, reading)
            ahead = self.lookahead and n > 1 and self._room(generating) >= 2 * n
            for step in self.engine.decode_block([r.seq for r in generating], n, ahead=ahead):
                for r, sampled in zip(generating, step):
                    if not r.done:  # a stop earlier in the block: the rest is dropped
                        events += self._on_token(r, sampled)
        return events

    def _block(self, generating: list[Request], reading: list[Request]) -> int:
        """Decode steps for this iteration: ``decode_block`` while nothing else waits for a step
        and every sequence has that many tokens and positions left, else 1 (two compiled shapes
        a bucket, whatever the lengths)."""
        if self.decode_block == 1 or reading or self._waiting:
            return 1
        return self.decode_block if self._room(generating) >= self.decode_block else 1

    def _room(self, generating: list[Request]) -> int:
        """Tokens every generating sequence may still take (max_tokens and the context)."""
        return min(min(r.stop.max_tokens - len(r.tokens), self.engine.max_context - r.seq.n_cached)
                   for r in generating)

    def _on_token(self, r: Request, s: Sampled) -> list[Event]:
        if r.timings.t_first is None:
            r.timings.t_first = time.perf_counter()
        r.tokens.append(s.token)
        n = len(r.tokens)
        r.timings.n_generated = n
        # The context is full when the new token's position (n_cached) is past the cache.
        full = r.seq.n_cached >= self.engine.max_context
        if r._detok is None or s.token in r.stop.stop_tokens:
            delta = ""
        else:
            delta = r._detok.add(s.token)
            if n >= r.stop.max_tokens or full:
                delta += r._detok.flush()
        text, reason = r.stop.on_token(s.token, delta, n)
        if reason is None and full:
            text, reason = text + r.stop.finish(), "length"
        ev = Event(r.id, s.token, text, s.logprob, tuple(s.top), reason)
        r.events.put(ev)
        if reason is not None:
            self._close(r, reason)
        return [ev]

    def _finish(self, r: Request, reason: str, error: str | None = None) -> Event:
        ev = Event(r.id, None, "", finish_reason=reason, error=error)
        r.events.put(ev)
        self._close(r, reason)
        return ev

    def _close(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        r.timings.t_end = time.perf_counter()
        if r.seq is not None:
            self.engine.release(r.seq)
            r.seq = None
        if r in self._running:
            self._running.remove(r)

    def drive(self, req: Request) -> Iterator[Event]:
        """Step until ``req`` finishes, yielding its events as they come (single-threaded use)."""
        while True:
            while True:
                try:
                    ev = req.events.get_nowait()
                except queue.Empty:
                    break
                yield ev
                if ev.finish_reason is not None:
                    return
            self.step()

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running."""
        while self.has_work():
            self.step()

    def serve_forever(self, stop: threading.Event) -> None:
        """Step whenever there is work, sleep on the condition otherwise, until ``stop`` is set."""
        while not stop.is_set():
            with self._wake:
                while not (self._waiting or self._running) and not stop.is_set():
                    self._wake.wait(timeout=0.1)
            if not stop.is_set():
                self.step()
