"""Load-time repacking of GGUF weight blocks into the layouts the Pallas GEMV kernels read.

Contract: ``repack(raw, qtype, shape, layout)`` rearranges the bits of a Q8_0 / Q4_K / Q5_K / Q6_K
tensor ``[..., N, K]`` (raw uint8 ``[..., N, row_bytes]``) without changing a single value:
the integer quants, the sub-block scales and mins and the f16 super-scales are the file's, only
moved, and every array together holds exactly the file's byte count ("rows" excepted: it
unpacks the K-quants' 12 scale bytes to 16).
``dequantize_packed(pw)`` rebuilds the float32 values with ggml's arithmetic and is bit-exact
with ``quant.dequantize`` on the original blocks (tests/test_repack.py checks it).
``repack_on_device`` computes the "planes" and "ggml" layouts on the device holding the bytes.

The plane layout ("planes"). A kernel works on a chunk of C elements of one row at a time
(C = 256 for the K-quants, 128 for Q8_0). Inside a chunk, element ``p * W + j`` (plane p, column j) sits in
bit field p of the 32-bit word j: the chunk's W words unpack with one shift and mask per plane
into a ``[rows, W]`` tile whose W consecutive elements share one scale, so a kernel needs no
reshape or gather, only broadcasts. Per-chunk scales are stored ``[..., chunks, fields, N]``
(rows last) so a tile of rows reads them as one contiguous vector.

  Q8_0 (W=32, 4 planes of 8 bits; plane p of chunk c is ggml block 4c + p):
      qs int32 [..., N, K/4]        d f16 [..., K/32, N]
  Q4_K (W=32, 8 planes of 4 bits; plane p is sub-block p):
      qs int32 [..., N, K/8]        sc int32 [..., K/256, 3, N]  (the 12 packed 6-bit scale/min
                                    bytes, little-endian)        dm f16 [..., K/256, 2, N] (d, dmin)
  Q5_K: as Q4_K, plus qh uint8 [..., N, K/8]: bit p of byte j is the 5th bit of plane p,
      column j (ggml's own qh bytes, unchanged).
  Q6_K (each 128-element half is a chunk of W=16 columns and 8 planes of 16 = its sub-blocks):
      qs int32 [..., N, K/8]        low 4 bits, words (s, half, j)
      qh int32 [..., N, K/16]       high 2 bits of (half h, plane p, column j) at bit 16h + 2p of word (s, j)
      sc int32 [..., K/256, 4, N]   the 16 int8 sub-block scales, little-endian
      d  f16   [..., K/256, N]

The ggml layout ("ggml"). The quant bytes stay in the file's order, read as little-endian int32
words, row-major (byte k of word i is quant byte 4i + k of the row): each word holds 4
consecutive bytes of one sub-block, which is what a 4-way integer dot product (dp4a) wants.
The scale fields are the planes layout's, the same arrays.

  Q8_0:  qs int32 [..., N, K/4]   block b's 32 int8 quants are words 8b..8b+7;  d as planes
  Q4_K:  qs int32 [..., N, K/8]   each block's 128 qs bytes (block bytes 16:144), 32 words;
         byte 32s + l holds element 64s + l (low nibble) and 64s + 32 + l (high);  sc, dm as planes
  Q5_K:  as Q4_K with qs = block bytes 48:176, plus qh int32 [..., N, K/32]: the 32 qh bytes
         (block bytes 16:48), bit t of byte l the 5th bit of element 32t + l
  Q6_K:  qs int32 [..., N, K/8]   the 128 ql bytes (block bytes 0:128): per 128-element half h,
         byte 64h + l holds element 128h + l (low nibble) and 128h + 64 + l (high);
         qh int32 [..., N, K/16] the 64 qh bytes (block bytes 128:192): 2-bit field j of byte
         32h + l is the top of element 128h + 32j + l;  sc, d as planes

The "rows" layout (``_REPACK_ROWS``) is read by ``pallas.qgemv_rows`` only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T

from .formats import block_geometry

PACKABLE = (T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
MAGIC = 0x4B000000  # f32 bits of 2^23: OR-ing an integer below 2^23 into it gives 2^23 + q exactly


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight ``[..., N, K]`` in one of ``LAYOUTS`` (see the module docstring for each field).

    ``qh`` and ``sc`` are None for formats that have no such field. ``qtype`` and ``shape``
    (the logical shape) are static, so jit specializes on them.
    """

    qs: jax.Array
    d: jax.Array
    sc: jax.Array | None = None
    qh: jax.Array | None = None
    qtype: int = dataclasses.field(default=0, metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    layout: str = dataclasses.field(default="planes", metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves(self)
        return int(sum(a.size * a.dtype.itemsize for a in leaves))

    @property
    def type_name(self) -> str:
        return T(self.qtype).name


# ----------------------------------------------------------------------------------- NumPy side


class _NumpyOps:
    """Array primitives of the repack, NumPy flavour (load-time, any host)."""

    concat = staticmethod(np.concatenate)

    @staticmethod
    def pack_planes(q, bits: int):
        """OR plane p of ``q`` into bit field p: uint [..., P, W] (values < 2**bits) -> int32 [..., W]."""
        planes = q.shape[-2]
        assert planes * bits <= 32, (planes, bits)
        shifts = (np.arange(planes, dtype=np.uint32) * bits)[:, None]  # [P, 1]
        words = np.bitwise_or.reduce(q.astype(np.uint32) << shifts, axis=-2)
        return words.view(np.int32)

    @staticmethod
    def rows_last(a, lead: int):
        """[*lead, N, chunks, *fields] -> [*lead, chunks, *fields, N]: a row tile reads one vector."""
        return np.ascontiguousarray(np.moveaxis(a, lead, -1))

    @staticmethod
    def f16(b):
        """Little-endian f16 fields: uint8 [..., 2 * n] -> f16 [..., n]."""
        return np.ascontiguousarray(b).view("<f2")

    @staticmethod
    def u32(b):
        """Little-endian 32-bit words: uint8 [..., 4 * n] -> int32 [..., n]."""
        return np.ascontiguousarray(b).view("<i4")


class _JaxOps:
    """The same primitives in jnp, so a weight already on the card repacks there (the NumPy
    path runs at ~20-50 MB/s, minutes for a 17 GB model)."""

    concat = staticmethod(jnp.concatenate)

    @staticmethod
    def pack_planes(q, bits: int):
        planes = q.shape[-2]
        assert planes * bits <= 32, (planes, bits)
        shifts = (jnp.arange(planes, dtype=jnp.uint32) * bits)[:, None]  # [P, 1]
        words = jnp.sum(q.astype(jnp.uint32) << shifts, axis=-2, dtype=jnp.uint32)  # disjoint fields: sum == OR
        return jax.lax.bitcast_convert_type(words, jnp.int32)

    @staticmethod
    def rows_last(a, lead: int):
        return jnp.moveaxis(a, lead, -1)

    @staticmethod
    def f16(b):
        return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 2), jnp.float16)  # [..., n, 2] -> [..., n]

    @staticmethod
    def u32(b):
        return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 4), jnp.int32)  # [..., n, 4] -> [..., n]


