"""Open a GGUF model: architecture module, Config, checked tensor table, device parameters.

Contract: ``load_model(path, place=RULE)`` returns a :class:`Model` whose ``params`` map every
GGUF tensor name to a :class:`~bloomery_jax.quant.QTensor` holding the file's raw blocks on the
default device (no dequantized copy). Routed-expert tensors hold only the experts the
placement rule seats on the card (``[n_slots, ...]``, in slot order); ``model.placement`` says
where every expert is computed, and its host bridge holds all experts as views of the file.
Every problem is a GGUFError naming the file and the tensor or key: another architecture, a
missing or mis-shaped tensor, a ggml type we cannot dequantize; a bad rule is a ConfigError.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType

import jax
import numpy as np
from gguf import GGMLQuantizationType as T

from ..errors import ConfigError, GGUFError
from ..gguf_file import GGUFFile
from ..quant import SUPPORTED_TYPES, QTensor
from ..settings import ATTENTION, BRIDGES, KERNELS, ROUTING, WEIGHT_FORMS
from .registry import module_for_file
from .spec import check_tensors

# the prefill products' precision (pallas.moe_gemm precisions) a kernels= choice sets; others keep tf32x3
PREFILL_PRECISION_OF = {"pallas-tf32": "tf32", "pallas-qtiles": "q-bf16x2", "pallas-bf16": "q-bf16", "pallas-q8": "q-int8",
                        "pallas-q8-bf16": "q-bf16"}
# the kernels on "ggml"-layout weights, and the activation rounding they set
ACT_ROUNDING_OF = {"pallas-q8": "ggml-cuda", "pallas-q8-bf16": "q8-decode"}


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded model: ``module.forward(params, cfg, tokens, positions, cache, placement, logits_at=None)`` runs it.

    ``params`` and ``placement`` are the live state of the card: adaptive residency replaces
    expert buffers in ``params`` (in place, donated) and the ``placement`` table together.
    """

    gguf: GGUFFile
    cfg: object  # the architecture's Config (frozen, hashable)
    params: dict[str, QTensor]
    module: ModuleType
    placement: object = None  # placement.Placement for MoE models, None for dense ones
    kernels: str = "reference"  # the card kernels it runs (``resolve_kernels`` of the load's setting)
    bridge: str = "callback"  # the host-expert bridge it was loaded with (``resolve_bridge``)
    attention: str = "xla"  # the attention and routing it runs (``resolve_kernel_choice``)
    routing: str = "xla"

    @property
    def path(self) -> str:
        return self.gguf.path

    def init_cache(self, batch: int, max_len: int):
        return self.module.init_cache(self.cfg, batch, max_len)


def check_types(gf: GGUFFile) -> None:
    """Refuse the first tensor whose ggml type has no dequantizer, by name."""
    for info in gf:
        if T(info.qtype) not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise GGUFError(gf.path, f"ggml type {T(info.qtype).name} is not supported (supported: {supported})",
                            tensor=info.name)


AUTO_F32_BYTES = 2 << 30  # "auto" keeps float32 copies of card weights up to this size


