"""Build the ``tokenizers.Tokenizer`` that encodes raw text (no special tokens) for a Vocab.

Byte-level BPE (``gpt2``): the pre-tokenizer rule's regexes as a sequence of isolating splits,
then GPT-2's byte-to-unicode mapping, then BPE with the file's merges (ranked by position).

SentencePiece (``llama``): spaces become ``▁`` and the whole fragment is one word. llama.cpp
merges, at every step, the adjacent pair whose concatenation is a vocabulary token of highest
score (leftmost on ties) and falls back to ``<0xNN>`` byte tokens for what is left unmatched.
BPE whose merges are every split ``a + b`` of every token ``t`` (both parts tokens), ranked
by the score of ``t``, performs the same merges; the one difference is among different tokens of
exactly equal score, where BPE prefers the lower id instead of the leftmost pair (Gemma's normal
tokens have distinct scores; its control and byte tokens share -1000 and 0).

Special tokens are not registered here: splitting them out of the text follows llama.cpp's
own rule (longest first, see core.py), which ``tokenizers``' added-token matcher does not.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import GGUFError
from .vocab import Vocab

SPACE = "\u2581"  # SentencePiece's visible space


def token_to_id(vocab: Vocab) -> dict[str, int]:
    """Text -> id (read_vocab has checked that every text is listed once)."""
    return {t: i for i, t in enumerate(vocab.tokens)}


def build_bpe(vocab: Vocab, merges: object, ids: dict[str, int]) -> Tokenizer:
    """The byte-level BPE encoder of a ``gpt2`` vocabulary.

    Args:
      vocab: the vocabulary (``vocab.pre`` set).
      merges: the ``tokenizer.ggml.merges`` value: list of ``"left right"`` strings.
      ids: token_to_id(vocab).
    Returns:
      a tokenizers.Tokenizer producing the same ids as llama.cpp for text free of special tokens.
    """
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise GGUFError(vocab.path, "must be an array of strings", key="tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if cut < 0:
            continue
        left, right = m[:cut], m[cut + 1:]
        # A merge whose parts or result are not tokens can never yield a token id; skip it.
        if left in ids and right in ids and left + right in ids:
            pairs.append((left, right))
    model = models.BPE(vocab=ids, merges=pairs, ignore_merges=vocab.pre.ignore_merges, byte_fallback=False)
    tok = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in vocab.pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(vocab: Vocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Merges equivalent to llama.cpp's score-driven SentencePiece merging, best first.

    Returns:
      (left, right) pairs, ranked by the score of left + right (higher first), then by its id.
    """
    has = ids.__contains__
    found = [(tid, text[:k], text[k:]) for text, tid in ids.items()
             for k in range(1, len(text)) if has(text[:k]) and has(text[k:])]  # ~0.5M for Gemma
    tids = np.fromiter((f[0] for f in found), np.int64, len(found))
    order = np.lexsort((tids, -vocab.scores[tids]))  # score descending, then id
    return [found[k][1:] for k in order.tolist()]


def build_spm(vocab: Vocab, ids: dict[str, int]) -> Tokenizer:
    """The SentencePiece encoder of a ``llama`` vocabulary (space prefix handled by the caller).

    Args:
      vocab: the vocabulary.
      ids: token_to_id(vocab).
    Returns:
      a tokenizers.Tokenizer producing llama.cpp's ids for text free of special tokens.
    """
    missing = [b for b in range(256) if f"<0x{b:02X}>" not in ids]
    if missing:
        raise GGUFError(vocab.path, f"SentencePiece vocabulary lacks byte tokens such as "
                        f"<0x{missing[0]:02X}> ({len(missing)} missing)", key="tokenizer.ggml.tokens")
    model = models.BPE(vocab=ids, merges=spm_merges(vocab, ids), byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok
