"""Host expert kernels (bloomery_jax.host) against their NumPy float64 twin, with a derived tolerance.

Every comparison is ``|kernel - reference| <= tol`` elementwise, where ``tol`` comes from
``reference.moe_swiglu_bound``: a first-order rounding bound, ``n 2^-24 sum_i mag_i |v_i|`` per
dot product of K terms (n = K + 64 roundings with float32 activations, K / 32 + 16 with the
exact integer block sums of act="q8"; mag = |scale * quant| + |min| per element), carried
through silu, the product, the 8-bit re-rounding of the hidden vector under ``act="q8"`` (where
the kernel's hidden vector may round to the neighbouring integer) and the weighted sum. Under
``act="q8"`` the reference rounds x exactly as the kernel does (checked bit for bit below), so
no activation-quantization slack is needed. Control tests show the bound catches one flipped
quant (by 8-28x here); typical errors are 1e-4 to 1e-3 of it (it is a worst case).
"""

from __future__ import annotations

import itertools
import zlib

import jax.numpy as jnp
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.host import HostExpertLayer, HostTensor, host_moe_swiglu
from bloomery_jax.host import blocks as B
from bloomery_jax.host import reference as R
from bloomery_jax.host import simd, swiglu
from bloomery_jax.ops.actquant import round_activations
from bloomery_jax.quant import quantize

E, D = 8, 256
# (gate/up type, down type, F): F must be a multiple of 256 where down is a K-quant;
# Q8_0 with F = 96 runs the kernel's tail for rows that are not a multiple of 4 blocks.
FORMATS = {
    "Q4_K_M": (T.Q4_K, T.Q6_K, 256),
    "Q5_K": (T.Q5_K, T.Q5_K, 256),
    "Q6_K": (T.Q6_K, T.Q6_K, 256),
    "Q8_0": (T.Q8_0, T.Q8_0, 128),
    "Q8_0_tail": (T.Q8_0, T.Q8_0, 96),
    "Q4_K/Q8_0": (T.Q4_K, T.Q8_0, 128),
    "F32": (T.F32, T.F32, 128),
    "F16": (T.F16, T.F16, 128),
    "BF16": (T.BF16, T.BF16, 128),
}


def _tensor(w: np.ndarray, qtype) -> HostTensor:
    raw = quantize(w, qtype, threads=1)  # uint8 [E, rows, row_bytes]
    if qtype == T.F32:
        data = raw.view(np.float32)
    elif qtype == T.F16:
        data = raw.view(np.float16)
    elif qtype == T.BF16:
        data = raw.view(np.uint16)
    else:
        data = raw
    return HostTensor(data, qtype, w.shape)


_LAYERS: dict[str, HostExpertLayer] = {}
_DEQUANT: dict[str, dict] = {}  # per layer: the reference's dequantized experts


def _bound(name, *args):
    return R.moe_swiglu_bound(*args[:4], _layer(name), *args[4:], cache=_DEQUANT.setdefault(name, {}))


def _layer(name: str) -> HostExpertLayer:
    if name not in _LAYERS:
        gu, dn, F = FORMATS[name]
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        w = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in ((E, F, D), (E, F, D), (E, D, F))]
        _LAYERS[name] = HostExpertLayer(_tensor(w[0], gu), _tensor(w[1], gu), _tensor(w[2], dn))
    return _LAYERS[name]


def _routing(rng, N: int, k: int):
    x = (rng.standard_normal((N, D)) * rng.uniform(0.5, 3, (N, 1))).astype(np.float32)
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)  # top-k: distinct
    weights = rng.dirichlet(np.ones(k), N).astype(np.float32)
    return x, experts, weights