def load_model(path: str | os.PathLike, *, device=None, place="card", reserve_bytes: int = 0,
               host_threads: int | None = None, host_act: str | None = None, weights: str = "blocks",
               kernels: str = "reference", attention: str = "xla", bridge: str = "callback",
               routing: str = "xla") -> Model:
    """Open ``path``, check it against its architecture, and put its tensors on ``device``.

    Args:
      path: a GGUF file.
      device: a jax Device; None = the default device.
      place: a placement rule string (``placement.parse_rule``) or rule object.
      reserve_bytes: card bytes the caller needs besides the weights (KV cache), for budget rules.
      host_threads: Numba threads of the host experts (None = ``host.bridge.default_threads``).
      host_act: host experts' activations, "q8" (rounded to 8 bits as llama.cpp's CPU backend does,
        integer block sums) or "f32"; None = ``host.DEFAULT_ACT``.
      weights: card weights as the file's "blocks" (dequantized inside every step), as "f32"
        copies (the same values, dequantized once at load: the reference path then skips the
        per-step dequantization; 4-8x the memory), or "auto": f32 when those copies take at
        most AUTO_F32_BYTES and no expert runs on the host, else blocks.
      kernels: "reference" (jnp dequantize + matmul), "pallas" (card matmul weights repacked
        on the device for the Pallas kernels; ``weights`` must then be blocks or auto),
        "pallas-tf32" (as pallas, prefill products in one TF32 pass instead of three: sets
        ``cfg.prefill_precision``), "pallas-qtiles" (as pallas, prefill products multiply the
        stored quants by x in two bf16 parts, scales applied after each sub-block:
        ``prefill_precision`` "q-bf16x2"), "pallas-bf16" (as pallas-qtiles with x in one bf16 part:
        "q-bf16", each activation within 2^-9 of itself, where llama.cpp's Q8_1 rows err up to
        2^-8 of their block's largest), "pallas-q8" (as pallas with weights in the "ggml" layout and
        activations rounded to Q8_1 before every quantized matmul, as llama.cpp's CUDA backend
        does: decode GEMVs take integer dot products, prefill products int8 tiles; sets
        ``cfg.act_rounding="ggml-cuda"`` and ``prefill_precision`` "q-int8"), "pallas-q8-bf16"
        (pallas-q8's integer dot products at decode, pallas-bf16's tiles at prefill, where x is
        not rounded to Q8_1: ``act_rounding="q8-decode"``) or
        "auto" (pallas-bf16 on a GPU, else reference). Weights no kernel can serve are listed on
        stderr and run the reference path.
      attention: "xla" (``ops.attention``, jnp) or "pallas": one-token (decode) steps attend
        with ``pallas.decode_attention`` and prefill steps with ``pallas.prefill_attention``
        (flash attention), straight from the cache buffer, reading only each query's visible
        positions (the jnp path copies each layer's cache out of the buffer on the GPU and
        attends over all of it under a mask). ConfigError for an architecture without it.
        "auto": pallas on a GPU for an architecture that has it, else xla (``resolve_kernel_choice``).
      bridge: how steps reach the host experts: "callback" (``host.bridge.HostBridge``,
        jax.pure_callback), "ffi" (``host.ffi.FfiHostBridge``, an XLA FFI custom call; the
        same results bit for bit; ConfigError where its library cannot be built) or "auto"
        (``resolve_bridge``).
      routing: "xla" (``ops.routing``, jnp), "pallas" (``pallas.route_topk``: softmax and top-k
        in one kernel) or "pallas-tickets" (as pallas, but at decode with the ticket epilogues of
        ``pallas.tickets``). ConfigError for an architecture without it; "auto" as for attention.
    Returns:
      the Model.
    """
    from ..placement import ExpertLayout, Placement, parse_rule, slot_table

    if attention not in ATTENTION:
        raise ConfigError(f"attention={attention!r}: must be one of {', '.join(ATTENTION)}")
    bridge = resolve_bridge(bridge, device)
    if routing not in ROUTING:
        raise ConfigError(f"routing={routing!r}: must be one of {', '.join(ROUTING)}")
    gf = GGUFFile(path)
    module = module_for_file(gf)  # clear error for architectures we do not implement
    cfg = module.Config.from_gguf(gf)
    attention = resolve_kernel_choice("attention", attention, cfg, device)
    routing = resolve_kernel_choice("routing", routing, cfg, device)
    if attention != "xla":
        if not hasattr(cfg, "attention"):
            raise ConfigError(f"attention={attention!r}: the {gf.architecture} model has only the xla attention")
        cfg = dataclasses.replace(cfg, attention=attention)
    if routing != "xla":
        if not hasattr(cfg, "routing"):
            raise ConfigError(f"routing={routing!r}: the {gf.architecture} model has only the xla routing")
        cfg = dataclasses.replace(cfg, routing=routing)
    specs = module.tensor_specs(cfg)
    check_tensors(gf, specs)
    check_types(gf)
    rule = parse_rule(place) if isinstance(place, str) else place
    layout = ExpertLayout.from_file(gf, specs)
    on_card = rule.place(layout, reserve_bytes=reserve_bytes)  # [L, E] bool
    expert_layer = {s.name: s.layer for s in specs if s.role == "expert"}
    device = device or jax.devices()[0]
    params, host_tensors = {}, {}
    for info in gf:
        data = info.data.view(np.uint16) if info.qtype == T.BF16 else info.data  # bf16 travels as its bits
        shape = tuple(info.shape)
        layer = expert_layer.get(info.name)
        if layer is not None and not on_card[layer].all():
            host_tensors[info.name] = (layer, data, int(info.qtype), shape)
            data = data[on_card[layer]]  # [n_slots, rows, row_bytes]: slot order = expert id order
            shape = (int(on_card[layer].sum()),) + shape[1:]
        params[info.name] = QTensor(jax.device_put(data, device), int(info.qtype), shape)
    placement = None
    if expert_layer:
        host = _host_bridge(gf.path, host_tensors, host_threads, host_act, bridge) if host_tensors else None
        placement = Placement(jax.device_put(slot_table(on_card), device), host)
    kernels = resolve_kernels(kernels, device)
    if kernels.startswith("pallas"):
        if weights == "f32":
            raise ConfigError("weights='f32' and kernels='pallas' exclude each other: the kernels read blocks")
        params = _pack_for_kernels(params, specs, "ggml" if kernels in ACT_ROUNDING_OF else "planes", kernels)
        if kernels in PREFILL_PRECISION_OF:
            cfg = dataclasses.replace(cfg, prefill_precision=PREFILL_PRECISION_OF[kernels])
        if kernels in ACT_ROUNDING_OF:
            cfg = dataclasses.replace(cfg, act_rounding=ACT_ROUNDING_OF[kernels])
    elif _want_f32(weights, params, bool(host_tensors)):
        # Exactly the values the per-step dequantization forms (quant.dequantize is bit-exact).
        params = jax.jit(lambda ps: {k: q.dequantize() for k, q in ps.items()})(params)
    return Model(gguf=gf, cfg=cfg, params=params, module=module, placement=placement, kernels=kernels,
                 bridge=bridge, attention=attention, routing=routing)


