"""Pre-tokenizer splits against llama.cpp, made visible.

The vocabulary here is trained with *no* pre-tokenization on random strings over an alphabet
of awkward characters (tests/data/tokenizer_pieces.json: every Unicode category the regexes test, odd whitespace, contractions,
digits of other scripts, emoji sequences), so it holds merges across every boundary a ``pre``
regex may draw. Labelled with each supported ``pre``, the ids then differ from llama.cpp's as
soon as one piece boundary differs (llama.cpp applies its own regex engines: hand-written
splitters for some patterns, std::regex over category-collapsed text for others).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import pytest

from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.synth.vocab import add_to_writer
from bloomery_jax.tokenizer import SUPPORTED_PRE, Tokenizer

pytestmark = pytest.mark.llamacpp

PIECES = json.loads((Path(__file__).parent / "data" / "tokenizer_pieces.json").read_text(encoding="utf-8"))


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    rng = random.Random(1)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=6000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([random_text(rng) for _ in range(4000)], trainer=trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    specials = ["<|x0|>", "<|x1|>"]  # texts absent from the training strings
    root = tmp_path_factory.mktemp("splits")
    out = {}
    for pre in SUPPORTED_PRE:
        w = gguf.GGUFWriter(str(root / f"{pre}.gguf"), "qwen3moe")
        add_to_writer(w, {
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens + specials,
            "tokenizer.ggml.token_type": [1] * len(tokens) + [3] * len(specials),
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": len(tokens),
            "tokenizer.ggml.eos_token_id": len(tokens) + 1, "tokenizer.ggml.add_bos_token": False,
        })
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out[pre] = root / f"{pre}.gguf"
    return out


@pytest.mark.parametrize("pre", SUPPORTED_PRE)
def test_random_texts_match_llamacpp(files, pre):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(files[pre]), vocab_only=True, verbose=False)
    tok = Tokenizer.from_gguf(GGUFFile(files[pre]))
    rng = random.Random(0)
    mismatches = []
    for _ in range(1500):
        text = random_text(rng)
        ref = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        got = tok.encode(text, add_special=False)
        if got != ref:
            mismatches.append((text, ref, got))
    assert not mismatches, f"{len(mismatches)} of 1500 differ; first: {mismatches[0]}"
