"""What a command does before its first step: the compilation cache, loading, progress lines.

Contract. :func:`enable_compile_cache` turns on JAX's persistent compilation cache in
``<user cache>/xla`` (``default_model.cache_dir()``), so a second start of the same model and
shapes loads compiled steps from disk instead of compiling. :func:`open_model` loads a GGUF
(the embedded default model when the path is None) and its tokenizer, reporting progress and
the time taken through a :class:`Progress` line on stderr.
"""

from __future__ import annotations

import os
import sys
import time

import jax

from ..errors import UnsupportedArchitectureError


def enable_compile_cache(directory: str | os.PathLike | None = None) -> str:
    """Persist compiled XLA executables under ``directory`` (default ``<cache_dir>/xla``)."""
    if directory is None:
        from ..default_model import cache_dir

        directory = cache_dir() / "xla"
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Cache every step, however quick its compile: a start-up compiles many small ones.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(directory)


class Progress:
    """One status line on a stream: rewritten in place on a terminal, one line per update otherwise."""

    def __init__(self, stream=None, quiet: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._open = False

    def update(self, msg: str) -> None:
        if self.quiet:
            return
        if self._tty:
            self.stream.write("\r\x1b[2K" + msg)
            self._open = True
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()

    def done(self, msg: str) -> None:
        """The final state of the line (always ends it)."""
        if self.quiet:
            return
        if self._tty:
            self.stream.write("\r\x1b[2K" + msg + "\n")
        else:
            self.stream.write(msg + "\n")
        self._open = False
        self.stream.flush()


def open_model(path, progress: Progress, place: str = "card"):
    """Load a model and its tokenizer. Returns (model, tokenizer, seconds).

    Args:
      path: a GGUF file, or None for the embedded default model.
      progress: where the "loading" line goes.
      place: the expert placement rule (``placement.parse_rule``).
    Raises:
      BloomeryError (GGUFError, ConfigError, ...) on a bad file; for the default model an
      unsupported architecture says which one the default model needs.
    """
    from ..models.loader import load_model
    from ..tokenizer import Tokenizer

    default = path is None
    if default:
        from ..default_model import default_model_path

        progress.update("preparing the embedded default model (Gemma 3 270M)...")
        path = default_model_path()
    t0 = time.perf_counter()
    progress.update(f"loading {path} ...")
    try:
        model = load_model(path, place=place)
    except UnsupportedArchitectureError as e:
        if default:
            raise UnsupportedArchitectureError(
                e.path, f"the embedded default model (Gemma 3 270M) needs an architecture that is not "
                        f"registered yet: {e.problem}", key=e.key) from None
        raise
    tokenizer = Tokenizer.from_gguf(model.gguf)
    seconds = time.perf_counter() - t0
    where = ""
    if model.placement is not None and model.placement.host is not None:
        from ..placement import describe_placement

        where = f", {describe_placement(model)}"
    progress.done(f"loaded {path} ({model.gguf.architecture}{where}) in {seconds:.2f} s")
    return model, tokenizer, seconds
