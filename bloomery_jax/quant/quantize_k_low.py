"""NumPy quantizers for the low-bit K-quants Q2_K and Q3_K, all blocks at once.

They follow llama.cpp's reference quantizers (``quantize_row_q2_K_ref``, ``..._q3_K_ref``):

* Q2_K: per 16-element sub-block, the asymmetric scale/min search of Q4_K (``fit_scale_min``)
  with 2-bit quants, weights ``|x|`` and the weighted *absolute* error as the criterion; the
  sixteen scales and mins become 4-bit integers against f16 ``d`` / ``dmin``.
* Q3_K: per 16-element sub-block, a symmetric fit of 3-bit quants in [-4, 3] refined by
  coordinate descent (each quant in turn moves to its least-squares value while that lowers
  the weighted error, weights ``x**2``, up to five sweeps); the sixteen scales become 6-bit
  signed integers against one f16 ``d``.

As in ``quantize_k`` the searches run on whole chunks of sub-blocks in lock-step (Python loops
over candidates, sweeps and the 16 positions, never over blocks), each sub-block divided by a
power of two first, and only the fitted scales leave them: the quants are recomputed from
the stored scales. Each function maps f32 ``[NB, 256]`` to uint8 ``[NB, block_bytes]``.
"""

from __future__ import annotations

import numpy as np

from .quantize_k import _EPS, _colsum, _normalize, f16_bytes, f16_round, fit_scale_min

f32, f64 = np.float32, np.float64


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit quants in ggml order -> bytes: uint8 [NB, 256] -> [NB, 64].

    Per 128-element half, byte l holds elements l, l + 32, l + 64, l + 96 in bits 0-1, 2-3,
    4-5, 6-7.
    """
    q = q.reshape(q.shape[0], 2, 4, 32)  # [NB, half, shift, 32]
    packed = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return packed.reshape(q.shape[0], 64)


def _divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den == 0 (ggml skips such sub-blocks; any quant reads back the same)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = num / den
    return np.where(den != 0, q, 0)


def _inverse(v: np.ndarray, top: float) -> np.ndarray:
    """top / v where v > 0 and the quotient is finite, else 0."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(v > 0, f32(top) / np.where(v > 0, v, 1), 0).astype(f32)
    return np.where(np.isfinite(inv), inv, 0)


# --- Q2_K ----------------------------------------------------------------------------------


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """f32 [NB, 256] -> uint8 [NB, 84]: scales[16] (scale | min << 4) | qs[64] | d | dmin."""
    nb = x.shape[0]
    xn, unit = _normalize(x.reshape(nb * 16, 16))  # S = 16 sub-blocks per block
    sub = np.ascontiguousarray(xn.T)  # [16, S]
    scale, the_min = fit_scale_min(sub, np.abs(sub), 3, -0.5, 0.1, 15, mad=True)
    scale = (scale * unit).reshape(nb, 16)
    the_min = (the_min * unit).reshape(nb, 16)
    max_scale, max_min = scale.max(axis=1), the_min.max(axis=1)
    ls = np.clip(np.rint(_inverse(max_scale, 15)[:, None] * scale), 0, 15).astype(np.uint8)
    lm = np.clip(np.rint(_inverse(max_min, 15)[:, None] * the_min), 0, 15).astype(np.uint8)
    d_raw, dmin_raw = max_scale / f32(15), max_min / f32(15)
    d = f16_round(d_raw)[:, None] * ls.astype(f32)  # [NB, 16], what a reader will see
    dm = f16_round(dmin_raw)[:, None] * lm.astype(f32)
    q = _divide(x.reshape(nb, 16, 16) + dm[..., None], d[..., None])
    q = np.clip(np.rint(q), 0, 3).astype(np.uint8).reshape(nb, 256)
    return np.concatenate([ls | (lm << 4), _pack_crumbs(q), f16_bytes(d_raw), f16_bytes(dmin_raw)], axis=1)


# --- Q3_K ----------------------------------------------------------------------------------


