"""qwen3moe logits against llama.cpp (llama-cpp-python, F32 KV cache) on synthetic models.

Three shapes (GQA 2:1 / MQA 8:1 / MHA; head dims 64 / 32 / 128; experts 8 top-2 / 16 top-4 /
4 top-1), 500-token prompts (RoPE errors grow with position; short prompts hide them).

* F32 files, and F32 twins of quantized files: |Δlogit| <= 1e-3 x std(llama.cpp logits) at
  every position not excluded by a router near-tie (see ``excluded_positions``).
* Quantized files (Q8_0, Q4_K, Q6_K, Q4_K_M): mean KL(llama.cpp || ours) <= 0.01 and
  same top-1 >= 97%, with our forward rounding activations as llama.cpp's CPU backend does
  (``act_rounding="ggml-cpu"``). Why: that backend multiplies quantized weights by 8-bit
  copies of the activations (Q8_K / Q8_0). Measured on these models, llama.cpp on the
  quantized file against llama.cpp on its own exact F32 twin agrees on only 96.2-98.3% of
  top-1 tokens (the rounding flips ~1-2% of routing decisions per layer), so the exact
  reference path cannot meet 97% reliably; it is checked instead, tightly, by running it on
  the quantized file against llama.cpp on the twin (``test_quantized_file_exact_path``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bloomery_jax.models.loader import load_model

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

N_TOKENS = 500
N_CTX = 512
SHAPES = {
    "gqa": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8,
                n_experts_used=2, expert_ff=256, n_vocab=512),
    "mqa": dict(n_layers=3, d_model=256, n_heads=8, n_kv_heads=1, head_dim=32, n_experts=16,
                n_experts_used=4, expert_ff=256, n_vocab=384),
    "mha": dict(n_layers=2, d_model=256, n_heads=2, n_kv_heads=2, head_dim=128, n_experts=4,
                n_experts_used=1, expert_ff=256, n_vocab=320),
}
# Router near-tie threshold (logit units). Where our F32 logits agree with llama.cpp they do
# so to ~1e-5 of their std (measured 7e-6 x std 5 = 4e-5 absolute); router logits (std ~3)
# pass through the same arithmetic, so the two engines' router logits differ by ~2e-5. An
# expert swap needs a k-th/(k+1)-th margin below that difference: 1e-4 leaves a 5x guard.
NEAR_TIE = 1e-4
MAX_EXCLUDED = N_TOKENS // 10  # more than 10% excluded would leave the check toothless
REL_TOL = 1e-3  # |Δlogit| / std(logits), the bound


def prompt(n_vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, N_TOKENS).astype(np.int32)


def llama_logits(path, tokens) -> np.ndarray:
    """llama.cpp's logits of every position: float32 [T, V]."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, logits_all=True, n_threads=2, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        llm.eval(tokens.tolist())
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def our_logits(path, tokens, act_rounding: str = "none") -> tuple[np.ndarray, np.ndarray]:
    """Our logits [T, V] and router margins [L, T] for one sequence."""
    m = load_model(path)
    cfg = dataclasses.replace(m.cfg, act_rounding=act_rounding)
    pos = np.arange(len(tokens), dtype=np.int32)[None]
    logits, _, routing = m.module.jit_forward(m.params, cfg, tokens[None], pos, m.init_cache(1, N_CTX))
    return np.asarray(logits[0]), np.asarray(routing.margin[:, 0])


def excluded_positions(margins: np.ndarray) -> np.ndarray:
    """bool [T]: positions a router near-tie may have changed.

    A swapped expert at layer l, position t changes that token's stream from layer l on; for
    l < L-1 it also changes the keys/values later layers read, so every position >= t is
    suspect. A swap in the last layer changes position t only.
    """
    L, T = margins.shape
    ties = margins < NEAR_TIE  # [L, T]
    excluded = ties[L - 1].copy()
    early = np.flatnonzero(ties[: L - 1].any(axis=0))
    if early.size:
        excluded[early[0]:] = True
    return excluded


def assert_close(ours, ref, margins, record_property):
    excluded = excluded_positions(margins)
    n_excluded = int(excluded.sum())
    record_property("excluded_positions", n_excluded)
    print(f"excluded {n_excluded} of {len(excluded)} positions (router margin < {NEAR_TIE})")
    assert n_excluded <= MAX_EXCLUDED, f"{n_excluded} positions at or after router near-ties"
    tol = REL_TOL * float(ref.std())
    err = np.abs(ours - ref).max(axis=-1)  # [T]
    bad = np.flatnonzero((err > tol) & ~excluded)
    assert bad.size == 0, (f"{bad.size} positions off by more than {tol:.3g}; first {bad[:5].tolist()}, "
                           f"worst {err[~excluded].max():.3g}")


def kl_and_top1(ref: np.ndarray, ours: np.ndarray) -> tuple[float, float]:
    """Mean KL(ref || ours) over positions and the fraction of equal argmax tokens."""
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(ours)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return float(kl.mean()), float(np.mean(ref.argmax(-1) == ours.argmax(-1)))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_f32_model_matches_llamacpp(synth_model, shape, record_property):
    hp = SHAPES[shape]
    path, _ = synth_model(qtype="F32", seed=11, **hp)
    tokens = prompt(hp["n_vocab"], seed=1)
    ours, margins = our_logits(path, tokens)
    assert_close(ours, llama_logits(path, tokens), margins, record_property)


@pytest.mark.parametrize("shape,qtype", [("gqa", "Q4_K_M"), ("mqa", "Q6_K")])
def test_f32_twin_matches_llamacpp(synth_model, shape, qtype, record_property):
    hp = SHAPES[shape]
    _, report = synth_model(qtype=qtype, seed=5, twin=True, **hp)
    tokens = prompt(hp["n_vocab"], seed=2)
    ours, margins = our_logits(report.twin_path, tokens)
    assert_close(ours, llama_logits(report.twin_path, tokens), margins, record_property)


@pytest.mark.parametrize("shape,qtype", [("gqa", "Q4_K_M"), ("mqa", "Q6_K")])
def test_quantized_file_exact_path(synth_model, shape, qtype, record_property):
    """Our exact path reading the quantized blocks = llama.cpp on the dequantized twin."""
    hp = SHAPES[shape]
    path, report = synth_model(qtype=qtype, seed=5, twin=True, **hp)
    tokens = prompt(hp["n_vocab"], seed=2)
    ours, margins = our_logits(path, tokens)
    assert_close(ours, llama_logits(report.twin_path, tokens), margins, record_property)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q4_K_M"])
def test_quantized_file_kl(synth_model, qtype, record_property):
    hp = SHAPES["gqa"]
    path, _ = synth_model(qtype=qtype, seed=7, **hp)
    tokens = prompt(hp["n_vocab"], seed=3)
    ours, _ = our_logits(path, tokens, act_rounding="ggml-cpu")
    kl, top1 = kl_and_top1(llama_logits(path, tokens), ours)
    record_property("mean_kl", kl)
    record_property("same_top1", top1)
    print(f"{qtype}: mean KL {kl:.2e}, same top-1 {100 * top1:.1f}%")
    assert kl <= 0.01  # the bounds
    assert top1 >= 0.97
