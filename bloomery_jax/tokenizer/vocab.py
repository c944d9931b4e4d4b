"""The vocabulary of a GGUF file: token texts, types, scores and special-token rules.

:class:`Vocab` reads the ``tokenizer.*`` metadata keys and applies llama.cpp's rules for what
the file leaves out (default BOS/EOS ids, whether BOS is added, the space prefix), so that the
encoder and decoder built on it agree with llama.cpp on the same file. Only the ``gpt2``
(byte-level BPE) and ``llama`` (SentencePiece) models are supported; anything else, and any
malformed key, is a GGUFError naming the key.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import GGUFError
from .pretok import SUPPORTED_PRE, PreTokenizerRule, pre_tokenizer_rule

# gguf.TokenType values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SUPPORTED_MODELS = ("gpt2", "llama")

# Texts llama.cpp recognises as end-of-turn, end-of-generation and fill-in-the-middle tokens;
# it makes them control tokens whatever type the file gives them.
_EOT_BY_TEXT = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)
_EOG_BY_TEXT = frozenset(_EOT_BY_TEXT) | {
    "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "</s>", "<|eom_id|>", "[EOS]", "<eos>",
    "<turn|>", "<|tool_response>", "[e~[",
}
# Fill-in-the-middle pad, repo and file-separator tokens also end generation.
_FIM_EOG_BY_TEXT = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})
_FIM_BY_TEXT = _FIM_EOG_BY_TEXT | {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "\u2581<PRE>", "<|code_prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "\u2581<SUF>", "<|code_suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "\u2581<MID>", "<|code_middle|>",
}
_CONTROL_BY_TEXT = _EOG_BY_TEXT | _FIM_BY_TEXT


@dataclasses.dataclass
class Vocab:
    """Token table and special-token rules of one GGUF file.

    Attributes:
      path: the file, for error messages.
      model: ``gpt2`` or ``llama``.
      pre: the pre-tokenizer rule (byte-level BPE only; None for ``llama``).
      tokens: token text by id ([V] strings; empty texts renamed ``[EMPTY_<id>]`` as llama.cpp does).
      types: token type by id ([V] int).
      scores: SentencePiece score by id ([V] float; zeros when the file has none).
      bos_id, eos_id, eot_id, unk_id, pad_id: ids or None.
      add_bos, add_eos, add_space_prefix: llama.cpp's effective flags.
      chat_template: ``tokenizer.chat_template`` or None.
    """

    path: str
    model: str
    pre: PreTokenizerRule | None
    tokens: list[str]
    types: np.ndarray
    scores: np.ndarray
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def special_ids(self, parse_special: bool) -> list[int]:
        """Ids split out of raw text before the model runs, longest text (in bytes) first.

        User-defined tokens are always split out; control and unknown ones only when
        ``parse_special``. Ties keep id order.
        """
        kinds = (CONTROL, UNKNOWN, USER_DEFINED) if parse_special else (USER_DEFINED,)
        ids = np.flatnonzero(np.isin(self.types, kinds)).tolist()
        return sorted(ids, key=lambda i: -len(self.tokens[i].encode("utf-8")))

    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS, EOT and the end-of-turn tokens found by their text."""
        ids = {i for i in (self.eos_id, self.eot_id) if i is not None}
        ids |= {i for i in np.flatnonzero(self.types == CONTROL).tolist()
                if self.tokens[i] in _EOG_BY_TEXT | _FIM_EOG_BY_TEXT}
        return frozenset(ids)


