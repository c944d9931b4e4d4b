"""NumPy quantizers for the K-quant formats Q4_K, Q5_K and Q6_K, all blocks at once.

They follow the approach of llama.cpp's reference quantizers (``quantize_row_q*_K_ref``,
the path llama-quantize takes without an importance matrix):

* Q4_K / Q5_K: per 32-element sub-block, an asymmetric fit ``x ~ scale * q - min`` whose
  scale is searched over a range of candidate step counts around ``nmax``, each candidate
  refit by weighted least squares (weights ``rms + |x|``); the eight scales and mins are
  then quantized to 6 bits against a per-block f16 ``d`` / ``dmin`` and the elements are
  requantized with the stored (rounded) scales.
* Q6_K: per 16-element sub-block, a symmetric fit searched over 19 candidate inverse scales
  with weights ``x**2``; the sixteen scales become int8 against one f16 ``d``.

The search runs on all sub-blocks of a chunk in lock-step (a Python loop over candidate
steps, never over blocks), and only the fitted scales leave it: the quants are recomputed
from the stored scales, as ggml does. Before searching, each sub-block is divided by a
power of two near its largest magnitude; the search is scale-invariant, so this changes no
decision but keeps every sum finite for any finite input. f16 scales saturate at ±65504
instead of becoming inf (ggml would store inf, which dequantizes to inf / NaN).
"""

from __future__ import annotations

import numpy as np

QK_K = 256
F16_MAX = np.float32(65504.0)
# below this a sub-block counts as all zero (ggml's GROUP_MAX_EPS)
_EPS = np.float32(1e-15)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """f32 [...] -> uint8 [..., 2]: little-endian f16 bits, round to nearest even, saturated."""
    h = np.clip(v, -F16_MAX, F16_MAX).astype("<f2")
    return h.view(np.uint8).reshape(*v.shape, 2)


def f16_round(v: np.ndarray) -> np.ndarray:
    """The f32 value that f16_bytes stores (what a dequantizer will read back)."""
    return np.clip(v, -F16_MAX, F16_MAX).astype(np.float16).astype(np.float32)


