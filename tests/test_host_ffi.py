"""The FFI host bridge (host/ffi.py, host/ffi_bridge.cc, host/entry.py) on the CPU.

It runs the same layer kernel as the pure_callback bridge at the same thread count, so the
comparison is exact (bit for bit), inside jit, for K-quant, Q8_0 and f16 experts and for models;
the CUDA handler shares the record, the checks and the host function and is exercised on the
GPU machine (scripts/bridge_bench.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_host_experts import E, _layer, _routing
from test_hybrid import SHAPE, prompt

from bloomery_jax.engine import Engine
from bloomery_jax.engine.sampling import SamplingParams
from bloomery_jax.errors import ConfigError
from bloomery_jax.host import ffi_layout
from bloomery_jax.host.bridge import HostBridge
from bloomery_jax.host.ffi import _SLOTS, FfiHostBridge, _compiler, library
from bloomery_jax.models.loader import load_model
from bloomery_jax.models.qwen3moe import forward


def _bridges(names, threads):
    layers = {3 * i + 1: _layer(name) for i, name in enumerate(names)}
    return HostBridge(layers, threads), FfiHostBridge(layers, threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_callback_bridge_bit_for_bit(threads):
    names = ["Q4_K_M", "Q8_0", "F16", "Q5_K"]
    callback, ffi = _bridges(names, threads)
    rng = np.random.default_rng(5)
    for N in (1, 3, 8):
        x, experts, weights = _routing(rng, N, 4)
        on_host = rng.random(E) < 0.6
        for layer in callback.layers:
            outs = [np.asarray(jax.jit(lambda *a, b=b: b.moe(layer, *a))(x, experts, weights, on_host))
                    for b in (callback, ffi)]
            assert outs[1].dtype == np.float32 and outs[1].shape == (N, x.shape[1])
            np.testing.assert_array_equal(outs[1], outs[0])
            assert np.any(outs[1] != 0)
    # a token whose experts are all on the card gets exact zeros
    x, experts, weights = _routing(rng, 2, 4)
    on_host = np.ones(E, bool)
    on_host[experts[0]] = False
    y = np.asarray(jax.jit(lambda *a: ffi.moe(1, *a))(x, experts, weights, on_host))
    assert not y[0].any() and y[1].any()


def test_counts_calls_pairs_and_time():
    _, ffi = _bridges(["Q8_0"], 1)
    rng = np.random.default_rng(1)
    x, experts, weights = _routing(rng, 4, 2)
    on_host = np.arange(E) % 2 == 0
    step = jax.jit(lambda *a: ffi.moe(1, *a))
    for _ in range(3):
        step(x, experts, weights, on_host).block_until_ready()
    st = ffi.stats
    assert st.calls == 3 and st.pairs == 3 * int(on_host[experts].sum()) and st.seconds > 0


def test_a_cleared_slot_is_an_error_not_a_crash():
    _, ffi = _bridges(["Q8_0"], 1)
    rng = np.random.default_rng(2)
    args = (*_routing(rng, 1, 2), np.ones(E, bool))
    step = jax.jit(lambda *a: ffi.moe(1, *a))
    step(*args).block_until_ready()
    lib, slot = library(), ffi._slots[1]
    lib.bloomery_ffi_set_record(slot, None)
    try:
        with pytest.raises(Exception, match=f"slot {slot} has no layer record"):
            step(*args).block_until_ready()
    finally:
        lib.bloomery_ffi_set_record(slot, ffi._records[1].ctypes.data)
    step(*args).block_until_ready()


def test_a_shape_the_record_does_not_describe_is_an_error():
    _, ffi = _bridges(["Q8_0"], 1)
    rng = np.random.default_rng(3)
    x, experts, weights = _routing(rng, 2, 2)
    with pytest.raises(Exception, match="shapes do not match the layer record"):
        jax.jit(lambda *a: ffi.moe(1, *a))(x[:, :128], experts, weights, np.ones(E, bool)).block_until_ready()


def test_slots_are_handed_out_lowest_first_and_returned():
    a = _SLOTS.take(3)
    _SLOTS.give(a)
    assert _SLOTS.take(3) == a  # a new process's first bridge gets the same slots: cached steps stay valid
    _SLOTS.give(a)


def test_record_layout_matches_the_library():
    assert library().bloomery_ffi_record_words() == ffi_layout.WORDS
    assert "kStageX = %d," % ffi_layout.STAGE_X in ffi_layout.c_header()


def test_no_compiler_is_a_config_error(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        _compiler()


def test_hybrid_model_same_logits_and_tokens_as_callback(synth_model):
    """A whole model: prefill logits and greedy decode with the ffi bridge equal the callback's."""
    path, _ = synth_model(qtype="Q4_K_M", seed=11, **SHAPE)
    tokens = prompt()[None, :12]
    pos = np.arange(12)[None]
    logits, decoded = [], []
    for kind in ("callback", "ffi"):
        model = load_model(path, place="n-cpu-moe=2", host_act="q8", bridge=kind)
        out, _, _ = forward(model.params, model.cfg, jnp.asarray(tokens), jnp.asarray(pos), model.init_cache(1, 12),
                            model.placement)
        logits.append(np.asarray(out))
        eng = Engine(model, n_slots=1, max_context=48, ubatch=16, min_chunk=16)
        seq = eng.add(prompt(1)[:10].tolist(), SamplingParams(temperature=0.0))
        got = []
        while seq.pending > 1:
            sampled = eng.prefill(seq)
            if sampled is not None:
                got.append(sampled.token)
        while len(got) < 8:
            got.append(eng.decode([seq])[0].token)
        decoded.append(got)
        assert model.placement.host.stats.calls > 0
    assert isinstance(model.placement.host, FfiHostBridge)
    np.testing.assert_array_equal(logits[1], logits[0])
    assert decoded[1] == decoded[0]


def test_bad_bridge_name_is_a_config_error(synth_model):
    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    with pytest.raises(ConfigError, match="bridge='pipe'"):
        load_model(path, place="cpu-moe", bridge="pipe")
