"""The models with ``kernels="pallas"``: repacked weights and the Pallas decode kernels (run in
the Pallas interpreter on the CPU) give the reference path's results.

- Decode steps (one token) run qgemv and moe_gemv; prefill steps run moe_gemm for the experts
  and dequantize the other repacked weights (bit-exact). ``attention="pallas"`` makes decode
  steps attend with pallas.decode_attention and prefill steps with pallas.prefill_attention,
  straight from the cache buffer (plain cache and the engine's slot windows). The kernels sum in another order than
  XLA's dot: the logits agree within 1e-4 x their standard deviation (the hybrid tests' bound; a
  wrong weight or expert moves logits by about one std), and greedy tokens are identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from bloomery_jax.errors import ConfigError
from bloomery_jax.eval.runner import sequence_logits
from bloomery_jax.models.loader import load_model
from bloomery_jax.quant.repack import PackedWeight

SHAPE = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, n_experts_used=2,
             expert_ff=256, n_vocab=512)
TOL = 1e-4


@pytest.fixture(scope="module")
def q4km(synth_model):
    return synth_model(qtype="Q4_K_M", seed=5, **SHAPE)[0]


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, SHAPE["n_vocab"], n)


def test_weights_are_repacked(q4km):
    model = load_model(q4km, kernels="pallas")
    packed = {k for k, v in model.params.items() if isinstance(v, PackedWeight)}
    assert "blk.0.ffn_gate_exps.weight" in packed and "blk.1.attn_q.weight" in packed and "output.weight" in packed
    assert "token_embd.weight" not in packed  # a row lookup, not a matmul


@pytest.mark.parametrize("n_tokens,ubatch", [(32, 16), (10, 1)], ids=["prefill", "decode"])
def test_steps_within_bound(q4km, n_tokens, ubatch):
    ids = tokens(n_tokens, seed=ubatch)
    ref = sequence_logits(load_model(q4km, kernels="reference", weights="blocks"), ids, ubatch=ubatch)
    got = sequence_logits(load_model(q4km, kernels="pallas"), ids, ubatch=ubatch)
    err, bound = np.abs(got - ref).max(), TOL * ref.std()
    print(f"max |dlogit| {err:.3g}, bound {bound:.3g}")
    assert err <= bound
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("ubatch", [8, 32], ids=["host-experts", "streamed-experts"])
def test_layer_without_card_experts(q4km, ubatch):
    # n-cpu-moe=1: layer 0 keeps an empty [0, F, D] card tensor (its repack is empty), layer 1 the
    # kernels; 32-token steps stream layer 0's experts to the card, repack and run them in moe_gemm
    # (host experts on f32 activations: with the default 8-bit ones, an ulp of difference between the
    # kernels' and the reference's sums can flip one rounding step, which this bound does not allow)
    ids = tokens(40, seed=3)  # with ubatch 32: a 32-token chunk, then one padded to 8
    model = load_model(q4km, kernels="pallas", place="n-cpu-moe=1", host_act="f32")
    assert model.params["blk.0.ffn_gate_exps.weight"].shape[0] == 0
    ref = sequence_logits(load_model(q4km, kernels="reference", place="n-cpu-moe=1", host_act="f32"), ids,
                          ubatch=ubatch)
    got = sequence_logits(model, ids, ubatch=ubatch)
    assert np.abs(got - ref).max() <= TOL * ref.std()
    assert (model.placement.host.stats.streamed_bytes > 0) == (ubatch == 32)


@pytest.mark.parametrize("kernels,precision", [("pallas-tf32", "tf32"), ("pallas-qtiles", "q-bf16x2")])
def test_prefill_precision_setting(q4km, kernels, precision):
    # these kernels= choices only change the prefill products (experts and dense projections),
    # through the config (the interpreter computes tf32 at f32 HIGHEST, and quant tiles with
    # their bf16 parts of x)
    assert load_model(q4km, kernels="pallas").cfg.prefill_precision == "tf32x3"
    model = load_model(q4km, kernels=kernels)
    assert model.cfg.prefill_precision == precision and isinstance(model.params["blk.0.attn_q.weight"], PackedWeight)
    ids = tokens(16, seed=4)
    ref = sequence_logits(load_model(q4km, kernels="reference", weights="blocks"), ids, ubatch=16)
    assert np.abs(sequence_logits(model, ids, ubatch=16) - ref).max() <= TOL * ref.std()


@pytest.mark.parametrize("kernels", ["pallas-bf16", "pallas-q8-bf16"])
def test_bf16_prefill_is_nearer_exact_than_llamacpp_arithmetic(q4km, kernels):
    """kernels=pallas-bf16 rounds x to bf16 in the prefill products (quant tiles, one part; each
    element within 2^-9 of itself). Against the exact reference its logits move, yet less than
    llama.cpp's CUDA arithmetic (Q8_1 activations, up to 2^-8 of each 32-block's largest) moves
    them: the root-mean-square and the largest difference are both smaller, the argmax the same.
    pallas-q8-bf16 prefills so too (the same tiles on its "ggml"-layout weights, x not rounded to Q8_1)."""
    model = load_model(q4km, kernels=kernels)
    assert model.cfg.prefill_precision == "q-bf16" and isinstance(model.params["blk.0.attn_q.weight"], PackedWeight)
    ids = tokens(16, seed=4)
    reference = load_model(q4km, kernels="reference", weights="blocks")
    exact = sequence_logits(reference, ids, ubatch=16)
    q8 = sequence_logits(reference, ids, ubatch=16, act_rounding="ggml-cuda") - exact
    bf16 = sequence_logits(model, ids, ubatch=16) - exact
    rms = lambda d: float(np.sqrt(np.mean(d * d)))  # noqa: E731
    print(f"bf16: rms {rms(bf16):.3g} max {np.abs(bf16).max():.3g}; q8_1: rms {rms(q8):.3g} max {np.abs(q8).max():.3g}"
          f" (std {exact.std():.3g})")
    assert np.abs(bf16).max() > TOL * exact.std()  # the rounding is real
    assert rms(bf16) < rms(q8) and np.abs(bf16).max() < np.abs(q8).max()
    np.testing.assert_array_equal((exact + bf16).argmax(-1), exact.argmax(-1))


def test_unserved_weights_are_named(synth_model, capsys):
    f32 = synth_model(qtype="F32", seed=5, **SHAPE)[0]
    model = load_model(f32, kernels="pallas")
    assert not any(isinstance(v, PackedWeight) for v in model.params.values())
    err = capsys.readouterr().err
    assert "run the reference path" in err and "blk.0.attn_q.weight (F32" in err


def test_pallas_decode_attention_within_bound(q4km):
    """One-token steps over the plain cache, the kernel's attention against the jnp one."""
    ids = tokens(12, seed=7)
    ref = sequence_logits(load_model(q4km, kernels="reference", weights="blocks"), ids, ubatch=1)
    model = load_model(q4km, kernels="reference", weights="blocks", attention="pallas")
    assert model.cfg.attention == "pallas"
    got = sequence_logits(model, ids, ubatch=1)
    assert np.abs(got - ref).max() <= TOL * ref.std()
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("routing", ["xla", "pallas-tickets"])
def test_pallas_decode_attention_in_engine_windows(q4km, routing):
    """The engine's slot windows (bucket 2 of 3 slots, the window starting at slot 0; a sequence
    released so another moves slots): greedy tokens as with the jnp attention, logits within bound.
    With routing pallas-tickets a decode layer's attention is one launch (``attention_prepped``)."""
    from bloomery_jax.engine.engine import Engine
    from bloomery_jax.engine.sampling import SamplingParams

    def run(attention):
        model = load_model(q4km, kernels="reference", weights="blocks", attention=attention,
                           routing=routing if attention == "pallas" else "xla")
        eng = Engine(model, n_slots=3, max_context=64, ubatch=8, min_chunk=8)
        greedy = SamplingParams(temperature=0.0)
        seqs = [eng.add(tokens(n, seed=n).tolist(), greedy) for n in (5, 11, 7)]
        for s in seqs:
            while s.pending > 1:
                eng.prefill(s)
        out = [[sample.logprob for sample in eng.decode(seqs)] for _ in range(3)]
        eng.release(seqs[0])  # seqs[2] moves into slot 0
        out += [[sample.logprob for sample in eng.decode(seqs[1:])] for _ in range(3)]
        return [s.tokens for s in seqs], out

    (ref_tokens, ref_lp), (got_tokens, got_lp) = run("xla"), run("pallas")
    assert got_tokens == ref_tokens
    # the sampled tokens' log-probabilities: summation order moves them by ~1e-6 (measured); a wrong
    # slot, layer or length by ~1e-1
    for a, b in zip(ref_lp, got_lp):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)


