"""Which ggml type each tensor of a synthetic file gets, for a requested ``--qtype``.

Contract: :func:`tensor_type` maps (tensor spec, file-level qtype, model facts) to a ggml type
and a note when a fallback happened; :data:`QTYPES` lists the accepted ``--qtype`` names and
:func:`file_type` gives the ``general.file_type`` value (llama.cpp's ``llama_ftype``).

Rules (as llama.cpp's quantizer applies them):
  * 1-D tensors (norms) stay F32; the router ``ffn_gate_inp`` stays F32 (llama.cpp never
    quantizes it).
  * A "pure" qtype (F16, Q8_0, Q4_K, Q5_K, Q6_K) gives every other weight that type.
  * ``Q4_K_M`` is llama.cpp's mix on a Q4_K base (``llama_tensor_get_type``):
      - ``output.weight`` (and tied ``token_embd``): Q6_K, or Q8_0 when its rows are not a
        multiple of 256;
      - ``attn_v``: Q6_K in the layers ``use_more_bits`` picks (the first and last eighth and
        every third layer between); Q8_0 in every layer when the model has exactly 8 experts;
      - ``attn_k``: Q8_0 when the model has exactly 8 experts;
      - ``attn_output``: Q5_K when the model has exactly 8 experts;
      - ``ffn_down`` / ``ffn_down_exps`` / ``ffn_down_shexp``: Q6_K in ``use_more_bits`` layers;
      - everything else (untied ``token_embd`` included): Q4_K.
  * Rows whose length is not a multiple of the block size cannot take the type. Like
    llama.cpp we fall back: Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, and to F16 when even a
    32-element block does not fit (llama.cpp has no fallback for Q8_0 and refuses; we use F16).
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, LlamaFileType as FT

from ..errors import ConfigError
from ..models.spec import TensorSpec

QTYPES = ("F32", "F16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")

# --qtype name -> (base ggml type, general.file_type). Pure K types are recorded as the
# llama.cpp "_S" ftype, the closest name llama.cpp has for an all-one-type file.
_BASE = {
    "F32": (T.F32, FT.ALL_F32),
    "F16": (T.F16, FT.MOSTLY_F16),
    "Q8_0": (T.Q8_0, FT.MOSTLY_Q8_0),
    "Q4_K": (T.Q4_K, FT.MOSTLY_Q4_K_S),
    "Q5_K": (T.Q5_K, FT.MOSTLY_Q5_K_S),
    "Q6_K": (T.Q6_K, FT.MOSTLY_Q6_K),
    "Q4_K_M": (T.Q4_K, FT.MOSTLY_Q4_K_M),
}

# Fallback for rows that a 256-element block does not divide (llama.cpp tensor_type_fallback).
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def check_qtype(qtype: str) -> str:
    if qtype not in _BASE:
        raise ConfigError(f"unknown --qtype {qtype!r} (choose from {', '.join(QTYPES)})")
    return qtype


def file_type(qtype: str) -> int:
    return int(_BASE[check_qtype(qtype)][1])


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's layer pick for extra bits: first/last eighth and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _is_quantizable(spec: TensorSpec) -> bool:
    return len(spec.shape) >= 2 and spec.role not in ("norm", "router")


def _mix_q4_k_m(spec: TensorSpec, n_layers: int, n_experts: int, tied: bool) -> T:
    """The Q4_K_M choice before the row-length fallback (see the module docstring)."""
    name = spec.name
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K if spec.shape[-1] % 256 == 0 else T.Q8_0
    layer = spec.layer if spec.layer is not None else 0
    if "attn_v." in name:
        return T.Q8_0 if n_experts == 8 else (T.Q6_K if use_more_bits(layer, n_layers) else T.Q4_K)
    if "attn_k." in name and n_experts == 8:
        return T.Q8_0
    if "attn_output." in name and n_experts == 8:
        return T.Q5_K
    if "ffn_down" in name and use_more_bits(layer, n_layers):
        return T.Q6_K
    return T.Q4_K


def tensor_type(spec: TensorSpec, qtype: str, *, n_layers: int, n_experts: int,
                tied: bool = False) -> tuple[T, str | None]:
    """The ggml type of one tensor.

    Args:
      spec: the tensor (its name, NumPy-order shape, role and layer).
      qtype: the file-level ``--qtype`` name.
      n_layers, n_experts: model facts the Q4_K_M mix depends on.
      tied: whether the file has no ``output.weight`` (then token_embd takes the output's type).
    Returns:
      (ggml type, note): the note says why a fallback type was used, else None.
    """
    base = _BASE[check_qtype(qtype)][0]
    if base == T.F32 or not _is_quantizable(spec):
        return T.F32, None
    want = _mix_q4_k_m(spec, n_layers, n_experts, tied) if qtype == "Q4_K_M" else base
    n_cols = spec.shape[-1]
    got = want
    if n_cols % GGML_QUANT_SIZES[got][0]:
        got = _FALLBACK.get(got, T.F16)
        if n_cols % GGML_QUANT_SIZES[got][0]:
            got = T.F16
        return got, f"rows of {n_cols} are not a multiple of the {want.name} block: {want.name} -> {got.name}"
    return got, None
