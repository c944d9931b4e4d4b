"""The embedded default model's Gemma 3 vocabulary (SentencePiece, 262,144 tokens) against
llama.cpp: ids on the multilingual corpus with every add_special/parse_special combination,
every token's piece, detokenization and random strings of awkward characters. About 15 s:
reading the file takes ~3 s, building the tokenizer ~4 s of CPU (the merges derived from 262k
scores), the piece check 262k llama.cpp calls."""

from __future__ import annotations

import ctypes
import json
import random
import time
from pathlib import Path

import pytest

from bloomery_jax.default_model import default_model_path
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.tokenizer import Tokenizer

pytestmark = pytest.mark.llamacpp

DATA = Path(__file__).parent / "data"
CORPUS = json.loads((DATA / "tokenizer_corpus.json").read_text(encoding="utf-8"))
# Awkward characters plus Gemma's special texts and fragments of them.
PIECES = json.loads((DATA / "tokenizer_pieces.json").read_text(encoding="utf-8")) + [
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused3>", "<0x41>", "<table>", "</td>",
    "<start_of", "_turn>", "\u2581", "\u2581\u2581", "<mask>", "[multimodal]", "<start_of_image>",
]


@pytest.fixture(scope="module")
def gemma_file():
    return GGUFFile(default_model_path())


@pytest.fixture(scope="module")
def ours(gemma_file):
    start = time.process_time()
    tok = Tokenizer.from_gguf(gemma_file)
    tok.build_seconds = time.process_time() - start
    return tok


@pytest.fixture(scope="module")
def theirs():
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)


def test_vocabulary_facts(ours):
    v = ours.vocab
    assert v.model == "llama" and ours.n_vocab == 262144
    assert (v.bos_id, v.eos_id, v.add_bos, v.add_space_prefix) == (2, 1, True, False)
    assert v.chat_template is None  # the embedded file has none; chat.GEMMA_TEMPLATE stands in
    assert ours.token_id("<end_of_turn>") in ours.eog_ids
    # CPU seconds, generous for a loaded 2-core machine (about 3 s when idle).
    assert ours.build_seconds < 12, ours.build_seconds


@pytest.mark.parametrize("parse_special", [False, True])
@pytest.mark.parametrize("add_special", [False, True])
def test_ids_match_llamacpp(ours, theirs, add_special, parse_special):
    mismatches = []
    for text in CORPUS:
        ref = theirs.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
        got = ours.encode(text, add_special=add_special, parse_special=parse_special)
        if got != ref:
            mismatches.append((text, ref, got))
    assert not mismatches, f"{len(mismatches)} texts differ; first: {mismatches[0]}"


def test_every_piece_matches_llamacpp(ours, theirs):
    import llama_cpp

    buf = ctypes.create_string_buffer(1024)
    vocab = theirs._model.vocab
    for special in (False, True):
        for i in range(ours.n_vocab):
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
            assert ours.token_bytes(i, special) == buf.raw[:n], (i, ours.vocab.tokens[i], special)


def test_decode_matches_llamacpp_and_round_trips(ours, theirs):
    import llama_cpp

    for text in CORPUS:
        ids = ours.encode(text, parse_special=True)
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(4 * len(text) + 1024)
        n = llama_cpp.llama_detokenize(theirs._model.vocab, arr, len(ids), buf, len(buf), False, True)
        assert ours.decode(ids, special=True) == buf.raw[:n].decode("utf-8", errors="replace")
        assert ours.decode(ids[1:], special=True) == text  # ids[0] is BOS
        det = ours.detokenizer()
        assert "".join(det.add(i) for i in ids) + det.flush() == ours.decode(ids)


def test_random_texts_match_llamacpp(ours, theirs):
    rng = random.Random(0)
    mismatches = []
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40)))
        parse_special = rng.random() < 0.5
        ref = theirs.tokenize(text.encode("utf-8"), add_bos=False, special=parse_special)
        got = ours.encode(text, add_special=False, parse_special=parse_special)
        if got != ref:
            mismatches.append((text, parse_special, ref, got))
    assert not mismatches, f"{len(mismatches)} of 3000 differ; first: {mismatches[0]}"