def test_bad_kernel_settings(q4km):
    with pytest.raises(ConfigError, match="exclude each other"):
        load_model(q4km, kernels="pallas", weights="f32")
    with pytest.raises(ConfigError, match="kernels="):
        load_model(q4km, kernels="triton")
    with pytest.raises(ConfigError, match="attention="):
        load_model(q4km, attention="flash")
    assert not any(isinstance(v, PackedWeight) for v in load_model(q4km, kernels="auto").params.values())  # CPU


def test_auto_attention_and_routing_are_pallas_on_a_gpu(q4km):
    """auto: the kernels on a GPU for an architecture that has them, xla on the CPU and for one
    that has not (gemma3's Config has no attention field); the loaded model says which it runs."""
    from types import SimpleNamespace

    from bloomery_jax.models.loader import resolve_kernel_choice

    gpu, cpu = SimpleNamespace(platform="gpu"), SimpleNamespace(platform="cpu")
    qwen, gemma = SimpleNamespace(attention="xla", routing="xla"), SimpleNamespace()
    assert [resolve_kernel_choice(f, "auto", qwen, gpu) for f in ("attention", "routing")] == ["pallas", "pallas"]
    assert [resolve_kernel_choice(f, "auto", qwen, cpu) for f in ("attention", "routing")] == ["xla", "xla"]
    assert resolve_kernel_choice("attention", "auto", gemma, gpu) == "xla"
    assert resolve_kernel_choice("routing", "pallas", qwen, cpu) == "pallas"  # an explicit choice stands
    model = load_model(q4km, attention="auto", routing="auto")  # on this CPU
    assert (model.attention, model.routing, model.cfg.attention, model.cfg.routing) == ("xla",) * 4
    model = load_model(q4km, attention="pallas", routing="pallas")
    assert (model.attention, model.routing, model.cfg.attention, model.cfg.routing) == ("pallas",) * 4


