"""GGUF vocabularies as tokenizers that give the same ids as llama.cpp.

``Tokenizer.from_gguf(gf)`` reads ``tokenizer.*`` metadata: byte-level BPE (``gpt2``, with the
pre-tokenizer rules of pretok.py) and SentencePiece (``llama``, as in Gemma). ``encode``,
``decode`` and ``detokenizer()`` (streaming, UTF-8 safe) are the whole interface; an
unsupported model or ``pre`` is a GGUFError naming the key.
"""

from .core import Tokenizer
from .detok import IncrementalDetokenizer
from .pretok import SUPPORTED_PRE
from .vocab import SUPPORTED_MODELS, Vocab, read_vocab

__all__ = ["Tokenizer", "IncrementalDetokenizer", "Vocab", "read_vocab", "SUPPORTED_PRE", "SUPPORTED_MODELS"]
