"""Synthesis plug-in for qwen3moe: which hyper-parameters build the Config, and each tensor's init.

A plug-in provides ``ARCH``, ``DEFAULTS`` (small, fast shapes), ``make_config(**hparams)``,
``init(spec, cfg) -> (center, std)`` and ``n_hot(cfg)``; the generic writer (``synth.core``)
does the rest from ``models.<arch>.tensor_specs(cfg)`` and ``Config.to_metadata()``.
See ``synth/weights.py`` for why these scales give peaked outputs and decisive routing.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..models import qwen3moe as model
from ..models.spec import TensorSpec

ARCH = model.ARCH
MODEL = model

# Small enough that a file is written and loaded by llama.cpp in well under a second, with
# rows of 256 so every K-quant applies (expert_ff = 256 also gives ffn_down rows of 256).
DEFAULTS = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                n_experts=8, n_experts_used=2, expert_ff=256, n_vocab=512)

LOGIT_STD = 5.0  # std of the output logits (rows see an RMSNorm'd input of RMS 1)
ROUTER_STD = 3.0  # std of the router logits
QK_NORM = 1.4  # q/k norm weight: attention scores q·k/sqrt(Dh) get std ≈ QK_NORM**2 ≈ 2
BRANCH_RMS = 0.5  # RMS each attention / MoE branch adds to a stream of embedding RMS 1
SILU_GLU_RMS = 0.6  # RMS of silu(g)*u for g, u ~ N(0, 1)


def make_config(**hparams) -> model.Config:
    """The Config for the given hyper-parameters (missing ones take DEFAULTS)."""
    unknown = set(hparams) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"{ARCH}: unknown hyper-parameter(s) {sorted(unknown)} (known: {sorted(DEFAULTS)})")
    hp = {**DEFAULTS, **{k: v for k, v in hparams.items() if v is not None}}
    for k, v in hp.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{ARCH}: {k} must be a positive integer, got {v!r}")
    if hp["n_heads"] % hp["n_kv_heads"]:
        raise ConfigError(f"{ARCH}: n_heads {hp['n_heads']} is not a multiple of n_kv_heads {hp['n_kv_heads']}")
    if hp["n_experts_used"] > hp["n_experts"]:
        raise ConfigError(f"{ARCH}: top-k {hp['n_experts_used']} exceeds the {hp['n_experts']} experts")
    if hp["head_dim"] % 2:
        raise ConfigError(f"{ARCH}: head_dim {hp['head_dim']} must be even (RoPE rotates pairs)")
    return model.Config(**hp)


def init(spec: TensorSpec, cfg: model.Config) -> tuple[float, float]:
    """(center, std) of a tensor's values: ``center + std * N(0, 1)``."""
    name, D = spec.name, cfg.d_model
    if spec.role == "norm":
        return (QK_NORM if ("attn_q_norm" in name or "attn_k_norm" in name) else 1.0), 0.1
    if spec.role == "embed":
        return 0.0, 1.0
    if spec.role == "output":
        return 0.0, LOGIT_STD / math.sqrt(D)
    if spec.role == "router":
        return 0.0, ROUTER_STD / math.sqrt(D)
    if "attn_output" in name:  # averages of v rows (RMS <= 1) over q_dim inputs
        return 0.0, BRANCH_RMS / math.sqrt(cfg.q_dim)
    if "ffn_down" in name:  # silu(g)*u inputs of RMS ~0.6 over expert_ff inputs
        return 0.0, BRANCH_RMS / (SILU_GLU_RMS * math.sqrt(spec.shape[-1]))
    # q, k, v, gate, up: unit-RMS outputs from unit-RMS inputs (q/k are re-normalized anyway)
    return 0.0, 1.0 / math.sqrt(spec.shape[-1])


def n_hot(cfg: model.Config) -> int:
    """Hot experts per layer under route skew: an eighth of them (at least one)."""
    return max(1, cfg.n_experts // 8)
