"""Perplexity over chunks of a text, the way llama-perplexity computes it, and base-logits files.

Contract (llama-perplexity's default mode): the token list is cut into ``n_chunk = T // ctx``
chunks of ``ctx`` tokens; each chunk is evaluated from an empty cache, with its first token
replaced by BOS when the vocabulary adds one; only the second half is scored: the logits at
positions ``first = ctx // 2 .. ctx - 2`` predict the tokens at ``first + 1 .. ctx - 1``.
Like llama-perplexity it needs at least ``2 * ctx`` tokens.

Base file (``--save-base``, read back by ``--kl-base``): an uncompressed ``.npz`` with
  ``format``  "bloomery-ppl-base-1"
  ``ctx``     int, the chunk length
  ``tokens``  int32 ``[n_chunk, ctx]``: the tokens evaluated (BOS substitution included)
  ``logits``  float32 ``[n_chunk, ctx - 1 - ctx // 2, n_vocab]``: logits of the scored positions
A run compares against a base only when it evaluated exactly the same tokens.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile

import numpy as np

from ..errors import ConfigError
from ..models.loader import Model
from . import metrics
from .runner import check_tokens, sequence_logits

BASE_FORMAT = "bloomery-ppl-base-1"


@dataclasses.dataclass
class PerplexityRun:
    ctx: int
    tokens: np.ndarray  # int32 [n_chunk, ctx]
    logits: np.ndarray  # float32 [n_chunk, n_scored, V]
    nll: np.ndarray  # float64 [n_chunk * n_scored]

    @property
    def first(self) -> int:
        return self.ctx // 2

    def targets(self) -> np.ndarray:
        return self.tokens[:, self.first + 1:]  # [n_chunk, n_scored]


def chunk_tokens(tokens, ctx: int, bos_id: int | None) -> np.ndarray:
    """int32 ``[n_chunk, ctx]``: the chunks llama-perplexity evaluates."""
    if ctx < 4:
        raise ConfigError(f"--ctx must be at least 4, got {ctx}")
    ids = np.asarray(tokens, np.int32)
    if ids.size < 2 * ctx:
        raise ConfigError(f"the text tokenizes to {ids.size} tokens; perplexity with --ctx {ctx} needs at least {2 * ctx}")
    n_chunk = ids.size // ctx
    chunks = ids[: n_chunk * ctx].reshape(n_chunk, ctx).copy()
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def run_perplexity(model: Model, tokens, ctx: int, *, bos_id: int | None, ubatch: int = 512,
                   act_rounding: str | None = None) -> PerplexityRun:
    """Evaluate every chunk; ``bos_id`` replaces each chunk's first token (None: keep it)."""
    chunks = chunk_tokens(check_tokens(model, tokens), ctx, bos_id)
    first = ctx // 2
    scored = []
    for chunk in chunks:
        logits = sequence_logits(model, chunk, ubatch=ubatch, act_rounding=act_rounding)  # [ctx, V]
        scored.append(logits[first: ctx - 1])
    logits = np.stack(scored)  # [n_chunk, n_scored, V]
    targets = chunks[:, first + 1:]
    nll = metrics.token_nll(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return PerplexityRun(ctx=ctx, tokens=chunks, logits=logits, nll=nll)


def save_base(path: str, run: PerplexityRun) -> None:
    try:
        with open(path, "wb") as f:  # an open file: np.savez would append ".npz" to a bare name
            np.savez(f, format=np.array(BASE_FORMAT), ctx=np.array(run.ctx, np.int64),
                     tokens=run.tokens, logits=run.logits.astype(np.float32))
    except OSError as e:
        raise ConfigError(f"cannot write --save-base {path}: {e.strerror or e}") from None


def load_base(path: str) -> PerplexityRun:
    """Read a base file; ConfigError naming what is wrong with it."""
    if not os.path.isfile(path):
        raise ConfigError(f"--kl-base {path}: no such file")
    if not zipfile.is_zipfile(path):  # np.load would try to unpickle anything else
        raise ConfigError(f"--kl-base {path}: not a base-logits file (an .npz of format {BASE_FORMAT})")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "format" not in z.files or str(z["format"]) != BASE_FORMAT:
                raise ConfigError(f"--kl-base {path}: not a base-logits file of format {BASE_FORMAT}")
            missing = {"ctx", "tokens", "logits"} - set(z.files)
            if missing:
                raise ConfigError(f"--kl-base {path}: missing {', '.join(sorted(missing))}")
            ctx, tokens, logits = int(z["ctx"]), np.asarray(z["tokens"]), np.asarray(z["logits"], np.float32)
    except (OSError, ValueError) as e:  # zip/npy damage
        raise ConfigError(f"--kl-base {path}: unreadable ({e})") from None
    n_scored = ctx - 1 - ctx // 2
    if tokens.ndim != 2 or tokens.shape[1] != ctx or logits.ndim != 3 or logits.shape[:2] != (tokens.shape[0], n_scored):
        raise ConfigError(f"--kl-base {path}: tokens {list(tokens.shape)} and logits {list(logits.shape)} "
                          f"do not fit ctx {ctx}")
    targets = tokens[:, ctx // 2 + 1:]
    nll = metrics.token_nll(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return PerplexityRun(ctx=ctx, tokens=tokens.astype(np.int32), logits=logits, nll=nll)


def compare_to_base(run: PerplexityRun, base: PerplexityRun, base_path: str) -> dict[str, float]:
    """KL statistics of ``run`` against ``base`` (same tokens required) and the base's perplexity."""
    if base.ctx != run.ctx:
        raise ConfigError(f"--kl-base {base_path} was computed with --ctx {base.ctx}, this run uses {run.ctx}")
    if base.tokens.shape != run.tokens.shape or not np.array_equal(base.tokens, run.tokens):
        raise ConfigError(f"--kl-base {base_path} was computed on other tokens (different text or tokenizer)")
    if base.logits.shape[-1] != run.logits.shape[-1]:
        raise ConfigError(f"--kl-base {base_path} has a vocabulary of {base.logits.shape[-1]}, "
                          f"the model has {run.logits.shape[-1]}")
    V = run.logits.shape[-1]
    out = metrics.kl_report(base.logits.reshape(-1, V), run.logits.reshape(-1, V))
    out["base_ppl"], out["base_ppl_err"] = metrics.perplexity(base.nll)
    return out
