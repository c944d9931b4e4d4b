"""The GGUF reader on valid and malformed files.

Every malformed case must raise a GGUFError (never a bare NumPy / KeyError / struct traceback)
whose message names the file and the key or tensor at fault. Files are written with
gguf.GGUFWriter and then patched byte by byte.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bloomery_jax.errors import GGUFError, UnsupportedArchitectureError
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models import qwen3moe, registry

A = np.arange(32, dtype=np.float32).reshape(4, 8)  # a.weight: F32 [4, 8], 128 bytes
B_F32 = np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)  # b.weight: Q8_0 [2, 64], 136 bytes
C = np.full((3, 32), 0.5, np.float16)  # c.weight: F16 [3, 32], 192 bytes


def write(path, *, arch="qwen3moe", kv=None, tensors=True):
    """A small valid file: a few typed keys and three tensors (F32, Q8_0, F16)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32("test.count", 7)
    w.add_string("test.name", "hello")
    w.add_array("test.strings", ["alpha", "beta"])
    w.add_array("test.numbers", [1, 2, 3])
    w.add_uint32("test.key1", 1)
    w.add_uint32("test.key2", 2)
    for key, (value, adder) in (kv or {}).items():
        getattr(w, adder)(key, value)
    if tensors:
        w.add_tensor("a.weight", A)
        w.add_tensor("b.weight", gguf.quants.quantize(B_F32, T.Q8_0), raw_dtype=T.Q8_0)
        w.add_tensor("c.weight", C)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small(tmp_path):
    return write(tmp_path / "small.gguf")


def patch(path, offset, new: bytes):
    data = bytearray(path.read_bytes())
    data[offset:offset + len(new)] = new
    path.write_bytes(bytes(data))


def find(path, needle: bytes) -> int:
    data = path.read_bytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, f"{needle!r} must occur exactly once"
    return at


