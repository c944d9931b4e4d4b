"""The FFI host bridge (host/ffi.py, host/ffi_bridge.cc, host/entry.py) on the CPU.

It runs the same layer kernel as the pure_callback bridge at the same thread count, so the
comparison is exact (bit for bit), inside jit, for K-quant, Q8_0 and f16 experts and for models;
the CUDA handler shares the record, the checks and the host function and is exercised on the
GPU machine (scripts/bridge_bench.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_host_experts import E, _layer, _routing
from test_hybrid import SHAPE, greedy_tokens, prompt

from bloomery_jax.errors import ConfigError
from bloomery_jax.host import ffi_layout
from bloomery_jax.host.bridge import HostBridge
from bloomery_jax.host.ffi import _SLOTS, FfiHostBridge, compiler, library
from bloomery_jax.models.loader import load_model
from bloomery_jax.models.qwen3moe import forward


def _bridges(names, threads, team=None):
    layers = {3 * i + 1: _layer(name) for i, name in enumerate(names)}
    return HostBridge(layers, threads), FfiHostBridge(layers, threads, team=team)


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


@pytest.mark.parametrize("threads,plain", [(1, "0"), (2, "0"), (2, "1")])
def test_host_team_matches_the_callback_bridge_bit_for_bit(threads, plain, monkeypatch):
    """Calls of at most TEAM_TOKENS tokens on the host team (threads that stay awake between
    calls, ffi_bridge.cc) give the callback bridge's result bit for bit: after the team's threads
    have fallen asleep too (a spin of 0 us), for a token with no host pair, and for a call too
    large for the team (the Numba kernel); also with the shared items outside the one-thread
    regions (BLOOMERY_HOST_TEAM_PLAIN). Its spans nest as the kernel's do."""
    from bloomery_jax.host.ffi import TEAM_TOKENS

    monkeypatch.setenv("BLOOMERY_HOST_TEAM_SPIN_US", "0")
    monkeypatch.setenv("BLOOMERY_HOST_TEAM_PLAIN", plain)
    names = ["Q4_K_M", "Q8_0", "F16"]
    callback = HostBridge({3 * i + 1: _layer(name) for i, name in enumerate(names)}, threads)
    team = FfiHostBridge(callback.layers, threads, team=True)
    rng = np.random.default_rng(21)
    for N in (1, 2, TEAM_TOKENS, TEAM_TOKENS + 1, 1):
        x, experts, weights = _routing(rng, N, 4)
        on_host = rng.random(E) < 0.6
        on_host[experts[0]] = False  # the first token's experts all on the card: zeros
        for layer in callback.layers:
            outs = [np.asarray(jax.jit(lambda *a, b=b: b.moe(layer, *a))(x, experts, weights, on_host))
                    for b in (callback, team)]
            np.testing.assert_array_equal(outs[1], outs[0])
            assert not outs[1][0].any() and (N == 1 or outs[1][1:].any())
    call, regions, wake, join = team.stats.ticks
    assert call >= regions > wake + join and wake >= 0 and join >= 0
    # every call of at most TEAM_TOKENS tokens ran on the team, the larger one in the kernel
    assert [int(r[ffi_layout.TEAM_CALLS]) for r in team._records.values()] == [4] * len(names)
    assert team.stats.calls == 5 * len(names)
    assert {int(r[ffi_layout.TEAM_PLAIN]) for r in team._records.values()} == {int(plain)}


def _team_record(threads):
    """A team bridge over one Q4_K_M layer for calls of k = 4, a copy of its record, and the C
    entry that runs a call on the team from this thread (as host_call_probe.py calls it)."""
    import ctypes

    bridge = FfiHostBridge({1: _layer("Q4_K_M")}, threads, team=True)
    bridge._ensure_team_scratch(4)
    record = bridge._records[1].copy()
    record[ffi_layout.K] = 4  # the FFI handler sets it from the call's operands
    run_host = library().bloomery_ffi_run_host
    run_host.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64]
    return bridge, record, run_host