def resolve_kernels(kernels: str, device=None) -> str:
    """The kernels of a ``kernels`` setting: itself, or for "auto" pallas-q8-bf16 on a GPU, else
    reference. pallas-q8-bf16 decodes on integer dot products over Q8_1-rounded activations, as
    llama.cpp's CUDA backend does, and prefills on quant tiles with bf16 activations (on the H100
    at 512 tokens a 30B layer's experts took 0.95 ms, against 1.42 with x in two bf16 parts and
    2.49 on f32 tiles, at 8e-3 relative error, where llama.cpp's Q8_1 arithmetic gives 1.2e-2;
    benchmarks/gpu_2026-12-05-s14 and -s16). On the 30B-shaped file beside llama.cpp on two H100
    machines (benchmarks/gpu_2026-12-07-s29) it decoded at 1.095x and 1.094x llama.cpp and
    prefilled at 0.92x and 0.91x; pallas-bf16 (the planes GEMVs at decode, the same tiles on the
    planes layout) decoded at 0.91x and prefilled at 1.03x (gpu_2026-12-07-s28). Decode is most
    of a chat's time, so the default takes the faster decode."""
    if kernels not in KERNELS:
        raise ConfigError(f"kernels={kernels!r}: must be one of {', '.join(KERNELS)}")
    if kernels == "auto":
        platform = (device or jax.devices()[0]).platform
        return "pallas-q8-bf16" if platform in ("gpu", "cuda") else "reference"
    return kernels


def resolve_kernel_choice(field: str, choice: str, cfg, device=None) -> str:
    """An attention or routing setting (``field``) for a model of config ``cfg``: itself, or for
    "auto" pallas on a GPU where the architecture has the field (qwen3moe), else xla. (The
    side-by-side runs on the H200 took pallas for both: fewer launches, and attention that
    reads only the visible positions.)"""
    if choice != "auto":
        return choice
    on_gpu = (device or jax.devices()[0]).platform in ("gpu", "cuda")
    return "pallas" if on_gpu and hasattr(cfg, field) else "xla"


