"""Tokenizer tests on synthetic vocabularies: byte-level BPE for every supported ``pre`` and a
small SentencePiece one, each checked id for id against llama.cpp on the same GGUF file, plus
decoding, streaming and the errors for unsupported or malformed vocabularies."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import gguf
import pytest

from bloomery_jax.errors import ConfigError, GGUFError
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.synth.vocab import (
    MIN_VOCAB, SPECIAL_TOKENS, VALUE_TYPES, add_to_writer, byte_bpe_vocab, sentencepiece_vocab,
)
from bloomery_jax.tokenizer import SUPPORTED_PRE, Tokenizer

CORPUS = json.loads((Path(__file__).parent / "data" / "tokenizer_corpus.json").read_text(encoding="utf-8"))
PRES = ["qwen2", "llama-bpe", "deepseek-v3", "glm4", "default", "gpt-2"]


def write_vocab(path: Path, entries: dict, arch: str = "qwen3moe") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    add_to_writer(w, entries)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def without(entries: dict, *keys: str, **changes) -> dict:
    out = {k: v for k, v in entries.items() if k not in keys}
    out.update({k.replace("__", "."): v for k, v in changes.items()})
    return out


def llama_piece(llm, token: int, special: bool) -> bytes:
    """llama.cpp's token_to_piece with a buffer large enough for any token."""
    import llama_cpp

    buf = ctypes.create_string_buffer(1024)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, len(buf), 0, special)
    assert 0 <= n <= len(buf)
    return buf.raw[:n]


# --- files: one per vocabulary variant, shared by the module ------------------------------------
VARIANTS = {
    **{pre: (lambda pre=pre: byte_bpe_vocab(1000, pre=pre, seed=1)) for pre in PRES},
    # No add_bos key: llama-bpe defaults to adding BOS; glm4 has no BOS unless the file names one.
    "llama-bpe-nobos-key": lambda: without(byte_bpe_vocab(800, pre="llama-bpe"), "tokenizer.ggml.add_bos_token"),
    "glm4-no-bos": lambda: without(byte_bpe_vocab(800, pre="glm4"), "tokenizer.ggml.add_bos_token",
                                   "tokenizer.ggml.bos_token_id"),
    "qwen2-add-eos": lambda: without(byte_bpe_vocab(800, pre="qwen2"), tokenizer__ggml__add_eos_token=True),
    "spm": lambda: sentencepiece_vocab(1200, seed=2),
    "spm-space-prefix": lambda: sentencepiece_vocab(1200, seed=2, add_space_prefix=True),
}


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {name: write_vocab(root / f"{name}.gguf", make()) for name, make in VARIANTS.items()}


@pytest.fixture(scope="module")
def ours(vocab_files):
    return {name: Tokenizer.from_gguf(GGUFFile(p)) for name, p in vocab_files.items()}


@pytest.fixture(scope="module")
def theirs(vocab_files):
    llama_cpp = pytest.importorskip("llama_cpp")
    return {name: llama_cpp.Llama(model_path=str(p), vocab_only=True, verbose=False)
            for name, p in vocab_files.items()}


# --- against llama.cpp ---------------------------------------------------------------------------
@pytest.mark.llamacpp
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("parse_special", [False, True])
@pytest.mark.parametrize("add_special", [False, True])
def test_ids_match_llamacpp(ours, theirs, name, parse_special, add_special):
    tok, llm = ours[name], theirs[name]
    mismatches = []
    for text in CORPUS:
        ref = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
        got = tok.encode(text, add_special=add_special, parse_special=parse_special)
        if got != ref:
            mismatches.append((text, ref, got))
    assert not mismatches, f"{len(mismatches)} texts differ; first: {mismatches[0]}"


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", ["qwen2", "glm4", "spm", "spm-space-prefix"])
@pytest.mark.parametrize("special", [False, True])
def test_token_pieces_match_llamacpp(ours, theirs, name, special):
    tok, llm = ours[name], theirs[name]
    assert llm.n_vocab() == tok.n_vocab
    for i in range(tok.n_vocab):
        assert tok.token_bytes(i, special) == llama_piece(llm, i, special), (i, tok.vocab.tokens[i])


