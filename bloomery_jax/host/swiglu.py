"""Gated SwiGLU of the host-resident experts of one MoE layer, on the GGUF file's raw blocks.

Contract. ``host_moe_swiglu(x, experts, weights, on_host, layer)`` returns float32 ``[N, D]``:
for each token n, the sum over j with ``on_host[experts[n, j]]`` of
``weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n))`` (e = experts[n, j]); a token with no
host pair gets exact zeros. The weights are never dequantized as a whole, inside one Numba
call, in two parallel phases: gate+up → hidden vector per (token, expert) pair, over ranges of
the (expert, row of F) space; then down and the weighted sum, over ranges of D rows of the
output (all experts in each). By default each thread takes one range a phase, cut where the
estimated cost is even (``ROWS_PER_ITEM``), and each phase is a parallel region of its own;
``regions=1`` runs both in one region whose threads take the ranges from shared counters
(``atomics``). An expert with few tokens (decode) has each (row, token) dot read the row's
blocks itself; one with at least ``multi_min`` tokens (prefill) decodes each row once into a
small buffer (``blocks.decode_row``: int16 scale × quant, or float32 values) and dots that with
all its tokens, four at a time (``blocks.mdot``). Every output element and every dot product
belongs to one thread and is summed in a fixed order, so the result does not depend on the
thread count.

Activations (``act``): ``"f32"`` multiplies float32 activations; ``"q8"`` first rounds them to
8 bits as ggml's CPU backend does (Q8_K for K-quants, Q8_0 for Q8_0, bit-equal with
``bloomery_jax.ops.actquant``; the hidden vector is rounded again before down) and takes exact
integer block sums. F32/F16/BF16 weights always use float32 activations. Each variant matches
its float64 twin in ``reference`` within a derived rounding bound (tests/test_host_experts.py);
against exact arithmetic q8 is off by what the rounding itself costs, 1.2-1.8 % relative RMS of
the layer output (Q8_0 / Q4_K_M, Qwen3-30B-A3B shapes, random weights), as in llama.cpp;
f32 by 3e-7.

Measured (scripts/host_bench.py, 2026-12, this 2-core AMD EPYC znver4 VM with AVX-512, busy
with other work at times: numbers move by up to 30 % between runs; the two variants are
interleaved call by call). Qwen3-30B-A3B experts (D 2048, F 768, E 128, k 8, all on the host),
median GB/s = bytes of the distinct experts touched / time, and its ratio to a Numba parallel
float32 sum measured in the same run (30 GB/s with 2 threads, 28 with 1):

    weights           N   2 threads f32 / q8     1 thread f32 / q8
    Q4_K + Q6_K down  1    6.96 /  7.81 (0.26)    4.88 /  5.67 (0.20)
    Q4_K + Q6_K down  8    6.25 /  6.99 (0.23)    3.93 /  4.72 (0.17)
    Q8_0              2   10.6  / 14.5  (0.48)    8.44 / 12.4  (0.43)
    Q8_0              8   14.8  / 18.1  (0.60)    7.03 / 10.5  (0.37)

q8 was faster in every case (1.1-1.45x), hence ``DEFAULT_ACT = "q8"``. Those numbers are the portable
kernels'; on AVX2 CPUs the K-quant q8 row dots are ``host.simd``'s (vector IR on int8
activations): 1.5-1.9x the whole layer on the same VM with their first form (2026-12-03); with the
second, on the H200 host's 16 Xeon cores, 55-70 GB/s for one token and 59-95 GB/s for eight
(0.59-0.67 and 0.63-0.90 of the read bandwidth measured in the same run; the hosts lent differ
from call to call: docs/LOG.md, 2026-12-04). The kernels are
compute-bound on this machine (one core runs Q4_K_M at ~6 GB/s, Q8_0 at ~11-20). N = 64 ran at
1.6-4.5 GB/s of distinct bytes when every (token, expert) pair paid the full dot-product cost;
the multi-token path (decode a row once, dot it with the expert's tokens) is what prefill uses
now: see the 2026-12 before/after numbers under "Multi-token rows" below.

Multi-token rows (prefill). An expert with ``multi_min`` tokens or more (default 4; 8 for Q8_0
weights under q8, whose per-token dot reads the int8 blocks as cheaply as a decoded buffer)
decodes each row once (``blocks.decode_row``) and dots the buffer with its tokens, four a pass
(``blocks.mdot``: one weight load for four products; vpdpwssd on ymm for the integer kinds,
vfmadd231ps on zmm for f32, checked with ``host_bench.py --asm``). The integer block sums are
the per-token kernels' own, so the q8 rounding count is unchanged (K / 32 + 16); under f32 the
dequantized element ``d (s q) - dmin m`` adds at most 2 roundings (relative to |s q d| + |min|)
to a K-term dot, inside ``reference.dot_rounds``' K + 64. One (token, expert) pair is one dot
product on one thread either way, so the thread count still does not change the result; the
path taken (below or above ``multi_min``) may change the last bits. Measured 2026-12 with the
old kernel (commit 687035f) and the new one interleaved call by call (Qwen3-30B-A3B shapes as
above, all experts on the host, median ms, 2 threads; ~4 / ~16 tokens an expert at N = 64 / 256):

    weights  N      f32 old → new          q8 old → new
    Q4_K_M   1      3.05 →  3.11           2.81 →  2.91   (same code path: noise)
    Q4_K_M   8      25.9 →  25.6           22.7 →  22.6
    Q4_K_M   64     228  →  207  (1.10x)   185  →  176  (1.05x)
    Q4_K_M   256    686  →  388  (1.77x)   568  →  390  (1.46x)
    Q8_0     1      3.35 →  3.34           3.10 →  3.10
    Q8_0     64     142  →  138            120  →  120   (path off: < 8 tokens)
    Q8_0     256    520  →  351  (1.48x)   419  →  341  (1.23x)

One thread: Q4_K_M N = 256 1.37-1.65x, N = 64 1.04-1.24x; N = 1, 2, 8 within noise (0.94-1.09x).
Per dot (one core, one 2048-column row, T tokens), the decoded path costs about 0.6x the
per-token dot at T = 32 and breaks even near T = 2-4 (Q8_0 q8: T = 4-8).

Threads: Numba's OpenMP layer spins at the end of each parallel region. When another process
holds a core, a 2-thread call took 45-56 ms instead of 3-5 (a thread descheduled at a barrier);
``OMP_WAIT_POLICY=passive`` or ``NUMBA_THREADING_LAYER=workqueue`` (set before Numba starts)
brought it back to 4-6 ms; dynamic chunks (``chunksize`` > 0) helped in one run and not in the
next, so the default stays static. Give the kernels cores of their own: importing bloomery_jax
sets a 10,000-spin wait, and the bridges leave two cores free (``bridge.default_threads``).
"""

