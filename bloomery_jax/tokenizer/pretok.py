"""Pre-tokenizer rules of byte-level BPE vocabularies, keyed by ``tokenizer.ggml.pre``.

A rule is what llama.cpp (src/llama-vocab.cpp, checked against llama-cpp-python 0.3.36's
vendored copy) applies for that ``pre`` value: a list of regexes applied one after another,
each splitting every piece left by the previous one into its matches and the gaps between
them, plus the vocabulary flags that go with the name. The regexes are facts about those
tokenizers; they are written here in the form the ``tokenizers`` library's Oniguruma engine
reads. An unknown name is an error, never a silent default.
"""

from __future__ import annotations

import dataclasses

# Contractions written without (?i:...) because llama.cpp's engines lack inline flags.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _GPT2,
    r"\p{N}+",
    "[0-9][0-9][0-9]",
)


@dataclasses.dataclass(frozen=True)
class PreTokenizerRule:
    """How one ``tokenizer.ggml.pre`` value splits text before BPE.

    Attributes:
      name: the canonical ``pre`` name.
      regexes: applied in order; each splits every current piece (matches and gaps both kept).
      ignore_merges: a whole piece that is itself a vocabulary token is emitted as that token
        without running merges (llama.cpp does this for llama3 and glm4 vocabularies).
      add_bos_default: whether a BOS token is added when the GGUF has no
        ``tokenizer.ggml.add_bos_token`` key.
      no_default_bos: without a ``tokenizer.ggml.bos_token_id`` key there is no BOS token
        (llama.cpp clears its default BOS for glm4; an explicit key still sets one).
    """

    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos_default: bool = False
    no_default_bos: bool = False


_RULES = {
    "default": PreTokenizerRule("default", _DEFAULT),
    "qwen2": PreTokenizerRule("qwen2", (_QWEN2,)),
    "llama-bpe": PreTokenizerRule("llama-bpe", (_LLAMA3,), ignore_merges=True, add_bos_default=True),
    "deepseek-v3": PreTokenizerRule("deepseek-v3", _DEEPSEEK3),
    "glm4": PreTokenizerRule("glm4", (_LLAMA3,), ignore_merges=True, no_default_bos=True),
    "gpt-2": PreTokenizerRule("gpt-2", (_GPT2,)),
}

# Other spellings llama.cpp maps onto the same rule.
_ALIASES = {
    "llama3": "llama-bpe",
    "llama-v3": "llama-bpe",
    "deepseek-r1-qwen": "qwen2",
    "glm5": "glm4",
}

SUPPORTED_PRE = tuple(sorted(_RULES))


def pre_tokenizer_rule(pre: str) -> PreTokenizerRule | None:
    """The rule for a ``tokenizer.ggml.pre`` value, or None when it is not supported.

    Args:
      pre: the metadata value (an alias such as ``llama3`` maps to its canonical rule).
    Returns:
      the rule, or None; the caller turns None into a GGUFError naming the key.
    """
    return _RULES.get(_ALIASES.get(pre, pre))
