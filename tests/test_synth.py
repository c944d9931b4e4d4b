"""Synthetic GGUF models: structure, type policy, twins, determinism, fast-path statistics,
route skew, the CLI, and loading in llama.cpp."""

from __future__ import annotations

import dataclasses
import filecmp

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.errors import ConfigError
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models import qwen3moe
from bloomery_jax.models.spec import check_tensors
from bloomery_jax.synth import synthesize
from bloomery_jax.synth import policy
from bloomery_jax.synth.__main__ import main as synth_main
from bloomery_jax.synth.blocks import FAST_TYPES, random_blocks
from bloomery_jax.synth.qwen3moe import make_config, init

QTYPES = list(policy.QTYPES)
# A second shape: GQA 4, 16 experts top-4, three layers, expert rows of 128 (K-quant fallback).
SHAPE_B = dict(n_layers=3, d_model=256, n_heads=8, n_kv_heads=2, head_dim=32, n_experts=16,
               n_experts_used=4, expert_ff=128, n_vocab=384)


def values(info) -> np.ndarray:
    """f32 values of a tensor of a GGUFFile, by gguf-py's dequantizer (the reference)."""
    if info.qtype == T.F32:
        return np.asarray(info.data, np.float32)
    if info.qtype == T.F16:
        return np.asarray(info.data).astype(np.float32)
    return gguf.quants.dequantize(np.asarray(info.data), info.qtype)


def test_f32_file_matches_the_architecture_table(tiny_model):
    gf = GGUFFile(tiny_model)
    assert gf.architecture == "qwen3moe"
    cfg = qwen3moe.Config.from_gguf(gf)
    # eps is stored as FLOAT32: it comes back as the f32 nearest 1e-6.
    assert cfg == dataclasses.replace(make_config(), rms_eps=float(np.float32(1e-6)))
    check_tensors(gf, qwen3moe.tensor_specs(cfg))  # every tensor, right shapes, nothing extra
    assert gf.require("general.file_type", int) == 0
    assert gf.require("general.alignment", int) == 32
    assert len(gf.require("tokenizer.ggml.tokens", list)) == cfg.n_vocab
    assert all(i.qtype == T.F32 for i in gf)


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_qtype_has_the_policy_types(synth_model, qtype):
    path, report = synth_model(qtype=qtype, **SHAPE_B)
    gf = GGUFFile(path)
    cfg = qwen3moe.Config.from_gguf(gf)
    check_tensors(gf, qwen3moe.tensor_specs(cfg))
    assert gf.require("general.file_type", int) == policy.file_type(qtype)
    for spec in qwen3moe.tensor_specs(cfg):
        want, _ = policy.tensor_type(spec, qtype, n_layers=cfg.n_layers, n_experts=cfg.n_experts)
        assert gf.tensor(spec.name).qtype == want, spec.name
        if spec.role in ("norm", "router"):
            assert want == T.F32, spec.name
    total = sum(i.n_bytes for i in gf)
    assert sum(report.bytes_per_type.values()) == total
    assert report.n_params == sum(i.n_elements for i in gf)


def _spec(cfg, name):
    return next(s for s in qwen3moe.tensor_specs(cfg) if s.name == name)