def test_pallas_attention_refuses_a_cache_over_its_offsets(q4km):
    """The engine says, before making the cache, when a pallas-attention cache buffer would pass
    2^31 elements (the kernels' int32 offsets), and how to get under it."""
    from bloomery_jax.engine.engine import PALLAS_CACHE_ELEMENTS, Engine

    model = load_model(q4km, attention="pallas")
    cfg = model.cfg
    per_position = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    too_long = PALLAS_CACHE_ELEMENTS // per_position + 1  # one slot of this many positions is over
    with pytest.raises(ConfigError, match="int32 offsets.*lower max_context or parallel"):
        Engine(model, n_slots=1, max_context=too_long, min_rows=1)


# kernels=pallas-q8 against the reference path with the same (llama.cpp CUDA) activation rounding:
# where the two paths' f32 sums differ by an ulp next to a rounding boundary, one activation moves
# by a whole Q8_1 step (max|x| / 127 of its block) and that position's logits by up to a few 1e-2
# std (the same effect and bounds as tests/test_hybrid.py's 8-bit host activations).
Q8_FLIP_TOL, Q8_MIN_EXACT = 0.1, 0.8


def assert_q8_close(got, ref):
    """Logits [T, V] of q8 launches against the reference's with the same rounding: at least
    Q8_MIN_EXACT of the positions within TOL std, every one within Q8_FLIP_TOL, the same argmax."""
    err, std = np.abs(got - ref).max(axis=1), ref.std()  # [positions]
    print(f"{np.mean(err <= TOL * std):.2%} of positions within {TOL} std, worst {err.max() / std:.3g} std")
    assert np.mean(err <= TOL * std) >= Q8_MIN_EXACT and err.max() <= Q8_FLIP_TOL * std
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kernels,n_tokens,ubatch,routing", [("pallas-q8", 32, 16, "xla"), ("pallas-q8", 10, 1, "xla"),
                                                             ("pallas-q8-bf16", 10, 1, "pallas"),
                                                             ("pallas-q8-bf16", 10, 1, "pallas-tickets")],
                         ids=["prefill", "decode", "decode-q8-bf16", "decode-q8-bf16-tickets"])