def test_host_team_gives_the_caller_its_thread_count_back():
    """A team part runs with its thread's Numba thread count at 1 (so that its region stays on that
    thread); after a team call the calling thread has the record's count again, for the other
    parallel Numba code it runs. Called through the C entry on this thread, as the probe does."""
    import numba

    bridge, record, run_host = _team_record(2)
    x, experts, weights = _routing(np.random.default_rng(3), 1, 4)
    on_host = np.ones(E, bool)
    out = np.empty_like(x)
    numba.set_num_threads(2)
    run_host(record.ctypes.data, x.ctypes.data, experts.ctypes.data, weights.ctypes.data, on_host.ctypes.data,
             out.ctypes.data, 1)
    assert int(record[ffi_layout.TEAM_CALLS]) == 1 and out.any()
    assert numba.get_num_threads() == 2


def test_host_team_threads_stamp_their_phases_in_order():
    """Each team thread stamps its phases (ffi_layout.TEAM_STAMPS) after the team's counters: every
    stamp of a call lies between the counter read just before the call and just after it, in the
    order the phases run, and the next call's stamps replace them (the call's memset spares them)."""
    from bloomery_jax.host.ticks import _now

    threads = 2
    bridge, record, run_host = _team_record(threads)
    counters = bridge._team_scratch[3]
    rng = np.random.default_rng(5)
    on_host = np.ones(E, bool)
    previous = None
    for _ in range(2):
        x, experts, weights = _routing(rng, 1, 4)
        out = np.empty_like(x)
        before = _now()
        run_host(record.ctypes.data, x.ctypes.data, experts.ctypes.data, weights.ctypes.data, on_host.ctypes.data,
                 out.ctypes.data, 1)
        after = _now()
        # [threads, 8] words, each thread's line: its stamps first
        stamps = counters[ffi_layout.COUNTER_WORDS:].reshape(threads, 8)[:, :len(ffi_layout.TEAM_STAMPS)]
        assert (stamps >= before).all() and (stamps <= after).all(), (before, stamps, after)
        assert (np.diff(stamps, axis=1) >= 0).all(), stamps
        assert previous is None or (stamps > previous.max()).all()
        previous = stamps.copy()


def test_dynamic_chunks_give_the_same_result(monkeypatch):
    """With BLOOMERY_HOST_CHUNKSIZE's setting (here 2: work items handed out two at a time as threads
    free up) the handler sets the chunk size through Numba's C setter before each call; every
    output element still belongs to one thread and one summation order, so the result is the
    static split's bit for bit."""
    from bloomery_jax.host import ffi

    static_callback, static_ffi = _bridges(["Q4_K_M"], 2)
    monkeypatch.setattr(ffi, "CHUNKSIZE", 2)
    dynamic_ffi = FfiHostBridge(static_ffi.layers, 2)
    assert dynamic_ffi._records[1][ffi_layout.CHUNKSIZE] == 2 and static_ffi._records[1][ffi_layout.CHUNKSIZE] == 0
    rng = np.random.default_rng(8)
    x, experts, weights = _routing(rng, 8, 4)
    on_host = rng.random(E) < 0.7
    outs = [np.asarray(jax.jit(lambda *a, b=b: b.moe(1, *a))(x, experts, weights, on_host))
            for b in (static_callback, static_ffi, dynamic_ffi)]
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])


def test_counts_calls_pairs_and_time():
    """Also the kernel's tick spans, in the record's TICKS_* words: a whole call holds its regions,
    and a region its wait for the workers and its join (the Numba kernel's: the team's are
    test_host_team_matches_the_callback_bridge_bit_for_bit's)."""
    _, ffi = _bridges(["Q8_0"], 2, team=False)
    rng = np.random.default_rng(1)
    x, experts, weights = _routing(rng, 4, 2)
    on_host = np.arange(E) % 2 == 0
    step = jax.jit(lambda *a: ffi.moe(1, *a))
    for _ in range(3):
        step(x, experts, weights, on_host).block_until_ready()
    st = ffi.stats
    assert st.calls == 3 and st.pairs == 3 * int(on_host[experts].sum()) and st.seconds > 0
    call, regions, wake, join = st.ticks
    assert call > regions > wake + join and wake >= 0 and join >= 0


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
    assert "kStageIn = %d," % ffi_layout.STAGE_IN in ffi_layout.c_header()


