"""Streaming GGUF writing: tensor infos first, then each tensor's data in chunks.

Contract: :class:`GGUFStream` wraps ``gguf.GGUFWriter`` for the header, metadata and tensor
infos (so the layout is exactly what gguf-py and llama.cpp expect), then takes each tensor's
bytes in as many chunks as the caller likes, in the order the infos were declared, checking
that each tensor gets exactly its declared byte count. Memory use is one chunk, not one file.

Metadata values are typed the way llama.cpp's loader wants them: non-negative ints as UINT32
(UINT64 when larger), negative ints as INT32, floats as FLOAT32, bools, strings, and lists of
strings / ints (INT32) / floats (FLOAT32). ``tokenizer.*`` entries from ``synth.vocab`` are
written by that module's own ``add_to_writer`` so their types follow its table.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFValueType as V, GGUFWriter

from ..errors import ConfigError
from . import vocab


def _add_value(w: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        value = int(value)
        if value < 0:
            w.add_int32(key, value)
        else:
            w.add_uint32(key, value) if value < 2**32 else w.add_uint64(key, value)
    elif isinstance(value, (float, np.floating)):
        w.add_float32(key, float(value))
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        if not items:
            raise ConfigError(f"metadata {key!r}: empty arrays are not written")
        if all(isinstance(v, str) for v in items):
            w.add_array(key, items)
        elif all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items):
            w.add_key_value(key, [int(v) for v in items], V.ARRAY, sub_type=V.INT32)
        elif all(isinstance(v, (int, float, np.integer, np.floating)) for v in items):
            w.add_key_value(key, [float(v) for v in items], V.ARRAY, sub_type=V.FLOAT32)
        else:
            raise ConfigError(f"metadata {key!r}: mixed array element types")
    else:
        raise ConfigError(f"metadata {key!r}: no GGUF type for {type(value).__name__}")


def tensor_nbytes(shape: tuple[int, ...], qtype: T) -> int:
    elems, nbytes = GGML_QUANT_SIZES[T(qtype)]
    return int(np.prod(shape)) // elems * nbytes


class GGUFStream:
    """One GGUF file written tensor by tensor.

    Usage: ``s = GGUFStream(path, arch, metadata, tokenizer)``; ``s.add_tensor(...)`` for every
    tensor; ``s.begin()``; for each tensor in order, ``s.write(chunk)`` one or more times, then
    ``s.end_tensor()``; ``s.close()``.
    """

    def __init__(self, path: str | os.PathLike, arch: str, metadata: dict[str, Any],
                 tokenizer: dict[str, Any], alignment: int = 32):
        self.path = os.fspath(path)
        self.alignment = alignment
        self._w = GGUFWriter(self.path, arch)  # writes general.architecture itself
        self._w.data_alignment = alignment
        for key, value in metadata.items():
            _add_value(self._w, key, value)
        vocab.add_to_writer(self._w, tokenizer)
        self._infos: list[tuple[str, int]] = []
        self._cur = 0
        self._written = 0
        self._fout = None

    def add_tensor(self, name: str, shape: tuple[int, ...], qtype: T) -> None:
        """Declare a tensor (logical NumPy-order shape) before :meth:`begin`."""
        nbytes = tensor_nbytes(shape, qtype)
        self._w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=T(qtype))
        self._infos.append((name, nbytes))

    def begin(self) -> None:
        self._w.write_header_to_file()
        self._w.write_kv_data_to_file()
        self._w.write_ti_data_to_file()
        self._fout = self._w.fout[0]
        self._pad()

    def _pad(self) -> None:
        pos = self._fout.tell()
        self._fout.write(b"\0" * (-pos % self.alignment))

    def write(self, chunk: np.ndarray) -> None:
        """Append raw bytes (any dtype, C order) to the current tensor."""
        chunk = np.ascontiguousarray(chunk)
        self._fout.write(memoryview(chunk).cast("B"))
        self._written += chunk.nbytes

    def end_tensor(self) -> None:
        name, nbytes = self._infos[self._cur]
        if self._written != nbytes:
            raise RuntimeError(f"tensor {name!r}: wrote {self._written} bytes, declared {nbytes}")
        self._pad()
        self._cur += 1
        self._written = 0

    def close(self) -> None:
        if self._fout is not None and self._cur != len(self._infos):
            raise RuntimeError(f"{self.path}: closed after {self._cur} of {len(self._infos)} tensors")
        self._w.close()

    def abort(self) -> None:
        """Close and delete a file whose writing failed (a half-written GGUF is worse than none)."""
        self._w.close()
        if os.path.exists(self.path):
            os.remove(self.path)
