"""Shared fixtures: synthetic GGUF models, written once per test session and cached.

    def test_x(synth_model):
        path, report = synth_model(qtype="Q4_K_M", twin=True, n_layers=3)
        twin = report.twin_path

``synth_model(**kwargs)`` takes ``bloomery_jax.synth.synthesize``'s keyword arguments
(``twin=True`` instead of a twin path) and returns ``(path, SynthReport)``; equal arguments
give the same cached file. ``tiny_model`` is the default F32 file's path. ``llama_model`` opens
a file in llama.cpp (``logits_all``, F32 KV cache), skipping when llama-cpp-python is absent.
"""

from __future__ import annotations

import hashlib
import itertools
import json

import pytest

from bloomery_jax.synth import synthesize


# Every compiled XLA executable keeps its code mapped, and one pytest process compiles thousands:
# at ~32% of the suite the process reached the kernel's limit on memory mappings
# (vm.max_map_count, 65,530 by default), after which an XLA compile segfaulted or failed to
# "materialize symbols" and a shared library "failed to map segment" (nineteenth session). After
# a test module whose process holds more than MAP_BUDGET mappings, JAX's caches are dropped
# (compiled steps are shared within a module, rarely across modules). One module added ~30k, so
# after every MAP_STRIDE-th test the same check runs against MAP_LAST_RESORT too: a module that
# alone would cross the limit recompiles some of its steps instead of crashing the run. (Reading
# /proc/self/maps takes ~40 ms at 40k mappings, hence the stride.)
MAP_BUDGET = 30_000
MAP_LAST_RESORT = 50_000
MAP_STRIDE = 8


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return 0


def _release_above(limit: int) -> None:
    if _mappings() > limit:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    yield
    _release_above(MAP_BUDGET)


_tests_run = itertools.count(1)


@pytest.fixture(autouse=True)
def _release_compiled_code_near_the_limit():
    yield
    if next(_tests_run) % MAP_STRIDE == 0:
        _release_above(MAP_LAST_RESORT)


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    cache: dict[str, tuple] = {}

    def make(*, twin: bool = False, **kwargs):
        key = json.dumps({"twin": twin, **kwargs}, sort_keys=True, default=str)
        if key not in cache:
            stem = hashlib.sha1(key.encode()).hexdigest()[:12]
            twin_path = root / f"{stem}.twin.gguf" if twin else None
            report = synthesize(root / f"{stem}.gguf", twin_path=twin_path, **kwargs)
            cache[key] = (report.path, report)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(synth_model) -> str:
    return synth_model()[0]


@pytest.fixture(scope="session")
def llama_model():
    llama_cpp = pytest.importorskip("llama_cpp")

    def open_model(path, n_ctx: int = 64):
        # F32 KV cache: llama.cpp's default F16 cache would blur tight comparisons.
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                               type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)

    return open_model
