"""Numba's on-disk cache for the host kernels, keyed on every host module's source.

Numba keys a cached function on its own file's source only. The layer kernel in ``swiglu``
inlines the row dots of ``blocks`` and the vector IR of ``simd``, so after an edit of either its
cached machine code would silently keep the old kernels (it did, once: an A/B that measured
nothing). :func:`install` puts locators first in Numba's list (its own two: ``NUMBA_CACHE_DIR``, then
the package's ``__pycache__``) that, for the files of this
package, stamps the cache with the hash of all of them together (and of ``BLOOMERY_HOST_ISA``,
which changes what the layer kernel inlines without changing a source). It uses Numba's cache-locator
classes (``numba.core.caching``), which are not public API: where they are missing, nothing is
installed and the plain per-file behaviour stays.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HOST_DIR = Path(__file__).resolve().parent


def package_stamp() -> bytes:
    """SHA-256 over the sources of every module of this package, in name order, and over the
    settings that choose which row kernels the layer kernel inlines (``BLOOMERY_HOST_ISA``)."""
    h = hashlib.sha256(os.environ.get("BLOOMERY_HOST_ISA", "").encode())
    for path in sorted(HOST_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.digest()


def install() -> bool:
    """Put the package-wide locators first; True when Numba's locator list was found."""
    try:
        from numba.core import caching
        impl = caching.CacheImpl
        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator)  # NUMBA_CACHE_DIR first, as Numba
    except (ImportError, AttributeError):
        return False
    if any(getattr(c, "host_package", False) for c in impl._locator_classes):
        return True
    for base in reversed(bases):
        impl._locator_classes.insert(0, _package_locator(base))
    return True


def _package_locator(base):
    class HostPackageLocator(base):
        host_package = True

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent != HOST_DIR:
                return None
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return package_stamp()

    HostPackageLocator.__name__ = HostPackageLocator.__qualname__ = f"HostPackage{base.__name__}"
    return HostPackageLocator
