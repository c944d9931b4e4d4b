"""``python -m bloomery_jax.eval`` end to end on a tiny synthetic file (subprocesses), and metrics."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter

from bloomery_jax.eval import metrics
from bloomery_jax.eval.perplexity import chunk_tokens
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models.loader import load_model
from bloomery_jax.tokenizer import Tokenizer

TINY = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
            n_experts_used=2, expert_ff=64, n_vocab=320)
WORDS = "the of and to in is was for on that with as by at from his her an which it".split()


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bloomery_jax.eval", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(synth_model):
    return synth_model(qtype="F32", seed=4, **TINY)[0]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("eval") / "text.txt"
    path.write_text(" ".join(rng.choice(WORDS, 300)), encoding="utf-8")
    return path


def test_logits_cli_every_position(tiny, tmp_path):
    out = tmp_path / "logits.npy"
    ids = [5, 17, 3, 250, 9, 9, 41]
    r = run_cli("logits", "--model", tiny, "--tokens", ",".join(map(str, ids)), "--out", out, "--ubatch", 3)
    assert r.returncode == 0, r.stderr
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (len(ids), TINY["n_vocab"])
    # Against one forward pass over the whole sequence in this process (the CLI went 3 tokens
    # a step through the cache): same math, other matmul shapes; 1e-5 of the logits' std.
    m = load_model(tiny)
    one, _, _ = m.module.jit_forward(m.params, m.cfg, np.array([ids], np.int32),
                                     np.arange(len(ids), dtype=np.int32)[None], m.init_cache(1, len(ids)))
    np.testing.assert_allclose(got, np.asarray(one[0]), rtol=0, atol=1e-5 * float(np.std(one)))


def test_logits_cli_text_uses_the_vocabulary(tiny, tmp_path):
    out = tmp_path / "t.npy"
    r = run_cli("logits", "--model", tiny, "--text", "the cat and the hat", "--out", out)
    assert r.returncode == 0, r.stderr
    n = len(Tokenizer.from_gguf(GGUFFile(tiny)).encode("the cat and the hat"))
    assert np.load(out).shape == (n, TINY["n_vocab"])


def test_perplexity_and_self_kl(tiny, text_file, tmp_path):
    base = tmp_path / "base.npz"
    r = run_cli("perplexity", "--model", tiny, "--text-file", text_file, "--ctx", 64, "--save-base", base, "--json")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert math.isfinite(first["ppl"]) and first["ppl"] > 1 and first["n_chunks"] >= 2
    assert first["n_scored"] == first["n_chunks"] * (64 - 1 - 32)
    with np.load(base) as z:
        assert z["logits"].shape == (first["n_chunks"], 31, TINY["n_vocab"])
    r = run_cli("perplexity", "--model", tiny, "--text-file", text_file, "--ctx", 64, "--kl-base", base, "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    # The same model on the same tokens: identical logits, so KL is exactly 0 and top-1 agrees.
    assert res["kl_mean"] == 0.0 and res["kl_max"] == 0.0 and res["kl_p99"] == 0.0
    assert res["same_top1_pct"] == 100.0
    assert res["ppl"] == res["base_ppl"] == first["ppl"]
    # A base made with another --ctx is refused in one line.
    r = run_cli("perplexity", "--model", tiny, "--text-file", text_file, "--ctx", 32, "--kl-base", base)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert "computed with --ctx 64, this run uses 32" in r.stderr


def test_other_architecture_is_one_line_error(tmp_path):
    path = tmp_path / "llama.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for cmd in (["logits", "--tokens", "1,2", "--out", tmp_path / "x.npy"], ["perplexity", "--text-file", path]):
        r = run_cli(cmd[0], "--model", path, *cmd[1:])
        assert r.returncode == 1 and r.stdout == ""
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "architecture 'llama' is not supported" in lines[0]


def test_bad_inputs_are_one_line_errors(tiny, tmp_path):
    cases = [
        (["logits", "--model", tiny, "--tokens", "1,x", "--out", tmp_path / "a.npy"], "comma-separated integers"),
        (["logits", "--model", tiny, "--tokens", "1,320", "--out", tmp_path / "a.npy"], "outside the vocabulary"),
        (["perplexity", "--model", tiny, "--text-file", tmp_path / "none.txt"], "cannot read --text-file"),
        (["perplexity", "--model", tiny, "--text-file", tiny, "--kl-base", tiny], "not a base-logits file"),
        (["logits", "--model", tmp_path / "missing.gguf", "--tokens", "1", "--out", tmp_path / "a.npy"], "no such file"),
    ]
    for args, msg in cases:
        r = run_cli(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and msg in lines[0], (args, r.stderr)


def test_chunking_follows_llama_perplexity():
    toks = np.arange(10, 110, dtype=np.int32)  # 100 tokens, ctx 32: 3 chunks, the tail dropped
    chunks = chunk_tokens(toks, 32, bos_id=1)
    assert chunks.shape == (3, 32) and chunks[:, 0].tolist() == [1, 1, 1]
    assert chunks[1, 1:].tolist() == list(range(43, 74))
    assert chunk_tokens(toks, 32, bos_id=None)[2, 0] == 74
    with pytest.raises(ValueError, match="needs at least 128"):
        chunk_tokens(toks, 64, bos_id=None)


def test_metrics_by_hand():
    V = 50
    uniform = np.zeros((7, V), np.float32)
    ppl, err = metrics.perplexity(metrics.token_nll(uniform, np.arange(7)))
    assert ppl == pytest.approx(V, rel=1e-12) and err == 0.0  # uniform: every token costs ln V
    p = np.log(np.array([[0.5, 0.25, 0.25]]))
    q = np.log(np.array([[0.25, 0.5, 0.25]]))
    # KL(p || q) = 0.5 ln 2 - 0.25 ln 2 = 0.25 ln 2
    assert metrics.kl_divergence(p, q)[0] == pytest.approx(0.25 * math.log(2), rel=1e-12)
    rep = metrics.kl_report(np.concatenate([p, p]), np.concatenate([q, p]))
    assert rep["kl_max"] == pytest.approx(0.25 * math.log(2)) and rep["same_top1_pct"] == 50.0
    assert rep["kl_p99"] == pytest.approx(0.99 * 0.25 * math.log(2))  # linear between the two sorted values
