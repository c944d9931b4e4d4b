"""Reading GGUF files: typed metadata and a validated, zero-copy tensor table.

Parsing is the `gguf` package's; this module makes it safe on untrusted files. Every read is
bounds-checked against the file size, every tensor's type, shape, byte size, alignment and
extent are checked before a view of its data is taken, and every failure is a
:class:`~bloomery_jax.errors.GGUFError` naming the file and the tensor or key at fault.

Shapes are given in NumPy order (row-major, outermost first): ggml's ``ne = [K, N]`` is
``shape = (N, K)`` here, so a weight ``[N, K]`` maps ``K`` inputs to ``N`` outputs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from .errors import GGUFError, UnsupportedArchitectureError

# ggml types whose data is a plain NumPy dtype; everything else is blocks of bytes.
PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.F64: np.dtype(np.float64),
    GGMLQuantizationType.I8: np.dtype(np.int8),
    GGMLQuantizationType.I16: np.dtype(np.int16),
    GGMLQuantizationType.I32: np.dtype(np.int32),
    GGMLQuantizationType.I64: np.dtype(np.int64),
}

MAX_DIMS = 4  # GGML_MAX_DIMS


class _TruncatedRead(Exception):
    """Internal: a read past the end of the file, turned into a GGUFError by the caller."""

    def __init__(self, offset: int, size: int, file_size: int):
        super().__init__(f"needs bytes {offset}..{offset + size} but the file has {file_size}")


class _CheckedReader(GGUFReader):
    """GGUFReader whose reads never run past the end and whose tensors are validated."""

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        size = np.dtype(dtype).itemsize * count
        if offset < 0 or count < 0 or offset + size > len(self.data):
            raise _TruncatedRead(int(offset), int(size), len(self.data))
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        self.tensor_problems: list[tuple[str, str]] = []
        for field in fields:
            problem = _tensor_info_problem(field, start_offs, self.alignment, len(self.data))
            if problem is not None:
                name = bytes(field.parts[1]).decode("utf-8", errors="replace")
                raise GGUFError(self._path, problem, tensor=name)
        super()._build_tensors(start_offs, fields)

    def __init__(self, path):
        self._path = path
        super().__init__(path, mode="r")


def _tensor_info_problem(field: ReaderField, data_start: int, alignment: int, file_size: int) -> str | None:
    """Why a tensor-info record is unusable, or None when it is fine."""
    _name_len, _name, n_dims, dims, raw_type, offset = field.parts
    n_dims, raw_type, offset = int(n_dims[0]), int(raw_type[0]), int(offset[0])
    if not 1 <= n_dims <= MAX_DIMS:
        return f"has {n_dims} dimensions; ggml allows 1 to {MAX_DIMS}"
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        return f"has unknown ggml type {raw_type}"
    if qtype not in GGML_QUANT_SIZES:
        return f"has ggml type {qtype.name} of unknown block size"
    ne = [int(d) for d in dims]
    if any(d <= 0 for d in ne):
        return f"has a non-positive dimension in ne={ne}"
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if ne[0] % block_elems:
        return f"row length {ne[0]} is not a multiple of the {qtype.name} block size {block_elems}"
    n_elems = int(np.prod(ne, dtype=np.uint64)) if max(ne) < 2**62 else 2**63
    n_bytes = n_elems // block_elems * block_bytes
    if offset % alignment:
        return f"data offset {offset} is not aligned to {alignment}"
    start = data_start + offset
    if start + n_bytes > file_size:
        return (
            f"data of {n_bytes} bytes at offset {start} runs past the end of the file "
            f"({file_size} bytes; truncated file?)"
        )
    return None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    Attributes:
      name: the GGUF (llama.cpp) tensor name, e.g. ``blk.3.ffn_gate_exps.weight``.
      qtype: its ggml type.
      shape: logical shape in NumPy order (ggml ``ne`` reversed).
      data: a read-only view of its bytes in the memory-mapped file: the plain dtype for
        F32/F16/integer types, else uint8 ``[*shape[:-1], row_bytes]``.
      offset: absolute byte offset of the data in the file.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A memory-mapped GGUF file: ``metadata`` (key → Python value) and ``tensors`` (name → TensorInfo)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GGUFError(self.path, "no such file")
        if os.path.getsize(self.path) < 24:
            raise GGUFError(self.path, "file too small to be GGUF (truncated?)")
        try:
            reader = _CheckedReader(self.path)
        except GGUFError:
            raise
        except _TruncatedRead as e:
            raise GGUFError(self.path, f"truncated header: a read {e}") from None
        except (ValueError, KeyError, UnicodeDecodeError, IndexError, OverflowError, MemoryError) as e:
            raise GGUFError(self.path, _describe_reader_error(e)) from None
        self.version = int(reader.fields["GGUF.version"].parts[0][0])
        self.alignment = int(reader.alignment)
        self.data_offset = int(reader.data_offset)
        self.metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = _field_value(field)
            except UnicodeDecodeError:
                raise GGUFError(self.path, "string value is not valid UTF-8", key=name) from None
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            qtype = GGMLQuantizationType(t.tensor_type)
            self.tensors[t.name] = TensorInfo(
                name=t.name,
                qtype=qtype,
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                data=t.data,
                offset=int(t.data_offset),
            )
        self._reader = reader  # keeps the memmap alive

    # --- metadata -------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(self.path, "must be a string", key="general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """The value of a required key, checked against ``kind`` (int also accepts bool-free ints)."""
        if key not in self.metadata:
            raise GGUFError(self.path, "required metadata key is missing", key=key)
        value = self.metadata[key]
        if kind is not None and not _is_kind(value, kind):
            raise GGUFError(self.path, f"expected {_kind_name(kind)}, found {type(value).__name__}", key=key)
        return value

    def arch_key(self, suffix: str, kind=None, default: Any = ...) -> Any:
        """``{architecture}.{suffix}``, required unless a default is given."""
        key = f"{self.architecture}.{suffix}"
        if default is not ... and key not in self.metadata:
            return default
        return self.require(key, kind)

    # --- tensors --------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(self.path, "required tensor is missing", tensor=name) from None

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.tensors)} tensors)"


def check_architecture(gf: GGUFFile, supported: list[str] | tuple[str, ...]) -> str:
    arch = gf.architecture
    if arch not in supported:
        raise UnsupportedArchitectureError(
            gf.path,
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(supported))})",
            key="general.architecture",
        )
    return arch


def _field_value(field: ReaderField) -> Any:
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1] if len(field.types) > 1 else None
        if sub is None:  # empty array
            return []
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if sub == GGUFValueType.ARRAY:
            raise ValueError("nested arrays are not supported")
        # Numeric arrays: one contiguous NumPy array (vocab scores, token types, …).
        return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    value = field.parts[-1][0]
    if main == GGUFValueType.BOOL:
        return bool(value)
    if main in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value)
    return int(value)


def _is_kind(value, kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    if float in kinds and isinstance(value, int):
        return True
    return isinstance(value, kinds)


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _describe_reader_error(e: Exception) -> str:
    msg = str(e)
    if "magic" in msg.lower():
        return "not a GGUF file (bad magic)"
    if "version" in msg.lower():
        return f"unsupported GGUF version: {msg}"
    if isinstance(e, KeyError):
        return f"duplicate metadata key: {msg}"
    if "field type" in msg.lower():
        return f"unknown metadata value type: {msg}"
    return f"malformed GGUF: {type(e).__name__}: {msg}"
