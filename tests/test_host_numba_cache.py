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
