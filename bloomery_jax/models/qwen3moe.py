"""Qwen3-MoE (``general.architecture = qwen3moe``): Qwen3-30B-A3B, Qwen3-235B-A22B.

Contract: ``Config.from_gguf(gf)`` reads every hyper-parameter from metadata, with
llama.cpp's defaults and key handling; ``tensor_specs(cfg)`` is the table of tensors the file
must hold (checked at load); ``Config.to_metadata()`` is the inverse of ``from_gguf`` (used
by the synthesizer); ``forward`` is the pure step (jit it with ``jit_forward``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..gguf_file import GGUFFile
from ..ops.attention import gqa_attention
from ..ops.experts import placed_moe_swiglu, takes_rounded_x
from ..ops.norms import rms_norm
from ..ops.qmatmul import as_f32, interpret_kernels, qmatmul, qmatmul_add, qmatmul_many, take_rows, weight_qtype
from ..ops.rope import RopeConfig, apply_rope, rope_cos_sin
from ..ops.routing import route_topk
from ..pallas import attn_prep
from ..pallas.route import RouterOut, router_logits_rounds, router_logits_routes, router_logits_serves
from ..pallas.route import route_topk as fused_route_topk
from ..pallas.route import router_logits as router_logits_kernel
from ..pallas.tickets import new_tickets
from .kv_cache import KVCache
from .spec import TensorSpec, attention_specs, embedding_specs

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
    rope_orig_context: int = 0  # 0: context_length
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor, multiplies the final rope magnitude
    # llama.cpp's hparams defaults for these; its qwen3moe loader reads none of them from the file.
    yarn_ext_factor: float = -1.0  # <0: 1 with YaRN scaling, else 0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    tied_embeddings: bool = False
    # Not from the file: "ggml-cpu" rounds matmul activations as llama.cpp's CPU backend does
    # (ops/actquant.py), to compare with it on quantized files; "none" is the exact reference.
    act_rounding: str = "none"
    # Not from the file: the precision of the prefill products of packed weights, experts
    # (pallas.moe_gemm) and dense projections (ops.qmatmul); set by the loader's kernels= choice
    # (loader.PREFILL_PRECISION_OF).
    prefill_precision: str = "tf32x3"
    # Not from the file: "pallas" makes one-token steps attend with pallas.decode_attention and
    # prefill steps with pallas.prefill_attention, read straight from the cache buffer
    # (models.loader's attention=); "xla" is ops.attention's jnp.
    attention: str = "xla"
    # Not from the file: "pallas" routes with pallas.route_topk (softmax and top-k in one kernel;
    # models.loader's routing=); "pallas-tickets" likewise, but a decode step routes in the
    # router's launch (pallas.route.router_logits' route_k), its o and down launches add the
    # residual (their combine=) and its attention combines its splits (pallas.attention_prepped,
    # with attention "pallas"), each in a launch's last program (pallas.tickets); "xla" is
    # ops.routing's jnp.
    routing: str = "xla"

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        return float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim)))

    def rope(self) -> RopeConfig:
        """The arguments llama.cpp passes to ``ggml_rope_ext`` for this model (NeoX style).

        Mirrors llama.cpp's context set-up: no scaling → ``freq_scale = 1``; ``ext_factor``
        is 1 for YaRN and 0 otherwise; with YaRN the attention factor becomes
        ``mscale(factor) / (1 + 0.1 ln factor)`` (the op multiplies the second factor back);
        ``rope.scaling.attn_factor`` multiplies it in every case. float32 arithmetic throughout.
        """
        f = np.float32
        freq_scale = f(1.0)
        if self.rope_scaling != "none" and self.rope_scaling_factor not in (0.0, 1.0):
            freq_scale = f(1.0) / f(self.rope_scaling_factor)
        ext = self.yarn_ext_factor
        if ext < 0:
            ext = 1.0 if self.rope_scaling == "yarn" else 0.0
        attn = f(self.yarn_attn_factor)
        if ext != 0:
            factor = f(1.0) / freq_scale
            attn = f(1.0) if factor <= 1 else f(f(0.1) * np.log(factor) + f(1.0))
            attn = f(attn * (f(1.0) / (f(1.0) + f(0.1) * np.log(factor))))
        attn = f(attn * f(self.rope_attn_factor))
        return RopeConfig(
            n_dims=self.n_rot,
            freq_base=float(f(self.rope_base)),
            neox=True,
            freq_scale=float(freq_scale),
            ext_factor=float(ext),
            attn_factor=float(attn),
            beta_fast=float(self.yarn_beta_fast),
            beta_slow=float(self.yarn_beta_slow),
            n_ctx_orig=self.rope_orig_context or self.context_length,
        )

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
        n_experts_used = k("expert_used_count", int)
        expert_ff = k("expert_feed_forward_length", int, default=None)
        if expert_ff is None:  # llama.cpp falls back to the dense FF length split over the used experts
            expert_ff = k("feed_forward_length", int) // max(n_experts_used, 1)
        factor = k("rope.scaling.factor", float, default=None)
        if factor is None:
            factor = k("rope.scale_linear", float, default=None)
        # llama.cpp: an absent type means linear (a no-op unless a factor is given).
        scaling = k("rope.scaling.type", str, default="linear" if factor is not None else "none")
        if scaling not in ("none", "linear", "yarn"):
            from ..errors import GGUFError

            raise GGUFError(gf.path, f"rope scaling {scaling!r} is not supported (none, linear, yarn)",
                            key=f"{ARCH}.rope.scaling.type")
        return cls(
            n_layers=k("block_count", int),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", int, default=n_heads),
            head_dim=head_dim,
            n_experts=k("expert_count", int),
            n_experts_used=n_experts_used,
            expert_ff=expert_ff,
            n_vocab=int(n_vocab),
            context_length=k("context_length", int, default=40960),
            rms_eps=float(k("attention.layer_norm_rms_epsilon", float, default=1e-6)),
            # llama.cpp's default base when the key is absent is 10000, not Qwen3's 1e6.
            rope_base=float(k("rope.freq_base", float, default=10_000.0)),
            rope_dim=k("rope.dimension_count", int, default=None),
            rope_scaling=scaling,
            rope_scaling_factor=float(factor if factor else 1.0),
            rope_orig_context=k("rope.scaling.original_context_length", int, default=0),
            rope_attn_factor=float(k("rope.scaling.attn_factor", float, default=1.0)),
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
        if self.rope_dim is not None:
            md[p + "rope.dimension_count"] = self.rope_dim
        if self.rope_scaling != "none":
            md[p + "rope.scaling.type"] = self.rope_scaling
            md[p + "rope.scaling.factor"] = float(self.rope_scaling_factor)
            if self.rope_orig_context:
                md[p + "rope.scaling.original_context_length"] = self.rope_orig_context
        if self.rope_attn_factor != 1.0:
            md[p + "rope.scaling.attn_factor"] = float(self.rope_attn_factor)
        return md


def tensor_specs(cfg: Config) -> list[TensorSpec]:
    """Every tensor of a qwen3moe file, with shapes in NumPy order ([out, in] for weights)."""
    D, V, E, F = cfg.d_model, cfg.n_vocab, cfg.n_experts, cfg.expert_ff
    specs = embedding_specs(V, D)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        specs += attention_specs(cfg, i) + [
            TensorSpec(b + "ffn_norm.weight", (D,), "norm", i),
            TensorSpec(b + "ffn_gate_inp.weight", (E, D), "router", i),
            TensorSpec(b + "ffn_gate_exps.weight", (E, F, D), "expert", i),
            TensorSpec(b + "ffn_up_exps.weight", (E, F, D), "expert", i),
            TensorSpec(b + "ffn_down_exps.weight", (E, D, F), "expert", i),
        ]
    return specs


# --- forward ---------------------------------------------------------------------------------
# Legend: B sequences, T new tokens, S cache slots, D model dim, Hq/Hkv heads, Dh head dim,
# E experts, k experts per token, V vocabulary, L layers.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """What the routers chose at every layer and token of a step."""

    experts: jax.Array  # int32 [L, B, T, k], best first
    weights: jax.Array  # float32 [L, B, T, k], renormalised
    margin: jax.Array  # float32 [L, B, T]: k-th minus (k+1)-th router logit (near-tie detector)


def _attention_block(params, cfg: Config, i: int, x, cos, sin, positions, cache: KVCache, mask, tickets=None):
    """The attention block on x: (x plus its output, the cache, the tickets). ``tickets``: the
    step's counter buffer (``pallas.tickets``), with which the decode attention is one launch
    (``pallas.attention_prepped``) and the decode output projection adds x."""
    b = f"blk.{i}."
    B, T, _ = x.shape
    ar = cfg.act_rounding
    # the attention norm goes with the projections: the one-launch decode GEMV forms it in-kernel
    norm = (as_f32(params[b + "attn_norm.weight"]), cfg.rms_eps)
    ws = [params[b + f"attn_{n}.weight"] for n in "qkv"]
    # Qwen3: per-head RMSNorm of q and k before the rotation.
    q_norm, k_norm = as_f32(params[b + "attn_q_norm.weight"]), as_f32(params[b + "attn_k_norm.weight"])
    one_token = cfg.attention == "pallas" and T == 1
    if one_token and attn_prep.serves(cfg.head_dim, cfg.n_rot):  # partial sums, norms, rotation, cache write: one kernel
        qkv = qmatmul_many(x, ws, ar, norm=norm, partials=True)  # [S, B, (Hq + 2 Hkv) Dh]
        prep = (qkv, (q_norm, k_norm, cfg.rms_eps), (cos[:, 0], sin[:, 0]), positions[:, 0])
        if tickets is not None:  # and the attention in the same launch, its splits combined by ticket
            o, cache, tickets = cache.attend_one_prepped(i, *prep, cfg.attn_scale, tickets)  # [B, Hq, Dh]
        else:
            q1, cache = cache.write_one_normed(i, *prep)  # q1 [B, Hq, Dh]
            o = cache.attend_one(i, q1, positions[:, 0], cfg.attn_scale)  # [B, Hq, Dh]
    else:
        q, k, v = qmatmul_many(x, ws, ar, norm=norm, precision=cfg.prefill_precision)
        q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)  # [B, T, Hq, Dh]
        k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)  # [B, T, Hkv, Dh]
        v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, q_norm, cfg.rms_eps), cos, sin, neox=True)
        k = apply_rope(rms_norm(k, k_norm, cfg.rms_eps), cos, sin, neox=True)
        cache = cache.write(i, k, v, positions)
        if one_token:
            o = cache.attend_one(i, q[:, 0], positions[:, 0], cfg.attn_scale)  # [B, Hq, Dh]
        elif cfg.attention == "pallas":  # prefill: flash attention straight from the cache buffer
            o = cache.attend_many(i, q, positions, cfg.attn_scale)  # [B, T, Hq, Dh]
        else:
            k_all, v_all = cache.layer(i)  # [B, S, Hkv, Dh]
            o = gqa_attention(q, k_all, v_all, mask, cfg.attn_scale)  # [B, T, Hq, Dh]
    o = o.reshape(B, T, cfg.q_dim)  # [B, T, Hq*Dh]
    w_o = params[b + "attn_output.weight"]
    if tickets is not None:  # the residual add made where the decode GEMV finishes (no launch of its own)
        x, tickets = qmatmul_add(x, o, w_o, ar, cfg.prefill_precision, tickets)
        return x, cache, tickets
    return x + qmatmul(o, w_o, ar, cfg.prefill_precision), cache, tickets


def _router(cfg: Config, x, norm, router_f32, gate, placement, i: int, tickets):
    """A decode step's router launch (``pallas.route.router_logits``): the norm, the router
    product, and as far as the shapes allow the rounding of the normed x for the integer-dot
    experts (x8) and, with tickets (routing "pallas-tickets"), the top-k (with the placement's
    card slots). Returns (x8, logits, route or None, tickets)."""
    B, T, D = x.shape
    N, k = B * T, cfg.n_experts_used
    rounded = takes_rounded_x(gate, N, k, cfg.act_rounding) and router_logits_rounds((N, D), router_f32)
    route_k = k if tickets is not None and router_logits_routes(N, router_f32, k) else 0
    table = {} if placement is None or not route_k else dict(slot_table=placement.slot_of, layer=i)
    out = router_logits_kernel(x.reshape(N, D), *norm, router_f32, rounded=rounded, route_k=route_k,
                               tickets=tickets if route_k else None, **table, interpret=interpret_kernels())
    if not isinstance(out, RouterOut):
        return None, out, None, tickets
    return out.x8, out.logits, out.route, out.tickets if route_k else tickets


def _moe_block(params, cfg: Config, i: int, x, placement, tickets=None):
    """The MoE block on x; ``tickets``: the step's counter buffer (``pallas.tickets``), with
    which the router's launch routes and the decode down launch adds x. Returns (x plus the
    block's output, the route, the tickets)."""
    b = f"blk.{i}."
    B, T, D = x.shape
    norm = (as_f32(params[b + "ffn_norm.weight"]), cfg.rms_eps)
    router = params[b + "ffn_gate_inp.weight"]
    # an F32 router's values (as_f32 computes nothing for them), which the reference also
    # multiplies by x unrounded
    router_f32 = as_f32(router) if weight_qtype(router) == 0 else None
    gate = params[b + "ffn_gate_exps.weight"]
    route, card, x8 = None, None, None
    if cfg.routing != "xla" and router_f32 is not None and router_logits_serves(B * T, router_f32):
        x8, router_logits, route, tickets = _router(cfg, x, norm, router_f32, gate, placement, i, tickets)
    else:
        h = rms_norm(x, *norm).reshape(B * T, D)  # [N, D]
        router_logits = qmatmul(h, router, cfg.act_rounding)  # [N, E]
    if route is not None:  # routed in the router's launch
        experts, weights, margin, *card = route
    elif cfg.routing != "xla":
        # with a placement the kernel also looks up each pick's card slot (no lookup kernel)
        table = () if placement is None else (placement.slot_of, i)
        experts, weights, margin, *card = fused_route_topk(router_logits, cfg.n_experts_used, *table,
                                                           interpret=interpret_kernels())
    else:
        experts, weights, margin = route_topk(router_logits, cfg.n_experts_used)  # [N, k], [N, k], [N]
    card = card[0] if card else None
    # the experts take x and the norm: the decode GEMV forms it in-kernel, so h feeds only the router;
    # with tickets they return x plus their output (the decode down launch adds it: no launch of its own)
    y = placed_moe_swiglu(x.reshape(B * T, D), experts, weights, gate, params[b + "ffn_up_exps.weight"],
                          params[b + "ffn_down_exps.weight"], cfg.act_rounding, placement, i, cfg.prefill_precision,
                          norm, card, x8, tickets)  # [N, D]
    if tickets is None:
        x = x + y.reshape(B, T, D)
    else:
        y, tickets = y
        x = y.reshape(B, T, D)
    k = cfg.n_experts_used
    return x, (experts.reshape(B, T, k), weights.reshape(B, T, k), margin.reshape(B, T)), tickets


