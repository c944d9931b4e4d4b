"""Atomic counters for Numba kernels: a work queue and a wait inside one parallel region.

Why: a decode layer call of the host kernels ran two Numba parallel regions (gate/up, then down),
and each region's fork and join of 14 workers cost ~9 us on the H100's host even with spinning
workers (scripts/host_call_probe.py). With these, the layer kernel runs one region: its threads
take work items from a shared counter (``fetch_add``) and wait for the items of the phase before
(``load``) instead of a join and a new fork.

Contract. ``fetch_add(a, i, v)`` adds ``v`` to ``a[i]`` (int64 array) atomically, sequentially
consistent, and returns the old value; ``load(a, i)`` reads ``a[i]`` atomically with acquire
ordering, so whatever the writer stored before its ``fetch_add`` is visible after a ``load`` that
sees it; ``pause()`` is the CPU's spin-wait hint (x86 ``pause``; nothing elsewhere). Indices are
not bounds-checked.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _element(context, builder, aryty, ary, index):
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.gep(data, [index])


@intrinsic
def fetch_add(typingctx, a, i, v):
    """Atomically ``a[i] += v``; returns the value before."""
    if not (isinstance(a, types.Array) and a.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary, index, value = args
        value = context.cast(builder, value, sig.args[2], types.int64)
        return builder.atomic_rmw("add", _element(context, builder, sig.args[0], ary, index), value, "seq_cst")

    return types.int64(a, i, v), codegen


@intrinsic
def load(typingctx, a, i):
    """``a[i]``, read atomically with acquire ordering."""
    if not (isinstance(a, types.Array) and a.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_element(context, builder, sig.args[0], *args), "acquire", 8)

    return types.int64(a, i), codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint: lets the core's sibling thread run and saves power while spinning."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen
