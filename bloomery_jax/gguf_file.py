"""Reading GGUF files: typed metadata and a validated, zero-copy tensor table.

The header is parsed here (not by gguf-py's reader) so that untrusted files are safe: every
read is bounds-checked against the file size before it happens, counts are checked against
what the file could possibly hold, keys, strings and tensor names must be UTF-8, and every
tensor's type, shape, byte size, alignment and data extent are checked before a view of its
data is taken. Every failure is a :class:`~bloomery_jax.errors.GGUFError` naming the file and
the key or tensor at fault; nothing else escapes (a bug aside).

The data layout rule is ggml's: tensor data lies in the data section at aligned offsets, each
tensor's extent (up to the next tensor's data, or the end of the file) holds exactly its bytes
plus alignment padding. A shape that needs more bytes (overlap) or fewer (a gap) is refused.

Shapes are given in NumPy order (row-major, outermost first): ggml's ``ne = [K, N]`` is
``shape = (N, K)`` here, so a weight ``[N, K]`` maps ``K`` inputs to ``N`` outputs.
Only little-endian files (the only kind llama.cpp writes) are read.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

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
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_MAGIC = b"GGUF"

V = GGUFValueType
# scalar value type -> (struct format, NumPy dtype)
_SCALARS = {
    V.UINT8: ("<B", "<u1"), V.INT8: ("<b", "<i1"), V.UINT16: ("<H", "<u2"), V.INT16: ("<h", "<i2"),
    V.UINT32: ("<I", "<u4"), V.INT32: ("<i", "<i4"), V.FLOAT32: ("<f", "<f4"), V.BOOL: ("<?", "<u1"),
    V.UINT64: ("<Q", "<u8"), V.INT64: ("<q", "<i8"), V.FLOAT64: ("<d", "<f8"),
}


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


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; errors name what was being read."""

    def __init__(self, path: str, buf: memoryview):
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0

    def need(self, n: int, what: str, **where) -> int:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(self.path, f"truncated header: {what} needs bytes {self.pos}..{self.pos + n} "
                                       f"but the file has {self.size}", **where)
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: str, what: str, **where):
        start = self.need(struct.calcsize(fmt), what, **where)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def raw_string(self, what: str, **where) -> bytes:
        n = self.scalar("<Q", f"the length of {what}", **where)
        start = self.need(n, what, **where)
        return bytes(self.buf[start:start + n])

    def text(self, what: str, **where) -> str:
        raw = self.raw_string(what, **where)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(self.path, f"{what} is not valid UTF-8", **where) from None


def _read_value(cur: _Cursor, vtype: int, key: str, *, in_array: bool = False) -> Any:
    try:
        vtype = V(vtype)
    except ValueError:
        raise GGUFError(cur.path, f"unknown metadata value type {vtype}", key=key) from None
    if vtype in _SCALARS:
        value = cur.scalar(_SCALARS[vtype][0], "a metadata value", key=key)
        return float(value) if vtype in (V.FLOAT32, V.FLOAT64) else value
    if vtype == V.STRING:
        return cur.text("a string value", key=key)
    if in_array:
        raise GGUFError(cur.path, "nested arrays are not supported", key=key)
    etype = cur.scalar("<I", "an array element type", key=key)
    count = cur.scalar("<Q", "an array length", key=key)
    try:
        etype = V(etype)
    except ValueError:
        raise GGUFError(cur.path, f"unknown array element type {etype}", key=key) from None
    if count == 0:
        return []
    if etype in _SCALARS:  # numeric arrays: one NumPy array (vocab scores, token types, ...)
        dtype = np.dtype(_SCALARS[etype][1])
        start = cur.need(count * dtype.itemsize, f"an array of {count} {etype.name}", key=key)
        arr = np.frombuffer(cur.buf, dtype, count, start)
        return arr.astype(bool) if etype == V.BOOL else arr.astype(dtype.newbyteorder("="))
    if etype == V.STRING:
        if count > (cur.size - cur.pos) // 8:  # each string needs at least its 8-byte length
            raise GGUFError(cur.path, f"array of {count} strings cannot fit in the file (truncated?)", key=key)
        return [cur.text(f"string {i} of the array", key=key) for i in range(count)]
    raise GGUFError(cur.path, "nested arrays are not supported", key=key)


def _tensor_layout(path, infos, data_start, alignment, file_size) -> None:
    """Check offsets, alignment and extents of the tensor infos (see the module docstring)."""
    for name, qtype, shape, offset, n_bytes in infos:
        if offset % alignment:
            raise GGUFError(path, f"data offset {offset} is not aligned to {alignment}", tensor=name)
        start = data_start + offset
        if start + n_bytes > file_size:
            raise GGUFError(path, f"data of {n_bytes} bytes at offset {start} runs past the end of the file "
                                  f"({file_size} bytes; truncated file?)", tensor=name)
    by_offset = sorted(infos, key=lambda t: t[3])
    for i, (name, qtype, shape, offset, n_bytes) in enumerate(by_offset):
        nxt = by_offset[i + 1] if i + 1 < len(by_offset) else None
        extent = (nxt[3] if nxt else file_size - data_start) - offset
        what = f"shape {list(shape)} of {qtype.name} needs {n_bytes} bytes"
        if n_bytes > extent:
            raise GGUFError(path, f"{what} but its data overlaps tensor {nxt[0]!r} after {extent} bytes",
                            tensor=name)
        padded = -(-n_bytes // alignment) * alignment
        if extent > padded:
            after = f"before tensor {nxt[0]!r}" if nxt else "to the end of the file"
            raise GGUFError(path, f"{what} but its data extent is {extent} bytes {after} "
                                  "(shape and data disagree)", tensor=name)


def _tensor_info(cur: _Cursor, index: int):
    """One tensor-info record -> (name, qtype, NumPy-order shape, offset, n_bytes)."""
    where = {"tensor": f"#{index}"}
    raw = cur.raw_string(f"the name of tensor #{index}", **where)
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise GGUFError(cur.path, "tensor name is not valid UTF-8",
                        tensor=raw.decode("utf-8", errors="replace")) from None
    where = {"tensor": name}
    n_dims = cur.scalar("<I", "the dimension count", **where)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(cur.path, f"has {n_dims} dimensions; ggml allows 1 to {MAX_DIMS}", **where)
    ne = [cur.scalar("<Q", "a dimension", **where) for _ in range(n_dims)]
    raw_type = cur.scalar("<I", "the ggml type", **where)
    offset = cur.scalar("<Q", "the data offset", **where)
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GGUFError(cur.path, f"has unknown ggml type id {raw_type}", **where) from None
    if 0 in ne:
        raise GGUFError(cur.path, f"has a zero dimension in ne={ne}", **where)
    if any(d >= 2**62 for d in ne) or int(np.prod([float(d) for d in ne])) >= 2**62:
        raise GGUFError(cur.path, f"dimensions ne={ne} are impossibly large", **where)
    if ne[0] % block_elems:
        raise GGUFError(cur.path, f"row length {ne[0]} is not a multiple of the {qtype.name} block size "
                                  f"{block_elems}", **where)
    n_bytes = int(np.prod(ne, dtype=np.int64)) // block_elems * block_bytes
    return name, qtype, tuple(reversed(ne)), offset, n_bytes


class GGUFFile:
    """A memory-mapped GGUF file: ``metadata`` (key → Python value) and ``tensors`` (name → TensorInfo).

    Attributes:
      metadata: key → value (ints, floats, bools, str; numeric arrays as NumPy arrays, string
        arrays as lists of str).
      value_types: key → the GGUFValueType the file stores it as (ARRAY for arrays).
      tensors: name → TensorInfo, in file order.
      version, alignment, data_offset: header facts.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GGUFError(self.path, "no such file")
        size = os.path.getsize(self.path)
        if size < 24:
            raise GGUFError(self.path, f"file of {size} bytes is too small to be GGUF (truncated?)")
        self._map = np.memmap(self.path, mode="r")
        cur = _Cursor(self.path, memoryview(self._map))
        magic = bytes(cur.buf[0:4])
        if magic != _MAGIC:
            raise GGUFError(self.path, f"not a GGUF file (magic {magic!r}, expected {_MAGIC!r})")
        cur.pos = 4
        self.version = cur.scalar("<I", "the version")
        if self.version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file?)" if swapped in SUPPORTED_VERSIONS else ""
            raise GGUFError(self.path, f"unsupported GGUF version {self.version}{hint}; "
                                       f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}")
        n_tensors = cur.scalar("<Q", "the tensor count")
        n_kv = cur.scalar("<Q", "the metadata count")
        # No check of the counts up front: every record consumes >= 13 bytes and every read is
        # bounds-checked, so a bogus count ends at the first read it makes impossible, and the
        # error names the key or tensor being read there.
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, GGUFValueType] = {}
        for i in range(n_kv):
            raw = cur.raw_string(f"metadata key #{i}", key=f"#{i}")
            try:
                key = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise GGUFError(self.path, "metadata key is not valid UTF-8",
                                key=raw.decode("utf-8", errors="replace")) from None
            if key in self.metadata:
                raise GGUFError(self.path, "duplicate metadata key", key=key)
            vtype = cur.scalar("<I", "a metadata value type", key=key)
            self.metadata[key] = _read_value(cur, vtype, key)
            self.value_types[key] = V(vtype)
        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a = self.metadata["general.alignment"]
            if self.value_types["general.alignment"] != V.UINT32 or a == 0 or a & (a - 1):
                raise GGUFError(self.path, f"must be a UINT32 power of two, found {a!r}", key="general.alignment")
            self.alignment = int(a)
        infos = []
        names = set()
        for i in range(n_tensors):
            info = _tensor_info(cur, i)
            if info[0] in names:
                raise GGUFError(self.path, "duplicate tensor name", tensor=info[0])
            names.add(info[0])
            infos.append(info)
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        _tensor_layout(self.path, infos, self.data_offset, self.alignment, size)
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, shape, offset, n_bytes in infos:
            start = self.data_offset + offset
            view = self._map[start:start + n_bytes]
            if qtype in PLAIN_DTYPES:
                view = view.view(PLAIN_DTYPES[qtype]).reshape(shape)
            else:
                view = view.reshape(*shape[:-1], -1)  # [..., row_bytes]
            self.tensors[name] = TensorInfo(name, qtype, shape, view, start)

    # --- metadata -------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.require("general.architecture", str)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """The value of a required key, checked against ``kind`` (int also accepts bool-free ints)."""
        if key not in self.metadata:
            raise GGUFError(self.path, "required metadata key is missing", key=key)
        value = self.metadata[key]
        if kind is not None and not _is_kind(value, kind):
            raise GGUFError(self.path, f"expected {_kind_name(kind)}, found {_type_name(value)}", key=key)
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


def _type_name(value) -> str:
    return "array" if isinstance(value, (list, np.ndarray)) else type(value).__name__
