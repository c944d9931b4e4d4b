"""python -m bloomery_jax.generate on a synthetic qwen3moe model, checked against the model's own path.

The engine's greedy tokens are compared with greedy decoding through the architecture's plain
``jit_forward`` and its own KVCache (models/kv_cache.py): a different cache, a different step
layout, no slots. Greedy tokens are robust to the 1e-6-level differences of summation order
(see test_engine_gates.py); the prompt is fixed, so a near-tie would show up as a stable failure.
"""

from __future__ import annotations

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

from bloomery_jax import generate
from bloomery_jax.models.loader import load_model
from bloomery_jax.tokenizer import Tokenizer

SHAPE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, n_experts_used=2,
             expert_ff=64, n_vocab=512)
COMMON = ["--ubatch", "16", "--no-compile-cache", "--quiet"]  # ubatch 16: the shapes test_bench.py uses


@pytest.fixture(scope="module")
def model_path(synth_model):
    return str(synth_model(seed=3, **SHAPE)[0])


def own_path_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the model module's plain forward and KV cache."""
    m = load_model(path)
    cache = m.init_cache(1, len(prompt) + n)
    logits, cache, _ = m.module.jit_forward(m.params, m.cfg, jnp.asarray([prompt], jnp.int32),
                                            jnp.arange(len(prompt), dtype=jnp.int32)[None], cache)
    out = [int(np.argmax(logits[0, -1]))]
    for i in range(n - 1):
        pos = len(prompt) + i
        logits, cache, _ = m.module.jit_forward(m.params, m.cfg, jnp.asarray([[out[-1]]], jnp.int32),
                                                jnp.asarray([[pos]], jnp.int32), cache)
        out.append(int(np.argmax(logits[0, 0])))
    return out


def test_json_greedy_matches_the_model_own_path(model_path):
    buf = io.StringIO()
    rec = generate.run(["--model", model_path, "--prompt", "The quick brown fox", "-n", "12", "--temperature", "0",
                        "--json", *COMMON], out=buf, err=io.StringIO())
    assert json.loads(buf.getvalue()) == json.loads(json.dumps(rec))
    tok = Tokenizer.from_gguf(load_model(model_path).gguf)
    assert rec["prompt_tokens"] == tok.encode("The quick brown fox", add_special=True)
    want = own_path_greedy(model_path, rec["prompt_tokens"], 12)
    if rec["finish_reason"] == "stop":  # an end-of-generation token ended it early
        assert rec["tokens"] == want[: len(rec["tokens"])] and rec["tokens"][-1] in tok.eog_ids
    else:
        assert rec["finish_reason"] == "length" and rec["tokens"] == want
    t = rec["timings"]
    assert t["n_prompt"] == len(rec["prompt_tokens"]) and t["n_generated"] == len(rec["tokens"])
    assert t["prompt_tps"] > 0 and t["load_s"] > 0 and t["compile_s"] > 0


def test_streams_text_and_ends_with_rates(model_path):
    out, err = io.StringIO(), io.StringIO()
    rec = generate.run(["--model", model_path, "--prompt", "Hello", "-n", "6", "--seed", "7", "--top-k", "5",
                        *COMMON], out=out, err=err)
    assert out.getvalue() == rec["text"] + "\n"
    last = err.getvalue().strip().splitlines()[-1]
    assert last.startswith(f"prompt: {len(rec['prompt_tokens'])} tokens,") and "decode:" in last and "tok/s" in last
    # the same seed again: the same tokens
    again = generate.run(["--model", model_path, "--prompt", "Hello", "-n", "6", "--seed", "7", "--top-k", "5",
                          "--json", *COMMON], out=io.StringIO(), err=io.StringIO())
    assert again["tokens"] == rec["tokens"]
    # decoded four steps a device call: the same tokens and text (-n 6: one block, then single steps)
    blocks = generate.run(["--model", model_path, "--prompt", "Hello", "-n", "6", "--seed", "7", "--top-k", "5",
                           "--decode-block", "4", "--json", *COMMON], out=io.StringIO(), err=io.StringIO())
    assert blocks["tokens"] == rec["tokens"] and blocks["text"] == rec["text"]


def test_chat_renders_the_template(model_path):
    rec = generate.run(["--model", model_path, "--prompt", "Hi", "--chat", "-n", "2", "--temperature", "0", "--json",
                        *COMMON], out=io.StringIO(), err=io.StringIO())
    tok = Tokenizer.from_gguf(load_model(model_path).gguf)
    text = tok.decode(rec["prompt_tokens"], special=True)
    assert "Hi" in text and text != "Hi" and len(rec["prompt_tokens"]) > len(tok.encode("Hi"))


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--model", "/nonexistent/m.gguf"], "m.gguf"),
    (["--prompt", "x", "-n", "0"], "-n must be >= 1"),
    (["--prompt", "x", "--temperature", "-2"], "temperature"),
    (["--prompt", "x", "--top-p", "abc"], "invalid float"),
    (["--model", "M"], "--prompt"),
])
def test_errors_are_one_line(argv, message, model_path, capsys):
    argv = argv if "--model" in argv else ["--model", model_path, *argv]
    assert generate.main([*argv, *COMMON]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_residency_and_routing_trace(model_path, tmp_path):
    """--place/--residency/--record-routing: the same greedy tokens as all on the card, placement
    numbers in the record, and a trace holding every real token of every step."""
    from bloomery_jax.placement.trace import DECODE, PREFILL, load_trace

    argv = ["--model", model_path, "--prompt", "The quick brown fox", "-n", "10", "--temperature", "0", "--json",
            *COMMON]
    card = generate.run(argv, out=io.StringIO(), err=io.StringIO())
    trace_path = tmp_path / "trace.npz"
    rec = generate.run([*argv, "--place", "card-experts=2", "--residency", "lfu", "--record-routing", str(trace_path)],
                       out=io.StringIO(), err=io.StringIO())
    assert rec["tokens"] == card["tokens"]
    stats = rec["placement"]
    assert stats["rule"] == "card-experts=2" and stats["policy"] == "lfu" and stats["swaps_total"] > 0
    assert 0 < stats["card_served_fraction"] <= 1 and stats["host_calls"] > 0
    trace = load_trace(trace_path)
    # the prompt in one prefill chunk, then one decode step per generated token but the last
    assert trace.tokens(PREFILL) == len(rec["prompt_tokens"])
    assert trace.tokens(DECODE) == len(rec["tokens"]) - 1
    assert (trace.n_layers, trace.n_experts) == (SHAPE["n_layers"], SHAPE["n_experts"])


def test_unsupported_architecture_is_named(tmp_path, capsys, monkeypatch):
    import gguf

    from bloomery_jax import default_model

    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert generate.main(["--model", str(path), "--prompt", "x", *COMMON]) == 1
    err = capsys.readouterr().err
    assert "architecture 'llama' is not supported" in err and "qwen3moe" in err
    # as the default model: the message says that the default model needs it
    monkeypatch.setattr(default_model, "default_model_path", lambda *a, **k: path)
    assert generate.main(["--prompt", "x", *COMMON]) == 1
    assert "embedded default model (Gemma 3 270M) needs an architecture that is not registered" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_generates():
    rec = generate.run(["--prompt", "The capital of France is", "-n", "4", "--temperature", "0", "--json",
                        "--quiet"], out=io.StringIO(), err=io.StringIO())
    assert rec["architecture"] == "gemma3" and len(rec["tokens"]) >= 1