@pytest.mark.llamacpp
def test_bos_eos_rules_match_llamacpp(ours, theirs):
    for name in VARIANTS:
        tok, llm = ours[name], theirs[name]
        ref = llm.tokenize(b"hi", add_bos=True, special=False)
        got = tok.encode("hi", add_special=True)
        assert got == ref, name
    assert ours["llama-bpe-nobos-key"].encode("hi")[0] == ours["llama-bpe-nobos-key"].bos_id
    assert ours["glm4-no-bos"].bos_id is None
    assert ours["qwen2-add-eos"].encode("hi")[-1] == ours["qwen2-add-eos"].eos_id


@pytest.mark.llamacpp
def test_synthesized_model_tokenizer_matches_llamacpp(tiny_model):
    """The tokenizer inside a synthesized qwen3moe model (the synth package's writer)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tiny_model), vocab_only=True, verbose=False)
    tok = Tokenizer.from_gguf(GGUFFile(tiny_model))
    for text in CORPUS:
        assert tok.encode(text, parse_special=True) == llm.tokenize(text.encode(), add_bos=True, special=True)


# --- decoding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2", "deepseek-v3", "spm", "spm-space-prefix"])
def test_decode_round_trips(ours, name):
    tok = ours[name]
    for text in CORPUS:
        ids = tok.encode(text, add_special=False, parse_special=True)
        if tok.vocab.add_space_prefix and any(isinstance(f, int) for f in tok.split_specials(text, True)):
            continue  # SentencePiece adds a space after every special token: not invertible
        assert tok.decode(ids, special=True) == text
        if "<" not in text:  # no control-token texts: plain decoding gives the text back too
            assert tok.decode(ids) == text


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", ["qwen2", "deepseek-v3", "spm", "spm-space-prefix"])
@pytest.mark.parametrize("special", [False, True])
def test_decode_matches_llamacpp(ours, theirs, name, special):
    """llama_detokenize without cleanup: the vocabularies whose clean_spaces is off in llama.cpp
    (we never apply HF's clean_up_tokenization_spaces; streaming servers do not either)."""
    import llama_cpp

    tok, llm = ours[name], theirs[name]
    for text in CORPUS:
        ids = tok.encode(text, add_special=True, parse_special=True)
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(4 * len(text) + 1024)
        n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, len(buf), False, special)
        assert 0 <= n <= len(buf)
        assert tok.decode(ids, special=special) == buf.raw[:n].decode("utf-8", errors="replace"), text


@pytest.mark.parametrize("name", ["qwen2", "spm", "spm-space-prefix"])
def test_streaming_never_emits_broken_utf8(ours, name):
    tok = ours[name]
    for text in CORPUS:
        ids = tok.encode(text, add_special=False)
        det = tok.detokenizer()
        chunks = [det.add(i) for i in ids] + [det.flush()]
        assert "".join(chunks) == tok.decode(ids)
        if "\ufffd" not in text:
            assert not any("\ufffd" in c for c in chunks), text


def test_streaming_holds_a_split_character(ours):
    tok = ours["qwen2"]
    emoji = "🧑🏿‍🚀"  # several tokens per code point in a 1000-token vocabulary
    ids = tok.encode(emoji, add_special=False)
    assert len(ids) > len(emoji)
    det = tok.detokenizer()
    out = [det.add(i) for i in ids]
    assert "".join(out) == emoji
    assert out[0] == ""  # the first token is a partial UTF-8 sequence
    # A stream cut inside a character ends in one replacement character, not a crash.
    det = tok.detokenizer()
    assert det.add(ids[:1]) == "" and det.flush() == "\ufffd"


def test_decode_rejects_bad_ids(ours):
    tok = ours["qwen2"]
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tok.decode([1, tok.n_vocab])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tok.decode([-1])


def test_special_tokens_parsed_only_when_asked(ours):
    tok = ours["qwen2"]
    im_start = tok.token_id("<|im_start|>")
    assert tok.encode("<|im_start|>", add_special=False, parse_special=True) == [im_start]
    assert im_start not in tok.encode("<|im_start|>", add_special=False, parse_special=False)
    assert tok.eos_id == tok.token_id("<|im_end|>") and tok.eos_id in tok.eog_ids