@pytest.mark.parametrize("n_experts", [8, 16])
def test_q4_k_m_mix_follows_llama_cpp(n_experts):
    # llama.cpp's use_more_bits(i, 8) picks layers 0, 3, 6, 7; an 8-expert model bumps
    # attn_v / attn_k to Q8_0 and attn_output to Q5_K.
    cfg = make_config(n_layers=8, n_experts=n_experts, n_experts_used=2)
    more = {0, 3, 6, 7}

    def ty(name):
        return policy.tensor_type(_spec(cfg, name), "Q4_K_M", n_layers=8, n_experts=n_experts)[0]

    assert ty("output.weight") == T.Q6_K
    assert ty("token_embd.weight") == T.Q4_K
    assert ty("output_norm.weight") == T.F32
    for i in range(8):
        b = f"blk.{i}."
        assert ty(b + "ffn_down_exps.weight") == (T.Q6_K if i in more else T.Q4_K)
        assert ty(b + "ffn_gate_exps.weight") == T.Q4_K
        assert ty(b + "ffn_up_exps.weight") == T.Q4_K
        assert ty(b + "ffn_gate_inp.weight") == T.F32
        assert ty(b + "attn_q.weight") == T.Q4_K
        if n_experts == 8:
            assert ty(b + "attn_v.weight") == T.Q8_0
            assert ty(b + "attn_k.weight") == T.Q8_0
            assert ty(b + "attn_output.weight") == T.Q5_K
        else:
            assert ty(b + "attn_v.weight") == (T.Q6_K if i in more else T.Q4_K)
            assert ty(b + "attn_k.weight") == T.Q4_K
            assert ty(b + "attn_output.weight") == T.Q4_K


def test_qwen3_30b_layer_pick():
    # use_more_bits(i, 48): the first and last six layers and i = 8, 11, ..., 41.
    picked = [i for i in range(48) if policy.use_more_bits(i, 48)]
    assert picked == list(range(6)) + list(range(8, 42, 3)) + list(range(42, 48))


@pytest.mark.parametrize("want,cols,got", [
    (T.Q4_K, 128, T.Q5_0), (T.Q5_K, 96, T.Q5_1), (T.Q6_K, 160, T.Q8_0), (T.Q4_K, 48, T.F16),
])
def test_row_length_fallbacks(want, cols, got):
    from bloomery_jax.models.spec import TensorSpec

    spec = TensorSpec("blk.0.ffn_up_exps.weight", (4, 64, cols), "expert", 0)
    qt, note = policy.tensor_type(spec, {T.Q4_K: "Q4_K", T.Q5_K: "Q5_K", T.Q6_K: "Q6_K"}[want],
                                  n_layers=1, n_experts=4)
    assert qt == got and want.name in note and got.name in note


def test_q4_k_m_output_with_short_rows_is_q8_0():
    # llama.cpp's own output rule (not the generic fallback): rows of 320 cannot take Q6_K
    cfg = make_config(d_model=320, n_heads=5, n_kv_heads=1, head_dim=64)
    out, note = policy.tensor_type(_spec(cfg, "output.weight"), "Q4_K_M", n_layers=2, n_experts=8)
    assert out == T.Q8_0 and note is None
    emb, note = policy.tensor_type(_spec(cfg, "token_embd.weight"), "Q4_K_M", n_layers=2, n_experts=8)
    assert emb == T.Q5_0 and "Q4_K -> Q5_0" in note


def test_fallbacks_are_reported(synth_model):
    _, report = synth_model(qtype="Q4_K", **SHAPE_B)
    downs = [f for f in report.fallbacks if "ffn_down_exps" in f]
    assert len(downs) == SHAPE_B["n_layers"] and all("Q4_K -> Q5_0" in f for f in downs)
    assert "fallback: blk.0.ffn_down_exps.weight" in str(report)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M"])
def test_twin_holds_the_exact_dequantized_values(synth_model, qtype):
    path, report = synth_model(qtype=qtype, twin=True, **SHAPE_B)
    q, twin = GGUFFile(path), GGUFFile(report.twin_path)
    assert twin.require("general.file_type", int) == 0
    assert list(q.tensors) == list(twin.tensors)
    meta = lambda gf: {k: v for k, v in gf.metadata.items() if k not in ("general.file_type", "general.name")}
    assert repr(meta(q)) == repr(meta(twin))
    for name, info in q.tensors.items():
        t = twin.tensor(name)
        assert t.qtype == T.F32 and t.shape == info.shape
        # Exact: the twin is defined as gguf-py's dequantization of the stored blocks.
        np.testing.assert_array_equal(np.asarray(t.data), values(info).reshape(info.shape), err_msg=name)


