"""One submitted request as the HTTP handlers see it: events arriving on an asyncio queue.

Contract. The provider's worker thread calls :meth:`Job.push` with each scheduler
:class:`~bloomery_jax.engine.scheduler.Event`; the handler, on the event loop, awaits
:meth:`Job.next`, which also watches the client: if it has gone away, :meth:`Job.next` raises
:class:`ClientGone` and the handler cancels the job (its slot is freed before the next step).
A job whose time limit passed is cancelled by the worker and marked ``timed_out``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from ..engine.scheduler import Event
from .prompts import Prepared

POLL_S = 0.25  # how often a waiting handler checks for a client disconnect


class ClientGone(Exception):
    """The HTTP client disconnected while its request was running."""


class Job:
    """A request in flight.

    Attributes:
      request: the scheduler's Request (timings, generated tokens, finish reason).
      prepared: prompt ids and settings.
      id: the response id (``chatcmpl-…`` / ``cmpl-…``).
      created: Unix time of submission (OpenAI's ``created``).
      deadline: time.monotonic() after which the worker cancels the job.
      timed_out: set by the worker when the deadline cancelled it.
    """

    def __init__(self, request, prepared: Prepared, loop: asyncio.AbstractEventLoop, time_limit: float,
                 prefix: str):
        self.request = request
        self.prepared = prepared
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.deadline = time.monotonic() + time_limit
        self.time_limit = time_limit
        self.timed_out = False
        self.finished = False  # the finishing event was pushed
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._getter: asyncio.Task | None = None
        self._checked = time.monotonic()  # last client check

    # --- worker thread ------------------------------------------------------------------------
    def push(self, ev: Event) -> None:
        if ev.finish_reason is not None:
            self.finished = True
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
        except RuntimeError:  # the event loop has closed (server shutting down)
            pass

    # --- event loop ---------------------------------------------------------------------------
    async def next(self, http_request=None) -> Event:
        """The next event; raises ClientGone when ``http_request``'s client has disconnected.

        The client is checked every POLL_S seconds whether or not events keep coming (a busy
        request always has one ready, and must still notice its client leaving).
        """
        if http_request is not None and time.monotonic() - self._checked >= POLL_S:
            self._checked = time.monotonic()
            if await http_request.is_disconnected():
                raise ClientGone()
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self._queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=POLL_S if http_request is not None else None)
            if done:
                ev, self._getter = self._getter.result(), None
                return ev
            self._checked = time.monotonic()
            if await http_request.is_disconnected():
                raise ClientGone()

    def discard(self) -> None:
        """Drop the pending queue read (the handler is leaving)."""
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None
