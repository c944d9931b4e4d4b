"""The CPU's time-stamp counter inside Numba kernels: where a host layer call's time goes.

Why: a decode call of the host kernels costs ~37 us an expert plus ~120 us whatever its experts
(twentieth session), and only stamps taken inside the kernel tell the serial preparation, the
workers' wake-up at each parallel region, the work and the join apart.

Contract. ``ticks()`` is ``llvm.readcyclecounter``: on x86 the invariant TSC, a count that rises
at a constant rate on every core, cheap enough (tens of cycles) to take per work item.
``ticks_per_second()`` measures that rate once against the wall clock. Where the CPU has no
such counter it reads 0, and so does every span.
"""

from __future__ import annotations

import functools
import time

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def ticks(typingctx):
    """The time-stamp counter now (int64)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(cache=True, nogil=True)
def _now():
    return ticks()


@functools.cache
def ticks_per_second(span_s: float = 0.02) -> float:
    """The counter's rate, measured once against the wall clock over ``span_s`` (0.0 where the
    CPU has no counter)."""
    _now()  # compiled (or loaded from the disk cache) first: that took up to ~30 ms of the span
    t0, c0 = time.perf_counter_ns(), _now()
    time.sleep(span_s)
    t1, c1 = time.perf_counter_ns(), _now()
    return (c1 - c0) * 1e9 / (t1 - t0)