def test_signal_comes_from_the_argument_then_the_environment(monkeypatch):
    from bloomery_jax.host.ffi import resolve_signal

    monkeypatch.delenv("BLOOMERY_FFI_SIGNAL", raising=False)
    assert resolve_signal(None) == "doorbell" and resolve_signal("hostfunc") == "hostfunc"
    monkeypatch.setenv("BLOOMERY_FFI_SIGNAL", "hostfunc")
    assert resolve_signal(None) == "hostfunc" and resolve_signal("doorbell") == "doorbell"
    with pytest.raises(ConfigError, match="signal 'bell' is not one of hostfunc, doorbell"):
        resolve_signal("bell")


def test_no_compiler_is_a_config_error(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        compiler()


def test_auto_bridge_is_ffi_on_a_gpu_with_a_compiler_else_callback(monkeypatch, capsys):
    from types import SimpleNamespace

    from bloomery_jax.models.loader import resolve_bridge

    gpu, cpu = SimpleNamespace(platform="gpu"), SimpleNamespace(platform="cpu")
    assert [resolve_bridge(b, cpu) for b in ("auto", "ffi", "callback")] == ["callback", "ffi", "callback"]
    assert resolve_bridge("auto", gpu) == "ffi"
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert resolve_bridge("auto", gpu) == "callback"
    assert "needs a C++ compiler" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="bridge='pipe'"):
        resolve_bridge("pipe", cpu)


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
        decoded.append(greedy_tokens(model, prompt(1)[:10].tolist(), 8, n_slots=1, max_context=48))
        assert model.placement.host.stats.calls > 0
    assert isinstance(model.placement.host, FfiHostBridge)
    np.testing.assert_array_equal(logits[1], logits[0])
    assert decoded[1] == decoded[0]


def test_overlapped_halves_same_logits_and_tokens(synth_model, monkeypatch):
    """With BLOOMERY_FFI_OVERLAP=1, a layer with experts on both sides makes its host call in two
    halves around the card's experts (the start, a barrier, the card, the finish): the same
    prefill logits and greedy tokens, bit for bit, as one whole call, and as many calls counted.
    A step of layers without card experts keeps the whole call."""
    path, _ = synth_model(qtype="Q4_K_M", seed=11, **SHAPE)
    tokens, pos = jnp.asarray(prompt()[None, :12]), jnp.asarray(np.arange(12)[None])
    logits, decoded, calls = [], [], []
    for overlap in ("0", "1"):
        monkeypatch.setenv("BLOOMERY_FFI_OVERLAP", overlap)
        model = load_model(path, place="card-experts=4", host_act="q8", bridge="ffi")
        assert model.placement.host.overlap == (overlap == "1")
        step = jax.jit(forward, static_argnums=1)
        args = (model.params, model.cfg, tokens, pos, model.init_cache(1, 12), model.placement)
        hlo = step.lower(*args).as_text()
        assert ("bloomery_host_moe_start" in hlo and "bloomery_host_moe_finish" in hlo
                and "optimization_barrier" in hlo) == (overlap == "1"), overlap
        logits.append(np.asarray(step(*args)[0]))
        decoded.append(greedy_tokens(model, prompt(1)[:10].tolist(), 8, n_slots=1, max_context=48))
        calls.append(model.placement.host.stats.calls)
    np.testing.assert_array_equal(logits[1], logits[0])
    assert decoded[1] == decoded[0] and calls[1] == calls[0] > 0
    monkeypatch.setenv("BLOOMERY_FFI_OVERLAP", "1")
    model = load_model(path, place="cpu-moe", bridge="ffi")
    hlo = jax.jit(forward, static_argnums=1).lower(model.params, model.cfg, tokens[:, :4], pos[:, :4],
                                                   model.init_cache(1, 4), model.placement).as_text()
    assert set(re.findall(r"bloomery_host_moe\w*", hlo)) == {"bloomery_host_moe"}