def read_vocab(gf) -> Vocab:
    """Build the :class:`Vocab` of an open GGUFFile.

    Args:
      gf: a bloomery_jax.gguf_file.GGUFFile.
    Returns:
      the vocabulary.
    Raises:
      GGUFError: unsupported ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``, or a malformed key.
    """
    path = gf.path
    model = gf.require("tokenizer.ggml.model", str)
    if model not in SUPPORTED_MODELS:
        raise GGUFError(path, f"tokenizer model {model!r} is not supported (supported: "
                        f"{', '.join(SUPPORTED_MODELS)})", key="tokenizer.ggml.model")
    tokens = gf.require("tokenizer.ggml.tokens", list)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFError(path, "must be a non-empty array of strings", key="tokenizer.ggml.tokens")
    n = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(tokens)) != n:  # llama.cpp aborts on such a file (an assertion in its loader)
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise GGUFError(path, f"token text {t!r} appears twice (ids {seen[t]} and {i})",
                                key="tokenizer.ggml.tokens")
            seen[t] = i
    types = _int_array(gf, "tokenizer.ggml.token_type", n, default=NORMAL)
    scores = _float_array(gf, "tokenizer.ggml.scores", n)
    for i, t in enumerate(tokens):
        if t in _CONTROL_BY_TEXT and types[i] != CONTROL:
            types[i] = CONTROL

    pre = None
    if model == "gpt2":
        name = gf.get("tokenizer.ggml.pre")
        if name is None:
            raise GGUFError(path, "is missing; llama.cpp would fall back to 'default' with degraded "
                            "quality; set it explicitly", key="tokenizer.ggml.pre")
        if not isinstance(name, str) or (pre := pre_tokenizer_rule(name)) is None:
            raise GGUFError(path, f"pre-tokenizer {name!r} is not supported (supported: "
                            f"{', '.join(SUPPORTED_PRE)})", key="tokenizer.ggml.pre")
        bos, eos, unk = 11, 11, None  # llama.cpp's defaults for gpt2 vocabularies
        if pre.no_default_bos:
            bos = None
        add_bos, add_space_prefix = pre.add_bos_default, False
    else:
        bos, eos, unk = 1, 2, 0
        add_bos, add_space_prefix = True, True
    # A default id outside the vocabulary is dropped, as llama.cpp does.
    bos, eos, unk = (i if i is not None and i < n else None for i in (bos, eos, unk))

    return Vocab(
        path=path, model=model, pre=pre, tokens=tokens, types=types, scores=scores,
        bos_id=_token_id(gf, "tokenizer.ggml.bos_token_id", n, bos),
        eos_id=_token_id(gf, "tokenizer.ggml.eos_token_id", n, eos),
        eot_id=_token_id(gf, "tokenizer.ggml.eot_token_id", n, _first_with_text(tokens, _EOT_BY_TEXT)),
        unk_id=_token_id(gf, "tokenizer.ggml.unknown_token_id", n, unk),
        pad_id=_token_id(gf, "tokenizer.ggml.padding_token_id", n, None),
        add_bos=_flag(gf, "tokenizer.ggml.add_bos_token", add_bos),
        add_eos=_flag(gf, "tokenizer.ggml.add_eos_token", False),
        add_space_prefix=_flag(gf, "tokenizer.ggml.add_space_prefix", add_space_prefix),
        chat_template=_optional_str(gf, "tokenizer.chat_template"),
    )


def _first_with_text(tokens: list[str], texts) -> int | None:
    wanted = set(texts)
    return next((i for i, t in enumerate(tokens) if t in wanted), None)


def _int_array(gf, key: str, n: int, default: int) -> np.ndarray:
    value = gf.get(key)
    if value is None:
        return np.full(n, default, np.int32)
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise GGUFError(gf.path, "must be an array of integers", key=key)
    if len(arr) < n:
        raise GGUFError(gf.path, f"has {len(arr)} entries for {n} tokens", key=key)
    return arr[:n].astype(np.int32)


def _float_array(gf, key: str, n: int) -> np.ndarray:
    value = gf.get(key)
    if value is None:
        return np.zeros(n, np.float32)
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "fiu":
        raise GGUFError(gf.path, "must be an array of numbers", key=key)
    if len(arr) < n:
        raise GGUFError(gf.path, f"has {len(arr)} entries for {n} tokens", key=key)
    return arr[:n].astype(np.float32)


def _token_id(gf, key: str, n: int, default: int | None) -> int | None:
    value = gf.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(gf.path, f"must be an integer token id, found {type(value).__name__}", key=key)
    if not 0 <= value < n:
        raise GGUFError(gf.path, f"token id {value} is outside the vocabulary of {n}", key=key)
    return value


def _flag(gf, key: str, default: bool) -> bool:
    value = gf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise GGUFError(gf.path, f"must be a bool, found {type(value).__name__}", key=key)
    return value


def _optional_str(gf, key: str) -> str | None:
    value = gf.get(key)
    if value is not None and not isinstance(value, str):
        raise GGUFError(gf.path, f"must be a string, found {type(value).__name__}", key=key)
    return value