def fit_q3(x: np.ndarray, zero: np.ndarray, nmax: int = 4, sweeps: int = 5) -> np.ndarray:
    """Scale of the fit ``x ~ scale * l``, integer l in [-nmax, nmax), by coordinate descent.

    Start from the largest-magnitude element mapped to -nmax; then, sweep by sweep, move
    each quant to ``round(x_i * sum w l^2 / sum w x l)`` over the others, keeping the move
    only if it raises ``(sum w x l)^2 / sum w l^2`` (lowers the weighted error), weights
    ``x**2``. A sweep that changes nothing would change nothing again, so running all the
    sweeps on every sub-block gives ggml's early-exit result.

    Args:
      x: f32 [n, S], sub-block s in column s; zero: bool [S], sub-blocks to treat as zero.
    Returns:
      scale f32 [S] = sum w x l / sum w l^2 (0 where ``zero`` or no signal).
    """
    cols = np.arange(x.shape[1])
    extreme = x[np.abs(x).argmax(axis=0), cols]
    zero = zero | (extreme == 0)
    extreme = np.where(zero, 1, extreme).astype(f32)
    l = np.clip(np.rint(x * (f32(-nmax) / extreme)), -nmax, nmax - 1).astype(f64)  # [n, S]
    xd = x.astype(f64)
    w = xd * xd
    sumlx = (w * xd * l).sum(axis=0)  # [S]
    suml2 = (w * l * l).sum(axis=0)
    for _ in range(sweeps):
        for i in range(x.shape[0]):  # sequential within a sub-block, vectorized across them
            wi, xi, li = w[i], xd[i], l[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            live = slx > 0
            new = np.clip(np.rint(xi * _divide(sl2, np.where(live, slx, 0))), -nmax, nmax - 1)
            slx_new = slx + wi * xi * new
            sl2_new = sl2 + wi * new * new
            take = live & (new != li) & (sl2_new > 0) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            l[i] = np.where(take, new, li)
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
    scale = _divide(sumlx, suml2)
    return np.where(zero, 0, scale).astype(f32)


def _pack_q3_scales(l: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales (offset by 32) -> ggml's 12 bytes: uint8 [NB, 16] -> [NB, 12]."""
    out = np.empty((l.shape[0], 12), np.uint8)
    out[:, 0:8] = (l[:, 0:8] & 0x0F) | ((l[:, 8:16] & 0x0F) << 4)
    high = (l >> 4).reshape(l.shape[0], 4, 4)  # [NB, j // 4, j % 4]
    out[:, 8:12] = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    return out


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """f32 [NB, 256] -> uint8 [NB, 110]: hmask[32] | qs[64] | scales[12] | d."""
    nb = x.shape[0]
    tiny = np.abs(x).reshape(nb * 16, 16).max(axis=1) < _EPS  # judged on the real values
    xn, unit = _normalize(x.reshape(nb * 16, 16))
    scale = (fit_q3(np.ascontiguousarray(xn.T), tiny) * unit).reshape(nb, 16)  # [NB, 16]
    rows = np.arange(nb)
    max_scale = scale[rows, np.abs(scale).argmax(axis=1)]  # signed, largest magnitude
    live = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(live, f32(-32) / np.where(live, max_scale, 1), 0).astype(f32)
    ls = (np.clip(np.rint(iscale[:, None] * scale), -32, 31) + 32).astype(np.uint8)  # [NB, 16]
    with np.errstate(divide="ignore"):
        d_raw = np.where(live, f32(1) / np.where(live, iscale, 1), 0).astype(f32)
    d = f16_round(d_raw)[:, None] * (ls.astype(f32) - 32)  # [NB, 16]
    q = np.clip(np.rint(_divide(x.reshape(nb, 16, 16), d[..., None])), -4, 3) + 4
    q = q.astype(np.uint8).reshape(nb, 256)
    # the third bit of element j goes to bit j // 32 of hmask[j % 32]
    hbits = (q >> 2).reshape(nb, 8, 32)
    hmask = (hbits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([hmask, _pack_crumbs(q & 0x03), _pack_q3_scales(ls), f16_bytes(d_raw)], axis=1)
