"""Server counters and their Prometheus text exposition (format 0.0.4, written by hand).

Contract. The provider's worker thread calls :meth:`Metrics.on_token` and
:meth:`Metrics.on_finish`; ``/metrics`` calls :meth:`Metrics.render` with the scheduler's
live gauges. Names follow llama-server's meaning under a ``bloomery_`` prefix: prompt and
generated token totals, the seconds spent on each (so tok/s = tokens / seconds), requests
running and queued, and a decode rate over the last ``WINDOW_S`` seconds.
"""

from __future__ import annotations

import collections
import threading
import time

WINDOW_S = 10.0


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.generated_tokens = 0
        self.decode_seconds = 0.0
        self.decode_tokens = 0  # tokens after each finished request's first (what decode_seconds timed)
        self.finished = collections.Counter()  # finish reason -> requests
        self.rejected = collections.Counter()  # reason (queue_full, bad_request, ...) -> requests
        self._recent: collections.deque[float] = collections.deque()  # times of generated tokens
        self.started = time.time()

    def on_token(self, now: float) -> None:
        with self._lock:
            self.generated_tokens += 1
            self._recent.append(now)
            self._trim(now)

    def on_finish(self, reason: str, timings) -> None:
        with self._lock:
            self.finished[reason] += 1
            if timings.prompt_s is not None:
                self.prompt_tokens += timings.n_prompt
                self.prompt_seconds += timings.prompt_s
            if timings.decode_s is not None and timings.n_generated > 1:
                self.decode_seconds += timings.decode_s
                self.decode_tokens += timings.n_generated - 1

    def on_reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0] < now - WINDOW_S:
            self._recent.popleft()

    def render(self, *, running: int, queued: int, slots: int, queue_bound: int, kv_used: float,
               in_flight: int, placement: dict | None = None) -> str:
        """The exposition text. ``placement`` (engines with host experts): routed and card-served
        expert calls, and with residency the swaps and bytes moved to the card."""
        now = time.perf_counter()
        with self._lock:
            self._trim(now)
            recent = len(self._recent) / WINDOW_S
            p_tps = self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0
            d_tps = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
            rows = [
                ("prompt_tokens_total", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)]),
                ("prompt_seconds_total", "counter", "Seconds spent reading prompts.", [("", self.prompt_seconds)]),
                ("tokens_predicted_total", "counter", "Generated tokens.", [("", self.generated_tokens)]),
                ("tokens_predicted_seconds_total", "counter", "Seconds spent generating after the first token.",
                 [("", self.decode_seconds)]),
                ("prompt_tokens_per_second", "gauge", "Average prompt throughput (tokens/s).", [("", p_tps)]),
                ("predicted_tokens_per_second", "gauge", "Average per-request decode throughput (tokens/s).",
                 [("", d_tps)]),
                ("recent_tokens_per_second", "gauge", f"Generated tokens per second over the last {WINDOW_S:g} s.",
                 [("", recent)]),
                ("requests_processing", "gauge", "Requests holding a slot.", [("", running)]),
                ("requests_deferred", "gauge", "Requests waiting for a slot.", [("", queued)]),
                ("requests_in_flight", "gauge", "Requests submitted and not yet answered in full.",
                 [("", in_flight)]),
                ("slots_total", "gauge", "Sequence slots (--parallel).", [("", slots)]),
                ("queue_bound", "gauge", "Most requests that may wait for a slot.", [("", queue_bound)]),
                ("kv_cache_usage_ratio", "gauge", "Filled fraction of the KV cache.", [("", kv_used)]),
                ("requests_finished_total", "counter", "Finished requests by finish reason.",
                 [(f'{{reason="{k}"}}', v) for k, v in sorted(self.finished.items())]),
                ("requests_rejected_total", "counter", "Requests refused before running, by reason.",
                 [(f'{{reason="{k}"}}', v) for k, v in sorted(self.rejected.items())]),
            ]
        if placement:
            routed, card = placement["routed_calls"], placement["card_calls"]
            rows += [
                ("expert_calls_total", "counter", "Routed (token, expert) calls.", [("", routed)]),
                ("expert_calls_card_total", "counter", "Routed calls the card served.", [("", card)]),
                ("expert_card_served_ratio", "gauge", "Fraction of routed calls the card served.",
                 [("", card / routed if routed else 0.0)]),
            ]
            if "swaps_total" in placement:
                rows += [
                    ("expert_swaps_total", "counter", "Experts seated on the card by residency.",
                     [("", placement["swaps_total"])]),
                    ("expert_swap_bytes_total", "counter", "Bytes of expert blocks copied to the card.",
                     [("", placement["bytes_moved"])]),
                ]
        out = []
        for name, kind, doc, samples in rows:
            full = f"bloomery_{name}"
            out.append(f"# HELP {full} {doc}")
            out.append(f"# TYPE {full} {kind}")
            for labels, value in samples:
                out.append(f"{full}{labels} {_num(value)}")
        return "\n".join(out) + "\n"


def _num(v) -> str:
    return str(v) if isinstance(v, int) else repr(float(v))
