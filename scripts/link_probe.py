"""Can the link to the card carry some of a decode step's host experts while the host computes the rest?

A design probe for issues 8 and 9, run on the GPU machine. A decode layer's host call reads each
chosen expert once (Qwen3-30B-A3B, Q4_K_M: ~3.06 MB an expert) at the host kernels' rate (~59
GB/s on the H100's 16-core host, 0.71 of its read bandwidth). If the link from pinned memory to
the card runs at tens of GB/s *while* the host kernels run, a layer could send s of its host
experts to the card and compute only the rest on the host: both finish sooner than the host
alone. Both read the same DRAM, so the question is how much they slow each other.

Measured, with the experts in the FFI bridge's pinned memory (what the engine's host kernels read
and prefill streams from), median over ``--reps`` after a warm-up, each step's routing walking
through the E experts so that little comes from the last-level cache:

- ``read_gbs``: a 14-thread Numba float32 sum over 1 GiB (the host's read bandwidth);
- ``bulk``: one 24.5 MB copy to the card (the link alone, one transfer);
- ``link[s]``: s experts copied as a step would (their gate, up and down rows: 3 copies);
- ``host[m]``: the host kernels' layer call, one token, m of its 8 experts on the host;
- ``host8_under_link``: ``host[8]`` while another thread keeps copying experts, and that
  thread's GB/s meanwhile: how much each slows the other;
- ``split[s]``: ``host[8 - s]`` and the copy of the other s experts started together; ``both``
  is when the later one ends. Against ``host[8]``: the gain a split layer call could have before
  the card's own work on the s experts (~3 us each at the card's GEMV rates).

Copies are synchronous ``cuMemcpyHtoD`` calls on a thread of their own (the GIL is released in
them), one per expert tensor, so ``link[s]`` carries a call's latency per copy that a stream of
queued copies would hide. Without a GPU the copies are host memcpys, which only checks the script.

    python scripts/link_probe.py --reps 30 --json link.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numba
import numpy as np

from bloomery_jax.host import host_moe_swiglu
from bloomery_jax.host.bridge import default_threads
from bloomery_jax.host.ffi import FfiHostBridge, _on_cuda
from bloomery_jax.host.swiglu import EXPERT_ROLES
from host_bench import make_layer, read_bandwidth

K = 8  # experts a token


class Link:
    """Copies of whole experts (gate, up and down rows) from the bridge's pinned layer to one
    device buffer, synchronously, on the calling thread."""

    def __init__(self, bridge: FfiHostBridge, max_experts: int):
        layer = bridge.layers[0]
        self.srcs = [getattr(layer, r).data for r in EXPERT_ROLES]  # [E, rows, row_bytes] each
        self.expert_bytes = [s.nbytes // s.shape[0] for s in self.srcs]
        self.cuda = _on_cuda()
        n = max(max_experts * sum(self.expert_bytes), 8 * self.expert_bytes[0])
        if self.cuda:
            self.device = jax.devices()[0]
            self.buf = jnp.zeros(n, jnp.uint8, device=self.device)
            self.buf.block_until_ready()
            self.dst = self.buf.unsafe_buffer_pointer()
            self.lib = bridge._lib
        else:
            self.buf = np.empty(n, np.uint8)
        self.err = ctypes.create_string_buffer(256)

    def _rows(self, dst_offset: int, src: np.ndarray, ids: np.ndarray, row_bytes: int) -> None:
        if not self.cuda:
            for j, e in enumerate(ids):
                self.buf[dst_offset + j * row_bytes:dst_offset + (j + 1) * row_bytes] = src.reshape(-1)[
                    e * row_bytes:(e + 1) * row_bytes]
            return
        if self.lib.bloomery_ffi_rows_to_device(self.device.id, self.dst + dst_offset, src.ctypes.data,
                                                ids.ctypes.data, ids.size, row_bytes, self.err, len(self.err)):
            raise RuntimeError(self.err.value.decode())

    def experts(self, ids) -> int:
        """Copy experts ``ids``; returns the bytes moved."""
        ids = np.ascontiguousarray(ids, np.int64)
        offset = 0
        for src, nbytes in zip(self.srcs, self.expert_bytes):
            self._rows(offset, src, ids, nbytes)
            offset += ids.size * nbytes
        return offset

    def bulk(self, experts: int) -> int:
        """One copy of the first ``experts`` experts' gate bytes (contiguous)."""
        nbytes = experts * self.expert_bytes[0]
        self._rows(0, self.srcs[0], np.zeros(1, np.int64), nbytes)
        return nbytes