def test_same_seed_same_bytes(tmp_path):
    kw = dict(qtype="Q4_K_M", route_skew=1.0, fast=True, n_layers=1)
    synthesize(tmp_path / "a.gguf", seed=3, **kw)
    synthesize(tmp_path / "b.gguf", seed=3, **kw)
    synthesize(tmp_path / "c.gguf", seed=4, **kw)
    assert filecmp.cmp(tmp_path / "a.gguf", tmp_path / "b.gguf", shallow=False)
    assert not filecmp.cmp(tmp_path / "a.gguf", tmp_path / "c.gguf", shallow=False)


@pytest.mark.parametrize("qtype", sorted(FAST_TYPES, key=int))
def test_random_blocks_have_the_intended_statistics(qtype):
    std = 0.02
    x = gguf.quants.dequantize(random_blocks(qtype, (256, 1024), std, np.random.default_rng(0)), qtype)
    assert x.shape == (256, 1024) and np.isfinite(x).all()
    # Tolerances: each 256-value block's mean square varies by ~40% (its scale factor and
    # sub-block scales), so over 1024+ blocks the std estimate is good to ~0.6%: 3% is ~5 sigma.
    assert abs(x.std() / std - 1) < 0.03
    # Q8_0's int8 q has mean -0.5 (-0.007 std); other offsets average out: 0.02 std bound.
    assert abs(x.mean()) < 0.02 * std
    # Blocks and sub-blocks differ in scale (a kernel that mixed them up would be caught):
    # d varies by a factor uniform in [0.7, 1.3] (CV ~0.17), sub-block scales in 32..63.
    blocks = random_blocks(qtype, (64, 1024), std, np.random.default_rng(1))
    blocks = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])  # [n_blocks, block_bytes]
    d_at = {T.Q6_K: 208}.get(qtype, 0)
    d = blocks[:, d_at:d_at + 2].copy().view(np.float16).astype(np.float32).ravel()
    assert d.std() / d.mean() > 0.1
    if qtype in (T.Q4_K, T.Q5_K):
        sc, _ = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        sub = sc.reshape(len(blocks), -1).astype(np.float32)
    elif qtype == T.Q6_K:
        sub = np.abs(blocks[:, 192:208].view(np.int8).astype(np.float32))
    else:
        sub = None
    if sub is not None:
        assert (sub.std(axis=1) > 0).all()


def test_fast_expert_tensors_match_the_plugin_init(synth_model):
    path, report = synth_model(qtype="Q4_K_M", fast=True, n_experts=16, n_experts_used=2)
    assert report.random_block_tensors >= 3  # gate, up, down of each layer
    gf = GGUFFile(path)
    cfg = qwen3moe.Config.from_gguf(gf)
    for spec in qwen3moe.tensor_specs(cfg):
        if spec.role != "expert":
            continue
        x = values(gf.tensor(spec.name))
        _, std = init(spec, cfg)
        # >= 1024 blocks per tensor: the std is good to ~0.6% (see the test above).
        assert abs(x.std() / std - 1) < 0.03, spec.name


def _router_share(path, layer=0):
    """Share of top-k routing slots (layer ``layer``, router over RMSNorm'd embeddings) per expert."""
    gf = GGUFFile(path)
    cfg = qwen3moe.Config.from_gguf(gf)
    emb = values(gf.tensor("token_embd.weight")).reshape(cfg.n_vocab, cfg.d_model)  # [V, D]
    h = emb / np.sqrt((emb**2).mean(axis=1, keepdims=True) + cfg.rms_eps)
    h = h * values(gf.tensor(f"blk.{layer}.ffn_norm.weight"))
    scores = h @ values(gf.tensor(f"blk.{layer}.ffn_gate_inp.weight")).reshape(cfg.n_experts, -1).T  # [V, E]
    top = np.argsort(-scores, axis=1)[:, : cfg.n_experts_used]  # [V, k]
    return np.bincount(top.ravel(), minlength=cfg.n_experts) / top.size, gf


