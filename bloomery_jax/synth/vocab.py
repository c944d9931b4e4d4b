"""A real byte-level BPE vocabulary for synthetic GGUF models.

:func:`byte_bpe_vocab` trains BPE merges (the ``tokenizers`` library's trainer) on a small
built-in multilingual corpus, pre-tokenized by the rule of the requested ``pre``, and returns the
``tokenizer.*`` metadata entries of a GGUF file holding exactly ``n_vocab`` tokens. Text in
English, code, Korean, Chinese, Japanese and emoji gets multi-byte tokens, so tokenizer tests
against llama.cpp exercise real merges. The result is a pure function of its arguments.

Token layout (as in Qwen's GGUFs): the 256 byte tokens and the trained merges first, then the
control tokens ``<|endoftext|>`` (BOS and padding), ``<|im_start|>``, ``<|im_end|>`` (EOS), then
``[PAD<i>]`` tokens of type UNUSED when the corpus yields fewer merges than asked for.

:func:`sentencepiece_vocab` gives a small Gemma-style (``llama`` model) vocabulary the same way.

Values are plain Python; :data:`VALUE_TYPES` names the GGUF type of each key and
:func:`add_to_writer` writes the entries with the matching ``gguf.GGUFWriter`` calls.
"""

from __future__ import annotations

import json
import random

from ..chat import CHATML_TEMPLATE, GEMMA_TEMPLATE
from ..errors import ConfigError
from ..tokenizer.pretok import SUPPORTED_PRE, pre_tokenizer_rule

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB = 300

# key -> GGUF value type: "string", "uint32", "bool", or ("array", element type).
VALUE_TYPES: dict[str, object] = {
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.ggml.tokens": ("array", "string"),
    "tokenizer.ggml.token_type": ("array", "int32"),
    "tokenizer.ggml.merges": ("array", "string"),
    "tokenizer.ggml.scores": ("array", "float32"),
    "tokenizer.ggml.bos_token_id": "uint32",
    "tokenizer.ggml.eos_token_id": "uint32",
    "tokenizer.ggml.padding_token_id": "uint32",
    "tokenizer.ggml.unknown_token_id": "uint32",
    "tokenizer.ggml.add_bos_token": "bool",
    "tokenizer.ggml.add_eos_token": "bool",
    "tokenizer.ggml.add_space_prefix": "bool",
    "tokenizer.chat_template": "string",
}

# Built-in training text: a few lines per script, so merges cover each of them.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. It's a test, isn't it? We'll see; they've gone.
Mixture-of-Experts models route every token to a few experts out of many.
A workstation with one GPU and a lot of host memory can still run a large model.
Tokenization must match llama.cpp exactly, including spaces, tabs and newlines.
In 2024 the price rose from $3.50 to $12.75 (an increase of 264%), said Dr. Smith.
Hello, world! HELLO WORLD. hello world... Hello   world.
def forward(params, cfg, tokens, positions, cache):
    logits = jnp.einsum("td,vd->tv", hidden, params["output.weight"])
    return logits, cache
for (int i = 0; i < n; ++i) { sum += x[i] * w[i]; }
if __name__ == "__main__":
    print(json.dumps({"key": [1, 2, 3], "ok": True}))
SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name;
<html><body><p class="note">Hi &amp; bye</p></body></html>
안녕하세요. 오늘 날씨가 정말 좋네요. 저는 한국어를 공부하고 있습니다.
대한민국의 수도는 서울입니다. 감사합니다! 모델이 토큰을 예측합니다.
你好，世界！今天天气很好。我们正在测试分词器。
人工智能模型可以理解中文和英文。这是一个混合专家模型。
こんにちは、世界。今日はいい天気ですね。東京は日本の首都です。
私は日本語を勉強しています。トークナイザーのテストをしています。
Привет, мир! Это проверка токенизатора. Ça va très bien, merci. Größe und Übung.
Emoji: 😀 😂 🎉 👍 🚀 ❤️ 👨‍👩‍👧‍👦 🇰🇷 🇯🇵 ✨ 🔥 and more 🙂🙃.
Numbers: 0 1 2 3 42 100 1000 3.14159 2,718 1e-6 0x1F 123456789.
Whitespace:  two spaces,   three,\ttab,\n\nblank lines,    four spaces.
"""

_WORDS_EXTRA = (
    "model token expert layer cache routing weight tensor quantized block scale host device "
    "prefill decode sampling temperature probability vocabulary merge byte unicode"
).split()


def _training_lines(seed: int) -> list[str]:
    """The corpus lines plus seeded random word sequences; the seed changes merge ties and counts."""
    rng = random.Random(seed)
    lines = _CORPUS.splitlines(keepends=True)
    words = _CORPUS.split() + _WORDS_EXTRA
    extra = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + "\n" for _ in range(64)]
    lines = lines * 3 + extra
    rng.shuffle(lines)
    return lines


def byte_bpe_vocab(n_vocab: int, pre: str = "qwen2", seed: int = 0) -> dict[str, object]:
    """GGUF ``tokenizer.*`` metadata of a trained byte-level BPE vocabulary.

    Args:
      n_vocab: exact number of tokens, at least MIN_VOCAB (256 bytes + specials + some merges).
      pre: the ``tokenizer.ggml.pre`` value; merges are trained under its pre-tokenizer rule.
      seed: changes the training text order and extra lines; equal seeds give equal output.
    Returns:
      key -> plain Python value (str, int, bool, list[str], list[int]); types in VALUE_TYPES.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    if n_vocab < MIN_VOCAB:
        raise ConfigError(f"byte_bpe_vocab: n_vocab {n_vocab} is below the minimum {MIN_VOCAB}")
    rule = pre_tokenizer_rule(pre)
    if rule is None:
        raise ConfigError(f"byte_bpe_vocab: unknown pre {pre!r}; supported: {', '.join(SUPPORTED_PRE)}")

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    n_train = n_vocab - len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_train,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_training_lines(seed), trainer=trainer)

    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens))), "trainer ids are not dense"
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]

    types = [NORMAL] * len(tokens)
    first_special = len(tokens)
    tokens += SPECIAL_TOKENS
    types += [CONTROL] * len(SPECIAL_TOKENS)
    while len(tokens) < n_vocab:  # the corpus ran out of pairs to merge
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
    if len(set(tokens)) != len(tokens):
        raise ConfigError("byte_bpe_vocab: the trained vocabulary repeats a token text")
    endoftext, _im_start, im_end = range(first_special, first_special + 3)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": rule.name,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": endoftext,
        "tokenizer.ggml.eos_token_id": im_end,
        "tokenizer.ggml.padding_token_id": endoftext,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


# SentencePiece layout (as in Gemma's GGUF): specials, byte tokens, a few user-defined tokens
# that are split out of any text, then the trained pieces.
_SPM_HEAD = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
             ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED),
             ("  ", USER_DEFINED), ("<b>", USER_DEFINED)]


def sentencepiece_vocab(n_vocab: int, seed: int = 0, add_space_prefix: bool = False) -> dict[str, object]:
    """GGUF ``tokenizer.*`` metadata of a trained SentencePiece-style (``llama`` model) vocabulary.

    Pieces are BPE-trained on the built-in corpus with spaces written as U+2581; a piece's
    score is minus its training rank, so earlier merges win, as in SentencePiece BPE models.
    Padding to n_vocab uses ``<unusedN>`` control tokens, as Gemma does.

    Args:
      n_vocab: exact number of tokens, at least MIN_VOCAB.
      seed: as in byte_bpe_vocab.
      add_space_prefix: the ``tokenizer.ggml.add_space_prefix`` flag.
    Returns:
      key -> plain Python value; types in VALUE_TYPES.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if n_vocab < MIN_VOCAB:
        raise ConfigError(f"sentencepiece_vocab: n_vocab {n_vocab} is below the minimum {MIN_VOCAB}")
    head = _SPM_HEAD + [(f"<0x{b:02X}>", BYTE) for b in range(256)]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    lines = [line.replace("\n", " ") for line in _training_lines(seed)]
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - len(head), min_frequency=2, show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]

    tokens = [t for t, _ in head] + pieces
    types = [k for _, k in head] + [NORMAL] * len(pieces)
    scores = [-1000.0 if k in (CONTROL, USER_DEFINED, UNKNOWN) else 0.0 for _, k in head]
    scores += [-float(rank) for rank in range(len(pieces))]
    while len(tokens) < n_vocab:
        tokens.append(f"<unused{len(tokens) - len(head) - len(pieces)}>")
        types.append(CONTROL)
        scores.append(-1000.0)
    if len(set(tokens)) != len(tokens):
        raise ConfigError("sentencepiece_vocab: a trained piece repeats a special token's text")
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
        "tokenizer.chat_template": GEMMA_TEMPLATE,
    }


def add_to_writer(writer, entries: dict[str, object]) -> None:
    """Write ``entries`` (from :func:`byte_bpe_vocab`) into a ``gguf.GGUFWriter``.

    Args:
      writer: an open gguf.GGUFWriter, before its header is written.
      entries: key -> value; every key must be in VALUE_TYPES.
    """
    import gguf

    for key, value in entries.items():
        kind = VALUE_TYPES.get(key)
        if kind == "string":
            writer.add_string(key, value)
        elif kind == "uint32":
            writer.add_uint32(key, value)
        elif kind == "bool":
            writer.add_bool(key, value)
        elif kind == ("array", "string"):
            writer.add_array(key, value)
        elif kind == ("array", "int32"):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        elif kind == ("array", "float32"):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        else:
            raise ConfigError(f"add_to_writer: no GGUF type known for key {key!r}")