def _median_ms(ts) -> float:
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--splits", default="2,3,4", help="experts of the 8 sent over the link, comma-separated")
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default: the bridges' own)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    threads = args.threads or default_threads()
    numba.set_num_threads(threads)
    E = args.experts
    splits = [int(s) for s in args.splits.split(",")]
    bridge = FfiHostBridge({0: make_layer("q4_k_m", E, 768, 2048, distinct=8)}, threads=threads, signal="hostfunc")
    layer = bridge.layers[0]
    link = Link(bridge, K)
    expert_mb = sum(link.expert_bytes) / 1e6
    x = np.random.default_rng(0).standard_normal((1, 2048)).astype(np.float32)
    weights = np.full((1, K), 1.0 / K, np.float32)
    step = [0]  # routing walks the experts: 8 new ones each call (of host and link alike)

    def next_experts() -> np.ndarray:
        base = step[0] * K
        step[0] += 1
        return (base + np.arange(K)) % E

    def host_call(ids: np.ndarray, m: int) -> float:
        on_host = np.zeros(E, np.bool_)
        on_host[ids[:m]] = True
        t0 = time.perf_counter()
        host_moe_swiglu(x, ids[None].astype(np.int32), weights, on_host, layer)
        return time.perf_counter() - t0

    def timed(fn, *a) -> float:
        t0 = time.perf_counter()
        fn(*a)
        return time.perf_counter() - t0

    for _ in range(3):  # compile, warm the driver and the workers
        host_call(next_experts(), K)
        link.experts(next_experts()[:3])
        link.bulk(8)
    result = dict(device=str(jax.devices()[0].device_kind), link="cuMemcpyHtoD from pinned" if link.cuda else
                  "host memcpy (no GPU: checks the script only)", threads=threads, experts=E, reps=args.reps,
                  expert_mb=expert_mb, read_gbs=read_bandwidth(np.ones(1024 << 18, np.float32), 5)[0])
    bulk = [timed(link.bulk, 8) for _ in range(args.reps)]
    result["bulk"] = dict(mb=8 * link.expert_bytes[0] / 1e6, ms=_median_ms(bulk),
                          gbs=8 * link.expert_bytes[0] / statistics.median(bulk) / 1e9)
    result["link"] = {}
    for s in sorted({1, 3, 8, *splits}):
        ts = [timed(link.experts, next_experts()[:s]) for _ in range(args.reps)]
        result["link"][s] = dict(ms=_median_ms(ts), gbs=s * expert_mb / 1e3 / statistics.median(ts))
    result["host"] = {}
    for m in sorted({K, *(K - s for s in splits)}):
        ts = [host_call(next_experts(), m) for _ in range(args.reps)]
        result["host"][m] = dict(ms=_median_ms(ts), gbs=m * expert_mb / 1e3 / statistics.median(ts))

    # host[8] while a second thread keeps the link busy
    stop = threading.Event()
    moved = [0, 0.0]
    link_ids = [E // 2]

    def keep_copying():
        t0 = time.perf_counter()
        while not stop.is_set():
            moved[0] += link.experts((link_ids[0] + np.arange(K)) % E)
            link_ids[0] += K
        moved[1] = time.perf_counter() - t0

    th = threading.Thread(target=keep_copying)
    th.start()
    time.sleep(0.01)
    ts = [host_call(next_experts(), K) for _ in range(args.reps)]
    stop.set()
    th.join()
    result["host8_under_link"] = dict(ms=_median_ms(ts), gbs=K * expert_mb / 1e3 / statistics.median(ts),
                                      link_gbs=moved[0] / moved[1] / 1e9)

    # split[s]: the host's share and the link's share of one step's 8 experts, started together
    result["split"] = {}
    for s in splits:
        rows = dict(host=[], link=[], both=[])
        for _ in range(args.reps):
            ids = next_experts()
            go = threading.Barrier(2)
            ends = {}

            def send():
                go.wait()
                link.experts(ids[K - s:])
                ends["link"] = time.perf_counter()

            th = threading.Thread(target=send)
            th.start()
            go.wait()
            t0 = time.perf_counter()
            host_call(ids, K - s)
            ends["host"] = time.perf_counter()
            th.join()
            for key in ("host", "link"):
                rows[key].append(ends[key] - t0)
            rows["both"].append(max(ends.values()) - t0)
        result["split"][s] = {key: _median_ms(v) for key, v in rows.items()}
        result["split"][s]["gain_over_host8"] = result["host"][K]["ms"] / result["split"][s]["both"]
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
