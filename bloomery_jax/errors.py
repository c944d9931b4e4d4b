"""Error classes that carry enough context to be printed on one line.

Every failure caused by a file or a request the user gave us is one of these; CLIs print
``str(err)`` and exit non-zero, the server maps them to 400 responses.
"""

from __future__ import annotations


class BloomeryError(Exception):
    """Base class of every error the engine raises on bad input."""


class GGUFError(BloomeryError, ValueError):
    """A GGUF file that is malformed, truncated, or asks for something we do not support.

    The message always names the file, and the tensor or metadata key at fault when there is one.
    """

    def __init__(self, path, problem: str, *, tensor: str | None = None, key: str | None = None):
        self.path = str(path)
        self.problem = problem
        self.tensor = tensor
        self.key = key
        where = ""
        if tensor is not None:
            where = f" (tensor {tensor!r})"
        elif key is not None:
            where = f" (key {key!r})"
        super().__init__(f"{self.path}: {problem}{where}")


class UnsupportedArchitectureError(GGUFError):
    """``general.architecture`` names a model family we have no implementation for."""


class ConfigError(BloomeryError, ValueError):
    """A bad command-line option, config value or placement rule."""
