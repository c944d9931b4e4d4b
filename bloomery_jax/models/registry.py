"""Architecture name (GGUF ``general.architecture``) → model module.

Each module provides ``Config`` (``Config.from_gguf(gf)``), ``tensor_specs(cfg)`` and
``forward``. An unknown name fails loudly, listing the supported ones.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UnsupportedArchitectureError

# GGUF architecture string → module under bloomery_jax.models
ARCHITECTURES = {
    "qwen3moe": "qwen3moe",
    "gemma3": "gemma3",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def arch_module(arch: str, path: str = "<model>") -> ModuleType:
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            path,
            f"architecture {arch!r} is not supported (supported: {', '.join(supported_architectures())})",
            key="general.architecture",
        )
    return importlib.import_module(f"{__package__}.{ARCHITECTURES[arch]}")


def module_for_file(gf) -> ModuleType:
    return arch_module(gf.architecture, gf.path)
