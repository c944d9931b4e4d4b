"""Qwen3-MoE (``general.architecture = qwen3moe``): Qwen3-30B-A3B, Qwen3-235B-A22B.

Contract: ``Config.from_gguf(gf)`` reads every hyper-parameter from metadata;
``tensor_specs(cfg)`` is the table of tensors the file must hold (checked at load);
``Config.to_metadata()`` is the inverse of ``from_gguf`` (used by the synthesizer).
"""

from __future__ import annotations

import dataclasses

from ..gguf_file import GGUFFile
from .spec import TensorSpec

ARCH = "qwen3moe"


@dataclasses.dataclass(frozen=True)
class Config:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # key_length == value_length for Qwen3
    n_experts: int
    n_experts_used: int
    expert_ff: int
    n_vocab: int
    context_length: int = 40960
    rms_eps: float = 1e-6
    rope_base: float = 1_000_000.0
    rope_dim: int | None = None  # rotated dims per head; None = head_dim
    rope_scaling: str = "none"  # none | linear | yarn
    rope_scaling_factor: float = 1.0
    rope_orig_context: int = 0
    yarn_ext_factor: float = -1.0  # <0: derived from the scaling factor, as llama.cpp does
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    tied_embeddings: bool = False

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "Config":
        k = gf.arch_key
        n_heads = k("attention.head_count", int)
        d_model = k("embedding_length", int)
        head_dim = k("attention.key_length", int, default=d_model // n_heads)
        value_dim = k("attention.value_length", int, default=head_dim)
        if value_dim != head_dim:
            from ..errors import GGUFError

            raise GGUFError(gf.path, f"value_length {value_dim} != key_length {head_dim} is not supported",
                            key=f"{ARCH}.attention.value_length")
        tokens = gf.get("tokenizer.ggml.tokens")
        n_vocab = k("vocab_size", int, default=len(tokens) if tokens is not None else None)
        if n_vocab is None:
            n_vocab = gf.tensor("token_embd.weight").shape[0]
        scaling = k("rope.scaling.type", str, default="none")
        return cls(
            n_layers=k("block_count", int),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", int, default=n_heads),
            head_dim=head_dim,
            n_experts=k("expert_count", int),
            n_experts_used=k("expert_used_count", int),
            expert_ff=k("expert_feed_forward_length", int),
            n_vocab=int(n_vocab),
            context_length=k("context_length", int, default=40960),
            rms_eps=float(k("attention.layer_norm_rms_epsilon", float, default=1e-6)),
            rope_base=float(k("rope.freq_base", float, default=1_000_000.0)),
            rope_dim=k("rope.dimension_count", int, default=None),
            rope_scaling=scaling,
            rope_scaling_factor=float(k("rope.scaling.factor", float, default=1.0)),
            rope_orig_context=k("rope.scaling.original_context_length", int, default=0),
            yarn_ext_factor=float(k("rope.scaling.yarn_ext_factor", float, default=-1.0)),
            yarn_attn_factor=float(k("rope.scaling.attn_factor", float, default=1.0)),
            yarn_beta_fast=float(k("rope.scaling.yarn_beta_fast", float, default=32.0)),
            yarn_beta_slow=float(k("rope.scaling.yarn_beta_slow", float, default=1.0)),
            tied_embeddings="output.weight" not in gf.tensors,
        )

    def to_metadata(self) -> dict[str, object]:
        """GGUF metadata entries (key → int | float | str) describing this config."""
        p = ARCH + "."
        md: dict[str, object] = {
            p + "block_count": self.n_layers,
            p + "context_length": self.context_length,
            p + "embedding_length": self.d_model,
            # qwen3moe files carry the dense FF length too; every layer here is MoE.
            p + "feed_forward_length": self.expert_ff,
            p + "expert_feed_forward_length": self.expert_ff,
            p + "expert_count": self.n_experts,
            p + "expert_used_count": self.n_experts_used,
            p + "attention.head_count": self.n_heads,
            p + "attention.head_count_kv": self.n_kv_heads,
            p + "attention.key_length": self.head_dim,
            p + "attention.value_length": self.head_dim,
            p + "attention.layer_norm_rms_epsilon": float(self.rms_eps),
            p + "rope.freq_base": float(self.rope_base),
        }
        if self.rope_scaling != "none":
            md[p + "rope.scaling.type"] = self.rope_scaling
            md[p + "rope.scaling.factor"] = float(self.rope_scaling_factor)
            md[p + "rope.scaling.original_context_length"] = self.rope_orig_context
        return md


def tensor_specs(cfg: Config) -> list[TensorSpec]:
    """Every tensor of a qwen3moe file, with shapes in NumPy order ([out, in] for weights)."""
    D, V, E, F, Dh = cfg.d_model, cfg.n_vocab, cfg.n_experts, cfg.expert_ff, cfg.head_dim
    specs = [
        TensorSpec("token_embd.weight", (V, D), "embed"),
        TensorSpec("output_norm.weight", (D,), "norm"),
        TensorSpec("output.weight", (V, D), "output", optional=True),
    ]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        specs += [
            TensorSpec(b + "attn_norm.weight", (D,), "norm", i),
            TensorSpec(b + "attn_q.weight", (cfg.q_dim, D), "attn", i),
            TensorSpec(b + "attn_k.weight", (cfg.kv_dim, D), "attn", i),
            TensorSpec(b + "attn_v.weight", (cfg.kv_dim, D), "attn", i),
            TensorSpec(b + "attn_output.weight", (D, cfg.q_dim), "attn", i),
            TensorSpec(b + "attn_q_norm.weight", (Dh,), "norm", i),
            TensorSpec(b + "attn_k_norm.weight", (Dh,), "norm", i),
            TensorSpec(b + "ffn_norm.weight", (D,), "norm", i),
            TensorSpec(b + "ffn_gate_inp.weight", (E, D), "router", i),
            TensorSpec(b + "ffn_gate_exps.weight", (E, F, D), "expert", i),
            TensorSpec(b + "ffn_up_exps.weight", (E, F, D), "expert", i),
            TensorSpec(b + "ffn_down_exps.weight", (E, D, F), "expert", i),
        ]
    return specs