def test_overlap_comes_from_the_argument_then_the_environment(monkeypatch):
    from bloomery_jax.host.ffi import resolve_overlap

    monkeypatch.delenv("BLOOMERY_FFI_OVERLAP", raising=False)
    assert resolve_overlap(None) is True and resolve_overlap(False) is False
    monkeypatch.setenv("BLOOMERY_FFI_OVERLAP", "0")
    assert resolve_overlap(None) is False and resolve_overlap(True) is True
    monkeypatch.setenv("BLOOMERY_FFI_OVERLAP", "yes")
    with pytest.raises(ConfigError, match="BLOOMERY_FFI_OVERLAP='yes'"):
        resolve_overlap(None)


def test_team_comes_from_the_argument_then_the_environment(monkeypatch):
    """The host team is on by default where the threading layer runs it (this process's omp or
    tbb), and ``$BLOOMERY_HOST_TEAM`` or the argument turn it off."""
    from bloomery_jax.host.ffi import _threading_layer, resolve_team

    monkeypatch.delenv("BLOOMERY_HOST_TEAM", raising=False)
    assert resolve_team(None) is (_threading_layer() != "workqueue") and resolve_team(False) is False
    monkeypatch.setenv("BLOOMERY_HOST_TEAM", "0")
    assert resolve_team(None) is False
    monkeypatch.setenv("BLOOMERY_HOST_TEAM", "on")
    with pytest.raises(ConfigError, match="BLOOMERY_HOST_TEAM='on'"):
        resolve_team(None)