def _check(y, ref, tol):
    assert y.dtype == np.float32 and y.shape == ref.shape
    err = np.abs(y.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"err {err[worst]:.3g} > tol {tol[worst]:.3g} at {worst} (ref {ref[worst]:.3g})"
    return float(np.max(err / np.maximum(tol, 1e-300)))


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_reference(name, act):
    layer = _layer(name)
    rng = np.random.default_rng(7)
    # 70 x 2: enough activation elements (N D, pairs x F) for the kernel's parallel preparation
    for N, k in ((1, 2), (3, 4), (17, 3), (70, 2)):
        x, experts, weights = _routing(rng, N, k)
        on_host = rng.random(E) < 0.6
        on_host[experts[0, 0]] = True  # at least one host pair
        y = host_moe_swiglu(x, experts, weights, on_host, layer, act=act)
        ref, tol = _bound(name, x, experts, weights, on_host, act)
        ratio = _check(y, ref, tol)
        print(name, act, N, f"max err/tol {ratio:.3g}, max tol / max |ref| {np.max(tol) / np.max(np.abs(ref)):.3g}")


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_on_host_masks(act):
    layer = _layer("Q4_K_M")
    x, experts, weights = _routing(np.random.default_rng(1), 5, 4)
    none = host_moe_swiglu(x, experts, weights, np.zeros(E, bool), layer, act=act)
    assert none.dtype == np.float32 and np.all(none == 0)  # exact zeros, no pair on the host
    all_on = np.ones(E, bool)
    ref_all, tol_all = _bound("Q4_K_M", x, experts, weights, all_on, act)
    _check(host_moe_swiglu(x, experts, weights, all_on, layer, act=act), ref_all, tol_all)
    # token 2 routes only to experts that are on the card: its row is exactly zero
    on_host = np.ones(E, bool)
    on_host[experts[2]] = False
    y = host_moe_swiglu(x, experts, weights, on_host, layer, act=act)
    assert np.all(y[2] == 0)
    _check(y, *_bound("Q4_K_M", x, experts, weights, on_host, act))
    # the host part plus the card part is the whole: masks are additive
    rest = host_moe_swiglu(x, experts, weights, ~on_host, layer, act=act)
    assert np.all(np.abs(y.astype(np.float64) + rest - ref_all) <= 2 * tol_all)


def test_empty_batch_and_thread_count_invariance():
    layer = _layer("Q4_K_M")
    y0 = host_moe_swiglu(np.zeros((0, D), np.float32), np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32),
                         np.ones(E, bool), layer)
    assert y0.shape == (0, D)
    x, experts, weights = _routing(np.random.default_rng(2), 9, 4)
    on_host = np.ones(E, bool)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = host_moe_swiglu(x, experts, weights, on_host, layer)
    finally:
        numba.set_num_threads(before)
    many = host_moe_swiglu(x, experts, weights, on_host, layer)
    np.testing.assert_array_equal(one, many)  # each dot product belongs to one thread, in a fixed order


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0"])
def test_tolerance_catches_one_flipped_quant(name, act):
    """Flip one quant of a down row (a 4-bit nibble, by 8 steps) where the hidden vector is largest."""
    layer = _layer(name)
    x, experts, weights = _routing(np.random.default_rng(3), 1, 2)
    on_host = np.ones(E, bool)
    e = int(experts[0, 0])
    (wg, _), (wu, _), _ = (R.expert_matrix(t, e) for t in (layer.gate, layer.up, layer.down))
    g, u = wg @ x[0], wu @ x[0]
    f = int(np.argmax(np.abs(g / (1 + np.exp(-g)) * u)))
    raw = layer.down.data.copy()
    if layer.down.qtype == T.Q6_K:  # element f: block f // 256, half, group g, index l (see blocks.py)
        b, half, g4, l = f // 256, f % 256 // 128, f % 128 // 32, f % 32
        raw[e, 0, b * 210 + 64 * half + 32 * (g4 & 1) + l] ^= 0x8 << (4 * (g4 >> 1))
    else:  # Q8_0: flip bit 3 of the int8 quant
        raw[e, 0, f // 32 * 34 + 2 + f % 32] ^= 0x8
    bad = HostExpertLayer(layer.gate, layer.up, HostTensor(raw, layer.down.qtype, layer.down.shape))
    ref, tol = _bound(name, x, experts, weights, on_host, act)
    _check(host_moe_swiglu(x, experts, weights, on_host, layer, act=act), ref, tol)
    err = np.abs(host_moe_swiglu(x, experts, weights, on_host, bad, act=act) - ref)
    print(name, act, "flipped: err / tol", err[0, 0] / tol[0, 0])
    assert err[0, 0] > tol[0, 0], (err[0, 0], tol[0, 0])


def test_unsupported_types_and_shapes_raise():
    good = _layer("Q8_0")
    raw = np.zeros((E, 128, D // 32 * 18), np.uint8)
    q4_0 = HostTensor(raw, T.Q4_0, (E, 128, D))
    with pytest.raises(ValueError, match="Q4_0"):
        HostExpertLayer(q4_0, good.up, good.down)
    with pytest.raises(ValueError, match="uint8"):
        HostTensor(np.zeros((E, 128, 10), np.uint8), T.Q8_0, (E, 128, D))
    with pytest.raises(ValueError, match="multiple"):
        HostTensor(np.zeros((E, 128, 10), np.uint8), T.Q4_K, (E, 128, 100))
    with pytest.raises(ValueError, match="expected gate/up"):
        HostExpertLayer(good.gate, good.up, good.gate)
    with pytest.raises(ValueError, match="act"):
        HostExpertLayer(good.gate, good.up, good.down, act="int4")
    x, experts, weights = _routing(np.random.default_rng(4), 2, 2)
    with pytest.raises(ValueError, match="expert ids"):
        host_moe_swiglu(x, experts + E, weights, np.ones(E, bool), good)
    with pytest.raises(ValueError, match="on_host"):
        host_moe_swiglu(x, experts, weights, np.ones(E + 1, bool), good)


def _rows(rng, n, K):
    x = (rng.standard_normal((n, K)) * rng.uniform(1e-3, 40, (n, 1))).astype(np.float32)
    x[0, :256] = np.abs(x[0, :256])  # largest magnitude positive, then negative (Q8_K keeps the sign)
    x[1, :256] = -np.abs(x[1, :256])
    x[2, 256:512] = 0  # an all-zero block
    x[3, :32] = np.float32(0.5) * np.arange(32)  # exact halves: rint's ties go to even
    if n > 5:
        top = 2 * np.abs(x[4, 256:512]).max()
        x[4, 260], x[4, 300] = -top, top  # equal largest magnitudes: the first sets the sign
        x[5, 511] = 2 * np.abs(x[5, 256:512]).max()  # the block's largest in its last element
    return x


def test_activation_rounding_bit_equal_with_actquant():
    rng = np.random.default_rng(5)
    x = _rows(rng, 6, 1024)
    for qtype in (T.Q4_K, T.Q8_0):
        spec = np.asarray(round_activations(jnp.asarray(x), qtype, "ggml-cpu"))
        for m in range(x.shape[0]):
            if qtype == T.Q4_K:
                xq, xd, xb = np.empty(1024, np.int16), np.empty(4, np.float32), np.empty(32, np.int32)
                B.quantize_q8_k(x[m], xq, xd, xb)
                vals, q, d = R.act_q8_k(x[m])
                np.testing.assert_array_equal(xb, xq.reshape(32, 32).sum(1))
                got = xq.astype(np.float32) * np.repeat(xd, 256)
            else:
                xq, xd = np.empty(1024, np.int16), np.empty(32, np.float32)
                B.quantize_q8_0(x[m], xq, xd)
                vals, q, d = R.act_q8_0(x[m])
                got = xq.astype(np.float32) * np.repeat(xd, 32)
            np.testing.assert_array_equal(xq, q)  # kernel == NumPy twin, quant for quant
            np.testing.assert_array_equal(np.repeat(xd, d.size // xd.size), d)
            np.testing.assert_array_equal(got, spec[m])  # == bloomery_jax.ops.actquant (== libggml-cpu)
            np.testing.assert_array_equal(vals, spec[m])


def test_f16_round_matches_numpy():
    rng = np.random.default_rng(6)
    v = np.concatenate([np.abs(rng.standard_normal(20000)) * 10.0 ** rng.uniform(-9, 5, 20000),
                        [0.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 65504.0, 65519.0, 65520.0, 1.0 + 2.0 ** -11]])
    v = v.astype(np.float32)
    got = np.array([B.f16_round(np.float32(a)) for a in v], np.float32)
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as it should
        want = v.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, want)


# the K-quant q8 row kernels: each one this CPU can run (the host picks one of them at import)
Q8_IMPLS = {tag: tuple(getattr(B, f"_dot_{q}_q8_{tag}") for q in ("q4_k", "q5_k", "q6_k"))
            for tag, ok in (("portable", True), ("avx2", simd.HAS_AVX2), ("avx512", simd.HAS_AVX512BW)) if ok}
Q8_IMPLS["picked"] = (B.dot_q4_k_q8, B.dot_q5_k_q8, B.dot_q6_k_q8)


@pytest.mark.parametrize("qtype, impl", [(T.Q8_0, "picked")] + [(q, impl) for impl in Q8_IMPLS if impl != "picked"
                                                                for q in (T.Q4_K, T.Q5_K, T.Q6_K)])
def test_row_dots_against_dequantized_rows(qtype, impl):
    """Each format's two row kernels alone, against the dequantized row (512 columns, 4 rows)."""
    dot_q4_k_q8, dot_q5_k_q8, dot_q6_k_q8 = Q8_IMPLS[impl]
    rng = np.random.default_rng(int(qtype))
    K = 512
    w = rng.standard_normal((4, K)).astype(np.float32)
    raw = quantize(w, qtype, threads=1)
    wd, mag = R.expert_matrix(HostTensor(raw[None], qtype, (1, 4, K)), 0)
    x = rng.standard_normal(K).astype(np.float32)
    tab16, _ = B.conversion_tables()
    xs = np.empty(K // 32, np.float32)
    B.sums32(x, xs)
    if qtype == T.Q8_0:
        xq, xd = np.empty(K, np.int16), np.empty(K // 32, np.float32)
        B.quantize_q8_0(x, xq, xd)
        v8 = R.act_q8_0(x)[0]
    else:
        xq, xd, xb = np.empty(K, np.int16), np.empty(K // 256, np.float32), np.empty(K // 32, np.int32)
        B.quantize_q8_k(x, xq, xd, xb)
        xq8, x16 = np.empty(K, np.int8), np.empty(K // 16, np.int16)
        B.pack_q8_k(xq, xq8, x16)
        np.testing.assert_array_equal(xq8, xq)
        np.testing.assert_array_equal(x16, xq.reshape(-1, 16).sum(1))
        v8 = R.act_q8_k(x)[0]
    f32_dot = {T.Q4_K: lambda r: B.dot_q4_k_f32(r, x, xs, tab16), T.Q5_K: lambda r: B.dot_q5_k_f32(r, x, xs, tab16),
               T.Q6_K: lambda r: B.dot_q6_k_f32(r, x, tab16), T.Q8_0: lambda r: B.dot_q8_0_f32(r, x, tab16)}[qtype]
    q8_dot = {T.Q4_K: lambda r: dot_q4_k_q8(r, xq, xq8, xd, xb, x16, tab16),
              T.Q5_K: lambda r: dot_q5_k_q8(r, xq, xq8, xd, xb, x16, tab16),
              T.Q6_K: lambda r: dot_q6_k_q8(r, xq, xq8, xd, xb, x16, tab16),
              T.Q8_0: lambda r: B.dot_q8_0_q8(r, xq, xd, tab16)}[qtype]
    for r in range(4):
        for dot, v in ((f32_dot, x), (q8_dot, v8)):
            kind = "f32" if v is x else R.act_kind(qtype, "q8")
            tol = R.dot_rounds(K, kind) * R.U * (mag[r] @ np.abs(v.astype(np.float64)))  # moe_swiglu_bound's
            assert abs(dot(raw[r]) - wd[r] @ v.astype(np.float64)) <= tol


def _shared_routing(rng, N: int, k: int):
    """Routing with mixed token counts per expert: most tokens share experts 0-3 (many tokens
    each), token N - 1 alone uses experts 4-6 (one token each), and expert 7 has two tokens."""
    x, _, weights = _routing(rng, N, k)
    experts = np.stack([rng.choice(4, k, replace=False) for _ in range(N)]).astype(np.int32)
    experts[N - 1] = np.arange(4, 4 + k)
    experts[0, 0], experts[1, 0] = 7, 7
    return x, experts, weights


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_shared_experts_decode_rows_once(name, act):
    """Several tokens per expert (the prefill path: each row decoded once for all its tokens),
    mixed with experts of one and two tokens, against the reference with the same bound;
    multi_min = 1 sends every expert through the multi-token path, a large one none."""
    layer = _layer(name)
    rng = np.random.default_rng(8)
    x, experts, weights = _shared_routing(rng, 20, 3)
    on_host = np.ones(E, bool)
    on_host[5] = False
    ref, tol = _bound(name, x, experts, weights, on_host, act)
    ys = {}
    for multi_min in (1, 3, None, 1000):
        ys[multi_min] = host_moe_swiglu(x, experts, weights, on_host, layer, act=act, multi_min=multi_min)
        ratio = _check(ys[multi_min], ref, tol)
        print(name, act, "multi_min", multi_min, f"max err/tol {ratio:.3g}")
    assert not np.array_equal(ys[1], np.zeros_like(ys[1]))


def test_multi_token_path_thread_count_invariance():
    for name in ("Q4_K_M", "Q8_0_tail"):
        layer = _layer(name)
        x, experts, weights = _shared_routing(np.random.default_rng(9), 16, 3)
        on_host = np.ones(E, bool)
        before = numba.get_num_threads()
        try:
            numba.set_num_threads(1)
            one = host_moe_swiglu(x, experts, weights, on_host, layer, multi_min=2)
        finally:
            numba.set_num_threads(before)
        np.testing.assert_array_equal(one, host_moe_swiglu(x, experts, weights, on_host, layer, multi_min=2))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.F32, T.F16, T.BF16])
def test_decoded_row_dots_against_dequantized_rows(qtype):
    """blocks.decode_row + blocks.mdot alone (3 tokens, 544 or 512 columns), with dot_rounds' bound."""
    rng = np.random.default_rng(int(qtype) + 100)
    K = 544 if qtype == T.Q8_0 else 512  # Q8_0: 17 blocks, the tail of the four-block loop
    w = rng.standard_normal((4, K)).astype(np.float32)
    t = _tensor(w[None], qtype)
    wd, mag = R.expert_matrix(t, 0)
    raw = t.raw[0]
    fmt = {T.Q4_K: B.Q4_K, T.Q5_K: B.Q5_K, T.Q6_K: B.Q6_K, T.Q8_0: B.Q8_0, T.F32: B.F32, T.F16: B.F16,
           T.BF16: B.BF16}[qtype]
    X = _rows(rng, 4, K)[1:]
    M = X.shape[0]
    XQK, XDK, XBK = np.empty((M, K), np.int16), np.empty((M, K // 256 + 1), np.float32), np.empty((M, K // 32), np.int32)
    XQ0, XD0 = np.empty((M, K), np.int16), np.empty((M, K // 32), np.float32)
    for m in range(M):
        if K % 256 == 0:
            B.quantize_q8_k(X[m], XQK[m], XDK[m], XBK[m])
        B.quantize_q8_0(X[m], XQ0[m], XD0[m])
    tab16, tabbf = B.conversion_tables()
    wq, wsc, wm = np.empty(K, np.int16), np.empty(K // 32 + 1, np.float32), np.empty(K // 32 + 1, np.int16)
    wdm, wf = np.empty(K // 256 + 1, np.float32), np.empty(K, np.float32)
    ids = np.arange(M)
    res = np.empty(M, np.float32)
    for act in ("f32", "q8"):
        kind = R.act_kind(qtype, act)
        code = {"f32": 0, "q8_k": 1, "q8_0": 2}[kind]
        for r in range(4):
            B.decode_row(fmt, code, raw[r], wq, wsc, wm, wdm, wf, tab16, tabbf)
            B.mdot(fmt, code, wq, wsc, wm, wdm, wf, ids, X, XQK, XDK, XBK, XQ0, XD0, res)
            for m in range(M):
                v = R.round_act(X[m], kind).astype(np.float64)
                tol = R.dot_rounds(K, kind) * R.U * (mag[r] @ np.abs(v))
                assert abs(res[m] - wd[r] @ v) <= tol, (act, r, m)


@pytest.mark.parametrize("preset, spins", [(None, "10000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "0"),
                                           ({"GOMP_SPINCOUNT": "1000"}, "1000")])
def test_openmp_workers_spin_briefly_unless_the_user_says(preset, spins):
    """OpenMP reads its wait policy once, when Numba starts it: importing bloomery_jax sets a
    10,000-spin wait first (long-spinning workers starved the FFI bridge's host calls on the GPU
    machine; sleeping ones paid to wake between a call's regions), and a policy the user set is
    kept. libgomp's own account of its settings (OMP_DISPLAY_ENV) says what it read (unset, it
    spins 300,000 times; a passive policy is a spin count of 0)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **(preset or {}))
    code = ("import bloomery_jax.host, numba; numba.get_num_threads(); "
            "print(numba.threading_layer())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    if res.stdout.strip() != "omp":
        pytest.skip(f"Numba's threading layer here is {res.stdout.strip()}, not OpenMP")
    assert f"GOMP_SPINCOUNT = '{spins}'" in res.stderr, res.stderr[-2000:]


def test_host_threads_leave_cores_to_the_gpu_waiters(monkeypatch):
    """Unasked, the host experts take the usable cores but two (the threads that wait on the GPU
    need them), at least one; a NUMBA_NUM_THREADS the user set wins."""
    import numba

    from bloomery_jax.host import bridge

    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 64)
    for cores, expected in ((16, 14), (3, 1), (2, 1), (1, 1)):
        monkeypatch.setattr(bridge.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert bridge.default_threads() == expected
    monkeypatch.setenv("NUMBA_NUM_THREADS", "5")
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 5)
    assert bridge.default_threads() == 5
    assert bridge.HostBridge({}, threads=3).threads == 3


def test_prefetch_distance_is_whole_rows_of_each_matrix():
    """The hint's distance in bytes becomes whole rows of each matrix, rounded up, so that every
    stream keeps at least that many bytes in flight: 2,304 bytes are 2 Q4_K rows of 2048
    (1,152 B) and 4 Q6_K rows of 768 (630 B); 0 turns the hint off."""
    rows = numba.njit(lambda w, pf: swiglu._rows_ahead(w, pf))
    q4k, q6k = np.zeros((1, 2, 1152), np.uint8), np.zeros((1, 2, 630), np.uint8)
    assert [rows(q4k, b) for b in (0, 1, 1152, 1153, 2304)] == [0, 1, 1, 2, 2]
    assert [rows(q6k, b) for b in (1260, 2304)] == [2, 4]


def test_prefetch_hint_runs_on_into_the_next_experts_rows():
    """Each step of a work item's walk hints the row the walk dots ``rows`` steps later, across
    the boundary between two experts' runs, and nothing at or past the item's end. Phase 1 walks
    all F rows of each expert from a flat start; phase 2 an item's columns [base, base + W) of
    every expert."""
    hinted = numba.njit(lambda gexp, s, rows, end, W, base: swiglu._hinted_row(gexp, s, rows, end, W, base))
    gexp = np.array([3, 7, 9], np.int64)
    for W, base, first, end in ((5, 0, 2, 13), (4, 10, 0, 12)):  # phase 1 (F = 5), phase 2 (columns 10-13)
        walk = [(int(gexp[s // W]), base + s % W) for s in range(first, end)]  # the rows the item dots
        for rows in (1, 2, 4):
            got = [hinted(gexp, s, rows, end, W, base) for s in range(first, end)]
            assert got == walk[rows:] + [(-1, -1)] * rows
        assert all(hinted(gexp, s, 0, end, W, base) == (-1, -1) for s in range(first, end))
    assert hinted(gexp, 3, 2, 13, 5, 0) == (7, 0)  # step 5: the second expert's first row


@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0_tail"])
def test_prefetch_changes_no_bit(name):
    """Software prefetch (bytes ahead in a work item, as whole rows) is a cache hint only: the same output bit for
    bit with it off and on, on the one-token path and the decoded-row path, with work items short
    enough that the hint both fires and stops at an item's end."""
    layer = _layer(name)
    x, experts, weights = _shared_routing(np.random.default_rng(10), 12, 3)
    on_host = np.ones(E, bool)
    for multi_min in (1000, 2):  # every expert dotted row by row; experts with 2+ tokens decode rows once
        off = host_moe_swiglu(x, experts, weights, on_host, layer, multi_min=multi_min, rows_per_item=5,
                              prefetch_bytes=0)
        assert off.any()
        for ahead in (1, 3 * 144, 10 ** 6):  # a row, three Q4_K rows of D = 256, past any item
            on = host_moe_swiglu(x, experts, weights, on_host, layer, multi_min=multi_min, rows_per_item=5,
                                 prefetch_bytes=ahead)
            np.testing.assert_array_equal(on, off)


@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0_tail"])
def test_work_item_layout_changes_no_bit(name):
    """One cost-balanced share of the rows a thread (rows_per_item 0, the default; shares cross
    experts) and fixed blocks within an expert, in two parallel regions or in one with shared
    counters (one or three shares a thread), give the same output bit for bit, on the one-token
    path and the decoded-row path, at one thread and at all of them."""
    layer = _layer(name)
    x, experts, weights = _shared_routing(np.random.default_rng(11), 12, 3)
    on_host = np.ones(E, bool)
    on_host[experts[0, 1]] = False
    before = numba.get_num_threads()
    for multi_min in (1000, 2):
        blocks = host_moe_swiglu(x, experts, weights, on_host, layer, multi_min=multi_min, rows_per_item=5,
                                 regions=2)
        assert blocks.any()
        for threads in (1, before):
            try:
                numba.set_num_threads(threads)
                for rows, (regions, parts) in itertools.product((0, 5, 16), ((1, 1), (1, 3), (2, 1))):
                    y = host_moe_swiglu(x, experts, weights, on_host, layer, multi_min=multi_min, rows_per_item=rows,
                                        regions=regions, parts=parts)
                    np.testing.assert_array_equal(y, blocks)
            finally:
                numba.set_num_threads(before)


_ONE_REGION_CHECK = """
import numpy as np, numba
from tests.test_host_experts import _layer, _routing, host_moe_swiglu
assert numba.get_num_threads() == 6
layer = _layer("Q4_K_M")
rng = np.random.default_rng(13)
for n in (1, 1, 2, 5, 12):
    x, experts, weights = _routing(rng, n, 3)
    on_host = rng.random(8) < 0.7
    for rows in (0, 1, 7):
        two = host_moe_swiglu(x, experts, weights, on_host, layer, rows_per_item=rows, regions=2)
        for _ in range(3):
            one = host_moe_swiglu(x, experts, weights, on_host, layer, rows_per_item=rows, regions=1, parts=1 + _)
            assert np.array_equal(one, two), (n, rows)
        # more prange iterations than threads (shares cut for 13): some threads run several in turn
        real, numba.get_num_threads = numba.get_num_threads, lambda: 13
        try:
            one = host_moe_swiglu(x, experts, weights, on_host, layer, rows_per_item=rows, regions=1)
        finally:
            numba.get_num_threads = real
        assert np.array_equal(one, two), (n, rows, 13)
print("ok")
"""


def test_one_region_with_more_threads_than_cores():
    """One parallel region whose threads take items from shared counters and wait for the
    previous phase's items: with 6 Numba threads (more than CI's cores, so threads are descheduled
    while others wait on them), the same bits as two regions, call after call, for one to twelve
    tokens and items of 1 row to one share a thread, and with 13 iterations of the region's loop
    over the 6 threads; a wait that let a thread run ahead would read hidden rows not yet
    written, and a wait on threads rather than items could hang."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_NUM_THREADS="6")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _ONE_REGION_CHECK], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.slow
def test_parallel_regions_are_the_prange_loops():
    """Every parallel loop of the kernel is one of its prange loops. Inside a parallel=True
    function numpy calls that make arrays (np.zeros, .copy(), np.arange) become parallel loops
    too, each a fork and join of every worker for a few bytes: a decode call made two such
    regions before its two phases, and the one-region layout three in all (twentieth session).
    A fresh compile (~100 s on CI's cores) is the only way to the parallel pass's account."""
    import inspect

    from bloomery_jax.host import swiglu

    x, experts, weights = _routing(np.random.default_rng(15), 1, 2)
    host_moe_swiglu(x, experts, weights, np.ones(E, bool), _layer("Q8_0"))
    sig = swiglu._moe_kernel.signatures[0]
    fresh = numba.njit(parallel=True, fastmath=True, nogil=True)(swiglu._moe_kernel.py_func)
    fresh.compile(sig)
    loops = fresh.get_metadata(sig)["parfor_diagnostics"].initial_parfors
    src, first = inspect.getsourcelines(swiglu._moe_kernel.py_func)
    pranges = sorted(first + i for i, line in enumerate(src) if "prange(" in line)
    assert sorted(p.loc.line for p in loops) == pranges


@pytest.mark.parametrize("regions", [1, 2])
def test_tick_spans_nest(regions):
    """A call's tick spans (swiglu.SPANS) add up: the call holds its regions, a region its wait for
    the workers to start and its join; a call with no host pair has no region at all. The spans
    only watch: the output is the same with or without them."""
    from bloomery_jax.host.swiglu import SPANS
    from bloomery_jax.host.ticks import ticks_per_second

    layer = _layer("Q4_K_M")
    x, experts, weights = _routing(np.random.default_rng(16), 2, 4)
    spans = np.zeros(len(SPANS), np.int64)
    y = host_moe_swiglu(x, experts, weights, np.ones(E, bool), layer, regions=regions, spans=spans)
    np.testing.assert_array_equal(y, host_moe_swiglu(x, experts, weights, np.ones(E, bool), layer, regions=regions))
    call, region, wake, join = spans
    assert call > region > wake + join and wake >= 0 and join >= 0
    idle = np.zeros(len(SPANS), np.int64)
    host_moe_swiglu(x, experts, weights, np.zeros(E, bool), layer, regions=regions, spans=idle)
    assert idle[0] > 0 and not idle[1:].any()
    assert 1e8 < ticks_per_second() < 1e11  # x86's counter: ~1-5 GHz


def test_regions_setting_is_checked():
    layer = _layer("Q8_0")
    x, experts, weights = _routing(np.random.default_rng(14), 1, 2)
    with pytest.raises(ValueError, match="regions must be 1 or 2"):
        host_moe_swiglu(x, experts, weights, np.ones(E, bool), layer, regions=3)


def test_phase1_shares_cover_the_rows_at_even_cost():
    """The shares are contiguous, cover every (expert, row) once, and each costs the even share
    to within one row of the dearest expert; fixed blocks stay inside one expert."""
    from bloomery_jax.host.swiglu import _phase1_items

    rng = np.random.default_rng(12)
    for _ in range(40):
        F = int(rng.integers(1, 100))
        tokens = rng.integers(1, 12, int(rng.integers(1, 9)))  # tokens of each routed expert
        start = np.zeros(E + 1, np.int64)
        gexp = np.sort(rng.choice(E, tokens.size, replace=False)).astype(np.int64)
        for e, t in zip(gexp, tokens):
            start[e + 1] = t
        start = np.cumsum(start)
        threads, mmin = int(rng.integers(1, 20)), int(rng.integers(1, 6))
        b = _phase1_items(start, gexp, F, 0, threads, mmin)
        assert b[0] == 0 and b[-1] == gexp.size * F and np.all(np.diff(b) >= 0)
        assert b.size - 1 == min(threads, gexp.size * F)
        row_cost = np.where(tokens < mmin, tokens, 2.0 + 0.5 * tokens)
        cum = np.concatenate([[0.0], np.cumsum(np.repeat(row_cost, F))])  # cost before flat row q
        share = cum[b]
        even = cum[-1] * np.arange(b.size) / (b.size - 1)
        assert np.all(np.abs(share - even) <= row_cost.max() + 1e-9)
        rpi = int(rng.integers(1, 40))
        fixed = _phase1_items(start, gexp, F, rpi, threads, mmin)
        assert fixed[-1] == gexp.size * F and np.all(np.diff(fixed) > 0) and np.all(np.diff(fixed) <= rpi)
        assert np.all((fixed[1:] - 1) // F == fixed[:-1] // F)  # each block within one expert