def _colsum(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Sum over the first axis: f32 [n, S] -> [S].

    The fits keep sub-blocks in columns because NumPy sums a short axis slowly (one small
    reduction per row) but adds whole rows at SIMD speed.
    """
    return np.add.reduce(a, axis=0, out=out)


def _normalize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Divide each row (a sub-block) by a power of two: f32 [S, n] -> (x / u, u as f32 [S]).

    u = 2**(e - 1) for max|x| = m * 2**e, m in [0.5, 1): the quotient's magnitudes end in
    [1, 2), and u stays a finite f32 even for max|x| near the f32 limit.
    """
    amax = np.abs(x).max(axis=1)
    _, e = np.frexp(np.where(amax > 0, amax, 1).astype(np.float32))
    e = e - 1
    return np.ldexp(x, -e[:, None]).astype(np.float32), np.ldexp(np.float32(1), e).astype(np.float32)


# --- Q4_K / Q5_K ---------------------------------------------------------------------------


def fit_scale_min(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, mad: bool = False):
    """Weighted asymmetric fit ``x ~ scale * l + mn`` with integer ``l`` in [0, nmax], mn <= 0.

    Candidate 0 spreads [min(x, 0), max(x)] over nmax steps. Candidate k + 1 spreads
    [mn, max(x)] over ``nmax + rmin + rdelta * k`` steps, where mn is the best min found so
    far (so the search is sequential in k, as in ggml), then refits scale and min by weighted
    least squares on the quants it produced; it replaces the best if its weighted squared
    error (``mad``: weighted absolute error) is smaller.

    Args:
      x: f32 [n, S], sub-block s in column s; w: f32 [n, S] weights.
      nmax: largest quant; rmin, rdelta, nstep: the candidate step counts (k = 0..nstep).
      mad: judge candidates by sum w |error| (Q2_K) instead of sum w error^2.
    Returns:
      (scale f32 [S] >= 0, the_min = -mn f32 [S] >= 0); a flat sub-block gets scale 0.
    """
    f32, f64 = np.float32, np.float64
    lo = np.minimum(x.min(axis=0), 0)  # the min is never positive: 0 must stay representable
    hi = x.max(axis=0)
    live = hi - lo > 1e-30
    sum_w, sum_x = _colsum(w).astype(f64), _colsum(w * x).astype(f64)
    sum_x2 = _colsum(w * x * x).astype(f64)
    l, wl, tmp = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    sums = np.empty((3, x.shape[1]), f32)

    def quant_sums(step, mn):
        # quants of x over [mn, hi] in `step` steps; f64 [3, S]: sum w l, sum w l^2, sum w l x
        np.subtract(x, mn, out=l)
        np.multiply(l, step / np.where(live, hi - mn, 1).astype(f32), out=l)
        np.rint(l, out=l)
        np.clip(l, f32(0), f32(nmax), out=l)
        np.multiply(w, l, out=wl)
        _colsum(wl, out=sums[0])
        _colsum(np.multiply(wl, l, out=tmp), out=sums[1])
        _colsum(np.multiply(wl, x, out=tmp), out=sums[2])
        return sums.astype(f64)

    def sq_err(s, m, sl, sl2, sxl):
        if mad:  # sum w |s*l + m - x| has no closed form in the sums: one more pass over l
            np.multiply(l, s.astype(f32), out=tmp)
            np.add(tmp, m.astype(f32), out=tmp)
            np.subtract(tmp, x, out=tmp)
            np.abs(tmp, out=tmp)
            return _colsum(np.multiply(tmp, w, out=tmp)).astype(f64)
        # sum w (s*l + m - x)^2 expanded from the sums; in f64 the cancellation costs nothing
        return s * (s * sl2 + 2 * (m * sl - sxl)) + m * (m * sum_w - 2 * sum_x) + sum_x2

    best_scale = np.where(live, hi - lo, 0).astype(f64) / nmax
    best_min = lo.astype(f64)
    best_err = sq_err(best_scale, best_min, *quant_sums(f32(nmax), lo))
    for k in range(nstep + 1):
        step = f32(rmin) + f32(rdelta) * f32(k) + f32(nmax)
        sl, sl2, sxl = quant_sums(step, best_min.astype(f32))
        det = sum_w * sl2 - sl * sl
        ok = (det > 0) & live
        inv_det = 1 / np.where(ok, det, 1)
        scale = (sum_w * sxl - sum_x * sl) * inv_det
        mn = (sl2 * sum_x - sl * sxl) * inv_det
        clamp = mn > 0  # a positive min would hide zero: refit through the origin instead
        if clamp.any():
            mn = np.where(clamp, 0, mn)
            scale = np.where(clamp, sxl / np.where(sl2 > 0, sl2, 1), scale)
        err = sq_err(scale, mn, sl, sl2, sxl)
        better = ok & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_min = np.where(better, mn, best_min)
    return np.maximum(best_scale, 0).astype(f32), (-best_min).astype(f32)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit scales and mins of 8 sub-blocks -> ggml's 12-byte layout: uint8 [NB, 8] x2 -> [NB, 12]."""
    out = np.empty((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return out


def _inv63(v: np.ndarray) -> np.ndarray:
    """63 / v where that is finite, else 0 (v subnormal: its f16 d is 0, the 6-bit scales moot)."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(v > 0, np.float32(63) / np.where(v > 0, v, 1), 0).astype(np.float32)
    return np.where(np.isfinite(inv), inv, 0)


def _k4_common(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Shared Q4_K / Q5_K fit: f32 [NB, 256] -> (d, dmin, scales[12] bytes, quants uint8 [NB, 8, 32])."""
    nb = x.shape[0]
    xn, unit = _normalize(x.reshape(nb * 8, 32))  # S = 8 sub-blocks per block
    sub = np.ascontiguousarray(xn.T)  # [32, S]
    av = np.sqrt(_colsum(sub * sub) / np.float32(32))
    w = av + np.abs(sub)
    scale, the_min = fit_scale_min(sub, w, nmax, rmin, rdelta, nstep)
    scale = (scale * unit).reshape(nb, 8)  # back to the input's units (exact)
    the_min = (the_min * unit).reshape(nb, 8)
    max_scale, max_min = scale.max(axis=1), the_min.max(axis=1)
    inv_s, inv_m = _inv63(max_scale), _inv63(max_min)
    ls = np.clip(np.rint(inv_s[:, None] * scale), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_m[:, None] * the_min), 0, 63).astype(np.uint8)
    d_raw, dmin_raw = max_scale / np.float32(63), max_min / np.float32(63)
    # requantize against the scales a reader will see: f16 d times the 6-bit integer
    d = f16_round(d_raw)[:, None] * ls.astype(np.float32)  # [NB, 8]
    dm = f16_round(dmin_raw)[:, None] * lm.astype(np.float32)
    xs = x.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = (xs + dm[..., None]) / d[..., None]
    q = np.where(d[..., None] != 0, q, 0)  # a zero scale reads back -dm whatever the quant
    q = np.clip(np.rint(q), 0, nmax).astype(np.uint8)  # [NB, 8, 32]
    return f16_bytes(d_raw), f16_bytes(dmin_raw), _pack_k4_scales(ls, lm), q


def _nibble_pack(q: np.ndarray) -> np.ndarray:
    """uint8 [NB, 8, 32] (values < 16) -> [NB, 128]: sub-block 2i low nibbles, 2i+1 high."""
    pairs = q.reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """f32 [NB, 256] -> uint8 [NB, 144]: d | dmin | scales[12] | qs[128]."""
    d, dmin, scales, q = _k4_common(x, 15, -1.0, 0.1, 20)
    return np.concatenate([d, dmin, scales, _nibble_pack(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """f32 [NB, 256] -> uint8 [NB, 176]: d | dmin | scales[12] | qh[32] | qs[128]."""
    d, dmin, scales, q = _k4_common(x, 31, -0.5, 0.1, 15)
    # bit j of qh[l] is the fifth bit of element l of sub-block j
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([d, dmin, scales, qh, _nibble_pack(q & 0x0F)], axis=1)


# --- Q6_K ----------------------------------------------------------------------------------


def fit_symmetric(x: np.ndarray, nmax: int, zero: np.ndarray) -> np.ndarray:
    """Scale of the fit ``x ~ scale * l`` with integer l in [-nmax, nmax), weights x**2.

    The element of largest magnitude is mapped to ``-(nmax + 0.1 k)`` for k = -9..9; each
    candidate's quants get their least-squares scale, and the candidate with the largest
    ``(sum w x l)^2 / sum w l^2`` (least weighted error) wins, the earliest on ties.

    Args:
      x: f32 [n, S], sub-block s in column s; zero: bool [S], sub-blocks to treat as all zero.
    Returns:
      scale f32 [S] (signed: the largest-magnitude element maps to -nmax); 0 where ``zero``.
    """
    f32, f64 = np.float32, np.float64
    cols = np.arange(x.shape[1])
    extreme = x[np.abs(x).argmax(axis=0), cols]  # signed value of largest magnitude (first one)
    zero = zero | (extreme == 0)
    extreme = np.where(zero, 1, extreme).astype(f32)
    w = x * x
    wx = w * x
    steps = [f32(nmax)] + [f32(nmax) + f32(0.1) * f32(k) for k in (*range(-9, 0), *range(1, 10))]
    sumlx, suml2 = (np.empty((len(steps), x.shape[1]), f32) for _ in range(2))  # [K, S]
    l, tmp = np.empty_like(x), np.empty_like(x)
    for k, step in enumerate(steps):
        np.multiply(x, -step / extreme, out=l)
        np.rint(l, out=l)
        np.clip(l, f32(-nmax), f32(nmax - 1), out=l)
        _colsum(np.multiply(wx, l, out=tmp), out=sumlx[k])
        np.multiply(w, l, out=tmp)
        _colsum(np.multiply(tmp, l, out=tmp), out=suml2[k])
    lx, l2 = sumlx.astype(f64), suml2.astype(f64)
    ok = l2 > 0
    l2 = np.where(ok, l2, 1)
    gain = np.where(ok, lx * lx / l2, -np.inf)
    gain[0] = np.where(ok[0], gain[0], 0)  # candidate 0 with no signal scores 0, as in ggml
    best = gain.argmax(axis=0)  # [S], first maximum
    scale = np.where(ok[best, cols], lx[best, cols] / l2[best, cols], 0)
    return np.where(zero, 0, scale).astype(f32)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """f32 [NB, 256] -> uint8 [NB, 210]: ql[128] | qh[64] | scales[16] (int8) | d."""
    nb = x.shape[0]
    tiny = np.abs(x).reshape(nb * 16, 16).max(axis=1) < _EPS  # judged on the real values
    xn, unit = _normalize(x.reshape(nb * 16, 16))  # S = 16 sub-blocks per block
    sub = np.ascontiguousarray(xn.T)  # [16, S]
    scale = (fit_symmetric(sub, 32, tiny) * unit).reshape(nb, 16)  # [NB, 16], input units
    rows = np.arange(nb)
    max_scale = scale[rows, np.abs(scale).argmax(axis=1)]  # signed, largest magnitude
    live = np.abs(max_scale) >= _EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(live, np.float32(-128) / max_scale, 0).astype(np.float32)
    sc = np.minimum(np.rint(iscale[:, None] * scale), 127).astype(np.int8)  # [NB, 16] in [-128, 127]
    with np.errstate(divide="ignore"):
        d_raw = np.where(live, np.float32(1) / iscale, 0).astype(np.float32)
    dl = f16_round(d_raw)[:, None] * sc.astype(np.float32)  # [NB, 16]
    xs = x.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = xs / dl[..., None]
    q = np.where(dl[..., None] != 0, q, 0)  # a zero scale reads back 0 whatever the quant
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [NB, half, k, 32]
    # per half: ql bytes 0-31 carry quarters 0 (low) and 2 (high), bytes 32-63 quarters 1 and 3
    ql = np.concatenate([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                         (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=2)  # [NB, 2, 64]
    qh = ((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    zero_block = ~live
    out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), f16_bytes(d_raw)], axis=1)
    out[zero_block] = 0  # ggml writes an all-zero block when every scale is ~0
    return out
