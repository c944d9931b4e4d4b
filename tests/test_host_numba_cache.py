"""The host kernels' Numba cache is stamped with every host module's source (host/numba_cache.py)."""

from numba.core import caching

from bloomery_jax.host import blocks, numba_cache, swiglu


def test_host_functions_use_the_package_stamp():
    for fn in (blocks.dot_q4_k_q8, swiglu._moe_kernel):
        locator = fn._cache._impl._locator
        assert getattr(locator, "host_package", False), type(locator)
        assert locator.get_source_stamp() == numba_cache.package_stamp()
    assert sum(getattr(c, "host_package", False) for c in caching.CacheImpl._locator_classes) == 2
    assert numba_cache.install()  # a second install adds nothing
    assert sum(getattr(c, "host_package", False) for c in caching.CacheImpl._locator_classes) == 2


def test_stamp_changes_with_any_module(tmp_path, monkeypatch):
    for name in ("blocks.py", "simd.py", "swiglu.py"):
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(numba_cache, "HOST_DIR", tmp_path)
    before = numba_cache.package_stamp()
    (tmp_path / "simd.py").write_text("# simd.py, edited\n")
    assert numba_cache.package_stamp() != before


def test_stamp_changes_with_the_isa_cap(monkeypatch):
    """BLOOMERY_HOST_ISA changes which row kernels the layer kernel inlines, not any source."""
    monkeypatch.delenv("BLOOMERY_HOST_ISA", raising=False)
    default = numba_cache.package_stamp()
    monkeypatch.setenv("BLOOMERY_HOST_ISA", "avx2")
    assert numba_cache.package_stamp() != default


# A layer kernel call on the multi-token path (an expert with four tokens or more), K-quant weights.
LAYER_CALL = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_host_experts import E, _layer, _routing
from bloomery_jax.host import host_moe_swiglu
rng = np.random.default_rng(5)
x, experts, weights = _routing(rng, 8, 4)
np.save(sys.argv[1], host_moe_swiglu(x, experts, weights, rng.random(E) < 0.6, _layer("Q4_K_M")))
"""


def test_cached_kernels_compute_what_fresh_ones_do(tmp_path):
    """A process that compiles the layer kernel and one that loads it from the disk cache give
    the same bits. They did not while a fast-math callee (blocks.mdot) was linked into the kernel
    as a copy optimised again there: which copy ran depended on what the process loaded first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    script = tmp_path / "layer_call.py"
    script.write_text(LAYER_CALL)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    outs = []
    for run in ("fresh", "cached"):
        out = tmp_path / f"{run}.npy"
        res = subprocess.run([sys.executable, str(script), str(out), str(Path(__file__).parent)], env=env,
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[1], outs[0])
