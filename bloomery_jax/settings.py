"""Run-time settings chosen in gin config files (``configs/*.gin``) and ``--gin_param`` overrides.

``configs/base.gin`` holds the defaults; each model family has a small file that includes it
and overrides what differs. Settings are plain data handed to the engine; nothing here is
read inside a jitted function.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import gin

from .errors import ConfigError

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
KERNELS = ("reference", "pallas", "pallas-tf32", "pallas-qtiles", "pallas-bf16", "pallas-q8", "pallas-q8-bf16", "auto")  # auto: pallas-q8-bf16 on a GPU (models.loader.resolve_kernels)
KV_DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("xla", "pallas", "auto")  # attention; auto: pallas on a GPU where the model has it (load_model)
ROUTING = ("xla", "pallas", "pallas-tickets", "auto")  # MoE routing; auto: as attention
BRIDGES = ("callback", "ffi", "auto")  # the host-expert bridge; auto: ffi on a GPU (models.loader.resolve_bridge)
WEIGHT_FORMS = ("blocks", "f32", "auto")  # card weights (models.loader.load_model)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    max_context: int = 4096  # tokens per sequence in the KV cache
    ubatch: int = 512  # prefill tokens per step
    parallel: int = 1  # sequences decoded together
    kernels: str = "auto"  # reference: jnp dequantize+matmul; pallas: GPU kernels; auto: pallas-q8-bf16 on a GPU
    placement: str = "card"  # placement rule string (see bloomery_jax.placement)
    kv_dtype: str = "float32"
    weights: str = "auto"  # card weights: blocks | f32 | auto (models.loader.load_model)
    attention: str = "auto"  # xla (jnp) | pallas (kernels on the cache buffer) | auto (pallas on a GPU)
    bridge: str = "auto"  # host experts: callback (jax.pure_callback) | ffi (XLA FFI custom call) | auto
    # MoE routing: xla (jnp softmax + top-k) | pallas (one kernel) | pallas-tickets (at decode in the
    # router's launch, o and down add x, attention in one launch: pallas.tickets; not yet measured on a card) | auto (pallas on a GPU)
    routing: str = "auto"
    decode_block: int = 0  # decode steps per device call while only generating; 0: 8 on a GPU, else 1

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ConfigError(f"RuntimeSettings.kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.weights not in WEIGHT_FORMS:
            raise ConfigError(f"RuntimeSettings.weights must be one of {WEIGHT_FORMS}, got {self.weights!r}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"RuntimeSettings.attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.routing not in ROUTING:
            raise ConfigError(f"RuntimeSettings.routing must be one of {ROUTING}, got {self.routing!r}")
        if self.bridge not in BRIDGES:
            raise ConfigError(f"RuntimeSettings.bridge must be one of {BRIDGES}, got {self.bridge!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"RuntimeSettings.kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        for name in ("max_context", "ubatch", "parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"RuntimeSettings.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.decode_block, int) or self.decode_block < 0:
            raise ConfigError(f"RuntimeSettings.decode_block must be 0 (the device's default) or a positive "
                              f"integer, got {self.decode_block!r}")
        if self.ubatch > 4096:
            raise ConfigError(f"RuntimeSettings.ubatch must be at most 4096, got {self.ubatch}")


def load_settings(config_files: Sequence[str] = (), bindings: Sequence[str] = ()) -> RuntimeSettings:
    """Parse gin files and bindings (``RuntimeSettings.ubatch = 1024``) into settings.

    Bad files or bindings raise ConfigError naming what gin could not parse.
    """
    from . import placement  # noqa: F401  (registers the rule classes gin configs may name)

    gin.clear_config()
    for path in config_files:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        # `include 'base.gin'` resolves next to the including file, then in configs/.
        gin.add_config_file_search_path(os.path.dirname(os.path.abspath(path)))
    gin.add_config_file_search_path(CONFIG_DIR)
    root = logging.getLogger()
    root.addFilter(_quiet_include_probe)
    try:
        gin.parse_config_files_and_bindings(list(config_files), list(bindings), skip_unknown=False)
        return RuntimeSettings()
    except ConfigError:
        raise
    except Exception as e:  # gin raises ValueError, SyntaxError, KeyError …
        raise ConfigError(f"bad gin config: {type(e).__name__}: {e}".splitlines()[0]) from None
    finally:
        root.removeFilter(_quiet_include_probe)
        gin.clear_config()


def _quiet_include_probe(record: logging.LogRecord) -> bool:
    """Drop gin's "Path not found: base.gin" error line: gin logs it when an include is not
    relative to the working directory, before it finds the file on the search paths (a missing
    include still raises, and load_settings turns that into a ConfigError)."""
    return not record.getMessage().startswith("Path not found:")
