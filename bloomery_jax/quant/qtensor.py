"""QTensor: a weight kept as its GGUF blocks on the device, dequantized inside the jitted step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from .dequant import dequantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A tensor in a ggml block format.

    ``data`` holds exactly the file's bytes: uint8 ``[*shape[:-1], row_bytes]`` for block
    formats, or the plain dtype (f32, f16; bf16 as uint16 bits) with ``shape``. ``qtype`` and
    ``shape`` are static, so a QTensor is a pytree leaf-carrier that jit treats by its type.
    """

    data: jax.Array
    qtype: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_numpy(cls, data: np.ndarray, qtype, shape) -> "QTensor":
        qtype = T(qtype)
        if qtype == T.BF16:
            data = np.asarray(data).view(np.uint16)
        return cls(jnp.asarray(data), int(qtype), tuple(int(s) for s in shape))

    @classmethod
    def from_tensor_info(cls, info) -> "QTensor":
        return cls.from_numpy(info.data, info.qtype, info.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self.data, self.qtype, self.shape).astype(dtype)

    @property
    def nbytes(self) -> int:
        return int(self.data.size * self.data.dtype.itemsize)

    @property
    def type_name(self) -> str:
        return T(self.qtype).name