# --- the synthetic vocabulary itself ----------------------------------------------------------------
@pytest.mark.parametrize("pre", PRES)
def test_byte_bpe_vocab_shape_and_types(pre):
    v = byte_bpe_vocab(MIN_VOCAB + 211, pre=pre, seed=3)
    assert set(v) <= set(VALUE_TYPES)
    tokens, types = v["tokenizer.ggml.tokens"], v["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == MIN_VOCAB + 211 and len(set(tokens)) == len(tokens)
    assert all(type(t) is str for t in tokens) and all(type(t) is int for t in types)
    assert all(type(m) is str and m.count(" ") == 1 for m in v["tokenizer.ggml.merges"])
    for s in SPECIAL_TOKENS:
        assert types[tokens.index(s)] == 3
    assert v["tokenizer.ggml.pre"] == pre and v["tokenizer.ggml.add_bos_token"] is False
    # Real text gets multi-byte tokens in every script of the corpus.
    assert any(len(t) >= 3 and all(ord(c) >= 0x80 for c in t) for t in tokens)


def test_byte_bpe_vocab_is_deterministic_and_seeded():
    a, b = byte_bpe_vocab(700, seed=5), byte_bpe_vocab(700, seed=5)
    assert a == b
    assert byte_bpe_vocab(700, seed=6)["tokenizer.ggml.merges"] != a["tokenizer.ggml.merges"]


def test_byte_bpe_vocab_pads_large_sizes():
    v = byte_bpe_vocab(5000)
    tokens, types = v["tokenizer.ggml.tokens"], v["tokenizer.ggml.token_type"]
    assert len(tokens) == 5000 and tokens[-1] == "[PAD4999]" and types[-1] == 5


def test_byte_bpe_vocab_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="minimum"):
        byte_bpe_vocab(MIN_VOCAB - 1)
    with pytest.raises(ConfigError, match="unknown pre 'nope'"):
        byte_bpe_vocab(400, pre="nope")


# --- errors for unsupported or malformed vocabularies -------------------------------------------------
@pytest.mark.parametrize("key,value,match", [
    ("tokenizer.ggml.pre", "tekken", r"pre-tokenizer 'tekken' is not supported .*key 'tokenizer.ggml.pre'"),
    ("tokenizer.ggml.model", "t5", r"tokenizer model 't5' is not supported .*key 'tokenizer.ggml.model'"),
    ("tokenizer.ggml.bos_token_id", 10**6, r"outside the vocabulary .*key 'tokenizer.ggml.bos_token_id'"),
])
def test_unsupported_vocab_is_a_gguf_error(tmp_path, key, value, match):
    entries = byte_bpe_vocab(400)
    entries[key] = value
    path = write_vocab(tmp_path / "bad.gguf", entries)
    with pytest.raises(GGUFError, match=match):
        Tokenizer.from_gguf(GGUFFile(path))


def test_missing_pre_and_merges_are_gguf_errors(tmp_path):
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.merges"):
        path = write_vocab(tmp_path / "bad.gguf", without(byte_bpe_vocab(400), key))
        with pytest.raises(GGUFError, match=key.replace(".", r"\.")):
            Tokenizer.from_gguf(GGUFFile(path))


def test_short_token_type_array_is_a_gguf_error(tmp_path):
    entries = byte_bpe_vocab(400)
    entries["tokenizer.ggml.token_type"] = entries["tokenizer.ggml.token_type"][:-1]
    path = write_vocab(tmp_path / "bad.gguf", entries)
    with pytest.raises(GGUFError, match="399 entries for 400 tokens"):
        Tokenizer.from_gguf(GGUFFile(path))


def test_every_supported_pre_is_tested():
    assert set(PRES) == set(SUPPORTED_PRE)


def test_repeated_token_text_is_a_gguf_error(tmp_path):
    # llama.cpp aborts (an assertion in its loader) on such a file; we refuse it cleanly.
    entries = byte_bpe_vocab(400)
    entries["tokenizer.ggml.tokens"][-1] = entries["tokenizer.ggml.tokens"][100]
    path = write_vocab(tmp_path / "bad.gguf", entries)
    with pytest.raises(GGUFError, match=r"appears twice \(ids 100 and 399\).*tokenizer.ggml.tokens"):
        Tokenizer.from_gguf(GGUFFile(path))
