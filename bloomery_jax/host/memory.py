"""Host memory for expert weights: anonymous mappings on 2 MiB boundaries, with or without huge pages.

Why it matters: a layer call reads each chosen expert's rows in work items of ~18 KB scattered
over the layer's ~0.4 GB (many GB over a token). On 4 KiB pages nearly every item starts on a
page the TLB does not map, and the walk is paid before the first byte arrives; one entry of a
transparent huge page maps 2 MiB. The engine's host experts live on 4 KiB pages: the file's
page cache (callback bridge) or the driver's ``cuMemHostAlloc`` (FFI bridge on a GPU), while
``scripts/host_bench.py`` reads NumPy arrays, which NumPy asks huge pages for. On the GPU
machine's host the bench measured 55-70 GB/s and the engine's calls 34-47 (docs/LOG.md).

``pages``: "small" keeps what the bridges did before (file views; ``cuMemHostAlloc``); "huge"
copies the experts into memory from :func:`host_buffer` (a CUDA bridge then page-locks it with
``cuMemHostRegister``). ``$BLOOMERY_HOST_PAGES`` sets the default. Measured on that host
(2026-12-05, ``host_bench.py --memory``): 53-56 GB/s a one-token call from every kind of memory,
so the pages are not the gap, and "small" stays the default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re

import numpy as np

from ..errors import ConfigError

PAGES = ("small", "huge")
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # linux/mman.h


def resolve_pages(pages: str | None) -> str:
    """``pages``, else ``$BLOOMERY_HOST_PAGES``, else "small"."""
    name = pages or os.environ.get("BLOOMERY_HOST_PAGES") or PAGES[0]
    if name not in PAGES:
        raise ConfigError(f"host expert pages {name!r} is not one of {', '.join(PAGES)}")
    return name


def host_buffer(nbytes: int, pages: str) -> np.ndarray:
    """uint8 ``[nbytes]`` of fresh anonymous memory starting on a 2 MiB boundary, advised to take
    huge pages ("huge") or not to ("small") when it is first touched. The mapping runs on to the
    next 2 MiB boundary (:func:`mapped_bytes`), and the array keeps it alive. Where the kernel has
    no transparent huge pages the advice does nothing."""
    if pages not in PAGES:
        raise ValueError(f"host_buffer: pages must be one of {PAGES}, got {pages!r}")
    length = mapped_bytes(nbytes)
    m = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room to align
    whole = np.frombuffer(m, np.uint8)  # holds the mapping
    start = -whole.ctypes.data % HUGE_PAGE
    buf = whole[start:start + nbytes]
    _madvise(buf.ctypes.data, length, _MADV_HUGEPAGE if pages == "huge" else _MADV_NOHUGEPAGE)
    return buf


def mapped_bytes(nbytes: int) -> int:
    """The bytes of mapping a :func:`host_buffer` of ``nbytes`` owns from its start: whole 2 MiB pages."""
    return nbytes + (-nbytes % HUGE_PAGE)


def huge_page_bytes(a: np.ndarray) -> int:
    """Bytes of the mappings that hold ``a``'s memory backed by transparent huge pages now
    (``/proc/self/smaps``: AnonHugePages); 0 where that cannot be read."""
    lo = a.ctypes.data
    hi = lo + a.nbytes
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                if head:
                    start, end = int(head.group(1), 16), int(head.group(2), 16)
                    inside = start < hi and end > lo
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _madvise(address: int, length: int, advice: int) -> None:
    libc = _libc()
    if libc is None:
        return
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(advice)) != 0:
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: a kernel built without transparent huge pages; the memory works as is
            raise OSError(err, f"madvise: {os.strerror(err)}")


_LIBC: list = []


def _libc():
    if not _LIBC:
        name = ctypes.util.find_library("c")
        _LIBC.append(ctypes.CDLL(name, use_errno=True) if name and os.name == "posix" else None)
    return _LIBC[0]
