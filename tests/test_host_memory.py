"""host.memory: anonymous host buffers on 2 MiB boundaries, with or without huge pages, and the
bridges' ``pages`` setting (the experts copied onto huge pages compute the same bits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bloomery_jax.errors import ConfigError
from bloomery_jax.host import host_moe_swiglu
from bloomery_jax.host.bridge import HostBridge
from bloomery_jax.host.memory import HUGE_PAGE, host_buffer, huge_page_bytes, resolve_pages
from test_host_experts import E, _layer, _routing

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (the bracketed word), None where there is none."""
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.parametrize("pages", ["small", "huge"])
def test_buffers_start_on_a_huge_page_and_hold_their_bytes(pages):
    buf = host_buffer(3 * HUGE_PAGE + 12345, pages)
    assert buf.dtype == np.uint8 and buf.shape == (3 * HUGE_PAGE + 12345,) and buf.flags.writeable
    assert buf.ctypes.data % HUGE_PAGE == 0
    buf[:] = np.arange(buf.size) % 251  # touched: the pages exist now
    assert int(buf[-1]) == (buf.size - 1) % 251 and int(buf.sum(dtype=np.int64)) > 0
    if pages == "small":
        assert huge_page_bytes(buf) == 0  # advised against huge pages


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no transparent huge pages on this kernel")
def test_huge_buffers_get_huge_pages():
    buf = host_buffer(8 * HUGE_PAGE, "huge")
    buf.fill(1)
    assert huge_page_bytes(buf) >= HUGE_PAGE, "touched huge-page memory holds no huge page"


def test_pages_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("BLOOMERY_HOST_PAGES", raising=False)
    assert resolve_pages(None) == "small"
    monkeypatch.setenv("BLOOMERY_HOST_PAGES", "huge")
    assert resolve_pages(None) == "huge" and resolve_pages("small") == "small"
    with pytest.raises(ConfigError, match="host expert pages 'giant'"):
        resolve_pages("giant")
    with pytest.raises(ValueError, match="pages must be one of"):
        host_buffer(10, "giant")


def test_bridge_on_huge_pages_computes_the_same_bits():
    layer = _layer("Q4_K_M")
    small, huge = HostBridge({3: layer}, threads=2, pages="small"), HostBridge({3: layer}, threads=2, pages="huge")
    assert small.layers[3] is layer  # views of the file, as before
    for role in ("gate", "up", "down"):
        a, b = getattr(huge.layers[3], role).data, getattr(layer, role).data
        assert a.ctypes.data % HUGE_PAGE == 0 and not np.shares_memory(a, b) and np.array_equal(a, b)
    x, experts, weights = _routing(np.random.default_rng(2), 5, 4)
    on_host = np.arange(E) % 2 == 0
    np.testing.assert_array_equal(host_moe_swiglu(x, experts, weights, on_host, huge.layers[3]),
                                  host_moe_swiglu(x, experts, weights, on_host, layer))