from __future__ import annotations

import dataclasses
import os

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from numba import njit, prange, types
from numba.extending import intrinsic

from . import atomics
from . import blocks as B
from .ffi_layout import COUNTER_WORDS, COUNTERS
from .simd import prefetch
from .ticks import ticks

# qtype → kernel format code
KERNEL_FORMATS = {T.F32: B.F32, T.F16: B.F16, T.BF16: B.BF16, T.Q8_0: B.Q8_0,
                  T.Q4_K: B.Q4_K, T.Q5_K: B.Q5_K, T.Q6_K: B.Q6_K}
ACTS = ("f32", "q8")
DEFAULT_ACT = "q8"
# Rows of one expert per parallel work item; 0: one share of the rows a thread, cut where the
# estimated cost is even (see _phase1_items). BLOOMERY_HOST_ROWS sets the default (a speed setting).
ROWS_PER_ITEM = int(os.environ.get("BLOOMERY_HOST_ROWS", "0"))
# Bytes of each weight matrix a thread asks the cache for ahead of the row it dots, as whole
# rows of that matrix (0: none; the hardware's prefetchers alone). In bytes, not rows, because
# what hides the memory's latency is the bytes in flight: 2 rows ahead (the default until the
# twenty-fourth session) kept 2.3 KB of each Q4_K gate/up stream in flight but only 1.3 KB of
# the Q6_K down rows (630 B each). On the H100's 16-core host, one call: n-cpu-moe=36 decode
# 51.6 (1,260 bytes: 2 rows each, the old default), 55.5 (2,304: 2 and 4 rows) and 51.5 tok/s
# (4,608); a one-token layer call 0.430, 0.354 and 0.385 ms (benchmarks/gpu_2026-12-06-s24).
# Shares with the hint against blocks of 16 rows without: 54.0 against 48.1 tok/s
# (gpu_2026-12-05-s18). A speed setting only; BLOOMERY_HOST_PREFETCH_BYTES sets the default.
PREFETCH_BYTES = int(os.environ.get("BLOOMERY_HOST_PREFETCH_BYTES", "2304"))


def _regions(regions: int, what: str = "host_moe_swiglu: regions") -> int:
    if regions not in (1, 2):  # 1 or 2 as asked: any other value is a mistake, not a setting
        raise ValueError(f"{what} must be 1 or 2, got {regions!r}")
    return int(regions)


# Parallel regions a layer call runs: 2, gate/up then down, each a fork and a join of the workers
# (~9 us with 14 spinning workers on the H100's host, scripts/host_call_probe.py); 1, one region
# whose threads take items from shared counters and wait for the previous phase's items
# (atomics). The same dots in the same order either way. BLOOMERY_HOST_REGIONS sets the default.
# (Until the twentieth session two array fills in the kernel were regions of their own: a call
# made four, and one "region" three; its measurement, no gain, was of that.)
REGIONS = _regions(int(os.environ.get("BLOOMERY_HOST_REGIONS", "2")), "BLOOMERY_HOST_REGIONS")
# In one region with shares (ROWS_PER_ITEM 0): shares a thread, taken as threads free up, so a
# thread slowed by a neighbour leaves its last shares to the others. 1: one share each, as with
# two regions. BLOOMERY_HOST_PARTS sets the default.
PARTS = max(1, int(os.environ.get("BLOOMERY_HOST_PARTS", "1")))
# Activation rows with fewer elements than this are prepared (rounded to 8 bits, summed) inside
# the region that reads them, by its first threads while the others still wake: a decode call's
# 1 x 2048 inputs and 8 x 768 hidden rows take microseconds, less than a region of their own's
# fork and join. Until the twenty-fifth session the calling thread prepared them between regions.
SERIAL_PREP_MAX = 16384
# word offsets of the shared counters (ffi_layout.COUNTERS)
P1_TAKEN, P1_DONE, H_TAKEN, H_DONE, P2_TAKEN, X_TAKEN, X_DONE = (8 * i for i in range(len(COUNTERS)))
# Tick spans a layer call adds up (host.ticks; the FFI record's TICKS_* words, in this order):
# the whole call, its parallel regions, their wait for the last thread to start work, and the
# wait from the last work item's end to the region's end. The serial part is CALL - REGIONS.
SPANS = ("call", "regions", "wake", "join")
SPAN_CALL, SPAN_REGIONS, SPAN_WAKE, SPAN_JOIN = range(len(SPANS))
# Work items a thread takes at a time (see host_moe_swiglu): 0, Numba's default, splits them
# statically. A speed setting only; BLOOMERY_HOST_CHUNKSIZE sets the default (both bridges).
# Dynamic chunks only make sense with fixed blocks (BLOOMERY_HOST_ROWS > 0): with one share a
# thread there are as many items as threads, and chunks of c leave all but 1/c of them idle.
CHUNKSIZE = int(os.environ.get("BLOOMERY_HOST_CHUNKSIZE", "0"))
# An expert with at least this many tokens decodes each row once for all of them (see
# host_moe_swiglu); Q8_0 rows against Q8_0 activations are cheap to dot straight from the
# blocks, so they switch later.
MULTI_MIN = 4
MULTI_MIN_Q8_0 = 8

_FLOAT_DTYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}


