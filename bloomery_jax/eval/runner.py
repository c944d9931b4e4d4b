"""Logits of every position of a token sequence, computed in fixed-size micro-batches.

Contract: ``sequence_logits(model, tokens)`` runs the model's jitted ``forward`` over one
sequence with a fresh KV cache, ``ubatch`` tokens per step, and returns float32
``[n_tokens, n_vocab]`` on the host. Every step has the same shape (the last one is padded
with tokens at position S, which the cache does not store), so one compilation serves all.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ConfigError
from ..models.loader import Model


def check_tokens(model: Model, tokens) -> np.ndarray:
    """The ids as int32 ``[T]``; ConfigError if empty or outside the vocabulary."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ConfigError("no tokens to evaluate")
    n_vocab = model.cfg.n_vocab
    bad = np.flatnonzero((ids < 0) | (ids >= n_vocab))
    if bad.size:
        raise ConfigError(f"token id {int(ids[bad[0]])} at index {int(bad[0])} is outside the vocabulary [0, {n_vocab})")
    return ids.astype(np.int32)


def sequence_logits(model: Model, tokens, *, ubatch: int = 512, act_rounding: str | None = None) -> np.ndarray:
    """Logits after every token of one sequence (positions 0..T-1).

    Args:
      model: from ``models.loader.load_model``.
      tokens: int ``[T]``.
      ubatch: tokens per forward step.
      act_rounding: ``"none"`` (exact), ``"ggml-cpu"`` or ``"ggml-cuda"`` (llama.cpp's CPU or CUDA
        activation rounding, ``ops/actquant.py``); None keeps the model's (``kernels=pallas-q8``
        loads it with ggml-cuda).
    Returns:
      float32 ``[T, n_vocab]``.
    """
    ids = check_tokens(model, tokens)
    if ubatch <= 0:
        raise ConfigError(f"--ubatch must be positive, got {ubatch}")
    T = ids.size
    step = min(ubatch, T)
    cfg = model.cfg if act_rounding is None else dataclasses.replace(model.cfg, act_rounding=act_rounding)
    cache = model.init_cache(1, T)
    out = np.empty((T, cfg.n_vocab), np.float32)
    for start in range(0, T, step):
        n = min(step, T - start)
        tok = np.zeros((1, step), np.int32)
        pos = np.full((1, step), T, np.int32)  # padding: position S, never stored
        tok[0, :n] = ids[start:start + n]
        pos[0, :n] = np.arange(start, start + n)
        logits, cache, _ = model.module.jit_forward(model.params, cfg, tok, pos, cache, model.placement)
        out[start:start + n] = np.asarray(logits[0, :n])
    return out
