"""Open a GGUF model: architecture module, Config, checked tensor table, device parameters.

Contract: ``load_model(path)`` returns a :class:`Model` whose ``params`` map every GGUF
tensor name to a :class:`~bloomery_jax.quant.QTensor` holding the file's raw blocks on the
default device (no dequantized copy). Every problem is a GGUFError naming the file and the
tensor or key: another architecture, a missing or mis-shaped tensor, a ggml type we cannot
dequantize.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType

import jax
import numpy as np
from gguf import GGMLQuantizationType as T

from ..errors import GGUFError
from ..gguf_file import GGUFFile
from ..quant import SUPPORTED_TYPES, QTensor
from .registry import module_for_file
from .spec import check_tensors


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: ``module.forward(params, cfg, tokens, positions, cache)`` runs it."""

    gguf: GGUFFile
    cfg: object  # the architecture's Config (frozen, hashable)
    params: dict[str, QTensor]
    module: ModuleType

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


def load_model(path: str | os.PathLike, *, device=None) -> Model:
    """Open ``path``, check it against its architecture, and put its tensors on ``device``.

    Args:
      path: a GGUF file.
      device: a jax Device; None = the default device.
    Returns:
      the Model.
    """
    gf = GGUFFile(path)
    module = module_for_file(gf)  # clear error for architectures we do not implement
    cfg = module.Config.from_gguf(gf)
    check_tensors(gf, module.tensor_specs(cfg))
    check_types(gf)
    device = device or jax.devices()[0]
    params = {}
    for info in gf:
        data = info.data.view(np.uint16) if info.qtype == T.BF16 else info.data  # bf16 travels as its bits
        params[info.name] = QTensor(jax.device_put(data, device), int(info.qtype), tuple(info.shape))
    return Model(gguf=gf, cfg=cfg, params=params, module=module)
