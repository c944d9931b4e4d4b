"""Perplexity and KL-divergence statistics, as llama-perplexity reports them.

All sums are float64. KL is ``KL(base || ours) = sum_v p_base(v) (log p_base(v) - log p(v))``
per position; percentiles interpolate linearly between sorted values (llama-perplexity's rule,
which is also ``np.percentile``'s default).
"""

from __future__ import annotations

import math

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of the last axis."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row: logits ``[N, V]``, targets int ``[N]`` -> float64 ``[N]``."""
    lp = log_softmax(logits)
    return -np.take_along_axis(lp, targets[:, None].astype(np.int64), axis=-1)[:, 0]


def mean_and_err(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n - 1) of the population std, as llama)."""
    v = np.asarray(values, np.float64)
    mean = float(v.mean())
    var = float(np.mean((v - mean) ** 2))  # = mean(v^2) - mean^2, without the cancellation
    err = math.sqrt(var / (v.size - 1)) if v.size > 1 and var > 0 else 0.0
    return mean, err


def perplexity(nll: np.ndarray) -> tuple[float, float]:
    """exp(mean nll) and its uncertainty ``ppl * err(mean nll)``."""
    mean, err = mean_and_err(nll)
    ppl = math.exp(mean)
    return ppl, ppl * err


def kl_divergence(base_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(base || ours) per row of ``[N, V]`` logits: float64 ``[N]`` (>= 0 up to rounding)."""
    lp, lq = log_softmax(base_logits), log_softmax(logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def kl_report(base_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """Mean (± error), max, 99th percentile of the KL, and the same-top-1 percentage."""
    kl = kl_divergence(base_logits, logits)
    mean, err = mean_and_err(kl)
    same = float(np.mean(base_logits.argmax(-1) == logits.argmax(-1)))
    return {
        "kl_mean": mean,
        "kl_mean_err": err,
        "kl_max": float(kl.max()),
        "kl_p99": float(np.percentile(kl, 99.0)),
        "same_top1_pct": 100.0 * same,
    }
