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
import numpy as np

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


def open_model(path, progress: Progress, place: str = "card", weights: str = "auto", kernels: str = "auto",
               attention: str = "auto", bridge: str = "auto", routing: str = "auto"):
    """Load a model and its tokenizer. Returns (model, tokenizer, seconds).

    Args:
      path: a GGUF file, or None for the embedded default model.
      progress: where the "loading" line goes.
      place: the expert placement rule (``placement.parse_rule``).
      weights: card weights as blocks | f32 | auto (``models.loader.load_model``).
      kernels: reference | pallas | auto (``models.loader.load_model``).
      attention: xla | pallas | auto (``models.loader.load_model``).
      bridge: callback | ffi | auto, how steps reach host experts (``models.loader.load_model``).
      routing: xla | pallas | auto (``models.loader.load_model``).
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
        model = load_model(path, place=place, weights=weights, kernels=kernels, attention=attention, bridge=bridge,
                           routing=routing)
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


def make_residency(model, policy: str = "off", *, prompt_streaming: bool = True, max_swaps: int | None = None):
    """A LiveResidency (policy lfu | lru) over ``model``, or None for "off"; ConfigError when it cannot apply."""
    from ..errors import ConfigError

    if policy == "off":
        return None
    if model.placement is None or model.placement.host is None:
        raise ConfigError(f"--residency {policy} needs host experts: choose --place other than 'card'")
    if max_swaps is not None and max_swaps < 1:
        raise ConfigError(f"--max-swaps must be >= 1, got {max_swaps}")
    from ..placement.residency import make_policy
    from ..placement.slots import LiveResidency

    return LiveResidency.for_model(model, make_policy(policy), prompt_streaming=prompt_streaming,
                                   max_swaps_per_layer=max_swaps)


def residency_from_args(model, args):
    return make_residency(model, args.residency, prompt_streaming=not args.no_prompt_streaming,
                          max_swaps=args.max_swaps)


def make_trace(model, args):
    """A TraceRecorder when ``--record-routing`` was given, else None."""
    from ..errors import ConfigError

    if not getattr(args, "record_routing", None):
        return None
    if model.placement is None:
        raise ConfigError("--record-routing needs a model with routed experts")
    from ..placement.trace import TraceRecorder

    L, E = np.asarray(model.placement.slot_of).shape
    return TraceRecorder(L, E, metadata=dict(model=str(model.path), placement=str(args.place)))


def placement_stats(engine, record: dict, args) -> None:
    """Add the placement's numbers to a result record; save the routing trace if one was kept.

    Adds ``placement`` (the rule), ``card_served_fraction`` of the routed calls (with residency
    also over the last 16 steps), swaps and bytes moved, and the host bridge's call count,
    seconds inside the host kernels, Numba threads and chunk size.
    """
    model = engine.model
    if model.placement is None:  # a dense model: nothing placed (make_trace refused a trace)
        return
    stats = {"rule": str(args.place)}
    host = model.placement.host
    if host is not None:
        stats["host_calls"] = host.stats.calls
        stats["host_pairs"] = host.stats.pairs
        stats["host_kernel_s"] = host.stats.seconds
        stats["host_threads"] = host.threads
        from ..host.swiglu import CHUNKSIZE

        stats["host_chunksize"] = CHUNKSIZE
    if engine.residency is not None:
        stats.update(engine.residency.stats())
        stats["policy"] = args.residency
        stats["prompt_streaming"] = not args.no_prompt_streaming
    if engine.routed_calls:
        stats["card_served_fraction"] = engine.card_calls / engine.routed_calls
    if engine.routing_trace is not None:
        engine.routing_trace.save(args.record_routing)
        stats["routing_trace"] = str(args.record_routing)
    record["placement"] = stats
