"""gemma3 at tiny size: masks, GELU, Config from metadata, cache vs no-cache, the sliding window,
full-size shapes, and one tiny F32 file against llama.cpp (every architecture switch: local and
global layers with their rope bases, a window crossed many times, linear rope scaling, soft-capping).

The real Gemma 3 270M against llama.cpp is tests/test_gemma3_llamacpp.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGUFWriter

from bloomery_jax.errors import ConfigError, GGUFError
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models import gemma3
from bloomery_jax.models.loader import load_model
from bloomery_jax.models.registry import arch_module
from bloomery_jax.models.spec import check_tensors
from bloomery_jax.ops.activations import geglu, gelu_tanh
from bloomery_jax.ops.masks import sliding_window_mask
from bloomery_jax.synth.vocab import add_to_writer, byte_bpe_vocab

SMALL = dict(n_layers=6, d_model=64, n_heads=4, n_kv_heads=2, head_dim=32, ff=96, n_vocab=320,
             context_length=256, rms_eps=float(np.float32(1e-6)), sliding_window=8,
             swa_layers=gemma3.swa_pattern_layers(6, 3), rope_base=1e6, rope_base_swa=1e4)


def write_gemma3(path, cfg: gemma3.Config, seed: int = 0, zero: tuple[str, ...] = ()) -> str:
    """A tiny F32 gemma3 GGUF llama.cpp can load: cfg.to_metadata(), a trained BPE vocab, random weights.

    Tensors whose name contains one of ``zero`` are written as zeros (to switch a path off).
    """
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "gemma3")
    for key, value in cfg.to_metadata().items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    add_to_writer(w, byte_bpe_vocab(cfg.n_vocab))
    for s in gemma3.tensor_specs(cfg):
        if s.optional:
            continue
        if s.role == "norm":
            arr = 1.0 + 0.2 * rng.standard_normal(s.shape)
        elif s.role == "embed":
            arr = rng.standard_normal(s.shape) / math.sqrt(cfg.d_model)  # x ~ unit after sqrt(D)
        else:
            arr = rng.standard_normal(s.shape) / math.sqrt(s.shape[-1])
        if any(z in s.name for z in zero):
            arr = np.zeros(s.shape)
        w.add_tensor(s.name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = write_gemma3(tmp_path_factory.mktemp("gemma3") / "small.gguf", gemma3.Config(**SMALL))
    return load_model(path)


def run(m, toks, pos, max_len):
    logits, cache, routing = m.module.jit_forward(m.params, m.cfg, np.asarray(toks, np.int32),
                                                  np.asarray(pos, np.int32), m.init_cache(len(toks), max_len))
    return logits, cache, routing


# --- building blocks --------------------------------------------------------------------------

def test_sliding_window_mask_matches_definition():
    rng = np.random.default_rng(0)
    S, W = 24, 5
    q_pos = rng.integers(0, S, (3, 7)).astype(np.int32)
    kv_len = np.array([S, 10, 17], np.int32)
    got = np.asarray(sliding_window_mask(q_pos, kv_len, S, W))
    s = np.arange(S)
    want = (s <= q_pos[..., None]) & (q_pos[..., None] - s < W) & (s < kv_len[:, None, None])
    np.testing.assert_array_equal(got, want)
    assert got.sum(-1).max() == W  # a query sees at most the window
    # No window: the plain causal mask.
    np.testing.assert_array_equal(np.asarray(sliding_window_mask(q_pos, kv_len, S, 0)),
                                  (s <= q_pos[..., None]) & (s < kv_len[:, None, None]))


def test_gelu_is_the_tanh_approximation():
    x = np.linspace(-12, 12, 4001).astype(np.float32)
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)))
    # float32 evaluation of the same formula: a few ulp (tanh, products), 1e-6 absolute near 0.
    np.testing.assert_allclose(np.asarray(gelu_tanh(x)), want, rtol=2e-6, atol=1e-6)
    # It is not the erf form: they differ by up to ~2e-4 around |x| ~ 2.
    erf = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    assert np.abs(want - erf).max() > 1e-4
    up = np.float32(3.0)
    np.testing.assert_allclose(np.asarray(geglu(x, np.full_like(x, up))), want * 3.0, rtol=3e-6, atol=3e-6)


# --- Config -------------------------------------------------------------------------------------

def test_config_round_trips_through_metadata(tmp_path):
    variants = [
        gemma3.Config(**SMALL),  # pattern 3: written as a number
        gemma3.Config(**{**SMALL, "swa_layers": gemma3.swa_pattern_layers(6, 6)}),  # default: no key
        gemma3.Config(**{**SMALL, "swa_layers": (True, False, True, True, False, False)}),  # flags
        gemma3.Config(**{**SMALL, "sliding_window": 0, "swa_layers": (False,) * 6}),  # all global
        gemma3.Config(**SMALL, rope_scaling="linear", rope_scaling_factor=8.0, final_logit_softcap=30.0,
                      rope_dim=16),
    ]
    for i, cfg in enumerate(variants):
        got = gemma3.Config.from_gguf(GGUFFile(write_gemma3(tmp_path / f"v{i}.gguf", cfg)))
        assert got == cfg, i
    md = variants[1].to_metadata()
    assert "gemma3.attention.sliding_window_pattern" not in md
    assert variants[0].to_metadata()["gemma3.attention.sliding_window_pattern"] == 3
    assert variants[2].to_metadata()["gemma3.attention.sliding_window_pattern"] == [True, False, True, True,
                                                                                      False, False]


def test_config_rope_and_scales_follow_llamacpp():
    cfg = gemma3.Config(**SMALL, rope_scaling="linear", rope_scaling_factor=8.0)
    local, glob = cfg.rope(local=True), cfg.rope(local=False)
    assert (local.freq_base, local.freq_scale, local.neox) == (1e4, 1.0, True)  # local: never scaled
    assert (glob.freq_base, glob.freq_scale, glob.n_dims) == (1e6, 0.125, 32)
    assert cfg.attn_scale == np.float32(1 / math.sqrt(32))  # head_dim, not d_model / n_heads = 16
    big = gemma3.Config(**{**SMALL, "n_layers": 62, "swa_layers": (True,) * 62})
    assert big.attn_scale == np.float32(1 / math.sqrt(16))  # the 27B rule: d_model / n_heads
    assert cfg.embed_scale == np.float32(8.0)


def _metadata_file(tmp_path, name, changes: dict, drop=()):
    cfg = gemma3.Config(**SMALL)
    w = GGUFWriter(str(tmp_path / name), "gemma3")
    md = {k: v for k, v in cfg.to_metadata().items() if k not in drop}
    md.update(changes)
    for key, value in md.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((cfg.n_vocab, cfg.d_model), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(tmp_path / name)


def test_config_defaults_and_errors(tmp_path):
    bare = gemma3.Config.from_gguf(_metadata_file(tmp_path, "bare.gguf", {}, drop=(
        "gemma3.rope.freq_base", "gemma3.attention.sliding_window_pattern")))
    assert bare.rope_base == 1e4 and bare.rope_base_swa == 1e4  # llama.cpp's defaults
    assert bare.swa_layers == (True,) * 5 + (False,)  # pattern 6: layer 5 is global
    assert bare.n_vocab == 320  # from token_embd when the file has no vocabulary
    nowin = gemma3.Config.from_gguf(_metadata_file(tmp_path, "nowin.gguf", {}, drop=("gemma3.attention.sliding_window",)))
    assert nowin.sliding_window == 0 and not any(nowin.is_local(i) for i in range(6))
    typeless = gemma3.Config.from_gguf(_metadata_file(tmp_path, "lin.gguf", {"gemma3.rope.scaling.factor": 8.0}))
    assert typeless.rope_scaling == "linear" and typeless.rope(local=False).freq_scale == 0.125
    none = gemma3.Config.from_gguf(_metadata_file(tmp_path, "none.gguf", {"gemma3.rope.scaling.factor": 8.0,
                                                                          "gemma3.rope.scaling.type": "none"}))
    assert none.rope(local=False).freq_scale == 1.0  # llama.cpp never scales with type none
    with pytest.raises(GGUFError, match=r"rope scaling 'yarn' is not supported for gemma3"):
        gemma3.Config.from_gguf(_metadata_file(tmp_path, "yarn.gguf", {"gemma3.rope.scaling.type": "yarn"}))
    with pytest.raises(GGUFError, match=r"value_length 16 != key_length 32.*'gemma3.attention.value_length'"):
        gemma3.Config.from_gguf(_metadata_file(tmp_path, "v.gguf", {"gemma3.attention.value_length": 16}))
    with pytest.raises(GGUFError, match=r"has 4 flags for 6 layers.*'gemma3.attention.sliding_window_pattern'"):
        gemma3.Config.from_gguf(_metadata_file(tmp_path, "p.gguf", {
            "gemma3.attention.sliding_window_pattern": [True, False, True, False]}))
    with pytest.raises(GGUFError, match=r"required metadata key is missing.*'gemma3.attention.layer_norm_rms_epsilon'"):
        gemma3.Config.from_gguf(_metadata_file(tmp_path, "e.gguf", {}, drop=("gemma3.attention.layer_norm_rms_epsilon",)))


def test_registry_and_loader(small):
    assert arch_module("gemma3") is gemma3
    assert isinstance(small.cfg, gemma3.Config) and small.module is gemma3
    assert small.cfg.tied_embeddings and "output.weight" not in small.params


def test_real_file_config_and_tensor_table():
    from bloomery_jax.default_model import default_model_path

    gf = GGUFFile(default_model_path())
    cfg = gemma3.Config.from_gguf(gf)
    check_tensors(gf, gemma3.tensor_specs(cfg))  # every tensor present, shaped, none extra
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ff, cfg.n_vocab) == (
        18, 640, 4, 1, 256, 2048, 262144)
    assert [i for i in range(18) if not cfg.is_local(i)] == [5, 11, 17]
    assert (cfg.sliding_window, cfg.rope_base, cfg.rope_base_swa) == (512, 1e6, 1e4)
    assert cfg.attn_scale == 1 / 16 and cfg.tied_embeddings and cfg.final_logit_softcap == 0.0
    roles = {s.role for s in gemma3.tensor_specs(cfg)}
    assert roles == {"embed", "output", "norm", "attn", "ffn"}


def test_full_size_shapes_without_memory():
    cfg = gemma3.Config(n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, head_dim=256, ff=2048,
                        n_vocab=262144, context_length=32768, rms_eps=1e-6, sliding_window=512,
                        swa_layers=gemma3.swa_pattern_layers(18, 6), rope_base=1e6)
    params = {s.name: jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in gemma3.tensor_specs(cfg) if not s.optional}
    cache = jax.eval_shape(lambda: gemma3.init_cache(cfg, 2, 1024))
    tok = jax.ShapeDtypeStruct((2, 600), jnp.int32)
    logits, new_cache, routing = jax.eval_shape(lambda p, t, c: gemma3.forward(p, cfg, t, t, c), params, tok, cache)
    assert logits.shape == (2, 600, 262144) and logits.dtype == jnp.float32
    assert new_cache.k.shape == (18, 2, 1024, 1, 256) and routing is None


# --- forward ------------------------------------------------------------------------------------

def test_prefill_then_decode_equals_one_pass(small):
    m, f = small, small.module.jit_forward
    rng = np.random.default_rng(0)
    B, T, P = 2, 30, 11  # T crosses the window (8) several times
    toks = rng.integers(0, m.cfg.n_vocab, (B, T)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    full, _, routing = run(m, toks, pos, T)
    assert routing is None  # dense: no router
    cache = m.init_cache(B, T)
    logits, cache, _ = f(m.params, m.cfg, toks[:, :P], pos[:, :P], cache)
    outs = [logits]
    for t in range(P, T):
        logits, cache, _ = f(m.params, m.cfg, toks[:, t:t + 1], pos[:, t:t + 1], cache)
        outs.append(logits)
    inc = jnp.concatenate(outs, axis=1)
    assert inc.shape == (B, T, m.cfg.n_vocab) and cache.lengths.tolist() == [T, T]
    # Same float32 operations in different matmul shapes: only accumulation order differs;
    # 1e-5 of the logits' std is ~100 ulps of the largest logits.
    assert float(jnp.max(jnp.abs(inc - full))) <= 1e-5 * float(jnp.std(full))


@pytest.mark.parametrize("softcap", [0.0, 5.0])  # uncapped logits reach about 4.5: a cap of 5 bends them
def test_logits_at_gives_those_rows_of_the_full_logits(small, softcap):
    cfg = dataclasses.replace(small.cfg, final_logit_softcap=softcap)  # the cap applies to the kept rows alike
    f = small.module.jit_forward
    B, T = 2, 20
    toks = np.random.default_rng(3).integers(0, cfg.n_vocab, (B, T)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    full = np.asarray(f(small.params, cfg, toks, pos, small.init_cache(B, T))[0])
    for rows in ([[19], [6]], [[3, 0, 19], [12, 12, 7]]):  # prefill's one row; several, unsorted, per sequence
        idx = np.asarray(rows, np.int32)  # [B, R]
        some, cache, _ = f(small.params, cfg, toks, pos, small.init_cache(B, T), logits_at=idx)
        assert some.shape == (B, idx.shape[1], cfg.n_vocab) and cache.lengths.tolist() == [T, T]
        # The same norm, per-row dot products and cap on the gathered rows: bit for bit.
        np.testing.assert_array_equal(np.asarray(some), np.take_along_axis(full, idx[:, :, None], axis=1))


def test_local_layer_sees_exactly_the_window(tmp_path):
    # One local layer: the logits at p depend on tokens p-W+1..p and on nothing older.
    cfg = gemma3.Config(**{**SMALL, "n_layers": 1, "swa_layers": (True,)})
    m = load_model(write_gemma3(tmp_path / "one.gguf", cfg, seed=1))
    W, T, p = cfg.sliding_window, 20, 15
    toks = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, T)).astype(np.int32)
    pos = np.arange(T, dtype=np.int32)[None]
    base = np.asarray(run(m, toks, pos, T)[0])[0, p]
    outside, inside = toks.copy(), toks.copy()
    outside[0, p - W] = (toks[0, p - W] + 1) % cfg.n_vocab
    inside[0, p - W + 1] = (toks[0, p - W + 1] + 1) % cfg.n_vocab
    # Masked keys get probability exactly 0, so a token outside the window changes nothing, bit for bit.
    np.testing.assert_array_equal(np.asarray(run(m, outside, pos, T)[0])[0, p], base)
    assert np.abs(np.asarray(run(m, inside, pos, T)[0])[0, p] - base).max() > 1e-3
    # The same model made global does see the older token.
    g = dataclasses.replace(m, cfg=dataclasses.replace(cfg, swa_layers=(False,)))
    assert np.abs(np.asarray(run(g, outside, pos, T)[0])[0, p] - np.asarray(run(g, toks, pos, T)[0])[0, p]).max() > 1e-3


# --- against llama.cpp (tiny F32 files: no activation rounding, so agreement is tight) ------------

def _kl_top1(ref: np.ndarray, ours: np.ndarray) -> tuple[float, float]:
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(ours)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return float(kl.max()), float((ref.argmax(-1) == ours.argmax(-1)).mean())


@pytest.mark.llamacpp
@pytest.mark.parametrize("variant", ["base", "scaled_capped_flags", "attention_only"])
def test_tiny_f32_matches_llamacpp(tmp_path, llama_model, variant):
    cfg = gemma3.Config(**SMALL)
    if variant == "scaled_capped_flags":  # linear scaling on global layers, soft-capping, per-layer flags
        cfg = dataclasses.replace(cfg, rope_scaling="linear", rope_scaling_factor=4.0, final_logit_softcap=3.0,
                                  swa_layers=(True, False, True, True, False, True))
    # attention_only: ffn_down = 0 switches every FFN off (its post-norm of zeros is zero).
    zero = ("ffn_down",) if variant == "attention_only" else ()
    path = write_gemma3(tmp_path / f"{variant}.gguf", cfg, seed=5, zero=zero)
    T = 48  # six windows of 8
    toks = np.random.default_rng(3).integers(0, cfg.n_vocab, T).astype(np.int32)
    llm = llama_model(path, n_ctx=64)
    llm.eval(toks.tolist())
    ref = np.array(llm.scores[:T], np.float32)
    m = load_model(path)
    ours = np.asarray(run(m, toks[None], np.arange(T, dtype=np.int32)[None], 64)[0])[0]
    err = np.abs(ref - ours).max() / ref.std()
    kl_max, top1 = _kl_top1(ref, ours)
    assert top1 == 1.0
    if variant == "attention_only":
        # Nothing is rounded on either side but the order of float32 sums (and llama.cpp's rms_norm
        # sums in double). Measured: 2.1e-6 of the logits' std. Bound 2e-5.
        assert err <= 2e-5
    else:
        # llama.cpp's CPU GELU reads a float16 table indexed by the float16-rounded input
        # (2^-11 relative per element); emulating that table cuts the gap from 2.3e-3 to 7e-4.
        # Measured: 2.3e-3 (base) and 2.0e-3 (scaled) of the std, KL max 3.3e-7 / 1.6e-7.
        # Bounds 5e-3 and KL 2e-6. A bug is far outside: no window gives 3.7 std, swapped rope
        # bases 1.8 std.
        assert err <= 5e-3 and kl_max <= 2e-6


def test_pallas_attention_is_refused(tmp_path):
    # Gemma 3's sliding-window layers have no kernel attention: asking for it is an error, not a fallback.
    path = write_gemma3(tmp_path / "one.gguf", gemma3.Config(**{**SMALL, "n_layers": 1, "swa_layers": (True,)}))
    with pytest.raises(ConfigError, match="only the xla attention"):
        load_model(path, attention="pallas")


def test_pallas_routing_is_refused(tmp_path):
    # Gemma 3 is dense: no router to run in a kernel.
    path = write_gemma3(tmp_path / "one.gguf", gemma3.Config(**{**SMALL, "n_layers": 1, "swa_layers": (True,)}))
    with pytest.raises(ConfigError, match="only the xla routing"):
        load_model(path, routing="pallas")
