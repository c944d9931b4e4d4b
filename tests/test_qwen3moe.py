"""qwen3moe at tiny size: cache vs no-cache, padding, loader errors, Config from metadata.

The comparison against llama.cpp is tests/test_llamacpp_qwen3moe.py; full-size shapes are in
tests/test_qwen3moe_shapes.py.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFWriter

from bloomery_jax.errors import ConfigError, GGUFError, UnsupportedArchitectureError
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models import qwen3moe
from bloomery_jax.models.loader import load_model

SMALL = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
             n_experts_used=2, expert_ff=64, n_vocab=320)


def write_gguf(path, arch: str, metadata: dict, tensors: dict[str, tuple[np.ndarray, T]]):
    """A minimal GGUF: metadata (int/float/str) and tensors given as (stored array, type)."""
    w = GGUFWriter(str(path), arch)
    for k, v in metadata.items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    for name, (arr, qtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=None if qtype == T.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def f32_tensors(cfg) -> dict[str, tuple[np.ndarray, T]]:
    rng = np.random.default_rng(0)
    return {s.name: ((rng.standard_normal(s.shape) * 0.1).astype(np.float32), T.F32)
            for s in qwen3moe.tensor_specs(cfg) if not s.optional}


@pytest.fixture(scope="module")
def small(synth_model):
    path, _ = synth_model(qtype="F32", seed=3, **SMALL)
    return load_model(path)


def test_prefill_then_decode_equals_one_pass(small):
    m, f = small, small.module.jit_forward
    rng = np.random.default_rng(0)
    B, T_, P = 2, 64, 40
    toks = rng.integers(0, m.cfg.n_vocab, (B, T_)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T_, dtype=np.int32), (B, T_))
    full, _, r_full = f(m.params, m.cfg, toks, pos, m.init_cache(B, T_))
    cache = m.init_cache(B, T_)
    logits, cache, r = f(m.params, m.cfg, toks[:, :P], pos[:, :P], cache)
    outs, experts = [logits], [r.experts]
    for t in range(P, T_):
        logits, cache, r = f(m.params, m.cfg, toks[:, t:t + 1], pos[:, t:t + 1], cache)
        outs.append(logits)
        experts.append(r.experts)
    inc = jnp.concatenate(outs, axis=1)
    assert inc.shape == (B, T_, m.cfg.n_vocab)
    np.testing.assert_array_equal(np.concatenate(experts, axis=2), np.asarray(r_full.experts))
    assert int(cache.lengths[0]) == T_
    # The same float32 operations in different matmul shapes: only accumulation order differs;
    # 1e-5 of the logits' std is ~100 float32 ulps of the largest logits (measured: 2e-6).
    tol = 1e-5 * float(jnp.std(full))
    assert float(jnp.max(jnp.abs(inc - full))) <= tol


def test_padded_batch_matches_single_sequences(small):
    m, f = small, small.module.jit_forward
    rng = np.random.default_rng(1)
    S = 32
    a = rng.integers(0, m.cfg.n_vocab, 20).astype(np.int32)
    b = rng.integers(0, m.cfg.n_vocab, 32).astype(np.int32)
    toks = np.zeros((2, 32), np.int32)
    toks[0, :20], toks[1] = a, b
    pos = np.stack([np.where(np.arange(32) < 20, np.arange(32), S), np.arange(32)]).astype(np.int32)  # pad = S
    batch, cache, _ = f(m.params, m.cfg, toks, pos, m.init_cache(2, S))
    assert cache.lengths.tolist() == [20, 32]
    alone, _, _ = f(m.params, m.cfg, a[None], np.arange(20, dtype=np.int32)[None], m.init_cache(1, S))
    # Different batch shapes, same math: 1e-5 of the logits' std as above.
    tol = 1e-5 * float(jnp.std(alone))
    assert float(jnp.max(jnp.abs(batch[0, :20] - alone[0]))) <= tol


# One row per sequence; several, unsorted and repeated; the engine's prefill (B=1, one row).
@pytest.mark.parametrize("rows", [[[23], [4]], [[5, 0, 23], [17, 17, 2]], [[23]]])
def test_logits_at_gives_those_rows_of_the_full_logits(small, rows):
    m, f = small, small.module.jit_forward
    idx = np.asarray(rows, np.int32)  # [B, R], different rows per sequence
    B, T_ = idx.shape[0], 24
    toks = np.random.default_rng(2).integers(0, m.cfg.n_vocab, (B, T_)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T_, dtype=np.int32), (B, T_))
    full, _, r_full = f(m.params, m.cfg, toks, pos, m.init_cache(B, T_))
    some, cache, r = f(m.params, m.cfg, toks, pos, m.init_cache(B, T_), logits_at=idx)
    assert some.shape == (B, idx.shape[1], m.cfg.n_vocab)
    want = np.take_along_axis(np.asarray(full), idx[:, :, None], axis=1)
    if idx.size > 1:  # the same norm and per-row dot products on the gathered rows: bit for bit
        np.testing.assert_array_equal(np.asarray(some), want)
    else:  # one row is a matrix-vector product, which XLA:CPU sums in another order (measured: ~1 ulp)
        assert float(np.abs(np.asarray(some) - want).max()) <= 1e-5 * float(want.std())
    np.testing.assert_array_equal(np.asarray(r.experts), np.asarray(r_full.experts))  # routing of every token
    assert cache.lengths.tolist() == [T_] * B


def test_routing_outputs(small):
    m = small
    toks = np.arange(10, dtype=np.int32)[None]
    _, _, r = m.module.jit_forward(m.params, m.cfg, toks, np.arange(10, dtype=np.int32)[None], m.init_cache(1, 16))
    L, k = m.cfg.n_layers, m.cfg.n_experts_used
    assert r.experts.shape == (L, 1, 10, k) and r.experts.dtype == jnp.int32
    assert r.weights.shape == (L, 1, 10, k) and r.margin.shape == (L, 1, 10)
    np.testing.assert_allclose(np.asarray(r.weights.sum(-1)), 1.0, rtol=1e-6)  # renormalised
    assert bool(jnp.all(r.margin >= 0))
    assert bool(jnp.all((r.experts >= 0) & (r.experts < m.cfg.n_experts)))


def test_loader_puts_raw_blocks_on_device(synth_model):
    path, _ = synth_model(qtype="Q8_0", seed=1, **SMALL)
    m = load_model(path)
    w = m.params["blk.0.ffn_gate_exps.weight"]
    assert w.type_name == "Q8_0" and w.shape == (8, 64, 64)
    assert w.data.dtype == jnp.uint8 and w.data.shape == (8, 64, 64 // 32 * 34)  # blocks, not floats
    assert isinstance(m.cfg, qwen3moe.Config) and m.module is qwen3moe


def test_f32_weights_give_the_same_logits_bit_for_bit(synth_model):
    """weights='f32' dequantizes once at load exactly as every step would: identical logits."""
    path, _ = synth_model(qtype="Q4_K_M", seed=5, n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                          n_experts=8, n_experts_used=2, expert_ff=256, n_vocab=512)
    tokens = np.random.default_rng(0).integers(0, 512, (1, 24))
    pos = np.arange(24)[None]
    out = {}
    for weights in ("blocks", "f32"):
        m = load_model(path, weights=weights)
        out[weights] = np.asarray(qwen3moe.jit_forward(m.params, m.cfg, tokens, pos, m.init_cache(1, 24))[0])
    assert isinstance(load_model(path, weights="auto").params["blk.0.attn_q.weight"], jnp.ndarray)
    np.testing.assert_array_equal(out["f32"], out["blocks"])


def test_weights_choice_and_errors(synth_model):
    path, _ = synth_model(qtype="Q8_0", seed=5, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                          n_experts=4, n_experts_used=2, expert_ff=64, n_vocab=320)
    hybrid = load_model(path, place="cpu-moe", weights="auto")  # host experts: the card keeps blocks
    assert not isinstance(hybrid.params["blk.0.attn_q.weight"], jnp.ndarray)
    with pytest.raises(ConfigError, match="needs every expert on the card"):
        load_model(path, place="cpu-moe", weights="f32")
    with pytest.raises(ConfigError, match="weights='bf16'"):
        load_model(path, weights="bf16")


def test_loader_refuses_other_architecture(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", "llama", {"llama.block_count": 1},
                      {"token_embd.weight": (np.zeros((4, 8), np.float32), T.F32)})
    with pytest.raises(UnsupportedArchitectureError, match=r"architecture 'llama' is not supported \(supported: .*qwen3moe"):
        load_model(path)


def test_loader_refuses_unsupported_type_by_name(tmp_path):
    cfg = qwen3moe.Config(**{**SMALL, "d_model": 256})
    tensors = f32_tensors(cfg)
    # IQ2_XXS: 66 bytes per 256 values; no dequantizer for it.
    tensors["blk.1.attn_v.weight"] = (np.zeros((cfg.kv_dim, 66), np.uint8), T.IQ2_XXS)
    path = write_gguf(tmp_path / "iq2.gguf", "qwen3moe", cfg.to_metadata(), tensors)
    with pytest.raises(GGUFError, match=r"IQ2_XXS is not supported.*\(tensor 'blk.1.attn_v.weight'\)"):
        load_model(path)


def test_loader_refuses_misshaped_tensor(tmp_path):
    cfg = qwen3moe.Config(**SMALL)
    tensors = f32_tensors(cfg)
    tensors["blk.0.ffn_up_exps.weight"] = (np.zeros((8, 32, 64), np.float32), T.F32)
    path = write_gguf(tmp_path / "bad.gguf", "qwen3moe", cfg.to_metadata(), tensors)
    with pytest.raises(GGUFError, match=r"has shape \[8, 32, 64\], the config expects \[8, 64, 64\]"):
        load_model(path)


def test_config_from_metadata_follows_llamacpp_defaults(tmp_path):
    cfg = qwen3moe.Config(**SMALL, rope_base=5e5, rope_scaling="yarn", rope_scaling_factor=4.0,
                          rope_orig_context=4096)
    path = write_gguf(tmp_path / "yarn.gguf", "qwen3moe", cfg.to_metadata(), f32_tensors(cfg))
    got = qwen3moe.Config.from_gguf(GGUFFile(path))
    # rms_eps travels as float32
    assert dataclasses.replace(got, tied_embeddings=False) == dataclasses.replace(cfg, rms_eps=float(np.float32(1e-6)))
    assert got.tied_embeddings  # output.weight absent
    # No rope keys at all: llama.cpp's base 10000 and no scaling.
    md = {k: v for k, v in qwen3moe.Config(**SMALL).to_metadata().items() if ".rope." not in k}
    bare = qwen3moe.Config.from_gguf(GGUFFile(write_gguf(tmp_path / "bare.gguf", "qwen3moe", md, f32_tensors(cfg))))
    assert bare.rope_base == 10000.0 and bare.rope().freq_scale == 1.0 and bare.rope().ext_factor == 0.0
    # A factor without a type is linear scaling in llama.cpp.
    md["qwen3moe.rope.scaling.factor"] = 2.0
    lin = qwen3moe.Config.from_gguf(GGUFFile(write_gguf(tmp_path / "lin.gguf", "qwen3moe", md, f32_tensors(cfg))))
    assert lin.rope_scaling == "linear" and lin.rope().freq_scale == 0.5