def forward(params, cfg: Config, tokens, positions, cache: KVCache, placement=None, logits_at=None):
    """One step over new tokens of B sequences: logits, the updated cache, the routing.

    Args:
      params: dict GGUF tensor name → QTensor (from ``models.loader.load_model``).
      cfg: the static Config.
      tokens: int32 ``[B, T]``.
      positions: int32 ``[B, T]``, the position of each token in its sequence; keys/values
        are stored in cache slot = position (positions ``>= S`` are padding: not stored).
      cache: KVCache holding ``[L, B, S, Hkv, Dh]`` keys/values of earlier steps.
      placement: a ``placement.Placement`` (which card slot or the host computes each expert),
        or None when every expert is on the card in id order.
      logits_at: None for the logits of every token, or int32 ``[B, R]``: indices into the T
        axis (each in ``[0, T)``) of the rows that need logits (prefill samples from one).
    Returns:
      logits float32 ``[B, T, V]`` (``[B, R, V]`` with ``logits_at``), the new KVCache, and a
      Routing (of every token either way).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    cos, sin = rope_cos_sin(positions, cfg.rope())  # [B, T, n_rot/2]
    cache = cache.with_lengths(positions)
    mask = cache.mask(positions)  # [B, T, S]
    x = take_rows(params["token_embd.weight"], tokens)  # [B, T, D]
    routes = []
    # the counters of the decode launches' last programs, one buffer for every layer
    tickets = new_tickets() if cfg.routing == "pallas-tickets" else None
    for i in range(cfg.n_layers):  # a Python loop: tensor types may differ between layers
        x, cache, tickets = _attention_block(params, cfg, i, x, cos, sin, positions, cache, mask, tickets)
        x, route, tickets = _moe_block(params, cfg, i, x, placement, tickets)
        routes.append(route)
    if logits_at is not None:  # only the rows asked for go through the norm and the V-wide output matmul
        x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, :, None], axis=1)  # [B, R, D]
    x = rms_norm(x, as_f32(params["output_norm.weight"]), cfg.rms_eps)
    out_w = params.get("output.weight", params["token_embd.weight"])  # tied when output is absent
    logits = qmatmul(x, out_w, cfg.act_rounding)  # [B, T or R, V]
    routing = Routing(*(jnp.stack(parts) for parts in zip(*routes)))
    return logits, cache, routing


# The jitted step: cfg static, cache donated (its buffers are reused for the new cache).
jit_forward = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("cache",))


def init_cache(cfg: Config, batch: int, max_len: int) -> KVCache:
    """An empty cache for ``batch`` sequences of up to ``max_len`` positions."""
    return KVCache.for_config(cfg, batch, max_len)
