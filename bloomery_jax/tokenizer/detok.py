"""Streaming detokenization that never emits a broken UTF-8 character.

A model emits tokens one by one and a character may span several of them (byte-fallback
tokens, or byte-level BPE pieces of a CJK character or an emoji). :class:`IncrementalDetokenizer`
keeps the bytes of an unfinished character until the next token completes it; bytes that can
never form a character become U+FFFD at once. Joining everything it returns, plus
:meth:`IncrementalDetokenizer.flush`, equals ``Tokenizer.decode`` of the same ids.
"""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    """Feed ids one at a time (or in chunks); get back the text that is complete so far.

    Args:
      tokenizer: a bloomery_jax.tokenizer.Tokenizer.
      special: render control tokens as their text.
    """

    def __init__(self, tokenizer, special: bool = False):
        self._tok = tokenizer
        self._special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SentencePiece with a space prefix: the first token's leading space is dropped.
        self._strip_space = tokenizer.strips_first_space
        self._started = False

    def add(self, ids) -> str:
        """Text completed by these ids (possibly empty).

        Args:
          ids: one id or an iterable of ids.
        """
        if isinstance(ids, int):
            ids = (ids,)
        ids = list(ids)
        data = self._tok.decode_bytes(ids, self._special)
        if ids and not self._started:
            self._started = True
            if self._strip_space and self._tok.token_bytes(ids[0], self._special).startswith(b" "):
                data = data[1:]
        return self._decoder.decode(data)

    def flush(self) -> str:
        """Whatever is left (an unfinished character becomes U+FFFD); the stream then restarts."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        self._started = False
        return text