def test_route_skew_concentrates_routing(synth_model):
    shape = dict(n_layers=2, n_experts=16, n_experts_used=4)
    flat, _ = _router_share(synth_model(route_skew=0.0, **shape)[0])
    path, report = synth_model(route_skew=3.0, **shape)
    skewed, gf = _router_share(path)
    hot = report.hot_experts[0]
    assert len(hot) == 2
    assert list(gf.require("bloomery.synth.hot_experts")) == [e for h in report.hot_experts for e in h]
    # Uniform: each expert gets ~1/16 of 2048 slots (binomial sd ~0.5%); 2x is far outside.
    assert flat.max() < 2 / 16
    # A = 3: the hot experts' logits rise by ~3 router sds, so they are in nearly every top-4:
    # each takes close to 1/k = 0.25 of the slots, four times the uniform share.
    assert skewed[hot].min() > 0.2
    assert skewed[hot].sum() > 3 * flat[hot].sum()


def test_bad_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="route skew"):
        synthesize(tmp_path / "x.gguf", route_skew=-1.0)
    with pytest.raises(ConfigError, match="qtype"):
        synthesize(tmp_path / "x.gguf", qtype="Q3_K")
    with pytest.raises(ConfigError, match="n_kv_heads"):
        synthesize(tmp_path / "x.gguf", n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="architecture"):
        synthesize(tmp_path / "x.gguf", arch="llama")


def test_cli_writes_and_reports(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert synth_main(["--out", str(out), "--qtype", "Q8_0", "--layers", "1", "--experts", "4",
                       "--top-k", "2", "--no-measure", "--twin", str(tmp_path / "t.gguf")]) == 0
    text = capsys.readouterr().out
    assert str(out) in text and "Q8_0" in text and "F32 twin" in text
    assert qwen3moe.Config.from_gguf(GGUFFile(out)).n_experts == 4
    assert synth_main(["--out", str(tmp_path / "x.gguf"), "--route-skew", "-2", "--no-measure"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "route skew" in err


@pytest.mark.slow
def test_our_forward_is_peaked(synth_model):
    _, report = synth_model(qtype="Q4_K_M", measure=True)
    # logit std 5 over V = 512 gives ~0.5 expected; 0.1 is 50x the uniform 1/512.
    assert report.mean_max_prob is not None and report.mean_max_prob > 0.1, report.notes


def _llama_max_probs(llm, n_vocab, n_tokens=8, seed=0):
    tokens = np.random.default_rng(seed).integers(0, n_vocab, n_tokens).tolist()
    llm.eval(tokens)
    logits = np.array(llm.scores[:n_tokens], dtype=np.float64)  # [T, V]
    assert logits.shape == (n_tokens, n_vocab) and np.isfinite(logits).all()
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)).max(axis=1)


@pytest.mark.llamacpp
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [{}, SHAPE_B], ids=["default", "gqa4-e16-ff128"])
def test_llama_cpp_loads_and_is_peaked(synth_model, llama_model, qtype, shape):
    path, report = synth_model(qtype=qtype, **shape)
    n_vocab = report.config["n_vocab"]
    mp = _llama_max_probs(llama_model(path), n_vocab)
    # Logit std 5 gives an expected mean max-prob ~0.5 here; 0.1 is > 38x uniform (1/384).
    assert mp.mean() > 0.1, mp


@pytest.mark.llamacpp
def test_llama_cpp_loads_the_twin(synth_model, llama_model):
    path, report = synth_model(qtype="Q4_K_M", twin=True, **SHAPE_B)
    assert _llama_max_probs(llama_model(report.twin_path), report.config["n_vocab"]).mean() > 0.1


@pytest.mark.llamacpp
def test_llama_cpp_loads_skewed_and_fast_files(synth_model, llama_model):
    path, report = synth_model(qtype="Q4_K_M", route_skew=2.0, fast=True, n_experts=16, n_experts_used=4)
    assert _llama_max_probs(llama_model(path), report.config["n_vocab"]).mean() > 0.1
