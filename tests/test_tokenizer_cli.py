"""``python -m bloomery_jax.tokenize``: ids as JSON, detokenize, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest

from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.synth.vocab import add_to_writer, byte_bpe_vocab
from bloomery_jax.tokenize import main, run
from bloomery_jax.tokenizer import Tokenizer

TEXT = "Hello 세계 <|im_start|>user\n😀"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    add_to_writer(w, byte_bpe_vocab(600))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_gguf(GGUFFile(model))


def test_subprocess_prints_ids(model, tok):
    out = subprocess.run([sys.executable, "-m", "bloomery_jax.tokenize", "--model", str(model), "--text", TEXT],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == tok.encode(TEXT, parse_special=True)
    assert out.stderr == ""


def test_flags_and_text_file(model, tok, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    got = json.loads(run(["--model", str(model), "--text-file", str(f), "--no-parse-special", "--no-add-special"]))
    assert got == tok.encode(TEXT, add_special=False, parse_special=False)
    assert tok.token_id("<|im_start|>") not in got


def test_detokenize(model, tok):
    ids = tok.encode(TEXT, parse_special=True)
    assert run(["--model", str(model), "--detokenize", "--text", json.dumps(ids)]) == tok.decode(ids)
    assert run(["--model", str(model), "--detokenize", "--special", "--text", json.dumps(ids)]) == TEXT


@pytest.mark.parametrize("argv,match", [
    (["--text", "x", "--text-file", "y"], "not allowed with argument"),
    ([], "one of the arguments --text --text-file is required"),
    (["--text-file", "/nonexistent/t.txt"], "cannot read --text-file"),
    (["--detokenize", "--text", "[1, 2"], "JSON array of token ids"),
    (["--detokenize", "--text", '["a"]'], "integer token ids"),
    (["--detokenize", "--text", "[100000]"], "token id 100000 is outside the vocabulary of 600"),
])
def test_errors_are_one_line(model, capsys, argv, match):
    assert main(["--model", str(model), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err


def test_bad_model_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all, really not")
    assert main(["--model", str(bad), "--text", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err


@pytest.mark.slow
def test_default_model_without_model_flag():
    ids = json.loads(run(["--text", "Hello world"]))
    assert ids == [2, 9259, 1902]  # BOS, "Hello", "▁world" in Gemma 3's vocabulary (llama.cpp gives the same)