def _nibble_pairs(qs, groups: int, width: int, xp=_NumpyOps):
    """ggml's 4-bit runs: uint8 [..., groups * width] -> [..., 2 * groups, width].

    Byte g * width + j holds element j of run 2g in its low nibble and of run 2g + 1 in its high one.
    """
    b = qs.reshape(*qs.shape[:-1], groups, 1, width)
    return xp.concat([b & 0x0F, b >> 4], axis=-2).reshape(*qs.shape[:-1], 2 * groups, width)


def _blocks(raw, qtype: T, shape: tuple[int, ...]):
    """Validated raw bytes as blocks: uint8 [..., N, row_bytes] -> [..., N, G, block_bytes]."""
    elems, nbytes = block_geometry(qtype)
    chunk = 128 if qtype == T.Q8_0 else 256
    if len(shape) < 2:
        raise ValueError(f"repack: {qtype.name} needs a matrix [..., N, K], got shape {shape}")
    k = shape[-1]
    if k % chunk:
        raise ValueError(f"repack: {qtype.name} rows of {k} elements are not a multiple of {chunk} "
                         f"(the GEMV kernels read {chunk}-element chunks)")
    if not isinstance(raw, jax.Array):
        raw = np.asarray(raw)
    want = (*shape[:-1], k // elems * nbytes)
    if raw.dtype != np.uint8 or raw.size != int(np.prod(want, dtype=np.int64)):
        raise ValueError(f"repack: {qtype.name} {shape} needs uint8 bytes {want}, got {raw.dtype} {raw.shape}")
    return raw.reshape(*shape[:-1], k // elems, nbytes)


# --- scale fields: the same arrays in the "planes" and "ggml" layouts


def _q8_0_scales(blocks, lead: int, xp=_NumpyOps) -> dict:
    # block: d (f16) | 32 int8
    *rows, nb, _ = blocks.shape
    d = xp.f16(blocks[..., 0:2]).reshape(*rows, nb)  # [..., N, K/32]
    return dict(d=xp.rows_last(d, lead))


def _k4_scales(blocks, lead: int, xp=_NumpyOps) -> dict:
    # block: d | dmin | scales[12] | ...
    dm = xp.f16(blocks[..., 0:4])  # [..., N, G, 2]
    sc = xp.u32(blocks[..., 4:16])  # [..., N, G, 3]
    return dict(sc=xp.rows_last(sc, lead), d=xp.rows_last(dm, lead))


def _q6_k_scales(blocks, lead: int, xp=_NumpyOps) -> dict:
    # block: ... | scales[16] (int8) | d (f16)
    *rows, g, _ = blocks.shape
    sc = xp.u32(blocks[..., 192:208])  # [..., N, G, 4]
    d = xp.f16(blocks[..., 208:210]).reshape(*rows, g)  # [..., N, G]
    return dict(sc=xp.rows_last(sc, lead), d=xp.rows_last(d, lead))


# --- "planes" quants


def _q8_0(blocks, lead: int, xp=_NumpyOps) -> dict:
    # 4 consecutive blocks form a chunk of 4 planes x 32 columns
    *rows, nb, _ = blocks.shape
    q = blocks[..., 2:34].reshape(*rows, nb // 4, 4, 32)  # [..., N, C, plane, j]
    qs = xp.pack_planes(q, 8).reshape(*rows, nb * 8)
    return dict(qs=qs, **_q8_0_scales(blocks, lead, xp))


def _k4_common(blocks, qs_bytes, lead: int, xp) -> dict:
    *rows, g, _ = blocks.shape
    q = _nibble_pairs(qs_bytes, 4, 32, xp)  # [..., N, G, 8, 32]: sub-block = plane
    qs = xp.pack_planes(q, 4).reshape(*rows, g * 32)
    return dict(qs=qs, **_k4_scales(blocks, lead, xp))


def _q4_k(blocks, lead: int, xp=_NumpyOps) -> dict:
    # block: d | dmin | scales[12] | qs[128]
    return _k4_common(blocks, blocks[..., 16:144], lead, xp)


def _q5_k(blocks, lead: int, xp=_NumpyOps) -> dict:
    # block: d | dmin | scales[12] | qh[32] | qs[128]
    *rows, g, _ = blocks.shape
    out = _k4_common(blocks, blocks[..., 48:176], lead, xp)
    out["qh"] = blocks[..., 16:48].reshape(*rows, g * 32)
    return out


def _q6_from_bytes(ql, qh, xp=_NumpyOps):
    """The 6-bit quants of Q6_K blocks in element order: ql [..., G, 128], qh [..., G, 64]
    (bytes, any integer dtype) -> [..., G, 256]."""
    *lead, g, _ = ql.shape
    ql = ql.reshape(*lead, g, 2, 64)
    qh = qh.reshape(*lead, g, 2, 1, 32)
    # per 128-element half: ql byte l holds elements l (low nibble) and l + 64 (high);
    # 2-bit field k of qh byte l holds the high bits of element 32 k + l
    low = _nibble_pairs(ql, 1, 64, xp).reshape(*lead, g, 2, 128)
    high = xp.concat([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2).reshape(*lead, g, 2, 128)
    return (low | (high << 4)).reshape(*lead, g, 256)


def _q6_values(blocks, xp=_NumpyOps):
    """The 6-bit quants of Q6_K blocks in element order: [..., G, 210] -> uint8 [..., G, 256]."""
    return _q6_from_bytes(blocks[..., 0:128], blocks[..., 128:192], xp)


def _q6_k(blocks, lead: int, xp=_NumpyOps) -> dict:
    # block: ql[128] | qh[64] | scales[16] (int8) | d (f16)
    *rows, g, _ = blocks.shape
    q = _q6_values(blocks, xp).reshape(*rows, g, 2, 8, 16)  # [..., G, half, plane, j]
    qs = xp.pack_planes(q & 15, 4).reshape(*rows, g * 32)  # words (s, h, j)
    high = (q >> 4).reshape(*rows, g, 16, 16)  # [..., G, h*8+p, j]
    qh_words = xp.pack_planes(high, 2).reshape(*rows, g * 16)  # words (s, j)
    return dict(qs=qs, qh=qh_words, **_q6_k_scales(blocks, lead, xp))


_REPACK = {T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


# --- "ggml" quants: the file's bytes as words, nothing moved within a row


def _words(blocks, start: int, stop: int, xp):
    """Bytes ``start:stop`` of every block as little-endian words, row-major:
    uint8 [..., N, G, block_bytes] -> int32 [..., N, G * (stop - start) / 4]."""
    *rows, g, _ = blocks.shape
    return xp.u32(blocks[..., start:stop]).reshape(*rows, g * ((stop - start) // 4))


def _ggml_q8_0(blocks, lead: int, xp=_NumpyOps) -> dict:
    return dict(qs=_words(blocks, 2, 34, xp), **_q8_0_scales(blocks, lead, xp))


def _ggml_q4_k(blocks, lead: int, xp=_NumpyOps) -> dict:
    return dict(qs=_words(blocks, 16, 144, xp), **_k4_scales(blocks, lead, xp))


def _ggml_q5_k(blocks, lead: int, xp=_NumpyOps) -> dict:
    return dict(qs=_words(blocks, 48, 176, xp), qh=_words(blocks, 16, 48, xp), **_k4_scales(blocks, lead, xp))


def _ggml_q6_k(blocks, lead: int, xp=_NumpyOps) -> dict:
    return dict(qs=_words(blocks, 0, 128, xp), qh=_words(blocks, 128, 192, xp), **_q6_k_scales(blocks, lead, xp))


_REPACK_GGML = {T.Q8_0: _ggml_q8_0, T.Q4_K: _ggml_q4_k, T.Q5_K: _ggml_q5_k, T.Q6_K: _ggml_q6_k}
_ON_DEVICE = {"planes": _REPACK, "ggml": _REPACK_GGML}  # the layouts repack_on_device builds


# --- "rows" layout: every field rows-first, each sub-block's quants in its own words, in order


def _natural_words(q: np.ndarray, bits: int) -> np.ndarray:
    """Quants in element order packed LSB-first: [..., E] -> int32 [..., E * bits / 32]."""
    per = 32 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)  # [..., words, per]
    return _NumpyOps.pack_planes(q.swapaxes(-1, -2), bits)


def _k4_fields(packed: np.ndarray) -> np.ndarray:
    """The 12 packed scale bytes -> uint8 [..., 2, 8]: 6-bit scales, then 6-bit mins."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return np.stack([sc, mn], axis=-2)


def _rows_q8_0(blocks: np.ndarray) -> dict:
    *rows, nb, _ = blocks.shape
    qs = _NumpyOps.u32(blocks[..., 2:34]).reshape(*rows, nb // 4, 4, 8)  # [..., N, C, block, word]
    return dict(qs=qs, d=_NumpyOps.f16(blocks[..., 0:2]).reshape(*rows, nb // 4, 4))


def _rows_k4(blocks: np.ndarray, qs_bytes: np.ndarray) -> dict:
    *rows, g, _ = blocks.shape
    q = _nibble_pairs(qs_bytes, 4, 32)  # [..., N, G, 8, 32]
    return dict(qs=_natural_words(q, 4), sc=_k4_fields(blocks[..., 4:16]), d=_NumpyOps.f16(blocks[..., 0:4]))


def _rows_q4_k(blocks: np.ndarray) -> dict:
    return _rows_k4(blocks, blocks[..., 16:144])


def _rows_q5_k(blocks: np.ndarray) -> dict:
    out = _rows_k4(blocks, blocks[..., 48:176])
    qh = blocks[..., 16:48]  # bit s of byte j: 5th bit of sub-block s, element j
    bits = np.stack([(qh >> s) & 1 for s in range(8)], axis=-2)  # [..., N, G, 8, 32]
    out["qh"] = _natural_words(bits, 1)[..., 0]  # [..., N, G, 8]: one word a sub-block
    return out


def _rows_q6_k(blocks: np.ndarray) -> dict:
    *rows, g, _ = blocks.shape
    q = _q6_values(blocks).reshape(*rows, g, 16, 16)  # [..., N, G, sub-block, e]
    return dict(qs=_natural_words(q & 15, 4), qh=_natural_words(q >> 4, 2)[..., 0],
                sc=np.ascontiguousarray(blocks[..., 192:208]).view(np.int8),
                d=_NumpyOps.f16(blocks[..., 208:210]).reshape(*rows, g))


_REPACK_ROWS = {T.Q8_0: _rows_q8_0, T.Q4_K: _rows_q4_k, T.Q5_K: _rows_q5_k, T.Q6_K: _rows_q6_k}
LAYOUTS = ("planes", "rows", "ggml")


def _check_type(qtype: T) -> None:
    if qtype not in _REPACK:
        names = ", ".join(t.name for t in PACKABLE)
        raise ValueError(f"repack: no GEMV layout for {qtype.name} (have {names})")


def repack(raw: np.ndarray, qtype, shape, layout: str = "planes") -> PackedWeight:
    """GGUF blocks of a ``[..., N, K]`` weight in one of ``LAYOUTS``, values unchanged.

    Args:
      raw: uint8 ``[..., N, row_bytes]`` (any shape with that byte count), e.g. a memmap view.
      qtype: Q8_0, Q4_K, Q5_K or Q6_K.
      shape: logical shape ``[..., N, K]``; K a multiple of 256 (128 for Q8_0).
      layout: "planes" (the kernel measured on the H200), "rows" (its successor, built and
        tested in interpret mode, not yet timed on the GPU; docs/LOG.md 2026-12-02) or "ggml"
        (the file's quant bytes as words, for integer dot-product kernels; the f32 planes
        kernels read it too).
    Returns:
      PackedWeight whose arrays are on the default device.
    Raises:
      ValueError: another type, a shape the layout cannot hold, or a byte count that does not fit.
    """
    qtype = T(qtype)
    shape = tuple(int(s) for s in shape)
    _check_type(qtype)
    if layout not in LAYOUTS:
        raise ValueError(f"repack: layout {layout!r} is not one of {LAYOUTS}")
    blocks = _blocks(raw, qtype, shape)
    if layout == "rows":
        fields = _REPACK_ROWS[qtype](blocks)
    else:
        fields = _ON_DEVICE[layout][qtype](blocks, len(shape) - 2)
    arrays = {k: jnp.asarray(v) for k, v in fields.items()}
    return PackedWeight(**arrays, qtype=int(qtype), shape=shape, layout=layout)


def repack_on_device(data: jax.Array, qtype, shape, layout: str = "planes") -> PackedWeight:
    """:func:`repack` into the "planes" or "ggml" layout for blocks already on a device, computed
    there.

    Args:
      data: uint8 ``[..., N, row_bytes]`` device array (a ``QTensor.data``).
      qtype, shape: as for :func:`repack`.
      layout: "planes" or "ggml".
    Returns:
      PackedWeight on the same device, bit-identical to
      ``repack(np.asarray(data), qtype, shape, layout)``.
    """
    qtype = T(qtype)
    shape = tuple(int(s) for s in shape)
    _check_type(qtype)
    if layout not in _ON_DEVICE:
        raise ValueError(f"repack_on_device: layout {layout!r} is not one of {tuple(_ON_DEVICE)}")
    _blocks(data, qtype, shape)  # validates before tracing
    lead = len(shape) - 2
    if 0 in shape[:lead]:  # no experts (a layer whose experts all run on the host): empty fields
        one = (1,) * lead
        probe = jax.eval_shape(lambda d: _repack_jit(d, int(qtype), one + shape[lead:], layout),
                               jax.ShapeDtypeStruct(one + data.shape[lead:], data.dtype))
        fields = {k: jnp.zeros(shape[:lead] + v.shape[lead:], v.dtype, device=data.sharding)
                  for k, v in probe.items()}
    else:
        fields = _repack_jit(data, int(qtype), shape, layout)
    return PackedWeight(**fields, qtype=int(qtype), shape=shape, layout=layout)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _repack_jit(data: jax.Array, qtype: int, shape: tuple[int, ...], layout: str) -> dict:
    return _ON_DEVICE[layout][T(qtype)](_blocks(data, T(qtype), shape), len(shape) - 2, _JaxOps)


# ------------------------------------------------------------------------------------ jnp side


def _planes(words: jax.Array, planes: int, bits: int) -> jax.Array:
    """Unpack bit fields: int32 [..., W] -> int32 [..., planes, W] (field p = bits p*bits..)."""
    shifts = jnp.arange(planes, dtype=jnp.int32)[:, None] * bits  # [P, 1]
    return (words[..., None, :] >> shifts) & ((1 << bits) - 1)


def _bytes_of(words: jax.Array, n: int) -> jax.Array:
    """Little-endian bytes of int32 words: [..., n] -> int32 [..., 4 * n] in 0..255."""
    return _planes(words, 4, 8).swapaxes(-1, -2).reshape(*words.shape[:-1], 4 * n)


def _rows_first(a: jax.Array, lead: int) -> jax.Array:
    """Inverse of the load-time move: [*lead, chunks, *fields, N] -> [*lead, N, chunks, *fields]."""
    return jnp.moveaxis(a, -1, lead)


def _f32(a: jax.Array) -> jax.Array:
    return a.astype(jnp.float32)


def k4_scale_min(a, b, c, p: int):
    """6-bit scale and min of sub-block p from the three packed words (any matching shapes).

    Bytes 0-3 (word a) hold scales 0-3 in their low 6 bits and bytes 4-7 (word b) mins 0-3;
    sub-blocks 4-7 keep their low 4 bits in bytes 8-11 (word c: scale low nibble, min high
    nibble) and their top 2 bits in the spare top bits of the bytes of a (scales) and b (mins).
    """
    if p < 4:
        return (a >> (8 * p)) & 63, (b >> (8 * p)) & 63
    u = 8 * (p - 4)
    sc = ((c >> u) & 0x0F) | (((a >> (u + 6)) & 3) << 4)
    mn = ((c >> (u + 4)) & 0x0F) | (((b >> (u + 6)) & 3) << 4)
    return sc, mn


def dequantize_packed(pw: PackedWeight) -> jax.Array:
    """float32 values ``pw.shape`` of a packed weight, bit-exact with ``dequantize`` of its blocks.

    The products follow ggml's order (f16 widened; ``d * sc`` first, then times the quant);
    each product is exact in f32, so only the final subtraction of the min rounds.
    """
    if pw.layout == "rows":
        return _dequantize_rows(pw)
    quants = _planes_quants if pw.layout == "planes" else _ggml_quants
    return _scaled(pw, quants(pw))


def _planes_quants(pw: PackedWeight) -> jax.Array:
    """The unsigned quants of a planes-layout weight grouped by scale, int32:
    Q8_0 [..., N, K/32, 32] (bytes), K-quants [..., N, G, 8, 32], Q6_K [..., N, G, 16, 16]."""
    qtype = T(pw.qtype)
    *rows, k = pw.shape
    if qtype == T.Q8_0:
        q = _planes(pw.qs.reshape(*rows, k // 128, 32), 4, 8)  # [..., N, C, plane, j]: plane = block
        return q.reshape(*rows, k // 32, 32)
    g = k // 256
    words = pw.qs.reshape(*rows, g, 32)
    if qtype in (T.Q4_K, T.Q5_K):
        q = _planes(words, 8, 4)  # [..., N, G, 8, 32]
        if qtype == T.Q5_K:
            qh = pw.qh.reshape(*rows, g, 32).astype(jnp.int32)
            q = q | (((qh[..., None, :] >> jnp.arange(8)[:, None]) & 1) << 4)
        return q
    low = _planes(words.reshape(*rows, g, 2, 16), 8, 4)  # [..., N, G, h, p, j]
    high = _planes(pw.qh.reshape(*rows, g, 16), 16, 2).reshape(*rows, g, 2, 8, 16)
    return (low | (high << 4)).reshape(*rows, g, 16, 16)  # sub-block 8h + p


def _ggml_quants(pw: PackedWeight) -> jax.Array:
    """As :func:`_planes_quants` for a ggml-layout weight: the words' bytes are the file's."""
    qtype = T(pw.qtype)
    *rows, k = pw.shape
    qs = _bytes_of(pw.qs, pw.qs.shape[-1])  # [..., N, quant bytes of the row]
    if qtype == T.Q8_0:
        return qs.reshape(*rows, k // 32, 32)
    g = k // 256
    qh = None if pw.qh is None else _bytes_of(pw.qh, pw.qh.shape[-1]).reshape(*rows, g, -1)  # [..., N, G, 32 or 64]
    if qtype == T.Q6_K:
        return _q6_from_bytes(qs.reshape(*rows, g, 128), qh, _JaxOps).reshape(*rows, g, 16, 16)
    q = _nibble_pairs(qs.reshape(*rows, g, 128), 4, 32, _JaxOps)  # [..., N, G, 8, 32]
    if qtype == T.Q5_K:  # bit t of qh byte l: 5th bit of sub-block t, element l
        q = q | (((qh[..., None, :] >> jnp.arange(8)[:, None]) & 1) << 4)
    return q


def _scaled(pw: PackedWeight, q: jax.Array) -> jax.Array:
    """float32 ``pw.shape``: quants grouped by scale (``_planes_quants``' shapes) times the
    scale fields, which are the same arrays in the planes and ggml layouts."""
    qtype = T(pw.qtype)
    lead = len(pw.shape) - 2
    if qtype == T.Q8_0:
        q = (q ^ 0x80) - 0x80  # the bytes are two's-complement int8
        d = _f32(_rows_first(pw.d, lead))  # [..., N, K/32]
        return (d[..., None] * _f32(q)).reshape(pw.shape)
    if qtype in (T.Q4_K, T.Q5_K):
        sc = _rows_first(pw.sc, lead)  # [..., N, G, 3]
        pairs = [k4_scale_min(sc[..., 0], sc[..., 1], sc[..., 2], p) for p in range(8)]
        scale = jnp.stack([s for s, _ in pairs], axis=-1)  # [..., N, G, 8]
        mins = jnp.stack([m for _, m in pairs], axis=-1)
        dm = _f32(_rows_first(pw.d, lead))  # [..., N, G, 2]
        dl = dm[..., 0:1] * _f32(scale)
        ml = dm[..., 1:2] * _f32(mins)
        return (dl[..., None] * _f32(q) - ml[..., None]).reshape(pw.shape)
    # Q6_K
    sc = _bytes_of(_rows_first(pw.sc, lead), 4)  # [..., N, G, 16] in 0..255
    sc = (sc ^ 0x80) - 0x80
    d = _f32(_rows_first(pw.d, lead))[..., None]  # [..., N, G, 1]
    dl = d * _f32(sc)  # [..., N, G, 16]
    return (dl[..., None] * _f32(q - 32)).reshape(pw.shape)


def _unpack_natural(words: jax.Array, bits: int) -> jax.Array:
    """Inverse of _natural_words: int32 [..., n] -> int32 [..., n * 32 / bits] in element order."""
    q = _planes(words, 32 // bits, bits)  # [..., per, n]
    return q.swapaxes(-1, -2).reshape(*words.shape[:-1], words.shape[-1] * (32 // bits))


def _dequantize_rows(pw: PackedWeight) -> jax.Array:
    qtype = T(pw.qtype)
    if qtype == T.Q8_0:
        q = _unpack_natural(pw.qs, 8)  # [..., N, C, 4, 32]
        q = (q ^ 0x80) - 0x80
        return (_f32(pw.d)[..., None] * _f32(q)).reshape(pw.shape)
    if qtype == T.Q6_K:
        q = _unpack_natural(pw.qs, 4) | (_unpack_natural(pw.qh[..., None], 2) << 4)  # [..., N, G, 16, 16]
        dl = _f32(pw.d)[..., None] * _f32(pw.sc)  # [..., N, G, 16]
        return (dl[..., None] * _f32(q - 32)).reshape(pw.shape)
    q = _unpack_natural(pw.qs, 4)  # [..., N, G, 8, 32]
    if qtype == T.Q5_K:
        q = q | (_unpack_natural(pw.qh[..., None], 1) << 4)
    dm = _f32(pw.d)  # [..., N, G, 2]
    dl = dm[..., 0:1] * _f32(pw.sc[..., 0, :])  # [..., N, G, 8]
    ml = dm[..., 1:2] * _f32(pw.sc[..., 1, :])
    return (dl[..., None] * _f32(q) - ml[..., None]).reshape(pw.shape)


def scale_magnitudes(pw: PackedWeight, *, stored_quants: bool = False) -> jax.Array:
    """float32 ``pw.shape``: |scale * q| + |min| of every element (|w| for formats without a min).

    The rows kernel multiplies sub-block sums by the scale and subtracts min * sum(x), so its
    rounding error scales with these magnitudes, not with |w| (they differ where s q ~ m).
    ``stored_quants``: Q6_K too as |s q| + |32 s|, q its stored quant (0..63, value q - 32), for
    kernels that multiply the stored quants and take the offset back separately (qgemv_q8).
    """
    w = dequantize_packed(pw)
    if T(pw.qtype) not in (T.Q4_K, T.Q5_K) + ((T.Q6_K,) if stored_quants else ()):
        return jnp.abs(w)
    mins = dataclasses.replace(pw, qs=jnp.zeros_like(pw.qs), qh=None if pw.qh is None else jnp.zeros_like(pw.qh))
    m = -dequantize_packed(mins)  # q = 0 leaves -min
    return jnp.abs(w + m) + jnp.abs(m)
