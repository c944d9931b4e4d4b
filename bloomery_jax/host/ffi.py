"""The host bridge through an XLA FFI custom call: the layer kernel runs without Python.

Contract. ``FfiHostBridge(layers, threads)`` is a :class:`~.bridge.HostBridge` whose ``moe`` is
one ``jax.ffi.ffi_call`` of ``ffi_bridge.cc`` per layer, with the same result bit for bit (the
same kernel, ``entry.layer_entry``, at the same thread count). On the CPU the handler runs the
kernel on XLA's buffers; on a CUDA device it enqueues the copies to and from pinned staging
buffers and the kernel on the step's stream, with no synchronisation, so XLA may keep the whole
step one CUDA graph. How the stream hands the kernel to the host is the bridge's ``signal``
(``ffi_layout.SIGNALS``): ``doorbell`` (the default: the stream writes a pinned word that a
spinning worker thread answers; ``ffi_bridge.cc``'s header) or ``hostfunc`` (``cuLaunchHostFunc``,
the driver's callback thread; slower on the H100: 63 against 35 us an empty layer call, and
n-cpu-moe=36 decode 36.6 against 41.0 tok/s, benchmarks/gpu_2026-12-05-s16 and -s17);
``BLOOMERY_FFI_SIGNAL`` sets the default. ``stream`` (prefill streaming) is a second
custom call that copies a layer's whole expert tensor to the step's device.

The library is compiled on first use with the system's C++ compiler (``$CXX``, else ``g++``,
``c++`` or ``clang++``) against jaxlib's FFI headers, into ``<user cache>/ffi`` keyed on its
source, the record layout and the jaxlib version; it needs no CUDA toolkit (the driver is
opened at run time). No compiler, or a failed build, is a :class:`~bloomery_jax.errors.ConfigError`
at load that names what is missing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import heapq
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from . import ffi_layout as F
from .bridge import BridgeStats, HostBridge
from .memory import host_buffer, mapped_bytes
from .swiglu import (_TAB16, _TABBF, CHUNKSIZE, EXPERT_ROLES, PARTS, PREFETCH_BYTES, REGIONS, ROWS_PER_ITEM, SPANS,
                     HostExpertLayer, kernel_settings, team_scratch)

SOURCE = Path(__file__).resolve().parent / "ffi_bridge.cc"
TARGET = "bloomery_host_moe"
START_TARGET, FINISH_TARGET = "bloomery_host_moe_start", "bloomery_host_moe_finish"  # a call in two halves
STREAM_TARGET = "bloomery_host_stream"
N_SLOTS = 1 << 16  # ffi_bridge.cc's kSlots


def compiler() -> str:
    """The C++ compiler that builds the ffi library; ConfigError when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise ConfigError("the ffi host bridge needs a C++ compiler (g++, c++ or clang++ on PATH, or $CXX); "
                      "use --bridge callback")


@functools.cache
def library() -> ctypes.CDLL:
    """Build (once per source and jaxlib), load and register the handlers; the loaded library."""
    import jaxlib

    from ..default_model import cache_dir

    cxx = compiler()
    header = F.c_header()
    key = hashlib.sha256(SOURCE.read_bytes() + header.encode() + jaxlib.__version__.encode() + cxx.encode())
    path = cache_dir() / "ffi" / f"libbloomery_bridge-{key.hexdigest()[:16]}.so"
    if not path.exists():
        _build(cxx, header, path)
    lib = ctypes.CDLL(str(path))
    if lib.bloomery_ffi_record_words() != F.WORDS:
        raise ConfigError(f"{path}: the bridge library's record layout does not match ffi_layout.py")
    lib.bloomery_ffi_set_record.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    lib.bloomery_ffi_pinned_alloc.restype = ctypes.c_void_p
    lib.bloomery_ffi_pinned_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    lib.bloomery_ffi_doorbell_start.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.bloomery_ffi_host_register.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                               ctypes.c_size_t]
    lib.bloomery_ffi_rows_to_device.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]
    on_cuda = _on_cuda()
    for target, cpu, cuda in ((TARGET, lib.BloomeryHostMoeCpu, lib.BloomeryHostMoeCuda),
                              (START_TARGET, lib.BloomeryHostMoeCpu, lib.BloomeryHostMoeStartCuda),
                              (FINISH_TARGET, lib.BloomeryHostMoeFinishCpu, lib.BloomeryHostMoeFinishCuda),
                              (STREAM_TARGET, lib.BloomeryStreamCpu, lib.BloomeryStreamCuda)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(cpu), platform="cpu")
        if on_cuda:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(cuda), platform="CUDA")
    return lib