@dataclasses.dataclass(eq=False)
class HostTensor:
    """One expert tensor of a layer, as the file stores it.

    Args:
      data: block formats: uint8 ``[E, rows, row_bytes]``, the file's bytes (a view of the GGUF
        memmap; never copied). F32 / F16: the float32 / float16 array ``[E, rows, cols]``; BF16:
        its uint16 bits.
      qtype: ``gguf.GGMLQuantizationType`` (or its int).
      shape: logical ``(E, rows, cols)``.
    """

    data: np.ndarray
    qtype: int
    shape: tuple

    def __post_init__(self):
        try:
            self.qtype = T(int(self.qtype))
        except ValueError:
            raise ValueError(f"HostTensor: unknown ggml type id {self.qtype}") from None
        self.shape = tuple(int(s) for s in self.shape)
        if len(self.shape) != 3:
            raise ValueError(f"HostTensor: shape must be (E, rows, cols), got {self.shape}")
        data = np.asarray(self.data)  # a memmap → plain ndarray view, no copy
        E, rows, cols = self.shape
        if self.qtype in _FLOAT_DTYPES:
            want = np.dtype(_FLOAT_DTYPES[self.qtype])
            if data.dtype != want or data.shape != self.shape:
                raise ValueError(f"HostTensor: {self.qtype.name} data must be {want} {self.shape}, "
                                 f"got {data.dtype} {data.shape}")
        else:
            elems, nbytes = GGML_QUANT_SIZES[self.qtype]
            if cols % elems:
                raise ValueError(f"HostTensor: {cols} columns are not a multiple of the "
                                 f"{self.qtype.name} block size {elems}")
            want_shape = (E, rows, cols // elems * nbytes)
            if data.dtype != np.uint8 or data.shape != want_shape:
                raise ValueError(f"HostTensor: {self.qtype.name} data must be uint8 {want_shape}, "
                                 f"got {data.dtype} {data.shape}")
        if not data.flags.c_contiguous:
            raise ValueError("HostTensor: data must be C-contiguous (a view of the file, not a strided copy)")
        self.data = data

    @property
    def raw(self) -> np.ndarray:
        """uint8 ``[E, rows, row_bytes]``: the bytes the kernels read (a read-only view)."""
        return _readonly(self.data.view(np.uint8))


EXPERT_ROLES = ("gate", "up", "down")  # a HostExpertLayer's tensors, in the order copies and handlers use


@dataclasses.dataclass(eq=False)
class HostExpertLayer:
    """The three expert tensors of one MoE layer: gate/up ``[E, F, D]``, down ``[E, D, F]``.

    Raises ValueError at construction for a type without a host kernel or mismatched shapes.
    ``act`` is the activation variant ``host_moe_swiglu`` uses by default for this layer.
    """

    gate: HostTensor
    up: HostTensor
    down: HostTensor
    act: str = DEFAULT_ACT

    def __post_init__(self):
        for role in EXPERT_ROLES:
            t = getattr(self, role)
            if t.qtype not in KERNEL_FORMATS:
                have = ", ".join(q.name for q in KERNEL_FORMATS)
                raise ValueError(f"HostExpertLayer: the {role} experts are {t.qtype.name}, which has no host "
                                 f"kernel (have: {have})")
        E, F, D = self.gate.shape
        if self.up.shape != (E, F, D) or self.down.shape != (E, D, F):
            raise ValueError(f"HostExpertLayer: expected gate/up (E, F, D) and down (E, D, F), got "
                             f"gate {self.gate.shape}, up {self.up.shape}, down {self.down.shape}")
        if self.act not in ACTS:
            raise ValueError(f"HostExpertLayer: act must be one of {ACTS}, got {self.act!r}")

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def dims(self) -> tuple[int, int]:
        """(D, F): model width and expert hidden width."""
        return self.gate.shape[2], self.gate.shape[1]

    def expert_bytes(self) -> int:
        """Bytes of one expert's three matrices in the file."""
        return sum(t.raw[0].nbytes for t in (self.gate, self.up, self.down))

    def copied(self, alloc) -> "HostExpertLayer":
        """This layer with each tensor's bytes copied into ``alloc(nbytes)`` (a uint8 array)."""
        tensors = []
        for t in (self.gate, self.up, self.down):
            data = alloc(int(t.data.nbytes)).view(t.data.dtype).reshape(t.data.shape)
            data[...] = t.data
            tensors.append(HostTensor(data, t.qtype, t.shape))
        return HostExpertLayer(*tensors, act=self.act)


def host_moe_swiglu(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, on_host: np.ndarray,
                    layer: HostExpertLayer, *, act: str | None = None,
                    rows_per_item: int = ROWS_PER_ITEM, chunksize: int = CHUNKSIZE,
                    multi_min: int | None = None, prefetch_bytes: int = PREFETCH_BYTES,
                    regions: int = REGIONS, parts: int = PARTS, spans: np.ndarray | None = None) -> np.ndarray:
    """Weighted SwiGLU sum of the (token, expert) pairs whose expert is on the host.

    Args:
      x: float32 ``[N, D]``.
      experts: int ``[N, k]`` expert ids in ``[0, E)``, distinct within a row (top-k).
      weights: float32 ``[N, k]``.
      on_host: bool ``[E]``.
      layer: the layer's host tensors.
      act: ``"f32"`` or ``"q8"`` (default: ``layer.act``).
      rows_per_item: rows of one expert per parallel work item; 0: one share of the rows a
        thread, cut where the estimated cost is even.
      chunksize: work items a thread takes at a time (``numba.set_parallel_chunksize``, for this
        call only); 0 gives each thread one equal contiguous share up front (static), > 0 hands
        chunks out as threads free up (dynamic; see the module docstring on threads).
      multi_min: an expert with at least this many tokens decodes each of its rows once into a
        small buffer and dots it with all of them (``blocks.decode_row`` / ``blocks.mdot``);
        fewer, and each (row, token) dot reads the blocks itself. Default: ``MULTI_MIN``
        (``MULTI_MIN_Q8_0`` for Q8_0 weights under ``act="q8"``), per phase; 1 forces the
        multi-token path everywhere.
      prefetch_bytes: while dotting a row, ask the cache for the row this many bytes ahead (in
        whole rows of that matrix, rounded up) in the same work item, on into its next expert's
        rows (0: no software prefetch). Never changes a result.
      regions: 1, one parallel region with work taken from shared counters; 2, one a phase
        (``REGIONS``). Never changes a result.
      parts: with ``regions`` 1 and ``rows_per_item`` 0, cost-balanced shares a thread, taken as
        threads free up (``PARTS``). Never changes a result.
      spans: int64 ``[len(SPANS)]`` to add this call's tick spans to (``SPANS``), or None.
    Returns:
      float32 ``[N, D]``.
    """
    D, F = layer.dims
    E = layer.n_experts
    x = np.ascontiguousarray(x, np.float32)
    experts = np.ascontiguousarray(experts, np.int32)
    weights = np.ascontiguousarray(weights, np.float32)
    on_host = np.ascontiguousarray(on_host, np.bool_)
    if x.ndim != 2 or x.shape[1] != D:
        raise ValueError(f"host_moe_swiglu: x must be [N, {D}], got {x.shape}")
    if experts.ndim != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise ValueError(f"host_moe_swiglu: experts and weights must be [N, k] with N = {x.shape[0]}, got "
                         f"{experts.shape} and {weights.shape}")
    if on_host.shape != (E,):
        raise ValueError(f"host_moe_swiglu: on_host must be [{E}], got {on_host.shape}")
    if experts.size and (experts.min() < 0 or experts.max() >= E):
        raise ValueError(f"host_moe_swiglu: expert ids must be in [0, {E}), got [{experts.min()}, {experts.max()}]")
    x, experts, weights, on_host = (_readonly(a) for a in (x, experts, weights, on_host))
    s = kernel_settings(layer, act, multi_min)
    out = np.empty((x.shape[0], D), np.float32)
    if spans is None:
        spans = np.zeros(len(SPANS), np.int64)
    before = numba.set_parallel_chunksize(int(chunksize))  # this thread's setting: restored below
    try:
        return _moe_kernel(out, x, experts, weights, on_host, layer.gate.raw, layer.up.raw, layer.down.raw,
                           *s.formats, s.q8, _TAB16, _TABBF, max(0, int(rows_per_item)),
                           numba.get_num_threads(), s.mmin1, s.mmin2, max(0, int(prefetch_bytes)),
                           _regions(regions), max(1, int(parts)), spans)
    finally:
        numba.set_parallel_chunksize(before)


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """The layer kernel's per-layer arguments other than the tensors."""

    formats: tuple[int, int, int]  # kernel format codes of gate, up, down
    q8: bool  # activations rounded to 8 bits
    mmin1: int  # tokens an expert needs for the multi-token path, gate/up phase
    mmin2: int  # the same, down phase


def kernel_settings(layer: HostExpertLayer, act: str | None = None, multi_min: int | None = None) -> KernelSettings:
    """Arguments of the layer kernel for ``layer`` (``act`` and ``multi_min`` as in
    :func:`host_moe_swiglu`)."""
    act = layer.act if act is None else act
    if act not in ACTS:
        raise ValueError(f"host_moe_swiglu: act must be one of {ACTS}, got {act!r}")
    fmts = tuple(KERNEL_FORMATS[t.qtype] for t in (layer.gate, layer.up, layer.down))
    if multi_min is None:
        mins = [MULTI_MIN_Q8_0 if (f == B.Q8_0 and act == "q8") else MULTI_MIN for f in fmts]
        mmin1, mmin2 = max(mins[0], mins[1]), mins[2]
    else:
        mmin1 = mmin2 = max(1, int(multi_min))
    return KernelSettings(fmts, act == "q8", mmin1, mmin2)


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: Numba compiles one specialization per writeable flag, and the GGUF
    memmap and JAX's callback arguments are read-only, so every input is passed that way."""
    v = a.view()
    v.flags.writeable = False
    return v


_TAB16, _TABBF = (_readonly(t) for t in B.conversion_tables())


# ---------------------------------------------------------------------------------------------
# The compiled kernel. Format codes are runtime values: one compilation (cached on disk) covers
# every combination of formats; the branch on the format is taken once per row, outside the
# vectorized loops.


@njit(inline="always")
def _kind(fmt, q8):
    """Which activation form a format reads: 0 float32 (+ sums per 32), 1 Q8_K, 2 Q8_0."""
    if not q8 or fmt <= B.BF16:
        return 0
    return 2 if fmt == B.Q8_0 else 1


@njit(inline="always")
def _prepare_row(X, m, ka, kb, XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0):
    """The activation forms row m of X needs for weights of activation kinds ka and kb."""
    if ka == 0 or kb == 0:
        B.sums32(X[m], XS[m])
    if (ka == 1 or kb == 1) and X.shape[1] % B.QK_K == 0:
        B.quantize_q8_k(X[m], XQK[m], XDK[m], XBK[m])
        B.pack_q8_k(XQK[m], XQ8[m], X16[m])
    if ka == 2 or kb == 2:
        B.quantize_q8_0(X[m], XQ0[m], XD0[m])


@njit(inline="always")  # inlined: a call per row costs 10-25 % (measured)
def _row_dot(fmt, q8, row, t, X, XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0, tab16, tabbf):
    if fmt == B.Q4_K:
        if q8:
            return B.dot_q4_k_q8(row, XQK[t], XQ8[t], XDK[t], XBK[t], X16[t], tab16)
        return B.dot_q4_k_f32(row, X[t], XS[t], tab16)
    if fmt == B.Q6_K:
        if q8:
            return B.dot_q6_k_q8(row, XQK[t], XQ8[t], XDK[t], XBK[t], X16[t], tab16)
        return B.dot_q6_k_f32(row, X[t], tab16)
    if fmt == B.Q5_K:
        if q8:
            return B.dot_q5_k_q8(row, XQK[t], XQ8[t], XDK[t], XBK[t], X16[t], tab16)
        return B.dot_q5_k_f32(row, X[t], XS[t], tab16)
    if fmt == B.Q8_0:
        if q8:
            return B.dot_q8_0_q8(row, XQ0[t], XD0[t], tab16)
        return B.dot_q8_0_f32(row, X[t], tab16)
    if fmt == B.F32:
        return B.dot_f32(row, X[t])
    if fmt == B.F16:
        return B.dot_f16(row, X[t], tab16)
    return B.dot_f16(row, X[t], tabbf)  # BF16


@njit(cache=True, nogil=True)
def _row_buffers(K):
    # one decoded row (blocks.decode_row): int16 weights, scales, mins, dmins, float32 values
    return (np.empty(K, np.int16), np.empty(K // 32 + 1, np.float32), np.empty(K // 32 + 1, np.int16),
            np.empty(K // 256 + 1, np.float32), np.empty(K, np.float32))


@njit(cache=True, nogil=True)
def _zeros(n):
    # int64 [n] zeros, made outside the parallel kernel: there np.zeros (like .copy() and
    # np.arange) becomes a parallel loop, a fork and join of every worker for a few bytes
    return np.zeros(n, np.int64)


@njit(cache=True, nogil=True)
def _act_buffers(M, K):
    # float32 sums per 32 | Q8_K quants (int16), scales, sums per 32, quants as int8, sums per 16 |
    # Q8_0 quants (int16), scales
    return (np.empty((M, K // 32), np.float32), np.empty((M, K), np.int16), np.empty((M, K // 256 + 1), np.float32),
            np.empty((M, K // 32), np.int32), np.empty((M, K), np.int8), np.empty((M, K // 16), np.int16),
            np.empty((M, K), np.int16), np.empty((M, K // 32), np.float32))


@njit(inline="always", nogil=True)
def _rows_ahead(w, pf):
    """The rows of ``w`` (uint8 ``[E, rows, row_bytes]``) that hold ``pf`` bytes, rounded up."""
    return (pf + w.shape[2] - 1) // w.shape[2]


@njit(inline="always", nogil=True)
def _hinted_row(gexp, s, rows, end, W, base):
    """The expert and row to prefetch at step ``s`` of a work item's walk, which dots the rows
    ``[base, base + W)`` of each expert in ``gexp`` in turn (phase 1: all F rows, flat
    q = g * F + f; phase 2: one item's columns of every expert) and ends before step ``end``:
    the row ``rows`` steps on, or (-1, -1) where ``rows`` is 0 or that step is past the end. The
    hint runs on into the next expert's rows, whose run would otherwise start unhinted (the
    hardware's prefetchers start each run anew too; phase 2 walks a run an expert per item)."""
    t = s + rows
    if rows <= 0 or t >= end:
        return -1, -1
    g = t // W
    return gexp[g], base + (t - g * W)


@njit(inline="always", nogil=True)
def _ahead(w, gexp, s, rows, end, W, base):
    """Prefetch ``w``'s row that _hinted_row names for step ``s``, if any."""
    e, r = _hinted_row(gexp, s, rows, end, W, base)
    if e >= 0:
        prefetch(w[e, r], 0, w.shape[2])


@njit(cache=True, nogil=True)
def _phase1_items(start, gexp, F, rpi, nthreads, mmin):
    """Bounds ``[items + 1]`` of phase 1's work items in the flat row space q = g * F + f.

    ``rpi`` > 0: blocks of ``rpi`` rows within one expert. ``rpi`` == 0: one contiguous share a
    thread, cut where the estimated cost is even, so each thread streams long runs of rows (a
    run per expert it crosses) and no thread waits on a last short item. A row's cost is its
    expert's token count T on the per-token path, and about 2 + T / 2 on the decoded path (it
    breaks even with per-token dots near T = 4: module docstring).
    """
    G = gexp.shape[0]
    if rpi > 0:
        nrb = (F + rpi - 1) // rpi
        bounds = np.empty(G * nrb + 1, np.int64)
        for g in range(G):
            for b in range(nrb):
                bounds[g * nrb + b] = g * F + b * rpi
        bounds[G * nrb] = G * F
        return bounds
    cost = np.empty(G, np.float64)  # one row of group g
    for g in range(G):
        T = start[gexp[g] + 1] - start[gexp[g]]
        cost[g] = T if T < mmin else 2.0 + 0.5 * T
    parts = max(1, min(nthreads, G * F))
    total = F * cost.sum()
    bounds = np.empty(parts + 1, np.int64)
    bounds[0] = 0
    g = 0
    before = 0.0  # cost of the groups before g
    for i in range(1, parts):
        target = total * i / parts
        while g < G - 1 and before + F * cost[g] <= target:
            before += F * cost[g]
            g += 1
        q = g * F + int(round((target - before) / cost[g]))
        bounds[i] = min(max(q, bounds[i - 1]), G * F)
    bounds[parts] = G * F
    return bounds


@njit(inline="always", nogil=True)
def _gate_up_item(q0, q1, gexp, start, pair_tok, x, H, gw, uw, gfmt, ufmt, q8, ka, kb, XS, XQK, XDK, XBK, XQ8, X16,
                  XQ0, XD0, tab16, tabbf, mmin1, maxc, pf):
    """Phase 1 on the flat rows ``[q0, q1)`` (q = g * F + f: group g's expert, row f), walked as
    one segment per expert: H[p, f] = silu(gate_e[f] . x_t) * (up_e[f] . x_t). ``pf``: bytes
    to prefetch ahead in each matrix."""
    D, F = x.shape[1], gw.shape[1]
    pfg, pfu = _rows_ahead(gw, pf), _rows_ahead(uw, pf)
    wq, wsc, wm, wdm, wf = _row_buffers(D if maxc >= mmin1 else 0)
    ga = np.empty(maxc, np.float32)
    ub = np.empty(maxc, np.float32)
    q = q0
    while q < q1:
        g = q // F
        e = gexp[g]
        r0 = q - g * F
        r1 = min(F, r0 + (q1 - q))
        q += r1 - r0
        p0, p1 = start[e], start[e + 1]
        if p1 - p0 < mmin1:  # few tokens: each (row, token) dot reads the row's blocks itself
            for r in range(r0, r1):
                _ahead(gw, gexp, g * F + r, pfg, q1, F, 0)
                _ahead(uw, gexp, g * F + r, pfu, q1, F, 0)
                grow = gw[e, r]
                urow = uw[e, r]
                for p in range(p0, p1):
                    t = pair_tok[p]
                    a = _row_dot(gfmt, q8, grow, t, x, XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0, tab16, tabbf)
                    b = _row_dot(ufmt, q8, urow, t, x, XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0, tab16, tabbf)
                    H[p, r] = a / (np.float32(1.0) + np.exp(-a)) * b
        else:  # several tokens: decode each row once, then dot it with every token
            ids = pair_tok[p0:p1]
            for r in range(r0, r1):
                _ahead(gw, gexp, g * F + r, pfg, q1, F, 0)
                _ahead(uw, gexp, g * F + r, pfu, q1, F, 0)
                B.decode_row(gfmt, ka, gw[e, r], wq, wsc, wm, wdm, wf, tab16, tabbf)
                B.mdot(gfmt, ka, wq, wsc, wm, wdm, wf, ids, x, XQK, XDK, XBK, XQ0, XD0, ga)
                B.decode_row(ufmt, kb, uw[e, r], wq, wsc, wm, wdm, wf, tab16, tabbf)
                B.mdot(ufmt, kb, wq, wsc, wm, wdm, wf, ids, x, XQK, XDK, XBK, XQ0, XD0, ub)
                for i in range(p1 - p0):
                    a = ga[i]
                    H[p0 + i, r] = a / (np.float32(1.0) + np.exp(-a)) * ub[i]


@njit(inline="always", nogil=True)
def _down_item(r0, r1, gexp, start, pids, pair_tok, pair_w, H, dw, dfmt, q8, kd, HS, HQK, HDK, HBK, HQ8, H16, HQ0,
               HD0, tab16, tabbf, mmin2, maxc, pf, out):
    """Phase 2 on output columns ``[r0, r1)`` for every expert in ascending order: out[t, d] +=
    w_p (down_e[d] . H[p]). ``pf``: bytes to prefetch ahead."""
    pfd = _rows_ahead(dw, pf)
    W = r1 - r0
    end = gexp.shape[0] * W  # the walk's steps: W rows of each expert
    wq, wsc, wm, wdm, wf = _row_buffers(H.shape[1] if maxc >= mmin2 else 0)
    res = np.empty(maxc, np.float32)
    for g in range(gexp.shape[0]):
        e = gexp[g]
        p0, p1 = start[e], start[e + 1]
        if p1 - p0 < mmin2:
            for r in range(r0, r1):
                _ahead(dw, gexp, g * W + r - r0, pfd, end, W, r0)
                drow = dw[e, r]
                for p in range(p0, p1):
                    y = _row_dot(dfmt, q8, drow, p, H, HS, HQK, HDK, HBK, HQ8, H16, HQ0, HD0, tab16, tabbf)
                    out[pair_tok[p], r] += pair_w[p] * y
        else:
            ids = pids[p0:p1]
            for r in range(r0, r1):
                _ahead(dw, gexp, g * W + r - r0, pfd, end, W, r0)
                B.decode_row(dfmt, kd, dw[e, r], wq, wsc, wm, wdm, wf, tab16, tabbf)
                B.mdot(dfmt, kd, wq, wsc, wm, wdm, wf, ids, H, HQK, HDK, HBK, HQ0, HD0, res)
                for i in range(p1 - p0):
                    out[pair_tok[p0 + i], r] += pair_w[p0 + i] * res[i]


@njit(inline="always", nogil=True)
def _take(counter, i, n):
    """The next of ``n`` items from the shared ``counter[i]``, or -1 once all are taken."""
    it = atomics.fetch_add(counter, i, 1)
    return it if it < n else -1


@njit(inline="always", nogil=True)
def _await(counter, i, n):
    """Spin until ``counter[i]`` (items finished) reaches ``n``."""
    while atomics.load(counter, i) < n:
        atomics.pause()


@njit(inline="always", nogil=True)
def _prepare_taken(counter, i, X, n, ka, kb, act):
    """Rows of X (``n`` of them) prepared for activation kinds ka and kb (_prepare_row, into the
    eight arrays of ``act``) by the threads that reach this first: each takes rows from
    ``counter[i]`` (X_TAKEN or H_TAKEN) and counts those it finished in the *_DONE word after it,
    then waits until all are finished. A row is only ever waited on while the thread that took
    it prepares it, so this never waits on a thread that has not started."""
    XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0 = act
    m = _take(counter, i, n)
    while m >= 0:
        _prepare_row(X, m, ka, kb, XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0)
        atomics.fetch_add(counter, i + 8, 1)
        m = _take(counter, i, n)
    _await(counter, i + 8, n)


@njit(cache=True, nogil=True)
def _group(experts, weights, on_host, E):
    """The host pairs grouped by expert (serial: O(N k + E)). Pair p = (token pair_tok[p], expert),
    with weight pair_w[p]; expert e's pairs are [start[e], start[e + 1]); gexp lists the experts
    with pairs, ascending; pids is the identity [P]; maxc the most pairs of one expert."""
    N, k = experts.shape
    start = np.zeros(E + 1, np.int64)
    for n in range(N):
        for j in range(k):
            e = experts[n, j]
            if on_host[e]:
                start[e + 1] += 1
    for e in range(E):
        start[e + 1] += start[e]
    P = start[E]
    fill = start[:E].copy()
    pair_tok = np.empty(P, np.int64)
    pair_w = np.empty(P, np.float32)
    for n in range(N):
        for j in range(k):
            e = experts[n, j]
            if on_host[e]:
                p = fill[e]
                fill[e] += 1
                pair_tok[p] = n
                pair_w[p] = weights[n, j]
    G = 0
    maxc = 0
    for e in range(E):
        if start[e + 1] > start[e]:
            G += 1
            maxc = max(maxc, start[e + 1] - start[e])
    gexp = np.empty(G, np.int64)
    g = 0
    for e in range(E):
        if start[e + 1] > start[e]:
            gexp[g] = e
            g += 1
    return start, pair_tok, pair_w, np.arange(P), gexp, maxc


@njit(cache=True, nogil=True)
def _items(start, gexp, F, D, rpi, nthreads, shares, mmin1):
    """The work items of a call: phase 1's bounds in the flat row space (_phase1_items) and phase
    2's rows an item. Phase 2 items are blocks of D rows across all experts: an item owns those
    columns of out for every token, so no element has two writers, and each is summed in
    ascending expert order whatever the thread count."""
    bounds = _phase1_items(start, gexp, F, rpi, shares, mmin1)
    if rpi > 0:
        rpi2 = max(1, min(rpi, D // (4 * nthreads)))  # >= 4 items a thread
    else:  # shares: every row costs the same here (all experts in each)
        rpi2 = (D + shares - 1) // shares
    return bounds, rpi2


@njit(inline="always", nogil=True)
def _stamp(counter, stamp, i):
    """A host-team thread's stamp ``i`` (ffi_layout.TEAM_STAMPS) at word ``stamp + i`` of the
    team's counters; ``stamp`` < 0: none (the one-region kernel)."""
    if stamp >= 0:
        counter[stamp + i] = ticks()


@njit(inline="always", nogil=True)
def _share(counter, bounds, n1, rpi2, n2, P, gexp, start, pids, pair_tok, pair_w, x, xrows, H, w3, fmt3, q8, kind3,
           xact, hact, tab16, tabbf, mmin1, mmin2, maxc, pf, out, zero_items, stamp):
    """One thread's part of a call whose threads take items from shared counters (COUNTERS,
    zeroed: taken / finished for x's first ``xrows`` rows' preparation (0: prepared already),
    phase 1, the hidden rows' preparation, phase 2) and wait for the previous phase's items to
    be finished, not for the other threads: a thread that runs late finishes whatever it took
    before it waits, so nothing waits on an item that is not running. ``zero_items``: each
    phase 2 item zeroes its columns of out first (else out is zero already). ``w3``, ``fmt3``,
    ``kind3``: gate, up and down; ``xact`` / ``hact``: the activation forms of x and of the
    hidden rows (_act_buffers); ``stamp``: where a team thread stamps its phases (_stamp).

    Inlined, into ``prange`` bodies or _share_plain only: the same items in a function of their
    own ran 1.25x (one region) to 1.5x (the team) slower a host expert, on one thread of the
    2-core VM (twenty-second session; LOG.md): the same machine code, but on arrays with an owner,
    whose reference counts a ``prange`` body's arrays do not have (_unowned). Few enough
    arguments (< 30) that CPython passes them without ``*args``, which Numba's inliner refuses."""
    gw, uw, dw = w3
    gfmt, ufmt, dfmt = fmt3
    ka, kb, kd = kind3
    XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0 = xact
    HS, HQK, HDK, HBK, HQ8, H16, HQ0, HD0 = hact
    D = x.shape[1]
    _stamp(counter, stamp, 3)
    if xrows > 0:
        _prepare_taken(counter, X_TAKEN, x, xrows, ka, kb, xact)
    it = _take(counter, P1_TAKEN, n1)
    while it >= 0:
        _gate_up_item(bounds[it], bounds[it + 1], gexp, start, pair_tok, x, H, gw, uw, gfmt, ufmt, q8, ka, kb,
                      XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0, tab16, tabbf, mmin1, maxc, pf)
        atomics.fetch_add(counter, P1_DONE, 1)
        it = _take(counter, P1_TAKEN, n1)
    _stamp(counter, stamp, 4)
    _await(counter, P1_DONE, n1)
    _stamp(counter, stamp, 5)
    _prepare_taken(counter, H_TAKEN, H, P, kd, kd, hact)
    _stamp(counter, stamp, 6)
    it = _take(counter, P2_TAKEN, n2)
    while it >= 0:
        r0, r1 = it * rpi2, min(D, (it + 1) * rpi2)
        if zero_items:
            for t in range(out.shape[0]):
                for r in range(r0, r1):
                    out[t, r] = 0.0
        _down_item(r0, r1, gexp, start, pids, pair_tok, pair_w, H, dw, dfmt, q8, kd, HS, HQK, HDK, HBK, HQ8, H16, HQ0,
                   HD0, tab16, tabbf, mmin2, maxc, pf, out)
        it = _take(counter, P2_TAKEN, n2)
    _stamp(counter, stamp, 7)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)  # the kernel's flags: the items' arithmetic must match
def _share_alone(counter, bounds, n1, rpi2, n2, P, gexp, start, pids, pair_tok, pair_w, x, xrows, H, w3, fmt3, q8,
                 kind3, xact, hact, tab16, tabbf, mmin1, mmin2, maxc, pf, out, zero_items, stamp):
    """``_share`` on the calling thread alone, compiled as a ``prange`` body (see _share's note).
    The caller's Numba thread count must be 1 (ffi_bridge.cc's team sets it): the region then runs
    on the caller, with no workers to wake."""
    for _ in prange(1):
        _share(counter, bounds, n1, rpi2, n2, P, gexp, start, pids, pair_tok, pair_w, x, xrows, H, w3, fmt3, q8, kind3,
               xact, hact, tab16, tabbf, mmin1, mmin2, maxc, pf, out, zero_items, stamp)


@intrinsic
def _unowned(typingctx, a):
    """Array ``a``, or each array of the tuple ``a``, as a view without its owner (a null
    meminfo), as the arrays of a ``prange`` body are (Numba's gufunc wrapper makes them so):
    Numba counts each view it makes of an owned array, and each time it passes one on, in the
    owner's reference count, a locked add (NRT_incref / NRT_decref), and the items make several
    a row dot (the row, x's activation forms ``XQK[t]``, ``XQ8[t]``, ...); without an owner
    those calls return at once. The caller must keep ``a`` alive while a view is in use."""
    arrays = a.types if isinstance(a, types.BaseTuple) else (a,)
    if not all(isinstance(t, types.Array) for t in arrays):
        return None

    def codegen(context, builder, sig, args):
        def bare(ty, value):
            src = context.make_array(ty)(context, builder, value)
            view = context.make_array(ty)(context, builder)
            context.populate_array(view, data=src.data, shape=src.shape, strides=src.strides,
                                   itemsize=src.itemsize, meminfo=None)
            return view._getvalue()

        if not isinstance(a, types.BaseTuple):
            return bare(a, args[0])
        items = [bare(t, builder.extract_value(args[0], i)) for i, t in enumerate(a.types)]
        return context.make_tuple(builder, a, items)

    return a(a), codegen


@njit(fastmath=True, cache=True, nogil=True)  # the kernel's flags: the items' arithmetic must match
def _share_plain(counter, bounds, n1, rpi2, n2, P, gexp, start, pids, pair_tok, pair_w, x, xrows, H, w3, fmt3, q8,
                 kind3, xact, hact, tab16, tabbf, mmin1, mmin2, maxc, pf, out, zero_items, stamp):
    """``_share`` on the calling thread without a parallel region, on views of its arrays
    without their owners (_unowned), as ``_share_alone``'s ``prange`` body has them. With the
    owners, the same items ran 1.8x slower a host expert on one thread of the 2-core VM, half of
    their samples (perf) in NRT_incref / NRT_decref's locked adds; without, 0.96x
    ``_share_alone``'s, the same bits. The caller holds the arrays for the call."""
    u = _unowned
    _share(u(counter), u(bounds), n1, rpi2, n2, P, u(gexp), u(start), u(pids), u(pair_tok), u(pair_w), u(x), xrows,
           u(H), u(w3), fmt3, q8, kind3, u(xact), u(hact), u(tab16), u(tabbf), mmin1, mmin2, maxc, pf, u(out),
           zero_items, stamp)


@njit(fastmath=True, cache=True, nogil=True)
def _team_part(out, x, experts, weights, on_host, gw, uw, dw, gfmt, ufmt, dfmt, q8, tab16, tabbf, rpi, mmin1, mmin2,
               pf, parts, scratch, counter, tid, nthreads, plain):
    """Thread ``tid``'s part of a layer call on the host team (ffi_bridge.cc): the same items, the
    same dots in the same order as ``_moe_kernel``'s one region, so the same bits. Every thread
    groups the pairs and rounds x itself (the same values on each; microseconds for the few tokens
    a team call has), instead of waiting for one thread to do it; the hidden rows go to
    ``scratch`` (``team_scratch``, shared), the counters are zero when the call starts; the thread
    stamps its phases after them (ffi_layout.TEAM_STAMPS). ``plain``: the shared items run in
    _share_plain, on arrays without owners as the region's are, instead of a one-thread parallel
    region (_share_alone), whose launch made some of 14 threads 70-90 us late on an H200 host
    (twenty-seventh session)."""
    stamp = COUNTER_WORDS + 8 * tid
    _stamp(counter, stamp, 0)
    N, D = x.shape
    E, F = gw.shape[0], gw.shape[1]
    start, pair_tok, pair_w, pids, gexp, maxc = _group(experts, weights, on_host, E)
    P = start[E]
    if P == 0:
        if tid == 0:
            out[:] = 0.0
        return
    _stamp(counter, stamp, 1)
    XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0 = _act_buffers(N, D)
    ka, kb, kd = _kind(gfmt, q8), _kind(ufmt, q8), _kind(dfmt, q8)
    for n in range(N):
        _prepare_row(x, n, ka, kb, XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0)
    H, HS, HQK, HDK, HBK, HQ8, H16, HQ0, HD0 = scratch
    bounds, rpi2 = _items(start, gexp, F, D, rpi, nthreads, nthreads * parts, mmin1)
    _stamp(counter, stamp, 2)
    xact = (XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0)
    hact = (HS[:P], HQK[:P], HDK[:P], HBK[:P], HQ8[:P], H16[:P], HQ0[:P], HD0[:P])
    n1, n2 = bounds.shape[0] - 1, (D + rpi2 - 1) // rpi2
    if plain:
        _share_plain(counter, bounds, n1, rpi2, n2, P, gexp, start, pids, pair_tok, pair_w, x, 0, H[:P], (gw, uw, dw),
                     (gfmt, ufmt, dfmt), q8, (ka, kb, kd), xact, hact, tab16, tabbf, mmin1, mmin2, maxc, pf, out, True,
                     stamp)
    else:
        _share_alone(counter, bounds, n1, rpi2, n2, P, gexp, start, pids, pair_tok, pair_w, x, 0, H[:P], (gw, uw, dw),
                     (gfmt, ufmt, dfmt), q8, (ka, kb, kd), xact, hact, tab16, tabbf, mmin1, mmin2, maxc, pf, out, True,
                     stamp)


def team_scratch(pairs: int, F: int) -> tuple:
    """The hidden rows of a team call of up to ``pairs`` host pairs, and their activation forms:
    float32 H [pairs, F], then _act_buffers(pairs, F)'s eight arrays."""
    return (np.empty((pairs, F), np.float32), *_act_buffers(pairs, F))


@njit(inline="always", nogil=True)
def _item_starts(first):
    """Stamps this thread's first work item of the region (threads beyond ``first``'s slots: none)."""
    i = 8 * numba.get_thread_id()
    if i < first.shape[0] and first[i] == 0:
        first[i] = ticks()


@njit(inline="always", nogil=True)
def _item_ends(last):
    """Stamps the end of this thread's latest work item."""
    i = 8 * numba.get_thread_id()
    if i < last.shape[0]:
        last[i] = ticks()


@njit(cache=True, nogil=True)
def _region_spans(spans, t0, first, last):
    """After a parallel region that began at ``t0``: adds its span, the wait for the last thread
    to start work (the workers' wake-up) and the wait after the last item ended (the join) to
    ``spans``, and clears the stamps for the next region."""
    t1 = ticks()
    began, ended = 0, 0
    for i in range(0, first.shape[0], 8):
        began, ended = max(began, first[i]), max(ended, last[i])
        first[i], last[i] = 0, 0
    spans[SPAN_REGIONS] += t1 - t0
    if began > 0:
        spans[SPAN_WAKE] += began - t0
        spans[SPAN_JOIN] += t1 - ended


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _moe_kernel(out, x, experts, weights, on_host, gw, uw, dw, gfmt, ufmt, dfmt, q8, tab16, tabbf, rpi, nthreads,
                mmin1, mmin2, pf, regions, parts, spans):
    # writes float32 out [N, D] (also returned); adds the call's tick spans to spans [SPANS]
    t_in = ticks()
    N, D = x.shape
    E, F = gw.shape[0], gw.shape[1]
    out[:] = 0.0

    # The only parallel regions are the prange loops below (no array expressions here: each
    # would be a region of its own, test_host_experts.py counts them).
    start, pair_tok, pair_w, pids, gexp, maxc = _group(experts, weights, on_host, E)
    P = start[E]
    if P == 0:
        spans[SPAN_CALL] += ticks() - t_in
        return out

    # each thread's first start and last end of a work item in the current region, a cache line apart
    first, last = _zeros(8 * nthreads), _zeros(8 * nthreads)
    XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0 = xact = _act_buffers(N, D)
    ka, kb = _kind(gfmt, q8), _kind(ufmt, q8)
    # a decode call's few activation rows are prepared in the region that reads them, a large
    # call's in a region of their own (SERIAL_PREP_MAX)
    counter = _zeros(COUNTER_WORDS)
    xrows = 0 if N * D >= SERIAL_PREP_MAX else N  # rows of x the first region prepares
    if xrows == 0:
        t0 = ticks()
        for n in prange(N):
            _item_starts(first)
            _prepare_row(x, n, ka, kb, XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0)
            _item_ends(last)
        _region_spans(spans, t0, first, last)
    H = np.empty((P, F), np.float32)
    HS, HQK, HDK, HBK, HQ8, H16, HQ0, HD0 = hact = _act_buffers(P, F)
    kd = _kind(dfmt, q8)
    bounds, rpi2 = _items(start, gexp, F, D, rpi, nthreads, nthreads * parts if regions == 1 else nthreads, mmin1)
    n1, n2 = bounds.shape[0] - 1, (D + rpi2 - 1) // rpi2

    if regions == 1:
        # One parallel region: each thread takes items from shared counters (_share)
        t0 = ticks()
        for _ in prange(nthreads):
            _item_starts(first)
            _share(counter, bounds, n1, rpi2, n2, P, gexp, start, pids, pair_tok, pair_w, x, xrows, H, (gw, uw, dw),
                   (gfmt, ufmt, dfmt), q8, (ka, kb, kd), xact, hact, tab16, tabbf, mmin1, mmin2, maxc, pf, out, False,
                   -1)
            _item_ends(last)
        _region_spans(spans, t0, first, last)
        spans[SPAN_CALL] += ticks() - t_in
        return out

    # Two parallel regions (and one for the hidden rows of a large call), joined between.
    t0 = ticks()
    for it in prange(n1):
        _item_starts(first)
        if xrows > 0:
            _prepare_taken(counter, X_TAKEN, x, xrows, ka, kb, xact)
        _gate_up_item(bounds[it], bounds[it + 1], gexp, start, pair_tok, x, H, gw, uw, gfmt, ufmt, q8, ka, kb,
                      XS, XQK, XDK, XBK, XQ8, X16, XQ0, XD0, tab16, tabbf, mmin1, maxc, pf)
        _item_ends(last)
    _region_spans(spans, t0, first, last)
    hrows = 0 if P * F >= SERIAL_PREP_MAX else P  # hidden rows phase 2's region prepares
    if hrows == 0:
        t0 = ticks()
        for p in prange(P):
            _item_starts(first)
            _prepare_row(H, p, kd, kd, HS, HQK, HDK, HBK, HQ8, H16, HQ0, HD0)
            _item_ends(last)
        _region_spans(spans, t0, first, last)
    t0 = ticks()
    for it in prange(n2):
        _item_starts(first)
        if hrows > 0:
            _prepare_taken(counter, H_TAKEN, H, hrows, kd, kd, hact)
        _down_item(it * rpi2, min(D, (it + 1) * rpi2), gexp, start, pids, pair_tok, pair_w, H, dw, dfmt, q8,
                   kd, HS, HQK, HDK, HBK, HQ8, H16, HQ0, HD0, tab16, tabbf, mmin2, maxc, pf, out)
        _item_ends(last)
    _region_spans(spans, t0, first, last)
    spans[SPAN_CALL] += ticks() - t_in
    return out