def test_host_team_refuses_the_workqueue_layer():
    """The host team's threads each start a Numba parallel region at once, which the workqueue
    threading layer cannot run: asking for the team there is a ConfigError, off still works, and
    by default the team is off there."""
    code = ("from bloomery_jax.host.ffi import resolve_team\n"
            "assert resolve_team(False) is False and resolve_team(None) is False\n"
            "try:\n    resolve_team(True)\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    env.pop("BLOOMERY_HOST_TEAM", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("ConfigError") and "workqueue" in run.stdout


def test_prefill_streaming_same_logits_and_bytes_as_callback(synth_model):
    """Steps of 32 tokens or more copy each host layer's whole expert tensors to the device
    (the stream custom call): the same logits as the callback bridge, the same bytes counted,
    no host kernel call."""
    path, _ = synth_model(qtype="Q4_K_M", seed=11, **SHAPE)
    tokens, pos = prompt()[None, :32], np.arange(32)[None]
    logits, streamed = [], []
    for kind in ("callback", "ffi"):
        model = load_model(path, place="cpu-moe", bridge=kind)
        step = jax.jit(forward, static_argnums=1)
        for _ in range(2):
            out, _, _ = step(model.params, model.cfg, jnp.asarray(tokens), jnp.asarray(pos), model.init_cache(1, 32),
                             model.placement)
        logits.append(np.asarray(out))
        bridge = model.placement.host
        per_step = sum(getattr(layer, r).data.nbytes for layer in bridge.layers.values() for r in ("gate", "up", "down"))
        assert bridge.stats.streamed_bytes == 2 * per_step and bridge.stats.calls == 0
    np.testing.assert_array_equal(logits[1], logits[0])


def test_ffi_steps_have_no_conditional(synth_model):
    """The callback bridge's steps branch around the host call; the ffi bridge's call stands in
    the step's straight-line code (a conditional would sync the stream on a GPU)."""
    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    tokens, pos = jnp.asarray(prompt()[None, :4]), jnp.asarray(np.arange(4)[None])
    for kind, branches in (("callback", True), ("ffi", False)):
        model = load_model(path, place="n-cpu-moe=1", bridge=kind)
        hlo = jax.jit(forward, static_argnums=1).lower(model.params, model.cfg, tokens, pos, model.init_cache(1, 4),
                                                       model.placement).as_text()
        assert ("stablehlo.case" in hlo or "stablehlo.if" in hlo) == branches, kind


def test_bad_bridge_name_is_a_config_error(synth_model):
    path, _ = synth_model(qtype="Q8_0", seed=11, **SHAPE)
    with pytest.raises(ConfigError, match="bridge='pipe'"):
        load_model(path, place="cpu-moe", bridge="pipe")


# A stand-in for the CUDA driver: every queued call runs at once, "pinned" memory is malloc'd and
# its device address is its own; a wait on a value spins until another thread writes it (10 s at most).
FAKE_LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
#include <chrono>
extern "C" {
typedef void (*host_fn)(void*);
int cuInit(unsigned f) { return 0; }
int cuDeviceGet(int* d, int ordinal) { *d = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void** ctx, int d) { *ctx = (void*)1; return 0; }
int cuCtxPushCurrent_v2(void* ctx) { return 0; }
int cuCtxPopCurrent_v2(void** ctx) { *ctx = (void*)1; return 0; }
int cuMemHostAlloc(void** p, size_t n, unsigned flags) { return posix_memalign(p, 64, n); }
int cuMemHostRegister_v2(void* p, size_t n, unsigned flags) { return flags == 1 ? 0 : 1; }
int cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t n, void* stream) {
  memcpy((void*)dst, (const void*)src, n); return 0; }
int cuMemcpyHtoD_v2(unsigned long long dst, const void* src, size_t n) { memcpy((void*)dst, src, n); return 0; }
int cuLaunchHostFunc(void* stream, host_fn fn, void* arg) { fn(arg); return 0; }
int cuMemHostGetDevicePointer_v2(unsigned long long* d, void* p, unsigned flags) {
  *d = (unsigned long long)p; return 0; }
int cuStreamWriteValue32_v2(void* stream, unsigned long long addr, unsigned value, unsigned flags) {
  __atomic_store_n((unsigned*)addr, value, __ATOMIC_SEQ_CST); return 0; }
int cuStreamWaitValue32_v2(void* stream, unsigned long long addr, unsigned value, unsigned flags) {
  if (flags != 1) return 1;  // only CU_STREAM_WAIT_VALUE_EQ is used
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (__atomic_load_n((unsigned*)addr, __ATOMIC_SEQ_CST) != value)
    if (std::chrono::steady_clock::now() > end) return 2;
  return 0; }
}
"""

CUDA_PATH_SCRIPT = r"""
import ctypes, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # before anything opens libcuda.so.1
sys.path.insert(0, sys.argv[2])
import numpy as np
from test_host_experts import E, _layer, _routing
from bloomery_jax.host import ffi_layout as F, host_moe_swiglu
from bloomery_jax.host.ffi import FfiHostBridge, library
lib = library()
layer = _layer("Q4_K_M")
bridge = FfiHostBridge({5: layer}, threads=2, signal="hostfunc")  # the doorbell after it
rec, slot = bridge._records[5], bridge._slots[5]
rec[F.K] = 4  # set by moe() at trace time
err = ctypes.create_string_buffer(256)
def enqueue(x, experts, weights, on_host, out, halves=3):  # 1 the start, 2 the finish, 3 the whole call
    return lib.bloomery_ffi_test_enqueue(ctypes.c_int64(slot), *(ctypes.c_void_p(a.ctypes.data) for a in
        (x, experts, weights, on_host, out)), ctypes.c_int64(x.shape[0]), ctypes.c_int(halves), err,
        ctypes.c_size_t(len(err)))
def halves(x, experts, weights, on_host):  # the start copies nothing back; the finish gives the whole result
    x = 2 * x  # not the last call's input: a finish that did not wait for the host would copy its output
    out = np.full_like(x, np.nan)
    assert enqueue(x, experts, weights, on_host, out, 1) == 0, err.value
    assert np.isnan(out).all()
    assert enqueue(x, experts, weights, on_host, out, 2) == 0, err.value
    np.testing.assert_array_equal(out, host_moe_swiglu(x, experts, weights, on_host, layer))
rng = np.random.default_rng(7)
x, experts, weights = _routing(rng, 3, 4)
on_host = np.arange(E) % 3 != 0
out = np.full_like(x, np.nan)
assert enqueue(x, experts, weights, on_host, out) == 1 and b"staging for 0" in err.value, err.value
bridge._ensure_staging(2, 4)
assert enqueue(x, experts, weights, on_host, out) == 1 and b"3 tokens but staging for 2" in err.value, err.value
bridge._ensure_staging(4, 4)
for n in (3, 1, 3):  # new sizes intern new host calls; a size seen before reuses its own
    xs, es, ws = x[:n].copy(), experts[:n].copy(), weights[:n].copy()
    out = np.full_like(xs, np.nan)
    assert enqueue(xs, es, ws, on_host, out) == 0, err.value
    np.testing.assert_array_equal(out, host_moe_swiglu(xs, es, ws, on_host, layer))
