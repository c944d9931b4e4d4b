"""Text <-> token ids for a GGUF file, matching llama.cpp's ``llama_tokenize``.

Encoding follows llama.cpp's order: (1) split special tokens out of the text, one token at a
time from the longest text to the shortest, each cutting every remaining text fragment at all
its occurrences (user-defined tokens always, control/unknown tokens only with
``parse_special``); (2) encode each text fragment with the ``tokenizers`` model from build.py
(SentencePiece fragments get a leading space when ``add_space_prefix`` and the fragment starts
the text or follows a special token); (3) add BOS/EOS when ``add_special`` and the file asks.

Decoding maps each id to its bytes (control tokens only with ``special=True``, unused tokens
never) and joins them; invalid UTF-8 becomes U+FFFD. See detok.py for streaming.
"""

from __future__ import annotations

from ..errors import ConfigError
from .build import SPACE, build_bpe, build_spm, token_to_id
from .vocab import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Vocab, read_vocab


class Tokenizer:
    """Tokenizer of one GGUF vocabulary.

    Attributes:
      vocab: the Vocab (token table, special ids, flags, chat template).
      backend: the tokenizers.Tokenizer that encodes text without special tokens.
    """

    def __init__(self, vocab: Vocab, merges: object = None):
        self.vocab = vocab
        self._ids = token_to_id(vocab)
        if vocab.model == "gpt2":
            self.backend = build_bpe(vocab, merges, self._ids)
        else:
            self.backend = build_spm(vocab, self._ids)
        self._specials = {True: vocab.special_ids(True), False: vocab.special_ids(False)}
        self._eog_ids = vocab.eog_ids()
        self._pieces: list[bytes] | None = None
        self._special_pieces: list[bytes] | None = None

    @classmethod
    def from_gguf(cls, gf) -> "Tokenizer":
        """Build from an open bloomery_jax.gguf_file.GGUFFile; GGUFError on a bad vocabulary."""
        vocab = read_vocab(gf)
        return cls(vocab, gf.get("tokenizer.ggml.merges") if vocab.model == "gpt2" else None)

    # --- properties -------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation (EOS, EOT, end-of-turn tokens)."""
        return self._eog_ids

    def token_id(self, text: str) -> int | None:
        """Id of the token whose text is exactly ``text``, or None."""
        return self._ids.get(text)

    # --- encoding ---------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
          text: the input.
          add_special: add BOS/EOS as the file's add_bos_token/add_eos_token say.
          parse_special: recognise control-token texts (``<|im_start|>``) in ``text`` as
            those tokens; user-defined tokens are recognised either way.
        Returns:
          ids, as llama.cpp's ``llama_tokenize(text, add_special, parse_special)`` gives them.
        """
        if not isinstance(text, str):
            raise ConfigError(f"tokenizer input must be str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: not text llama.cpp could receive
            raise ConfigError(f"tokenizer input is not valid Unicode: {e.reason} at index {e.start}") from None
        v = self.vocab
        out: list[int] = []
        if add_special and v.add_bos:
            if v.bos_id is None:
                raise ConfigError(f"{v.path}: the vocabulary asks for a BOS token but has none")
            out.append(v.bos_id)
        fragments = self.split_specials(text, parse_special) if text else []
        spm = v.model == "llama"
        prev_special = True
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if spm and v.add_space_prefix and prev_special:
                frag = " " + frag
            out.extend(self.backend.encode(frag, add_special_tokens=False).ids)
            prev_special = False
        if add_special and v.add_eos:
            if v.eos_id is None:
                raise ConfigError(f"{v.path}: the vocabulary asks for an EOS token but has none")
            out.append(v.eos_id)
        return out

    def split_specials(self, text: str, parse_special: bool) -> list[str | int]:
        """Step (1) of encoding: text fragments (str) and special-token ids (int), in order."""
        frags: list[str | int] = [text]
        tokens = self.vocab.tokens
        for sid in self._specials[parse_special]:
            stext = tokens[sid]
            if stext not in text:  # cheap test on the whole text first
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or stext not in frag:
                    new.append(frag)
                    continue
                for k, part in enumerate(frag.split(stext)):
                    if k:
                        new.append(sid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    # --- decoding ---------------------------------------------------------------------------
    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes one token stands for (empty for control tokens unless ``special``)."""
        self._check_id(token)
        table = self._piece_tables()[1 if special else 0]
        return table[token]

    def decode_bytes(self, ids, special: bool = False) -> bytes:
        """The bytes of a sequence of ids (may end inside a UTF-8 character)."""
        table = self._piece_tables()[1 if special else 0]
        ids = list(ids)
        try:
            if ids and (min(ids) < 0 or max(ids) >= len(table)):
                raise IndexError
            return b"".join(table[i] for i in ids)
        except (IndexError, TypeError):
            bad = next(i for i in ids if not (hasattr(i, "__index__") and 0 <= i < len(table)))
            raise ConfigError(f"token id {bad!r} is outside the vocabulary of {len(table)}") from None

    def decode(self, ids, special: bool = False) -> str:
        """Text of a sequence of ids; invalid UTF-8 becomes U+FFFD.

        Args:
          ids: token ids.
          special: render control tokens as their text (llama.cpp's ``special`` flag).
        """
        ids = list(ids)
        data = self.decode_bytes(ids, special)
        if ids and self.strips_first_space and self.token_bytes(ids[0], special).startswith(b" "):
            data = data[1:]  # the space the encoder put in front (llama.cpp strips it likewise)
        return data.decode("utf-8", errors="replace")

    @property
    def strips_first_space(self) -> bool:
        """Decoding drops one leading space of the first token (SentencePiece space prefix)."""
        return self.vocab.model == "llama" and self.vocab.add_space_prefix

    def detokenizer(self, special: bool = False) -> "IncrementalDetokenizer":
        """A streaming decoder; see :class:`IncrementalDetokenizer`."""
        from .detok import IncrementalDetokenizer

        return IncrementalDetokenizer(self, special)

    def _check_id(self, token) -> None:
        if not isinstance(token, int) or not 0 <= token < self.n_vocab:
            raise ConfigError(f"token id {token!r} is outside the vocabulary of {self.n_vocab}")

    def _piece_tables(self) -> tuple[list[bytes], list[bytes]]:
        """Per-id bytes without and with control tokens; built on first use."""
        if self._pieces is None:
            plain, with_special = [], []
            byte_level = self.vocab.model == "gpt2"
            inverse = _unicode_to_byte() if byte_level else None
            for text, kind in zip(self.vocab.tokens, self.vocab.types.tolist()):
                if kind in (CONTROL, UNKNOWN):
                    piece, shown = b"", text.encode("utf-8")
                elif kind == USER_DEFINED:
                    piece = shown = text.encode("utf-8")
                elif kind == NORMAL:
                    piece = shown = (_byte_decode(text, inverse) if byte_level
                                     else text.replace(SPACE, " ").encode("utf-8"))
                elif kind == BYTE:
                    piece = shown = _byte_token_value(text)
                else:  # unused or undefined tokens print nothing in llama.cpp
                    piece = shown = b""
                plain.append(piece)
                with_special.append(shown)
            self._pieces, self._special_pieces = plain, with_special
        return self._pieces, self._special_pieces


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest
    to U+0100 upward in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    rest = sorted(set(range(256)) - set(keep))
    table.update({chr(0x100 + k): b for k, b in enumerate(rest)})
    return table


def _byte_decode(text: str, inverse: dict[str, int]) -> bytes:
    out = bytearray()
    for ch in text:
        b = inverse.get(ch)
        if b is None:  # not a byte-level character; keep the character itself
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _byte_token_value(text: str) -> bytes:
    """``<0x41>`` -> b'A'; a byte token of another shape decodes to its own text."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return text.encode("utf-8")

