"""The layer kernel as a C function: what the FFI bridge (``ffi_bridge.cc``) calls, with no Python.

Contract. ``layer_entry.address`` is a C function
``void (int64 *record, int64 x, int64 experts, int64 weights, int64 on_host, int64 out, int64 n)``:
the five addresses are float32 ``x [n, D]``, int32 ``experts [n, k]``, float32 ``weights [n, k]``,
bool ``on_host [E]`` and float32 ``out [n, D]``, and the record (``ffi.Field`` words) holds the
layer's dimensions, the addresses of its three expert tensors (uint8 ``[E, rows, row_bytes]``)
and of the conversion tables, and the kernel settings; the kernel adds its tick spans to the
record's ``TICKS_*`` words. It runs ``swiglu._moe_kernel`` on those
views, so its result is the pure_callback bridge's bit for bit at the same thread count.
It holds no GIL and may run on any thread (the CUDA driver's host-function thread); the caller
sets that thread's Numba thread count first (``SET_THREADS``: a call to Numba's own
``set_num_threads`` from compiled code would keep the cfunc out of Numba's disk cache).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from . import ffi_layout as F
from .swiglu import _TAB16, SPANS, _moe_kernel, _team_part

TABLE_LEN = _TAB16.shape[0]  # both conversion tables: float32 [65536]


@intrinsic
def _pointer(typingctx, address, dtype):
    """int64 address → a typed pointer for ``numba.carray``."""
    target = types.CPointer(dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(target))

    return target(address, dtype), codegen


# A cfunc is compiled (or loaded from the disk cache) where it is defined, and the parallel
# kernel links against the threading layer's symbols, which exist once the layer has started.
numba.get_num_threads()

_SIGNATURE = types.void(types.CPointer(types.int64), types.int64, types.int64, types.int64, types.int64,
                        types.int64, types.int64)


@njit(cache=True, nogil=True)
def _views(rec, x, experts, weights, on_host, out, n):
    """A call's arrays and its layer's expert tensors and conversion tables, as views of the
    addresses the call and the record hold."""
    D, Fr, E, k = rec[F.D], rec[F.F], rec[F.E], rec[F.K]
    return (carray(_pointer(x, np.float32), (n, D)), carray(_pointer(experts, np.int32), (n, k)),
            carray(_pointer(weights, np.float32), (n, k)), carray(_pointer(on_host, np.bool_), (E,)),
            carray(_pointer(out, np.float32), (n, D)),
            carray(_pointer(rec[F.GATE], np.uint8), (E, Fr, rec[F.GATE_ROW_BYTES])),
            carray(_pointer(rec[F.UP], np.uint8), (E, Fr, rec[F.UP_ROW_BYTES])),
            carray(_pointer(rec[F.DOWN], np.uint8), (E, D, rec[F.DOWN_ROW_BYTES])),
            carray(_pointer(rec[F.TAB16], np.float32), (TABLE_LEN,)),
            carray(_pointer(rec[F.TABBF], np.float32), (TABLE_LEN,)))


@cfunc(_SIGNATURE, cache=True, nogil=True)
def layer_entry(rec, x, experts, weights, on_host, out, n):
    xa, ea, wa, ha, oa, gw, uw, dw, tab16, tabbf = _views(rec, x, experts, weights, on_host, out, n)
    spans = carray(rec, (F.WORDS,))[F.TICKS:F.TICKS + len(SPANS)]
    _moe_kernel(oa, xa, ea, wa, ha, gw, uw, dw, rec[F.GATE_FMT], rec[F.UP_FMT], rec[F.DOWN_FMT], rec[F.Q8] != 0,
                tab16, tabbf, rec[F.ROWS_PER_ITEM], rec[F.THREADS], rec[F.MULTI_MIN1], rec[F.MULTI_MIN2],
                rec[F.PREFETCH_BYTES], rec[F.REGIONS], rec[F.PARTS], spans)


_TEAM_SIGNATURE = types.void(types.CPointer(types.int64), types.int64, types.int64, types.int64, types.int64,
                             types.int64, types.int64, types.int64, types.int64)


@cfunc(_TEAM_SIGNATURE, cache=True, nogil=True)
def team_entry(rec, x, experts, weights, on_host, out, n, tid, nthreads):
    """Thread ``tid`` of ``nthreads``'s part of the call ``layer_entry`` would make, for the host
    team of ``ffi_bridge.cc``: the record's ``TEAM_SCRATCH`` holds the addresses of
    ``swiglu.team_scratch``'s nine arrays of ``TEAM_PAIRS`` rows, ``TEAM_COUNTERS`` the zeroed
    ``ffi_layout.COUNTERS`` and each thread's stamps, a cache line apart."""
    Fr = rec[F.F]
    xa, ea, wa, ha, oa, gw, uw, dw, tab16, tabbf = _views(rec, x, experts, weights, on_host, out, n)
    a = carray(_pointer(rec[F.TEAM_SCRATCH], np.int64), (9,))
    M = rec[F.TEAM_PAIRS]
    scratch = (carray(_pointer(a[0], np.float32), (M, Fr)), carray(_pointer(a[1], np.float32), (M, Fr // 32)),
               carray(_pointer(a[2], np.int16), (M, Fr)), carray(_pointer(a[3], np.float32), (M, Fr // 256 + 1)),
               carray(_pointer(a[4], np.int32), (M, Fr // 32)), carray(_pointer(a[5], np.int8), (M, Fr)),
               carray(_pointer(a[6], np.int16), (M, Fr // 16)), carray(_pointer(a[7], np.int16), (M, Fr)),
               carray(_pointer(a[8], np.float32), (M, Fr // 32)))
    counter = carray(_pointer(rec[F.TEAM_COUNTERS], np.int64), (F.COUNTER_WORDS + 8 * nthreads,))
    _team_part(oa, xa, ea, wa, ha, gw, uw, dw, rec[F.GATE_FMT], rec[F.UP_FMT], rec[F.DOWN_FMT], rec[F.Q8] != 0,
               tab16, tabbf, rec[F.ROWS_PER_ITEM], rec[F.MULTI_MIN1], rec[F.MULTI_MIN2], rec[F.PREFETCH_BYTES],
               rec[F.PARTS], scratch, counter, tid, nthreads, rec[F.TEAM_PLAIN] != 0)
