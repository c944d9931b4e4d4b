"""Stop conditions of one request, on the host: stop tokens, stop strings, max tokens.

Contract. :class:`StopStrings` turns the stream of text deltas into the text to emit: a stop
string may be split across tokens, so the longest tail of the pending text that is a prefix of
some stop string is held back until the next delta proves it is not one (or completes it). On a
match the text before the stop string is emitted and the stop string itself is not. A stop string
that never comes costs nothing but the held-back tail (at most the longest stop string's length
minus one), which :meth:`StopStrings.flush` releases when the request ends for another reason.

:class:`StopConditions` adds stop tokens (the token is not emitted) and ``max_tokens``.
Finish reasons are OpenAI's: ``"stop"`` and ``"length"``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from ..errors import ConfigError


class StopStrings:
    """Incremental stop-string matcher over text deltas."""

    def __init__(self, stops: Sequence[str]):
        stops = list(stops)
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ConfigError(f"stop string {s!r}: must be a non-empty string")
        self.stops = stops
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta. Returns (text safe to emit now, whether a stop string matched)."""
        text = self._held + delta
        if not self.stops:
            self._held = ""
            return text, False
        # The earliest match wins (equal starts emit the same text, whichever string it is).
        best = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
        if best is not None:
            self._held = ""
            return text[:best], True
        hold = self._partial_tail(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """Release the held-back tail (the request ended without a stop string)."""
        out, self._held = self._held, ""
        return out

    @property
    def held(self) -> str:
        return self._held


@dataclasses.dataclass
class StopConditions:
    """All the stop rules of one request.

    Args:
      max_tokens: the most tokens to generate (>= 1).
      stop_tokens: token ids that end generation (EOS, end-of-turn, user's); not emitted.
      stop_strings: strings that end generation; not emitted.
    """

    max_tokens: int
    stop_tokens: frozenset[int] = frozenset()
    stop_strings: Sequence[str] = ()

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_tokens!r}: must be a positive integer")
        self.stop_tokens = frozenset(int(t) for t in self.stop_tokens)
        self._strings = StopStrings(self.stop_strings)

    @classmethod
    def build(cls, max_tokens: int, stop_tokens: Iterable[int] = (), stop_strings: Sequence[str] | str = ()):
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        return cls(max_tokens, frozenset(stop_tokens), tuple(stop_strings))

    def on_token(self, token: int, delta: str, n_generated: int) -> tuple[str, str | None]:
        """Account one generated token.

        Args:
          token: the token id just generated.
          delta: its text delta from the incremental detokenizer.
          n_generated: tokens generated so far, this one included.
        Returns:
          (text to emit, finish reason or None to go on).
        """
        if token in self.stop_tokens:
            return self._strings.flush(), "stop"
        text, matched = self._strings.feed(delta)
        if matched:
            return text, "stop"
        if n_generated >= self.max_tokens:
            return text + self._strings.flush(), "length"
        return text, None

    def finish(self) -> str:
        """Text still held back when the request ends for an outside reason (context, cancel)."""
        return self._strings.flush()
