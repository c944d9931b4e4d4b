"""GGML block formats: geometry, jnp dequantization (bit-exact with gguf), NumPy quantizers.

    from bloomery_jax.quant import QTensor, dequantize, quantize
    w = QTensor.from_tensor_info(info)       # raw blocks on the device, no copy of values
    x @ w.dequantize().T                     # reference quantized matmul (f32)
"""

from .formats import SUPPORTED_TYPES, block_geometry, row_bytes
from .dequant import dequantize
from .qtensor import QTensor
from .quantize import QUANTIZE_TYPES, quantize
from .quantize_pool import QuantizePool

__all__ = ["SUPPORTED_TYPES", "QUANTIZE_TYPES", "block_geometry", "row_bytes", "dequantize", "quantize",
           "QuantizePool", "QTensor"]