def tensor_info_at(path, name: str) -> dict:
    """Byte offsets of the fields of tensor ``name``'s info record."""
    at = find(path, name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", path.read_bytes(), at)[0]
    dims = at + 4
    return {"n_dims": at, "dims": dims, "type": dims + 8 * n_dims, "offset": dims + 8 * n_dims + 4}


def read_u64(path, at):
    return struct.unpack_from("<Q", path.read_bytes(), at)[0]


def expect_error(path, match, *, key=None, tensor=None, cls=GGUFError, opener=GGUFFile):
    with pytest.raises(cls, match=match) as info:
        opener(path)
    err = info.value
    msg = str(err)
    assert "\n" not in msg and str(path) in msg and err.path == str(path)
    if key is not None:
        assert err.key == key and repr(key) in msg
    if tensor is not None:
        assert err.tensor == tensor and repr(tensor) in msg
    return err


# --- the valid file ---------------------------------------------------------------------

def test_valid_file_reads_back(small):
    gf = GGUFFile(small)
    assert gf.version == 3 and gf.alignment == 32 and gf.architecture == "qwen3moe"
    assert gf.metadata["test.count"] == 7 and gf.metadata["test.name"] == "hello"
    assert gf.metadata["test.strings"] == ["alpha", "beta"]
    np.testing.assert_array_equal(gf.metadata["test.numbers"], [1, 2, 3])
    assert list(gf.tensors) == ["a.weight", "b.weight", "c.weight"]
    np.testing.assert_array_equal(gf.tensor("a.weight").data, A)
    np.testing.assert_array_equal(gf.tensor("c.weight").data, C)
    b = gf.tensor("b.weight")
    assert b.qtype == T.Q8_0 and b.shape == (2, 64) and b.data.shape == (2, 68)
    np.testing.assert_array_equal(gguf.quants.dequantize(np.asarray(b.data), T.Q8_0),
                                  gguf.quants.dequantize(gguf.quants.quantize(B_F32, T.Q8_0), T.Q8_0))


def test_synthetic_model_reads_like_gguf_py(tiny_model):
    ours, ref = GGUFFile(tiny_model), gguf.GGUFReader(tiny_model)
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensor(t.name)
        assert mine.offset == t.data_offset and mine.shape == tuple(reversed(t.shape.tolist()))
        np.testing.assert_array_equal(np.asarray(mine.data), np.asarray(t.data))
    assert set(ours.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}


# --- header ------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")


def test_tiny_file(tmp_path):
    p = tmp_path / "t.gguf"
    p.write_bytes(b"GGUF\x03\0\0\0")
    expect_error(p, "too small")


def test_wrong_magic(small):
    patch(small, 0, b"GGML")
    expect_error(small, "not a GGUF file")


@pytest.mark.parametrize("version,match", [(1, "unsupported GGUF version 1"), (4, "unsupported GGUF version 4"),
                                           (3 << 24, "big-endian")])
def test_unsupported_version(small, version, match):
    patch(small, 4, struct.pack("<I", version))
    expect_error(small, match)


@pytest.mark.parametrize("at", [8, 16], ids=["tensor-count", "kv-count"])
def test_impossible_counts(small, at):
    patch(small, at, struct.pack("<Q", 1 << 40))
    expect_error(small, None)  # the reader runs into the data and stops at the first impossible read


def test_truncated_inside_kv_section(small):
    cut = find(small, b"hello") + 2
    small.write_bytes(small.read_bytes()[:cut])
    expect_error(small, "truncated header", key="test.name")


def test_truncated_inside_an_array(small):
    cut = find(small, b"beta") + 1
    small.write_bytes(small.read_bytes()[:cut])
    expect_error(small, "truncated header", key="test.strings")


def test_truncated_inside_tensor_infos(small):
    cut = tensor_info_at(small, "b.weight")["dims"] + 3
    small.write_bytes(small.read_bytes()[:cut])
    expect_error(small, "truncated header", tensor="b.weight")


# --- metadata ----------------------------------------------------------------------------

def test_duplicate_key(small):
    patch(small, find(small, b"test.key2"), b"test.key1")
    expect_error(small, "duplicate metadata key", key="test.key1")


def test_invalid_utf8_key(small):
    patch(small, find(small, b"test.count") + 5, b"\xff")
    expect_error(small, "key is not valid UTF-8", key="test.\ufffdount")


def test_invalid_utf8_value(small):
    patch(small, find(small, b"hello") + 1, b"\xc3")
    expect_error(small, "not valid UTF-8", key="test.name")


def test_invalid_utf8_array_element(small):
    patch(small, find(small, b"beta"), b"\x80")
    expect_error(small, "string 1 of the array is not valid UTF-8", key="test.strings")


def test_unknown_value_type(small):
    patch(small, find(small, b"test.count") + len("test.count"), struct.pack("<I", 99))
    expect_error(small, "unknown metadata value type 99", key="test.count")


def test_nested_array(small):
    # element type STRING -> ARRAY: an array of arrays, which neither we nor llama.cpp read
    patch(small, find(small, b"test.strings") + len("test.strings") + 4, struct.pack("<I", 9))
    expect_error(small, "nested arrays", key="test.strings")


@pytest.mark.parametrize("value,adder", [(3, "add_uint32"), (64, "add_uint64")])
def test_bad_alignment(tmp_path, value, adder):
    p = write(tmp_path / "a.gguf", kv={"general.alignment": (value, adder)}, tensors=False)
    expect_error(p, "power of two", key="general.alignment")


# --- tensor infos and data ---------------------------------------------------------------

def test_duplicate_tensor_name(small):
    patch(small, find(small, b"c.weight"), b"b.weight")
    expect_error(small, "duplicate tensor name", tensor="b.weight")


def test_invalid_utf8_tensor_name(small):
    patch(small, find(small, b"c.weight"), b"\xfe")
    expect_error(small, "tensor name is not valid UTF-8", tensor="\ufffd.weight")


def test_unknown_ggml_type(small):
    patch(small, tensor_info_at(small, "b.weight")["type"], struct.pack("<I", 99))
    expect_error(small, "unknown ggml type id 99", tensor="b.weight")


def test_too_many_dims(small):
    patch(small, tensor_info_at(small, "a.weight")["n_dims"], struct.pack("<I", 5))
    expect_error(small, "5 dimensions", tensor="a.weight")


def test_zero_dimension(small):
    patch(small, tensor_info_at(small, "a.weight")["dims"], struct.pack("<Q", 0))
    expect_error(small, "zero dimension", tensor="a.weight")


def test_row_not_a_multiple_of_the_block(small):
    patch(small, tensor_info_at(small, "b.weight")["dims"], struct.pack("<Q", 48))
    expect_error(small, "row length 48 is not a multiple of the Q8_0 block size 32", tensor="b.weight")


def test_shape_larger_than_its_data(small):
    # a.weight [4, 8] -> [5, 8]: 160 bytes, but b.weight's data starts 128 bytes in
    patch(small, tensor_info_at(small, "a.weight")["dims"] + 8, struct.pack("<Q", 5))
    expect_error(small, "overlaps tensor 'b.weight'", tensor="a.weight")


def test_shape_smaller_than_its_data(small):
    # a.weight [4, 8] -> [3, 8]: 96 bytes in an extent of 128
    patch(small, tensor_info_at(small, "a.weight")["dims"] + 8, struct.pack("<Q", 3))
    expect_error(small, "data extent is 128 bytes", tensor="a.weight")


def test_offset_outside_the_file(small):
    patch(small, tensor_info_at(small, "b.weight")["offset"], struct.pack("<Q", 1 << 30))
    expect_error(small, "runs past the end of the file", tensor="b.weight")


def test_misaligned_offset(small):
    at = tensor_info_at(small, "b.weight")["offset"]
    patch(small, at, struct.pack("<Q", read_u64(small, at) + 4))
    expect_error(small, "not aligned to 32", tensor="b.weight")


def test_truncated_inside_the_last_tensor(small):
    small.write_bytes(small.read_bytes()[:-100])  # c.weight holds the last 192 bytes
    expect_error(small, "runs past the end of the file", tensor="c.weight")


def test_trailing_bytes_after_the_last_tensor(small):
    small.write_bytes(small.read_bytes() + b"\0" * 64)
    expect_error(small, "to the end of the file", tensor="c.weight")


# --- architecture and keys, through the model layer --------------------------------------

def test_unsupported_architecture(tmp_path):
    p = write(tmp_path / "llama.gguf", arch="llama")
    err = expect_error(p, "architecture 'llama' is not supported", key="general.architecture",
                       cls=UnsupportedArchitectureError, opener=lambda q: registry.module_for_file(GGUFFile(q)))
    assert "qwen3moe" in str(err)  # the message lists what is supported


def _qwen_file(path, drop=(), override=None):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    md = qwen3moe.Config(n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, n_experts=4,
                         n_experts_used=2, expert_ff=32, n_vocab=16).to_metadata()
    md.update(override or {})
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
    for k, v in md.items():
        if k in drop:
            continue
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_required_key(tmp_path):
    p = _qwen_file(tmp_path / "m.gguf", drop={"qwen3moe.block_count"})
    expect_error(p, "required metadata key is missing", key="qwen3moe.block_count",
                 opener=lambda q: qwen3moe.Config.from_gguf(GGUFFile(q)))


def test_wrong_typed_key(tmp_path):
    p = _qwen_file(tmp_path / "m.gguf", override={"qwen3moe.expert_count": "four"})
    expect_error(p, "expected int, found str", key="qwen3moe.expert_count",
                 opener=lambda q: qwen3moe.Config.from_gguf(GGUFFile(q)))


# --- fuzz --------------------------------------------------------------------------------

def _mutations(data: bytes, header_end: int, rng: np.random.Generator, n: int):
    """Random byte-level corruptions: flips, overwrites with extreme values, cuts, splices.

    ``header_end`` (where tensor data starts) focuses most of them on the structure.
    """
    for _ in range(n):
        d = bytearray(data)
        kind = rng.integers(5)
        if kind == 0:  # flip a few bits, mostly in the header
            for _ in range(rng.integers(1, 6)):
                at = rng.integers(header_end) if rng.random() < 0.9 else rng.integers(len(d))
                d[at] ^= 1 << int(rng.integers(8))
        elif kind == 1:  # an extreme 4- or 8-byte integer somewhere in the header
            width = int(rng.choice([4, 8]))
            at = int(rng.integers(header_end - width))
            d[at:at + width] = rng.choice([b"\xff", b"\x7f", b"\x00", b"\x80"]) * width
        elif kind == 2:  # truncate anywhere
            del d[int(rng.integers(len(d))):]
        elif kind == 3:  # delete or insert a few bytes (shifts everything after)
            at = int(rng.integers(len(d)))
            if rng.random() < 0.5:
                del d[at:at + int(rng.integers(1, 9))]
            else:
                d[at:at] = rng.bytes(int(rng.integers(1, 9)))
        else:  # random bytes over a header span
            at = int(rng.integers(header_end - 16))
            d[at:at + 16] = rng.bytes(16)
        yield bytes(d)


@pytest.mark.parametrize("source", ["small", "synthetic"])
def test_fuzzed_files_load_or_raise_gguf_error(small, synth_model, tmp_path, source):
    # the synthetic model brings a real tokenizer's string arrays and the full key set
    src = small if source == "small" else synth_model(
        qtype="Q8_0", n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, n_experts=4,
        n_experts_used=2, expert_ff=64, n_vocab=320)[0]
    data = open(src, "rb").read()
    header_end = GGUFFile(src).data_offset
    p = tmp_path / "fuzz.gguf"
    outcomes = {"loaded": 0, "refused": 0}
    for i, mutated in enumerate(_mutations(data, header_end, np.random.default_rng(0), 800)):
        p.write_bytes(mutated)
        try:
            gf = GGUFFile(p)
        except GGUFError as e:
            assert str(p) in str(e) and "\n" not in str(e), (i, str(e))
            outcomes["refused"] += 1
            continue
        except Exception as e:  # anything else is a reader bug
            pytest.fail(f"mutation {i}: {type(e).__name__}: {e}")
        # Loaded: every tensor's view lies inside the file and has its full size.
        for t in gf:
            assert gf.data_offset <= t.offset and t.offset + t.n_bytes <= len(mutated), (i, t.name)
            np.asarray(t.data).tobytes()
            assert t.data.size * t.data.itemsize == t.n_bytes
        outcomes["loaded"] += 1
    # Both outcomes occur (flips inside tensor data or inside values keep a file valid), so
    # the loop really exercised both paths.
    assert outcomes["loaded"] >= 10 and outcomes["refused"] >= 300, outcomes