def test_q8_kernels_match_reference_with_cuda_rounding(q4km, kernels, n_tokens, ubatch, routing):
    """pallas-q8-bf16 decodes as pallas-q8 does (it prefills as pallas-bf16 does:
    test_bf16_prefill_is_nearer_exact_than_llamacpp_arithmetic); routed as on a GPU, its gate/up
    launches read the normed x that the router's launch rounded; with routing pallas-tickets the
    router's launch also routes, and o and down add the residual in their last programs."""
    model = load_model(q4km, kernels=kernels, routing=routing)
    assert model.params["blk.1.attn_q.weight"].layout == "ggml"
    if kernels == "pallas-q8":
        assert model.cfg.act_rounding == "ggml-cuda" and model.cfg.prefill_precision == "q-int8"  # int8 tiles
    else:
        assert model.cfg.act_rounding == "q8-decode" and model.cfg.prefill_precision == "q-bf16"
    ids = tokens(n_tokens, seed=ubatch + 1)
    ref = sequence_logits(load_model(q4km, kernels="reference", weights="blocks"), ids, ubatch=ubatch,
                          act_rounding="ggml-cuda")
    assert_q8_close(sequence_logits(model, ids, ubatch=ubatch), ref)
    # the rounding is real: exact activations give other logits
    exact = sequence_logits(load_model(q4km, kernels="reference", weights="blocks"), ids, ubatch=ubatch)
    assert np.abs(exact - ref).max() > 10 * TOL * ref.std()


@pytest.mark.parametrize("routing", ["pallas", "pallas-tickets"])
def test_q8_bf16_decode_beside_host_experts(q4km, routing):
    """pallas-q8-bf16 (the GPU's default kernels) with layer 0's experts on the host: layer 1's q8
    launches take their card slots from the placement, layer 0's experts run on the host (f32
    activations: their own rounding is tests/test_hybrid.py's), against the reference with the same
    placement and the llama.cpp CUDA rounding of the card's products; tolerances as above. Routed
    as on a GPU: layer 1's gate/up read the router's rounded x, the host the float x (pallas-tickets:
    down adds x and the card's rows, the host's rows are added after)."""
    ids = tokens(10, seed=4)
    model = load_model(q4km, kernels="pallas-q8-bf16", place="n-cpu-moe=1", host_act="f32", routing=routing)
    assert model.params["blk.0.ffn_gate_exps.weight"].shape[0] == 0
    ref = sequence_logits(load_model(q4km, kernels="reference", place="n-cpu-moe=1", host_act="f32"), ids, ubatch=1,
                          act_rounding="ggml-cuda")
    assert_q8_close(sequence_logits(model, ids, ubatch=1), ref)


@pytest.mark.parametrize("place", ["card", "n-cpu-moe=1"])
def test_tickets_step_matches_two_launch_form(q4km, place):
    """The GPU's configuration (pallas-q8-bf16, attention and routing pallas) under routing
    pallas-tickets, where the decode attention is one launch (``attention_prepped``) and the
    router, o and down finish by ticket, against routing pallas: the same arithmetic but for the
    order of some sums, so the q8 tolerances above (sums in another order can flip a rare Q8_1
    quant). Against the jnp attention they are not comparable position by position: a flip in
    a key stored at one position moves every later position (seen: 0.03 std from position 1 on)."""
    ids = tokens(10, seed=2)
    kw = dict(kernels="pallas-q8-bf16", attention="pallas", place=place, host_act="f32")
    ref = sequence_logits(load_model(q4km, routing="pallas", **kw), ids, ubatch=1)
    assert_q8_close(sequence_logits(load_model(q4km, routing="pallas-tickets", **kw), ids, ubatch=1), ref)


def compile_kernels(monkeypatch):
    """Make the model's Pallas calls lower for a GPU here, not run in the interpreter."""
    import importlib

    for name in ("ops.qmatmul", "ops.experts", "models.kv_cache", "models.qwen3moe", "engine.cache"):
        module = importlib.import_module(f"bloomery_jax.{name}")
        if hasattr(module, "interpret_kernels"):
            monkeypatch.setattr(module, "interpret_kernels", lambda: False)


