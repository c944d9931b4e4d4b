"""The slow twin of ``host_moe_swiglu``: plain NumPy, float64, and a rounding-error bound.

``moe_swiglu(x, experts, weights, on_host, layer, act)`` dequantizes the chosen experts' rows
exactly (``gguf.quants.dequantize``) and computes the same sum in float64. With ``act="q8"`` it
rounds the activations as the kernel does (``act_q8_k`` / ``act_q8_0``, plain NumPy transcriptions
of ``bloomery_jax.ops.actquant``) before each matmul, so that only float32 rounding separates the
two. ``moe_swiglu_bound`` also returns ``tol [N, D]``, an elementwise bound on
``|kernel - reference|`` derived from the kernel's rounding (see its docstring), so tests can
compare with a stated, not eyeballed, tolerance.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

U = 2.0 ** -24  # float32 unit roundoff
_Q8_K_TYPES = frozenset({T.Q4_K, T.Q5_K, T.Q6_K})
# byte range of the quants in a block (zeroing them leaves the min term alone: see expert_matrix)
_QUANT_BYTES = {T.Q4_K: (144, 16, 144), T.Q5_K: (176, 16, 176)}


def expert_matrix(t, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ``e`` of a HostTensor: (values float64 [rows, cols], magnitudes float64 [rows, cols]).

    The magnitude of an element is what the kernel's float sum sees of it: ``|w|``, except for
    Q4_K/Q5_K, where the kernel sums ``scale * quant`` and ``min`` apart, so it is
    ``|scale * quant| + |min|``; ``-min`` is read by dequantizing the blocks with every quant
    zeroed.
    """
    rows, cols = t.shape[1], t.shape[2]
    data = t.data[e]
    if t.qtype == T.F32:
        w = data.astype(np.float64)
    elif t.qtype == T.F16:
        w = data.astype(np.float64)
    elif t.qtype == T.BF16:
        w = (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        w = gguf.quants.dequantize(np.ascontiguousarray(data), t.qtype).astype(np.float64).reshape(rows, cols)
    mag = np.abs(w)
    if t.qtype in _QUANT_BYTES:
        size, lo, hi = _QUANT_BYTES[t.qtype]
        zeroed = np.array(data).reshape(rows, -1, size)
        zeroed[:, :, lo:hi] = 0
        z = gguf.quants.dequantize(zeroed.reshape(rows, -1), t.qtype).astype(np.float64).reshape(rows, cols)
        mag = np.abs(w - z) + np.abs(z)  # z = -min of the element's sub-block
    return w, mag


# --- activation rounding (bloomery_jax.ops.actquant, in NumPy) -----------------------------


def act_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 [K] → (values float32 [K], q int [K], d float32 [K] per element); blocks of 256."""
    b = np.asarray(x, np.float32).reshape(-1, 256)
    idx = np.argmax(np.abs(b), axis=1)  # the first largest |x|, as ggml's scan
    vmax = b[np.arange(b.shape[0]), idx]
    nz = vmax != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(nz, np.float32(-127.0) / np.where(nz, vmax, 1).astype(np.float32), 0).astype(np.float32)
    q = np.minimum(np.rint((iscale[:, None] * b).astype(np.float32)), np.float32(127))
    d = np.where(nz, np.float32(1.0) / np.where(nz, iscale, 1).astype(np.float32), 0).astype(np.float32)
    vals = (q * d[:, None]).astype(np.float32)
    return vals.reshape(-1), q.reshape(-1).astype(np.int64), np.repeat(d, 256)


def act_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 [K] → (values float32 [K], q int [K], d float32 [K] per element); blocks of 32."""
    b = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    nz = amax != 0
    inv = np.where(nz, np.float32(127.0) / np.where(nz, amax, 1).astype(np.float32), 0).astype(np.float32)
    q = np.rint((b * inv[:, None]).astype(np.float32))
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    vals = (q * d[:, None]).astype(np.float32)
    return vals.reshape(-1), q.reshape(-1).astype(np.int64), np.repeat(d, 32)


def act_kind(qtype, act: str) -> str:
    """How the kernel sees activations multiplying a weight of ``qtype``: f32, q8_k or q8_0."""
    if act == "q8" and T(qtype) in _Q8_K_TYPES:
        return "q8_k"
    if act == "q8" and T(qtype) == T.Q8_0:
        return "q8_0"
    return "f32"


def round_act(x: np.ndarray, kind: str) -> np.ndarray:
    """The float32 values the kernel multiplies for activations ``x`` (float32 [K])."""
    x = np.asarray(x, np.float32)
    if kind == "q8_k":
        return act_q8_k(x)[0]
    if kind == "q8_0":
        return act_q8_0(x)[0]
    return x


def dot_rounds(K: int, kind: str) -> int:
    """Most roundings a term of a K-term kernel dot product passes through.

    float32 activations: K + 64, whatever order the vectorized sum takes. 8-bit activations:
    the block sums are exact int32 (at most 256 * 945 * 127 < 2^31 for Q4_K, less elsewhere),
    so only the float combination rounds: a few products per block and the running sum over
    at most K / 32 blocks.
    """
    return K + 64 if kind == "f32" else K // 32 + 16


def _requant_bound(h: np.ndarray, dh: np.ndarray, kind: str) -> np.ndarray:
    """Bound on |q8(h + δ) - q8(h)| per element for |δ| <= dh (float32 [K] inputs, float64 out).

    Rounding the kernel's hidden vector (which differs from ours by at most dh) can (a) scale
    the block slightly differently, since its largest |h| moves by up to max dh, and (b) round
    an element to the neighbouring integer when ``scale * h`` lies within reach of a half
    integer. Elsewhere the quants agree and only (a) remains.
    """
    size = 256 if kind == "q8_k" else 32
    vals, q, d = act_q8_k(h) if kind == "q8_k" else act_q8_0(h)
    hb = np.abs(h.astype(np.float64)).reshape(-1, size)
    amax = hb.max(axis=1)
    dmax = dh.reshape(-1, size).max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(amax > 0, dmax / np.maximum(amax - dmax, 1e-300), np.inf) + 4 * U  # relative scale shift
    if kind == "q8_0":
        # the stored scale is f16(amax / 127): if that rounding is within reach, it can step by 2^-11
        lo = ((amax - dmax) / 127).astype(np.float16).astype(np.float64)
        hi = ((amax + dmax) / 127).astype(np.float16).astype(np.float64)
        rho = rho + np.where(lo != hi, 2.0 ** -10, 0)
    rho = np.repeat(rho, size)
    scale = np.repeat(np.where(amax > 0, 127.0 / np.maximum(amax, 1e-300), 0), size)  # |iscale|
    t = scale * np.abs(h.astype(np.float64))
    tau = scale * dh + t * (rho + 2 * U)  # how far scale * h can move
    frac = np.abs(t - np.floor(t) - 0.5)  # distance to the nearest half integer
    straddle = frac <= tau
    dd = np.abs(d.astype(np.float64))
    bound = np.where(straddle, (tau + 1) * dd * (1 + rho), 0) + np.abs(q) * dd * rho
    return np.where(np.isfinite(bound), bound, np.inf)


def moe_swiglu_bound(x, experts, weights, on_host, layer, act: str = "f32",
                     cache: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Reference output and an elementwise bound on the kernel's distance from it.

    ``cache`` (optional, one dict per layer) keeps the dequantized experts between calls.

    Returns (ref float64 [N, D], tol float64 [N, D]). The bound, first order in u = 2^-24:
      * a kernel dot product of K terms differs from the exact one by at most
        ``dot_rounds(K) u sum_i mag_i |v_i|`` (K + 64 roundings per term with float32
        activations, K / 32 + 16 with exact integer block sums; mag from ``expert_matrix``, v the
        activations the kernel multiplies, identical to ours: x, or x rounded bit-equally);
      * silu: |silu'| <= 1.1, so h = silu(g) u is off by 1.1 δg (|u| + δu) + |silu(g)| δu, plus
        8 u |h| for exp, the division and the product;
      * ``act="q8"`` rounds the kernel's h, not ours: ``_requant_bound`` adds what that can change;
      * down: sum_f |W_df| δh_f plus its own dot bound; the weighted sum over k adds (k + 1) u.
    """
    x = np.asarray(x, np.float32)
    experts = np.asarray(experts)
    weights = np.asarray(weights, np.float64)
    on_host = np.asarray(on_host, bool)
    N, D = x.shape
    F = layer.gate.shape[1]
    kg, ku, kd = (act_kind(t.qtype, act) for t in (layer.gate, layer.up, layer.down))
    ref = np.zeros((N, D))
    tol = np.zeros((N, D))
    absum = np.zeros((N, D))
    cache = {} if cache is None else cache
    for n in range(N):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            if not on_host[e]:
                continue
            if e not in cache:
                cache[e] = tuple(expert_matrix(t, e) for t in (layer.gate, layer.up, layer.down))
            (wg, mg), (wu, mu), (wd, md) = cache[e]
            vg = round_act(x[n], kg).astype(np.float64)
            vu = round_act(x[n], ku).astype(np.float64)
            g, u = wg @ vg, wu @ vu
            eg = dot_rounds(D, kg) * U * (mg @ np.abs(vg))
            eu = dot_rounds(D, ku) * U * (mu @ np.abs(vu))
            s = 1.0 / (1.0 + np.exp(-g))
            h = g * s * u
            dh = 1.1 * eg * (np.abs(u) + eu) + np.abs(g * s) * eu + 8 * U * (np.abs(h) + 1.1 * eg * (np.abs(u) + eu))
            if kd == "f32":
                vh, dvh = h, dh
            else:
                h32 = h.astype(np.float32)
                vh = round_act(h32, kd).astype(np.float64)
                dvh = _requant_bound(h32, dh + U * np.abs(h), kd)
            y = wd @ vh
            ey = np.abs(wd) @ dvh + dot_rounds(F, kd) * U * (md @ (np.abs(vh) + dvh))
            ref[n] += weights[n, j] * y
            tol[n] += abs(weights[n, j]) * ey
            absum[n] += np.abs(weights[n, j] * y)
    tol += (experts.shape[1] + 1) * U * absum
    return ref, tol


def moe_swiglu(x, experts, weights, on_host, layer, act: str = "f32", cache: dict | None = None) -> np.ndarray:
    """float64 [N, D]: what ``host_moe_swiglu`` computes, exactly (activations rounded under "q8")."""
    return moe_swiglu_bound(x, experts, weights, on_host, layer, act, cache)[0]