def resolve_bridge(bridge: str, device=None) -> str:
    """The host bridge of a ``bridge`` setting: itself, or for "auto" ffi on a GPU (queued on the
    step's stream; on the H200 it took the n-cpu-moe=36 bench from 289.7 to 1,090 tok/s pp512
    and 16.5 to 23.7 tok/s tg128) and callback elsewhere. A GPU machine with no C++ compiler to
    build the ffi library gets callback, and a line on stderr says so."""
    import sys

    if bridge not in BRIDGES:
        raise ConfigError(f"bridge={bridge!r}: must be one of {', '.join(BRIDGES)}")
    if bridge != "auto":
        return bridge
    if (device or jax.devices()[0]).platform not in ("gpu", "cuda"):
        return "callback"
    from ..host.ffi import compiler

    try:
        compiler()
    except ConfigError as e:
        print(f"bridge auto: callback, since {e}", file=sys.stderr)
        return "callback"
    return "ffi"


MATMUL_ROLES = ("attn", "output", "expert", "shared_expert", "ffn")  # spec roles whose weights feed a matmul


def _pack_for_kernels(params: dict, specs, layout: str, kernels: str) -> dict:
    """Matmul weights in the Pallas kernels' layout (repacked on the device, same values).

    The embedding stays in blocks (a row lookup); a tied output then runs the reference path.
    Weights of a type or shape the kernels cannot read are named on stderr.
    """
    import sys

    from ..quant.repack import repack_on_device

    roles = {s.name: s.role for s in specs}
    unserved = []
    for name, q in params.items():
        if roles.get(name) not in MATMUL_ROLES:
            continue
        try:
            params[name] = repack_on_device(q.data, q.qtype, q.shape, layout=layout)
        except ValueError:  # a type without a kernel, or rows not a whole number of chunks
            unserved.append(f"{name} ({T(q.qtype).name} {list(q.shape)})")
        else:
            q.data.delete()  # the blocks are not needed twice on the card
    if unserved:
        print(f"kernels={kernels}: {len(unserved)} matmul weights have no kernel and run the reference path: "
              + ", ".join(unserved[:8]) + (" ..." if len(unserved) > 8 else ""), file=sys.stderr)
    return params


def _want_f32(weights: str, params: dict, has_host: bool) -> bool:
    if weights not in WEIGHT_FORMS:
        raise ConfigError(f"weights={weights!r}: must be one of {', '.join(WEIGHT_FORMS)}")
    if weights == "blocks":
        return False
    if weights == "f32" and has_host:
        # residency copies the file's blocks into card slots: the card must hold blocks too
        raise ConfigError("weights='f32' needs every expert on the card (placement 'card'); use 'blocks' or 'auto'")
    f32_bytes = 4 * sum(int(np.prod(q.shape)) for q in params.values())
    return weights == "f32" or (not has_host and f32_bytes <= AUTO_F32_BYTES)


def _host_bridge(path: str, host_tensors: dict, threads: int | None, act: str | None, kind: str):
    """A HostBridge (``kind`` "callback") or FfiHostBridge ("ffi") over every expert of the
    layers that have host experts (views of the file)."""
    from ..host import DEFAULT_ACT, HostExpertLayer, HostTensor
    from ..host.bridge import HostBridge

    by_layer: dict[int, dict[str, HostTensor]] = {}
    for name, (layer, data, qtype, shape) in host_tensors.items():
        which = name.split(".")[2].split("_")[1]  # blk.N.ffn_gate_exps.weight -> gate
        by_layer.setdefault(layer, {})[which] = HostTensor(data, qtype, shape)
    layers = {}
    for layer, t in by_layer.items():
        try:
            layers[layer] = HostExpertLayer(t["gate"], t["up"], t["down"], act=act or DEFAULT_ACT)
        except ValueError as e:  # a ggml type without a host kernel: say so at load
            raise GGUFError(path, f"experts of layer {layer} cannot run on the host: {e}",
                            tensor=f"blk.{layer}.ffn_gate_exps.weight") from None
    if kind == "ffi":
        from ..host.ffi import FfiHostBridge

        return FfiHostBridge(layers, threads)
    return HostBridge(layers, threads)