def step_kernels(model, monkeypatch, tokens, positions) -> list:
    """``triton_kernels`` of one qwen3moe step of ``model`` (tokens and positions int32 [1, T])
    on an empty 64-slot cache, its Pallas calls lowered for an H200 (compile_kernels)."""
    from bloomery_jax.models import qwen3moe
    from triton_lowering import triton_kernels

    compile_kernels(monkeypatch)
    step = lambda params, tokens, positions, cache, placement: qwen3moe.forward(  # noqa: E731
        params, model.cfg, tokens, positions, cache, placement)
    return triton_kernels(monkeypatch, step, model.params, tokens, positions, qwen3moe.init_cache(model.cfg, 1, 64),
                          model.placement)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_decode_step_lowers_to_triton_for_h200(q4km, monkeypatch):
    """The whole one-token step of the GPU configuration (pallas kernels, attention and routing,
    the placement table as the engine passes it), lowered for an H200 without one: every kernel a verified Triton module, the q/k prep among them
    (it reads the q/k/v launch's partial sums and writes the cache through aliases); then a
    prefill step likewise."""
    import jax.numpy as jnp

    model = load_model(q4km, kernels="pallas", attention="pallas", routing="pallas")
    built = step_kernels(model, monkeypatch, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 5, jnp.int32))
    names = {name for name, _, _ in built}
    assert {"qgemv_many", "decode_qk_prep", "decode_attention", "router_logits", "route_topk", "moe_gemv_many"} <= names, names
    assert all(cc == 90 and ok for _, cc, ok in built)
    # a 16-token prefill step: flash attention from the cache, the grouped expert GEMM
    built = step_kernels(model, monkeypatch, jnp.zeros((1, 16), jnp.int32), jnp.arange(16, dtype=jnp.int32)[None])
    names = {name for name, _, _ in built}
    assert "prefill_attention" in names and any(n.startswith("moe_gemm") for n in names), names
    assert all(cc == 90 and ok for _, cc, ok in built)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_q8_decode_step_lowers_to_triton_for_h200(q4km, monkeypatch):
    """kernels=pallas-q8's one-token step for an H200: every quantized product a q8 launch that
    rounds its own input to Q8_1 (q/k/v and gate/up with the norm, down with SwiGLU), so the
    step makes no launch of the planes kernels and traces no ``quantize_q8_1``."""
    import jax.numpy as jnp

    from bloomery_jax.ops import actquant, experts, qmatmul

    model = load_model(q4km, kernels="pallas-q8", attention="pallas", routing="pallas")

    def no_rounding_launch(x):
        raise AssertionError("the q8 step rounded activations outside its kernels")

    for module in (actquant, experts, qmatmul):  # wherever the name is bound
        if hasattr(module, "quantize_q8_1"):
            monkeypatch.setattr(module, "quantize_q8_1", no_rounding_launch)
    built = step_kernels(model, monkeypatch, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 5, jnp.int32))
    names = {name for name, _, _ in built}
    assert {"qgemv_q8_many", "decode_qk_prep", "moe_gemv_q8_many"} <= names, names
    assert any(n.startswith("moe_gemv_q8_q") for n in names) and any(n.startswith("qgemv_q8_q") for n in names), names
    assert not any(n in ("qgemv_many", "moe_gemv_many") or n.startswith(("moe_gemv_q4", "moe_gemv_q6")) for n in names)
    assert all(cc == 90 and ok for _, cc, ok in built)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_tickets_decode_step_lowers_to_triton_for_h200(q4km, monkeypatch):
    """routing=pallas-tickets' one-token step of the GPU's kernels for an H200: the router's launch
    routes (no route_topk launch), o and down add the residual in their last programs, attention
    is one launch (no q/k prep, no split kernel), every kernel a verified Triton module."""
    import jax.numpy as jnp

    model = load_model(q4km, kernels="pallas-q8-bf16", attention="pallas", routing="pallas-tickets")
    built = step_kernels(model, monkeypatch, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 5, jnp.int32))
    names = {name for name, _, _ in built}
    assert {"router_logits", "moe_gemv_q8_many", "decode_attention_prepped"} <= names, names
    assert not names & {"route_topk", "decode_qk_prep", "decode_attention"}, names
    assert any(n.startswith("moe_gemv_q8_q") for n in names) and any(n.startswith("qgemv_q8_q") for n in names), names
    assert all(cc == 90 and ok for _, cc, ok in built)


