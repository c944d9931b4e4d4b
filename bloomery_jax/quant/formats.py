"""Block geometry of the ggml types we read: elements and bytes per block."""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

# The types dequantize() handles; anything else is refused at load with the tensor's name.
SUPPORTED_TYPES = frozenset({
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS,
})


# Byte offsets of the f16 scale / min fields inside one block (ggml's block structs).
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}


def block_geometry(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    return GGML_QUANT_SIZES[T(qtype)]


def row_bytes(qtype, n: int) -> int:
    """Bytes of a row of ``n`` elements (``n`` must be a multiple of the block size)."""
    elems, nbytes = block_geometry(qtype)
    if n % elems:
        raise ValueError(f"row of {n} elements is not a multiple of the {T(qtype).name} block size {elems}")
    return n // elems * nbytes
