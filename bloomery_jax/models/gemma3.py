"""Gemma 3 (``general.architecture = gemma3``): 270M, 1B, 4B, 12B, 27B text models.

Contract (as qwen3moe): ``Config.from_gguf(gf)`` reads every hyper-parameter from metadata
with llama.cpp's defaults; ``tensor_specs(cfg)`` is the table of tensors the file must hold;
``Config.to_metadata()`` is the inverse of ``from_gguf``; ``forward`` is the pure step, returning
``(logits, cache, routing)`` where ``routing`` is always ``None``: Gemma 3 is dense, it has no
router (``None`` is an empty pytree, so the jitted step's outputs keep one shape across archs).

The architecture, as llama.cpp builds it (``src/models/gemma3.cpp`` and its hparams loader):
  * token embeddings times ``sqrt(d_model)`` (float32), tied output embeddings unless the file
    has ``output.weight``; optional final logit soft-capping ``c * tanh(logits / c)``;
  * per layer: RMSNorm → q, k, v → per-head RMSNorm of q and k → NeoX rope → q times the
    attention scale (``1/sqrt(head_dim)``; the 62-layer 27B uses ``1/sqrt(d_model/n_heads)``) →
    softmax attention (no further scale) → output projection → post-attention RMSNorm →
    residual add; then RMSNorm → GeGLU FFN (tanh GELU of the gate times up, then down) →
    post-FFN RMSNorm → residual add. The norm weights are used as stored (the converter
    already folded Gemma's ``1 + w`` into them).
  * interleaved local/global attention: with ``attention.sliding_window`` set, layer ``i`` is
    local (sliding window) unless ``i % pattern == pattern - 1``, pattern 6 by default or
    ``attention.sliding_window_pattern`` (a number, or one flag per layer). Local layers
    rotate with ``rope.freq_base_swa`` (default 10000) and no frequency scaling; global
    layers with ``rope.freq_base`` (default 10000; 1e6 in Gemma 3 files) and the file's
    linear rope scaling (4B and larger ship factor 8). Without a window every layer is global.

The KV cache is the shared full-length ``KVCache`` for every layer; local layers only read
the last ``sliding_window`` slots through their mask (a ring buffer would save memory later).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import GGUFError
from ..gguf_file import GGUFFile
from ..ops.activations import geglu
from ..ops.attention import gqa_attention
from ..ops.masks import sliding_window_mask
from ..ops.norms import rms_norm
from ..ops.qmatmul import as_f32, qmatmul, take_rows
from ..ops.rope import RopeConfig, apply_rope, rope_cos_sin
from .kv_cache import KVCache
from .spec import TensorSpec, attention_specs, embedding_specs

ARCH = "gemma3"
DEFAULT_SWA_PATTERN = 6  # llama.cpp's gemma3 default: five local layers, then one global
DEFAULT_ROPE_BASE = 10_000.0  # llama.cpp's default for both bases when the key is absent


def swa_pattern_layers(n_layers: int, pattern: int) -> tuple[bool, ...]:
    """Which layers are local for a numeric pattern: all of them for 0, else ``i % n < n - 1``."""
    return tuple(pattern == 0 or (i % pattern) < pattern - 1 for i in range(n_layers))


@dataclasses.dataclass(frozen=True)
class Config:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # key_length == value_length
    ff: int  # feed_forward_length
    n_vocab: int
    context_length: int
    rms_eps: float
    sliding_window: int = 0  # 0: no local layers
    swa_layers: tuple[bool, ...] = ()  # per layer: local (sliding window) attention
    rope_base: float = DEFAULT_ROPE_BASE  # global layers
    rope_base_swa: float = DEFAULT_ROPE_BASE  # local layers
    rope_dim: int | None = None  # rotated dims per head; None = head_dim
    rope_scaling: str = "none"  # none | linear; applies to global layers only
    rope_scaling_factor: float = 1.0
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor, multiplies the rope magnitude
    final_logit_softcap: float = 0.0  # 0: none
    tied_embeddings: bool = True
    # Not from the file: "ggml-cpu" rounds matmul activations as llama.cpp's CPU backend does
    # (ops/actquant.py), to compare with it on quantized files; "none" is the exact reference.
    act_rounding: str = "none"
    # Not from the file: the precision of the prefill products of packed weights (ops.qmatmul);
    # set by the loader's kernels= choice (loader.PREFILL_PRECISION_OF).
    prefill_precision: str = "tf32x3"

    def __post_init__(self):
        if len(self.swa_layers) != self.n_layers:
            raise ValueError(f"swa_layers has {len(self.swa_layers)} flags for {self.n_layers} layers")

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
    def embed_scale(self) -> float:
        return float(np.sqrt(np.float32(self.d_model), dtype=np.float32))

    @property
    def attn_scale(self) -> float:
        """What q is multiplied by before attention (llama.cpp's ``f_attention_scale``)."""
        # llama.cpp picks by layer count: 62 layers is Gemma 3 27B, whose query scalar is
        # d_model / n_heads (integer division of the two counts), not head_dim.
        d = self.d_model // self.n_heads if self.n_layers == 62 else self.head_dim
        return float(np.float32(1.0) / np.sqrt(np.float32(d)))

    def is_local(self, layer: int) -> bool:
        return self.sliding_window > 0 and self.swa_layers[layer]

    def rope(self, local: bool) -> RopeConfig:
        """The ``ggml_rope_ext`` arguments of a local or a global layer (NeoX style)."""
        f = np.float32
        freq_scale = f(1.0)
        if not local and self.rope_scaling == "linear" and self.rope_scaling_factor not in (0.0, 1.0):
            freq_scale = f(1.0) / f(self.rope_scaling_factor)
        return RopeConfig(
            n_dims=self.n_rot,
            freq_base=float(f(self.rope_base_swa if local else self.rope_base)),
            neox=True,
            freq_scale=float(freq_scale),
            ext_factor=0.0,  # llama.cpp: 0 for every scaling type but YaRN
            attn_factor=float(f(self.rope_attn_factor)),
            n_ctx_orig=self.context_length,
        )

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "Config":
        k = gf.arch_key
        n_layers = k("block_count", int)
        n_heads = k("attention.head_count", int)
        d_model = k("embedding_length", int)
        head_dim = k("attention.key_length", int, default=d_model // n_heads)
        value_dim = k("attention.value_length", int, default=d_model // n_heads)
        if value_dim != head_dim:
            raise GGUFError(gf.path, f"value_length {value_dim} != key_length {head_dim} is not supported",
                            key=f"{ARCH}.attention.value_length")
        tokens = gf.get("tokenizer.ggml.tokens")
        n_vocab = k("vocab_size", int, default=len(tokens) if tokens is not None else None)
        if n_vocab is None:
            n_vocab = gf.tensor("token_embd.weight").shape[0]

        window = k("attention.sliding_window", int, default=0)
        swa_layers = (False,) * n_layers
        if window > 0:
            swa_layers = _read_swa_pattern(gf, n_layers)

        factor = k("rope.scaling.factor", float, default=None)
        if factor is None:
            factor = k("rope.scale_linear", float, default=None)
        # llama.cpp: an absent type means linear (a no-op unless a factor is given).
        scaling = k("rope.scaling.type", str, default="linear" if factor is not None else "none")
        if scaling not in ("none", "linear"):
            raise GGUFError(gf.path, f"rope scaling {scaling!r} is not supported for gemma3 (none, linear)",
                            key=f"{ARCH}.rope.scaling.type")
        if scaling == "none" or factor in (None, 0.0, 1.0):  # llama.cpp never scales with type none
            scaling, factor = "none", 1.0
        return cls(
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", int, default=n_heads),
            head_dim=head_dim,
            ff=k("feed_forward_length", int),
            n_vocab=int(n_vocab),
            context_length=k("context_length", int),
            rms_eps=float(k("attention.layer_norm_rms_epsilon", float)),
            sliding_window=max(window, 0),
            swa_layers=swa_layers,
            rope_base=float(k("rope.freq_base", float, default=DEFAULT_ROPE_BASE)),
            rope_base_swa=float(k("rope.freq_base_swa", float, default=DEFAULT_ROPE_BASE)),
            rope_dim=k("rope.dimension_count", int, default=None),
            rope_scaling=scaling,
            rope_scaling_factor=float(factor),
            rope_attn_factor=float(k("rope.scaling.attn_factor", float, default=1.0)),
            final_logit_softcap=float(k("final_logit_softcapping", float, default=0.0)),
            tied_embeddings="output.weight" not in gf.tensors,
        )

    def to_metadata(self) -> dict[str, object]:
        """GGUF metadata entries (key → int | float | str | list[bool]) describing this config."""
        p = ARCH + "."
        md: dict[str, object] = {
            p + "block_count": self.n_layers,
            p + "context_length": self.context_length,
            p + "embedding_length": self.d_model,
            p + "feed_forward_length": self.ff,
            p + "attention.head_count": self.n_heads,
            p + "attention.head_count_kv": self.n_kv_heads,
            p + "attention.key_length": self.head_dim,
            p + "attention.value_length": self.head_dim,
            p + "attention.layer_norm_rms_epsilon": float(self.rms_eps),
            p + "rope.freq_base": float(self.rope_base),
        }
        if self.sliding_window > 0:
            md[p + "attention.sliding_window"] = self.sliding_window
            if self.swa_layers != swa_pattern_layers(self.n_layers, DEFAULT_SWA_PATTERN):
                md[p + "attention.sliding_window_pattern"] = _pattern_value(self.swa_layers)
        if self.rope_base_swa != DEFAULT_ROPE_BASE:
            md[p + "rope.freq_base_swa"] = float(self.rope_base_swa)
        if self.rope_dim is not None:
            md[p + "rope.dimension_count"] = self.rope_dim
        if self.rope_scaling != "none":
            md[p + "rope.scaling.type"] = self.rope_scaling
            md[p + "rope.scaling.factor"] = float(self.rope_scaling_factor)
        if self.rope_attn_factor != 1.0:
            md[p + "rope.scaling.attn_factor"] = float(self.rope_attn_factor)
        if self.final_logit_softcap:
            md[p + "final_logit_softcapping"] = float(self.final_logit_softcap)
        return md


def _read_swa_pattern(gf: GGUFFile, n_layers: int) -> tuple[bool, ...]:
    """Local-layer flags from ``attention.sliding_window_pattern``: a number, or one flag per layer."""
    key = f"{ARCH}.attention.sliding_window_pattern"
    value = gf.get(key)
    if value is None:
        return swa_pattern_layers(n_layers, DEFAULT_SWA_PATTERN)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return swa_pattern_layers(n_layers, int(value))
    flags = np.asarray(value) if isinstance(value, (list, np.ndarray)) else None
    if flags is None or flags.ndim != 1 or flags.dtype.kind not in "biu":
        raise GGUFError(gf.path, f"expected a non-negative number or one flag per layer, found {value!r}", key=key)
    if flags.shape[0] != n_layers:
        raise GGUFError(gf.path, f"has {flags.shape[0]} flags for {n_layers} layers", key=key)
    return tuple(bool(f) for f in flags)


def _pattern_value(swa_layers: tuple[bool, ...]) -> int | list[bool]:
    """The shortest metadata value giving these flags: a number when one fits, else the flags."""
    for n in range(len(swa_layers) + 1):
        if swa_pattern_layers(len(swa_layers), n) == swa_layers:
            return n
    return list(swa_layers)


def tensor_specs(cfg: Config) -> list[TensorSpec]:
    """Every tensor of a gemma3 file, with shapes in NumPy order ([out, in] for weights)."""
    D, V, F = cfg.d_model, cfg.n_vocab, cfg.ff
    specs = embedding_specs(V, D)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        specs += attention_specs(cfg, i) + [
            TensorSpec(b + "post_attention_norm.weight", (D,), "norm", i),
            TensorSpec(b + "ffn_norm.weight", (D,), "norm", i),
            TensorSpec(b + "ffn_gate.weight", (F, D), "ffn", i),
            TensorSpec(b + "ffn_up.weight", (F, D), "ffn", i),
            TensorSpec(b + "ffn_down.weight", (D, F), "ffn", i),
            TensorSpec(b + "post_ffw_norm.weight", (D,), "norm", i),
        ]
    return specs


# --- forward ---------------------------------------------------------------------------------
# Legend: B sequences, T new tokens, S cache slots, D model dim, Hq/Hkv heads, Dh head dim,
# F FFN hidden size, V vocabulary.


def _norm(params, name: str, x, cfg: Config):
    return rms_norm(x, as_f32(params[name]), cfg.rms_eps)


def _attention(params, cfg: Config, i: int, h, rope, positions, cache: KVCache, mask):
    b = f"blk.{i}."
    B, T, _ = h.shape
    cos, sin = rope
    ar, pp = cfg.act_rounding, cfg.prefill_precision
    q = qmatmul(h, params[b + "attn_q.weight"], ar, pp).reshape(B, T, cfg.n_heads, cfg.head_dim)  # [B, T, Hq, Dh]
    k = qmatmul(h, params[b + "attn_k.weight"], ar, pp).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)  # [B, T, Hkv, Dh]
    v = qmatmul(h, params[b + "attn_v.weight"], ar, pp).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    q = apply_rope(_norm(params, b + "attn_q_norm.weight", q, cfg), cos, sin, neox=True)
    k = apply_rope(_norm(params, b + "attn_k_norm.weight", k, cfg), cos, sin, neox=True)
    q = q * jnp.float32(cfg.attn_scale)  # llama.cpp scales q, then attends with scale 1
    cache = cache.write(i, k, v, positions)
    k_all, v_all = cache.layer(i)  # [B, S, Hkv, Dh]
    o = gqa_attention(q, k_all, v_all, mask, 1.0).reshape(B, T, cfg.q_dim)  # [B, T, Hq*Dh]
    return qmatmul(o, params[b + "attn_output.weight"], ar, pp), cache  # [B, T, D]


def _ffn(params, cfg: Config, i: int, h):
    b, ar, pp = f"blk.{i}.", cfg.act_rounding, cfg.prefill_precision
    gate = qmatmul(h, params[b + "ffn_gate.weight"], ar, pp)  # [B, T, F]
    up = qmatmul(h, params[b + "ffn_up.weight"], ar, pp)  # [B, T, F]
    return qmatmul(geglu(gate, up), params[b + "ffn_down.weight"], ar, pp)  # [B, T, D]


def forward(params, cfg: Config, tokens, positions, cache: KVCache, placement=None, logits_at=None):
    """One step over new tokens of B sequences: logits, the updated cache, ``None``.

    Args:
      params: dict GGUF tensor name → QTensor or float array (``models.loader.load_model``).
      cfg: the static Config.
      tokens: int32 ``[B, T]``.
      positions: int32 ``[B, T]``, the position of each token in its sequence; keys/values
        are stored in cache slot = position (positions ``>= S`` are padding: not stored).
      cache: KVCache holding ``[L, B, S, Hkv, Dh]`` keys/values of earlier steps.
      placement: accepted and unused: a dense model has no experts to place.
      logits_at: None for the logits of every token, or int32 ``[B, R]``: indices into the T
        axis (each in ``[0, T)``) of the rows that need logits (prefill samples from one).
    Returns:
      logits float32 ``[B, T, V]`` (``[B, R, V]`` with ``logits_at``), soft-capped when the
      model says so, the new KVCache, and ``None`` for the routing (no router).
    """
    del placement
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    cache = cache.with_lengths(positions)
    global_mask = cache.mask(positions)  # [B, T, S]
    local_mask = sliding_window_mask(positions, cache.lengths, cache.max_len, cfg.sliding_window)
    rope_global = rope_cos_sin(positions, cfg.rope(local=False))  # 2 x [B, T, n_rot/2]
    rope_local = rope_cos_sin(positions, cfg.rope(local=True))
    x = take_rows(params["token_embd.weight"], tokens) * jnp.float32(cfg.embed_scale)  # [B, T, D]
    for i in range(cfg.n_layers):  # a Python loop: tensor types may differ between layers
        b = f"blk.{i}."
        local = cfg.is_local(i)
        h = _norm(params, b + "attn_norm.weight", x, cfg)
        a, cache = _attention(params, cfg, i, h, rope_local if local else rope_global, positions, cache,
                              local_mask if local else global_mask)
        x = x + _norm(params, b + "post_attention_norm.weight", a, cfg)
        f = _ffn(params, cfg, i, _norm(params, b + "ffn_norm.weight", x, cfg))
        x = x + _norm(params, b + "post_ffw_norm.weight", f, cfg)
    if logits_at is not None:  # only the rows asked for go through the norm, the V-wide output matmul and the cap
        x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, :, None], axis=1)  # [B, R, D]
    x = _norm(params, "output_norm.weight", x, cfg)
    out_w = params.get("output.weight", params["token_embd.weight"])  # tied when output is absent
    logits = qmatmul(x, out_w, cfg.act_rounding)  # [B, T or R, V]
    if cfg.final_logit_softcap:
        c = jnp.float32(cfg.final_logit_softcap)
        logits = jnp.tanh(logits / c) * c
    return logits, cache, None


# The jitted step: cfg static, cache donated (its buffers are reused for the new cache).
jit_forward = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("cache",))


def init_cache(cfg: Config, batch: int, max_len: int) -> KVCache:
    """An empty cache for ``batch`` sequences of up to ``max_len`` positions."""
    return KVCache.for_config(cfg, batch, max_len)