@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
@pytest.mark.parametrize("kernels,routing", [("pallas", "pallas"), ("pallas-q8-bf16", "pallas-tickets")])
def test_decode_block_lowers_graph_ready_for_h200(q4km, monkeypatch, kernels, routing):
    """A decode block of the GPU configuration (the engine's ``lax.scan`` of steps, each with the
    GPU's sampler) lowered for an H200: the loop's body has no sort and no conditional, which
    would keep the loop on the host (a cub sort is no CUDA graph node; a conditional makes the
    host wait for the card), and every kernel in it is a verified Triton module. Also under
    pallas-tickets (its epilogues decide in-kernel, not in XLA), two rows a step."""
    import jax
    import jax.numpy as jnp

    from bloomery_jax.engine import sampling, steps
    from bloomery_jax.engine.cache import SlotCache
    from triton_lowering import lowered_for_h200, triton_kernels

    model = load_model(q4km, kernels=kernels, attention="pallas", routing=routing)
    compile_kernels(monkeypatch)
    monkeypatch.setattr(sampling, "SEARCH_PLATFORMS", ("gpu", jax.default_backend()))
    monkeypatch.setattr(sampling, "BRANCH_FREE_PLATFORMS", ("gpu", jax.default_backend()))
    rows = 2
    cache = SlotCache.for_config(model.cfg, rows, 64)
    sampler = sampling.make_rows([sampling.row_arrays(sampling.SamplingParams(temperature=0.8, top_p=0.9),
                                                      model.cfg.n_vocab)] * rows)
    block = lambda params, cache, sampler, placement, tokens, positions, active: steps._decode_steps(  # noqa: E731
        model.module.forward, model.cfg, sampling.Plan(draw=True, n_top=20), 4, params, cache, sampler, placement, tokens,
        positions, active)
    args = (model.params, cache, sampler, model.placement, jnp.zeros(rows, jnp.int32), jnp.full(rows, 5, jnp.int32),
            jnp.ones(rows, bool))
    built = triton_kernels(monkeypatch, block, *args)
    names = {name for name, _, _ in built}
    if routing == "pallas":
        assert {"qgemv_many", "decode_qk_prep", "decode_attention", "router_logits", "route_topk",
                "moe_gemv_many"} <= names, names
    else:
        assert {"qgemv_q8_many", "decode_attention_prepped", "router_logits", "moe_gemv_q8_many"} <= names, names
        assert not names & {"route_topk", "decode_qk_prep", "decode_attention"}, names
    assert all(cc == 90 and ok for _, cc, ok in built)
    text = lowered_for_h200(block, *args)
    assert text.count("stablehlo.while") == 1  # the scan itself
    for op in ("stablehlo.sort", "stablehlo.case", "stablehlo.if"):
        assert op not in text, op

@pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")
def test_packed_prefill_products_take_the_prefill_precision(monkeypatch):
    """A packed weight times more rows than the GEMV takes: by default three TF32 passes when
    lowered for a GPU (tensor cores, f32-like error), HIGHEST's f32 on the CPU (which has no TF32
    algorithms); quant tiles when the model's prefill precision names them."""
    import jax
    import jax.numpy as jnp
    from gguf import GGMLQuantizationType as T

    from bloomery_jax.ops import qmatmul as qm
    from bloomery_jax.quant.repack import repack
    from bloomery_jax.synth.blocks import random_blocks
    from triton_lowering import lowered_for_h200, triton_kernels

    w = repack(random_blocks(T.Q4_K, (64, 256), 0.02, np.random.default_rng(0)), T.Q4_K, (64, 256))
    x = jnp.zeros((16, 256), jnp.float32)
    cpu = jax.jit(qm.qmatmul).lower(x, w).as_text()
    assert "tf32" not in cpu and "HIGHEST" in cpu
    monkeypatch.setattr(qm, "interpret_kernels", lambda: False)
    dots = [line for line in lowered_for_h200(qm.qmatmul, x, w).splitlines() if "dot_general" in line]
    assert dots and all("lhs_precision_type = tf32" in d and "num_primitive_operations = 3" in d for d in dots)
    # at a quant-tile precision (kernels=pallas-qtiles) the product is moe_gemm's kernel with one
    # expert, and no XLA dot is left
    quant = lambda x, w: qm.qmatmul(x, w, precision="q-bf16x2")  # noqa: E731
    assert [name for name, _, ok in triton_kernels(monkeypatch, quant, x, w) if ok] == ["moe_gemm_q4_k"]
    assert "stablehlo.dot_general" not in lowered_for_h200(quant, x, w)