halves(x, experts, weights, on_host)
import jax
from bloomery_jax.host import ffi as ffi_module
from bloomery_jax.host.bridge import HostBridge
from bloomery_jax.host.memory import HUGE_PAGE
ffi_module._on_cuda = lambda: True
# what a GPU bridge computes on: the same bytes, pinned by the driver (small pages) or on huge
# pages the driver registers
for pages in ("small", "huge"):
    bridge.pages = pages
    pinned = bridge._placed(layer)
    for r in ("gate", "up", "down"):
        a, b = getattr(pinned, r).data, getattr(layer, r).data
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b) and not np.shares_memory(a, b)
        assert pages == "small" or a.ctypes.data % HUGE_PAGE == 0
    np.testing.assert_array_equal(host_moe_swiglu(x, experts, weights, on_host, pinned),
                                  host_moe_swiglu(x, experts, weights, on_host, layer))
bridge.pages = "small"
# seating: the chosen experts' rows of the three tensors copied from the (pinned) host copy into
# one device buffer, in the layout the portable gather gives
ids = np.array([5, 0, 5, E - 1], np.int64)
cpu = jax.devices("cpu")[0]
blocks = np.asarray(bridge.experts_on_card(5, ids, cpu))
np.testing.assert_array_equal(blocks, np.asarray(HostBridge.experts_on_card(bridge, 5, ids, cpu)))
assert blocks.size == ids.size * sum(getattr(layer, r).data[0].nbytes for r in ("gate", "up", "down"))
st = bridge.stats
assert st.calls == 4 and st.pairs == int(on_host[experts].sum()) * 3 + int(on_host[experts[:1]].sum()), st
# the doorbell: the stand-in stream rings, our worker thread runs the call and answers, the
# stream's wait returns; each call's id rung and answered anew (the same size twice in a row too)
rec[F.SIGNAL] = F.SIGNALS.index("doorbell")
assert enqueue(x, experts, weights, on_host, out) == 1 and b"no doorbell for device 0" in err.value, err.value
bridge.start_doorbell(0)
bridge.start_doorbell(0)  # a second start is a no-op
for n in (3, 3, 1, 3, 2):
    xs, es, ws = x[:n].copy(), experts[:n].copy(), weights[:n].copy()
    out = np.full_like(xs, np.nan)
    assert enqueue(xs, es, ws, on_host, out) == 0, err.value
    np.testing.assert_array_equal(out, host_moe_swiglu(xs, es, ws, on_host, layer))
    halves(xs, es, ws, on_host)
import time
time.sleep(5.3)  # past the worker's 5 s to dozing: a call still gets answered
out = np.full_like(x, np.nan)
assert enqueue(x, experts, weights, on_host, out) == 0, err.value
np.testing.assert_array_equal(out, host_moe_swiglu(x, experts, weights, on_host, layer))
assert bridge.stats.calls == 15, bridge.stats
print("ok")
"""


def test_cuda_path_queues_copies_host_call_and_copy_back(tmp_path):
    """The CUDA handler's queue of work (staging copies in, the host call, copy out) against a
    stand-in driver that runs each call at once: the staging is sized and used right, and the
    result is the kernel's bit for bit, under both signals (cuLaunchHostFunc, the doorbell and
    its worker thread), whole and in two halves (the output arrives with the finish); and the
    copy of chosen experts' rows to the card that seating uses.
    (Graph capture and the real driver run on the GPU machine.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = tmp_path / "fake_libcuda.cc"
    src.write_text(FAKE_LIBCUDA)
    so = tmp_path / "libcuda.so.1"
    subprocess.run([compiler(), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(src), "-o", str(so)], check=True)
    script = tmp_path / "cuda_path.py"
    script.write_text(CUDA_PATH_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, str(script), str(so), str(Path(__file__).parent)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-3000:]
