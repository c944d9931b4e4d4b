"""``python -m bloomery_jax.serve`` as a command: bad options, bad files, the default model.

Bad options and files print one line naming the problem and exit 2 before binding; a model
that fails while loading (after the port is bound) exits 1. The default-model test serves the
embedded Gemma 3 270M with no ``--model`` and compares its greedy tokens with llama.cpp's on
the same prompt (slow: it compiles the model, about a minute on an idle CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest

from test_server import REPO, start_server, stop_server


def _serve(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "bloomery_jax.serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _problem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("bloomery_jax.serve:")]


def test_missing_model_file_exits_2(tmp_path):
    r = _serve("--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and _problem_lines(r.stderr) == [f"bloomery_jax.serve: --model "
                                                             f"'{tmp_path / 'nope.gguf'}': no such file"]


def test_not_a_gguf_file_exits_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    r = _serve("--model", str(bad))
    lines = _problem_lines(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and "not a GGUF file" in lines[0] and str(bad) in lines[0]


def test_bad_gin_binding_exits_2(tiny_model):
    r = _serve("--model", str(tiny_model), "--gin_param", "RuntimeSettings.nope = 1")
    lines = _problem_lines(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and "nope" in lines[0]


@pytest.mark.parametrize("args,word", [(["--parallel", "0"], "--parallel"), (["--timeout", "0"], "--timeout"),
                                       (["--port", "70000"], "--port"), (["--port", "x"], "--port"),
                                       (["--bogus"], "--bogus")])
def test_bad_option_values_exit_2(tiny_model, args, word):
    r = _serve("--model", str(tiny_model), *args)
    lines = _problem_lines(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and word in lines[0]


def test_model_failing_while_loading_exits_1(tmp_path):
    # With --config given the file is first opened by the loading thread, after the port is bound.
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00" * 64)
    r = _serve("--model", str(bad), "--config", os.path.join(REPO, "configs", "base.gin"), "--port", "0")
    assert r.returncode == 1, r.stderr
    assert any("loading failed" in line and str(bad) in line for line in _problem_lines(r.stderr)), r.stderr


@pytest.mark.slow
def test_default_model_chats_like_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    proc, port, _ = start_server(["--gin_param", "RuntimeSettings.max_context = 1024",
                                  "--gin_param", "RuntimeSettings.ubatch = 64"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0]
        assert model.id == "gemma-3-270m-q4_k_m"
        question = "What is the capital of France?"
        r = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": question}],
                                           max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
        ours = r.choices[0].logprobs.content
        assert r.usage.completion_tokens == 8 and len(ours) >= 1
        path = client.models.list().data[0].model_extra["meta"]["path"]
    finally:
        stop_server(proc)
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, verbose=False)
    prompt = f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"
    ids = [llm.token_bos()] + llm.tokenize(prompt.encode(), add_bos=False, special=True)
    assert len(ids) == r.usage.prompt_tokens  # the same prompt, token for token
    theirs = []
    for t in llm.generate(ids, temp=0.0, top_k=1):
        theirs.append(t)
        if len(theirs) == len(ours):
            break
    # Quantized file: llama.cpp rounds activations to 8 bits, so greedy choices may differ where
    # the top two are close. Compare up to the first position whose margin is under 1 nat.
    n = 0
    for entry in ours:
        if entry.top_logprobs[0].logprob - entry.top_logprobs[1].logprob < 1.0:
            break
        n += 1
    assert n >= 1, "no confident first token to compare"
    got = [bytes(e.bytes) for e in ours[:n]]
    want = [llm.detokenize([t], special=True) for t in theirs[:n]]
    assert got == want