def _build(cxx: str, header: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        (Path(tmp) / "bloomery_ffi_layout.h").write_text(header)
        out = Path(tmp) / path.name
        cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wno-return-type", f"-I{tmp}",
               f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out), "-ldl"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ConfigError(f"building the ffi host bridge failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
        os.replace(out, path)  # atomic: another process may be building the same file


def _numba_setter(name: str) -> int:
    """Address of the C function behind ``numba.<name>`` (``set_num_threads``,
    ``set_parallel_chunksize``: each sets the calling thread's value; the handler's thread is
    not a Python thread). Numba keeps them in a private module."""
    import numba
    from numba.np.ufunc import parallel

    numba.get_num_threads()  # starts the threading layer, which sets the pointers
    fn = getattr(parallel, f"_{name}", None)
    if fn is None:
        raise ConfigError(f"the ffi host bridge does not know this Numba ({numba.__version__}): no "
                          f"numba.np.ufunc.parallel._{name}; use --bridge callback")
    return ctypes.cast(fn, ctypes.c_void_p).value


def pack_inputs(h, experts, weights, on_host) -> jax.Array:
    """A host call's inputs as one byte vector (``ffi_bridge.cc``'s ``Packed``): x f32 [n, D],
    experts s32 [n, k], weights f32 [n, k], on_host bool [E], in native byte order. One buffer
    is one device-to-host copy a call instead of four (each a transfer of its own latency)."""
    as_bytes = lambda a, dtype: jax.lax.bitcast_convert_type(a.astype(dtype), jnp.uint8).reshape(-1)  # noqa: E731
    return jnp.concatenate([as_bytes(h, jnp.float32), as_bytes(experts, jnp.int32), as_bytes(weights, jnp.float32),
                            on_host.astype(jnp.uint8).reshape(-1)])


def _on_cuda() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def resolve_overlap(overlap: bool | None) -> bool:
    """Whether layers with card and host experts make their host call in two halves around the
    card's experts: ``overlap``, else ``$BLOOMERY_FFI_OVERLAP`` ("1" or "0"), else on. Only the
    doorbell signal lets the card run between the halves (with hostfunc they cost what a whole
    call does). On an H100 with a quarter of the experts on the card, halves against whole calls
    in one call: lfu-stream 113.2 against 93.1 tok/s, static 86.9 against 75.0 (twenty-first
    session, benchmarks/gpu_2026-12-06-s21)."""
    return _switch(overlap, "BLOOMERY_FFI_OVERLAP", "1")


def _switch(value: bool | None, env: str, default: str) -> bool:
    """``value``, else the environment variable ``env`` ("1" or "0", else a ConfigError), else ``default``."""
    if value is not None:
        return bool(value)
    setting = os.environ.get(env, default)
    if setting not in ("0", "1"):
        raise ConfigError(f"{env}={setting!r}: want 1 (on) or 0 (off)")
    return setting == "1"


# Host calls of at most this many tokens (decode) run on the host team when it is on; a team call
# holds its hidden rows in scratch of TEAM_TOKENS * k rows, shared by the bridge's layers.
TEAM_TOKENS = 8


def resolve_team(team: bool | None) -> bool:
    """Whether decode-sized host calls run on ``ffi_bridge.cc``'s host team (threads that stay
    awake between calls, no parallel region's fork and join) rather than in the Numba parallel
    kernel: ``team``, else ``$BLOOMERY_HOST_TEAM`` ("1" or "0"), else on where the threading
    layer can run it (below). The same bits either way. The team runs each thread's items in
    plain calls (``$BLOOMERY_HOST_TEAM_PLAIN``, default 1: ffi_layout.TEAM_PLAIN), which on two
    H100 hosts decoded n-cpu-moe=36 at 91.1 and 65.8 tok/s against two regions' 79.4 and 58.6
    (benchmarks/gpu_2026-12-07-s29: wake 1.0-1.5 us and join 0.3-0.5 against 20-36 and 11-20);
    with ``$BLOOMERY_HOST_TEAM_PLAIN=0`` each thread runs its items in a one-thread Numba region
    of its own (swiglu._share_alone), which Numba's reference counting had made 1.3-1.6x slower
    than two regions (twenty-second and twenty-eighth sessions, docs/LOG.md).
    ``$BLOOMERY_HOST_TEAM_SPIN_US`` (default 20000): how long its threads spin after a call before
    they sleep. The one-thread regions cannot start from several threads at once on the
    ``workqueue`` threading layer: there the team is off unless asked for, and asking is a
    ConfigError."""
    if team is None and "BLOOMERY_HOST_TEAM" not in os.environ:
        return _threading_layer() != "workqueue"
    on = _switch(team, "BLOOMERY_HOST_TEAM", "0")
    if on and _threading_layer() == "workqueue":
        raise ConfigError("the host team (BLOOMERY_HOST_TEAM=1) needs Numba's omp or tbb threading layer; this "
                          "process has workqueue (NUMBA_THREADING_LAYER, or no OpenMP or TBB runtime)")
    return on


def _threading_layer() -> str:
    """The Numba threading layer this process runs parallel regions on."""
    import numba

    numba.get_num_threads()  # starts the threading layer, as _numba_setter does
    return numba.threading_layer()


def resolve_signal(signal: str | None) -> str:
    """The bridge's signal: ``signal``, else ``$BLOOMERY_FFI_SIGNAL``, else ``doorbell``."""
    name = signal or os.environ.get("BLOOMERY_FFI_SIGNAL") or "doorbell"
    if name not in F.SIGNALS:
        raise ConfigError(f"ffi host bridge signal {name!r} is not one of {', '.join(F.SIGNALS)}")
    return name


class _Slots:
    """The library's record table: lowest free slot first, so the first bridge of every process
    gets the same slots and a step from the persistent compilation cache names the right ones."""

    def __init__(self):
        self._free = list(range(N_SLOTS))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        with self._lock:
            if len(self._free) < n:
                raise ConfigError(f"the ffi host bridge has {len(self._free)} free layer slots, {n} wanted")
            return [heapq.heappop(self._free) for _ in range(n)]

    def give(self, slots) -> None:
        with self._lock:
            for s in slots:
                heapq.heappush(self._free, s)


_SLOTS = _Slots()


def _release(lib, slots: dict) -> None:
    for s in slots.values():
        lib.bloomery_ffi_set_record(s, None)
    _SLOTS.give(slots.values())


class FfiHostBridge(HostBridge):
    """Host experts of a model behind the FFI custom calls (module docstring).

    On a CUDA device the experts are first copied from the file into pinned memory, which the
    host kernels then read and from which prefill streams them to the card (``stream``: one
    ``cuMemcpyAsync`` per tensor on the step's stream, at the link's speed; from the file's
    pageable pages a copy goes through a bounce buffer at a fraction of it).

    Args:
      layers: MoE layer index → its three expert tensors on the host.
      threads: Numba threads for the host kernels (None = Numba's default).
      signal: how a CUDA stream hands the kernel to the host (:func:`resolve_signal`).
      overlap: make each call in two halves around the layer's card experts (:func:`resolve_overlap`).
      team: run decode-sized calls on the host team (:func:`resolve_team`).
    """

    # No branch around ``moe``: XLA's CUDA graphs leave conditionals out by default, and outside a
    # graph a conditional reads its predicate on the host, which would synchronise the stream at
    # every layer and cut the step's graph there. A call with no host pair copies the
    # activations and back and runs a kernel that returns at once.
    skip_empty_calls = False

    def __init__(self, layers: dict[int, HostExpertLayer], threads: int | None = None, signal: str | None = None,
                 pages: str | None = None, overlap: bool | None = None, team: bool | None = None):
        from .entry import layer_entry, team_entry

        self.signal = resolve_signal(signal)
        self.overlap = resolve_overlap(overlap)
        self.team = resolve_team(team)
        self._team_scratch = None  # (k, the arrays, their addresses, the counters), once a call sets k
        self._lib = library()
        self._pinned_buffers: list = []  # never freed: recorded CUDA graphs may copy to or from them
        super().__init__(layers, threads, pages)
        entry = dict(FN=layer_entry.address, SET_THREADS=_numba_setter("set_num_threads"), THREADS=self.threads,
                     SET_CHUNKSIZE=_numba_setter("set_parallel_chunksize"), CHUNKSIZE=CHUNKSIZE,
                     SIGNAL=F.SIGNALS.index(self.signal), TEAM=int(self.team), TEAM_FN=team_entry.address,
                     TEAM_TOKENS=TEAM_TOKENS, TEAM_SPIN_US=int(os.environ.get("BLOOMERY_HOST_TEAM_SPIN_US", "20000")),
                     TEAM_PLAIN=int(_switch(None, "BLOOMERY_HOST_TEAM_PLAIN", "1")))
        if self.signal == "doorbell" and _on_cuda():
            for device in jax.devices("gpu"):
                self.start_doorbell(device.id)
        self._records = {i: self._record(layer, entry) for i, layer in self.layers.items()}
        self._slots = dict(zip(self._records, _SLOTS.take(len(self._records))))
        for i, s in self._slots.items():
            self._lib.bloomery_ffi_set_record(s, self._records[i].ctypes.data)
        weakref.finalize(self, _release, self._lib, dict(self._slots))
        self._stage_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FfiHostBridge({len(self.layers)} layers, {self.signal})"

    def start_doorbell(self, ordinal: int) -> None:
        """Start device ``ordinal``'s doorbell and the worker that answers it (once a process)."""
        err = ctypes.create_string_buffer(256)
        if self._lib.bloomery_ffi_doorbell_start(ordinal, err, len(err)):
            raise ConfigError(f"ffi host bridge, doorbell signal: {err.value.decode()} "
                              "(BLOOMERY_FFI_SIGNAL=hostfunc takes the driver's host-function thread)")

    @staticmethod
    def _record(layer: HostExpertLayer, entry: dict) -> np.ndarray:
        s = kernel_settings(layer)
        D, Fd = layer.dims
        g, u, d = layer.gate.raw, layer.up.raw, layer.down.raw
        rec = np.zeros(F.WORDS, np.int64)
        values = dict(entry, D=D, F=Fd, E=layer.n_experts, K=0, GATE=g.ctypes.data, UP=u.ctypes.data,
                      DOWN=d.ctypes.data, GATE_ROW_BYTES=g.shape[2], UP_ROW_BYTES=u.shape[2],
                      DOWN_ROW_BYTES=d.shape[2], GATE_FMT=s.formats[0], UP_FMT=s.formats[1],
                      DOWN_FMT=s.formats[2], Q8=int(s.q8), ROWS_PER_ITEM=ROWS_PER_ITEM, PREFETCH_BYTES=PREFETCH_BYTES,
                      REGIONS=REGIONS, PARTS=PARTS, MULTI_MIN1=s.mmin1, MULTI_MIN2=s.mmin2,
                      TAB16=_TAB16.ctypes.data, TABBF=_TABBF.ctypes.data)
        for name, v in values.items():
            rec[getattr(F, name)] = int(v)
        return rec

    @property
    def stats(self) -> BridgeStats:
        recs = self._records.values()
        return BridgeStats(calls=int(sum(r[F.CALLS] for r in recs)), pairs=int(sum(r[F.PAIRS] for r in recs)),
                           seconds=sum(int(r[F.NANOS]) for r in recs) * 1e-9,
                           streamed_bytes=int(sum(r[F.STREAMED] for r in recs)),
                           ticks=tuple(int(sum(r[F.TICKS + j] for r in recs)) for j in range(len(SPANS))))

    def moe(self, i: int, h: jax.Array, experts: jax.Array, weights: jax.Array, on_host: jax.Array) -> jax.Array:
        """As :meth:`HostBridge.moe`, through the custom call."""
        return self._call(TARGET, i, h, experts, weights, on_host)

    def moe_start(self, i: int, h: jax.Array, experts: jax.Array, weights: jax.Array, on_host: jax.Array) -> jax.Array:
        """The first half of :meth:`moe`: hands the call to the host and returns at once on a CUDA
        stream with the doorbell signal. The result is only for :meth:`moe_finish`."""
        return self._call(START_TARGET, i, h, experts, weights, on_host)

    def moe_finish(self, i: int, started: jax.Array, after: jax.Array) -> jax.Array:
        """The second half: layer ``i``'s host-expert output (as :meth:`moe`'s) from
        :meth:`moe_start`'s result. ``after`` is any array the step must compute first (the
        layer's card experts): it is an operand only, so that the wait for the host comes after it."""
        call = jax.ffi.ffi_call(FINISH_TARGET, jax.ShapeDtypeStruct(started.shape, jnp.float32))
        return call(started, after, slot=np.int64(self._slots[i]))

    def _call(self, target: str, i: int, h, experts, weights, on_host) -> jax.Array:
        n, k = experts.shape
        rec = self._records[i]
        if rec[F.K] not in (0, k):
            raise ValueError(f"FfiHostBridge: layer {i} was called with k = {rec[F.K]} and now {k}")
        rec[F.K] = k
        if self.team:
            self._ensure_team_scratch(k)
        if _on_cuda():
            self._ensure_staging(n, k)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(h.shape, jnp.float32))
        return call(pack_inputs(h, experts, weights, on_host), slot=np.int64(self._slots[i]))

    def stream(self, i: int, role: str):
        """As :meth:`HostBridge.stream`, through the custom call (a copy on the step's stream)."""
        from ..quant import QTensor

        t = getattr(self.layers[i], role)
        call = jax.ffi.ffi_call(STREAM_TARGET, jax.ShapeDtypeStruct(t.data.shape, t.data.dtype))
        return QTensor(call(slot=np.int64(self._slots[i]), role=np.int64(EXPERT_ROLES.index(role))), int(t.qtype),
                       tuple(t.shape))

    def experts_on_card(self, i: int, experts, device) -> jax.Array:
        """As :meth:`HostBridge.experts_on_card`; on a GPU each expert is copied from the pinned
        host copy straight into the fresh device buffer (no gather into a staging copy first)."""
        if not _on_cuda():
            return super().experts_on_card(i, experts, device)
        ids = np.ascontiguousarray(experts, np.int64)
        srcs = [getattr(self.layers[i], r).data for r in EXPERT_ROLES]  # [E, rows, row_bytes] in pinned memory
        row_bytes = [s.nbytes // s.shape[0] for s in srcs]
        out = jnp.zeros(ids.size * sum(row_bytes), jnp.uint8, device=device)
        out.block_until_ready()  # nothing of XLA's may still be writing it
        err = ctypes.create_string_buffer(256)
        dst = out.unsafe_buffer_pointer()
        for src, nbytes in zip(srcs, row_bytes):
            if self._lib.bloomery_ffi_rows_to_device(device.id, dst, src.ctypes.data, ids.ctypes.data, ids.size,
                                                     nbytes, err, len(err)):
                raise ConfigError(f"ffi host bridge: copying experts to the card: {err.value.decode()}")
            dst += ids.size * nbytes
        return out

    def _placed(self, layer: HostExpertLayer) -> HostExpertLayer:
        """On a CUDA device, ``layer`` copied into page-locked memory: the driver's
        (``cuMemHostAlloc``, 4 KiB pages) for "small" pages, or :func:`host_buffer`'s huge pages
        page-locked by ``cuMemHostRegister`` for "huge". Elsewhere as :class:`HostBridge`."""
        if not _on_cuda():
            return super()._placed(layer)
        if self.pages == "huge":
            return layer.copied(self._registered)
        return layer.copied(lambda n: np.frombuffer((ctypes.c_uint8 * n).from_address(self._pinned(n)), np.uint8))

    def _registered(self, size: int) -> np.ndarray:
        """A huge-page host buffer of ``size`` bytes, touched, then page-locked for the device's copies."""
        buf = host_buffer(size, "huge")
        buf.fill(0)  # fault the pages in (as huge pages) before the driver pins them
        err = ctypes.create_string_buffer(256)
        if self._lib.bloomery_ffi_host_register(jax.devices()[0].id, ctypes.c_void_p(buf.ctypes.data),
                                                ctypes.c_size_t(mapped_bytes(size)), err, len(err)):
            raise ConfigError(f"ffi host bridge: page-locking {size} bytes of huge-page memory: "
                              f"{err.value.decode()} (BLOOMERY_HOST_PAGES=small takes the driver's pinned memory)")
        self._pinned_buffers.append(buf)
        return buf

    def _ensure_staging(self, n: int, k: int) -> None:
        """Pinned staging for ``n`` tokens in every record (one set for the bridge: the layers'
        calls follow each other on the stream). Grows only; the old buffers are kept, since a
        recorded CUDA graph goes on copying to the addresses it was recorded with."""
        with self._stage_lock:
            first = next(iter(self._records.values()))
            if first[F.STAGE_TOKENS] >= n:
                return
            D, E = int(first[F.D]), int(first[F.E])
            sizes = dict(STAGE_IN=4 * n * D + 8 * n * k + E, STAGE_OUT=4 * n * D)  # as ffi_bridge.cc's Packed
            addresses = {name: self._pinned(size) for name, size in sizes.items()}
            for rec in self._records.values():
                for name, a in addresses.items():
                    rec[getattr(F, name)] = a
                rec[F.STAGE_TOKENS] = n

    def _ensure_team_scratch(self, k: int) -> None:
        """The host team's hidden rows for calls of ``k`` experts a token, in every record (one set
        for the bridge: team calls run one at a time)."""
        with self._stage_lock:
            if self._team_scratch is not None:
                if self._team_scratch[0] != k:
                    raise ValueError(f"FfiHostBridge: the host team's scratch is for k = {self._team_scratch[0]}, not {k}")
                return
            first = next(iter(self._records.values()))
            pairs = TEAM_TOKENS * k
            arrays = team_scratch(pairs, int(first[F.F]))
            addresses = np.array([a.ctypes.data for a in arrays], np.int64)
            counters = np.zeros(F.COUNTER_WORDS + 8 * self.threads, np.int64)  # and each thread's stamps
            self._team_scratch = (k, arrays, addresses, counters)
            for rec in self._records.values():
                rec[F.TEAM_SCRATCH], rec[F.TEAM_PAIRS] = addresses.ctypes.data, pairs
                rec[F.TEAM_COUNTERS] = counters.ctypes.data

    def _pinned(self, size: int) -> int:
        err = ctypes.create_string_buffer(256)
        device = jax.devices()[0].id
        p = self._lib.bloomery_ffi_pinned_alloc(device, max(size, 64), err, len(err))
        if not p:
            raise ConfigError(f"ffi host bridge: pinned memory of {size} bytes: {err.value.decode()}")
        self._pinned_buffers.append(p)
        return p
