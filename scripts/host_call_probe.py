"""What one decode layer call of the host kernels costs beyond reading its experts.

``link_probe.py`` on the H100's host (2026-12-05, nineteenth session) timed one-token calls with
4, 5, 6 and 8 of the token's experts on the host: 0.235 to 0.377 ms, a line of ~0.037 ms an
expert (3.06 MB: ~83 GB/s, 0.88 of the host's read bandwidth) plus ~0.085 ms a call. The
marginal rate is near the target; the fixed part is what keeps whole calls at 0.69. This splits
that part up, on the bridges' thread count:

- ``region_us``: an empty Numba parallel region (fork and join of the workers);
- for each wait setting (libgomp's spin count, read once a process: each runs in a child) and
  each gap between calls (``--gaps``: the card's work between two layer calls of a decode step,
  during which the workers spin or fall asleep), the call through ``entry.layer_entry`` (the C
  function the FFI bridge calls, no Python) under each kernel layout (``--layouts``: ``r2`` two
  parallel regions, ``r1pN`` one region with N shares a thread; ``python``: the default layout
  through ``host_moe_swiglu``; ``team``: the host team of ``ffi_bridge.cc``, threads that stay
  awake between calls, through its ``bloomery_ffi_run_host``, ``teampN`` with N shares a thread,
  ``teamplain`` without each thread's one-thread parallel region)
  with m of 8 experts on the host,
  and the line fitted through m = 1..8: intercept (fixed µs a call) and slope (µs an expert,
  with its GB/s);
- for the team, ``phases_us``: at each m, when the first and the last thread reached each of its
  stamps (``ffi_layout.TEAM_STAMPS``: its part entered, pairs grouped, items made, the shared
  items entered, its phase-1 items done, all of phase 1, the hidden rows, its part done), µs
  after the call began (medians): where the team's fixed ~0.1-0.3 ms a call goes, which only a
  call with work pays.

Each call's routing walks through the experts so that its weights come from DRAM.

    python scripts/host_call_probe.py --reps 40 --json calls.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

SPINS = {"10k": {"GOMP_SPINCOUNT": "10000"}, "1M": {"GOMP_SPINCOUNT": "1000000"},
         "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def _fit(ms: dict[int, float]) -> dict:
    xs, ys = list(ms), [ms[m] for m in ms]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return dict(intercept_us=(my - slope * mx) * 1e3, slope_us=slope * 1e3)


def child(args) -> dict:
    import numba
    import numpy as np
    from numba import njit, prange

    from bloomery_jax.host import ffi_layout as F
    from bloomery_jax.host import host_moe_swiglu
    from bloomery_jax.host.bridge import default_threads
    from bloomery_jax.host.entry import layer_entry
    from bloomery_jax.host.ffi import FfiHostBridge, library
    from bloomery_jax.host.ticks import _now, ticks_per_second
    from host_bench import make_layer

    threads = default_threads()
    numba.set_num_threads(threads)
    E, K = 128, 8
    layer = make_layer("q4_k_m", E, 768, 2048, distinct=8)
    # its record: what the FFI calls pass (with the team's scratch, for the team layout)
    bridge = FfiHostBridge({0: layer}, threads=threads, signal="hostfunc", team=True)
    bridge._ensure_team_scratch(K)
    layer, record = bridge.layers[0], bridge._records[0].copy()
    record[F.K] = K  # the FFI handler sets it from the call's operands
    run_host = library().bloomery_ffi_run_host
    run_host.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64]
    expert_mb = layer.expert_bytes() / 1e6
    entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p, *[ctypes.c_int64] * 6)(layer_entry.address)

    @njit(parallel=True, cache=True)
    def empty_region(a):
        for i in prange(a.shape[0]):
            a[i] += 1.0

    x = np.random.default_rng(0).standard_normal((1, 2048)).astype(np.float32)
    weights = np.full((1, K), 1.0 / K, np.float32)
    out = np.empty((1, 2048), np.float32)
    step = [0]
    # a team call's stamps (ffi_layout.TEAM_STAMPS) after the counters, [threads, 8]: each thread's line
    stamps = bridge._team_scratch[3][F.COUNTER_WORDS:].reshape(-1, 8)[:threads, :len(F.TEAM_STAMPS)]
    team_phases = []  # per team call: each stamp's first and last thread, ticks after the call began

    def call(path: str, m: int) -> float:
        ids = ((step[0] * K + np.arange(K)) % E).astype(np.int32)[None]
        step[0] += 1
        on_host = np.zeros(E, np.bool_)
        on_host[ids[0, :m]] = True
        if path.startswith("r"):  # r2 | r1pN
            record[F.REGIONS] = int(path[1])
            record[F.PARTS] = int(path[3:]) if path.startswith("r1p") else 1
        team = path.startswith("team")  # team | teampN | teamplain
        if team:
            record[F.PARTS] = int(path[5:]) if path.startswith("teamp") and path[5:].isdigit() else 1
            record[F.TEAM_PLAIN] = int(path == "teamplain")
        record[F.TEAM] = int(team)
        # the addresses first: each .ctypes.data costs microseconds, which the call's time must not hold
        args = [a.ctypes.data for a in (record, x, ids, weights, on_host, out)] + [1]
        t0 = time.perf_counter()
        if path == "python":
            host_moe_swiglu(x, ids, weights, on_host, layer)
        elif team:
            before = _now()
            run_host(*args)
        else:
            entry(*args)
        took = time.perf_counter() - t0
        if team and m:  # read after the clock: NumPy's reductions take microseconds
            team_phases.append((stamps.min(axis=0) - before, stamps.max(axis=0) - before))
        return took

    def gap(seconds: float) -> None:  # the card's work between two calls: this thread waits, idle
        if seconds:
            time.sleep(seconds)

    a = np.zeros(threads, np.float64)
    for _ in range(5):
        empty_region(a)
        for path in args.layouts:
            call(path, K)
    time.sleep(0.5)  # the team's helpers spin after the warm-up's calls (the twenty-fifth session's region: 845 us)
    ts = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        empty_region(a)
        ts.append(time.perf_counter() - t0)
    res = dict(threads=threads, expert_mb=expert_mb, region_us=statistics.median(ts) * 1e6, gaps={})
    for g in args.gaps:
        rows = {}
        for path in args.layouts:
            # the last layout's threads still spin (OpenMP's workers for GOMP_SPINCOUNT, the team's
            # helpers for TEAM_SPIN_US): let them sleep first, or this layout's first calls share
            # the cores with them (twenty-third session: the team's first series 1.9 ms a call)
            time.sleep(0.5)
            ms, phases = {}, {}
            for m in (0, 1, 2, 4, 6, 8):
                samples = []
                team_phases.clear()
                for _ in range(args.reps):
                    gap(g * 1e-6)
                    samples.append(call(path, m))
                ms[m] = statistics.median(samples) * 1e3
                if team_phases:  # when each phase's first and last thread got there, us after the call began
                    us = 1e6 / ticks_per_second()
                    phases[m] = {name: [round(float(np.median([c[0][i] for c in team_phases])) * us, 1),
                                        round(float(np.median([c[1][i] for c in team_phases])) * us, 1)]
                                 for i, name in enumerate(F.TEAM_STAMPS)}
            fit = _fit({m: v for m, v in ms.items() if m})
            fit["slope_gbs"] = expert_mb / fit["slope_us"] * 1e3
            rows[path] = dict(ms=ms, **fit)
            if phases:
                rows[path]["phases_us"] = phases
        res["gaps"][g] = rows
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--gaps", default="0,100", help="µs between calls, comma-separated")
    p.add_argument("--waits", default="10k,1M,passive", help=f"of {sorted(SPINS)}, comma-separated")
    p.add_argument("--layouts", default="r2,r1p1,team", help="r2, r1pN, team, teampN, teamplain or python, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="times every wait setting is run, in turn")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.gaps = [int(g) for g in args.gaps.split(",")]
    args.layouts = args.layouts.split(",")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    # Rounds of every wait setting in turn, so that a disturbed spell of the machine (the
    # nineteenth session's second machine had one in its first minute) does not fall on one alone.
    result = dict(reps=args.reps, rounds=[])
    for _ in range(args.rounds):
        result["rounds"].append(_round(args))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _round(args) -> dict:
    """One child process for each wait setting: {wait: the child's result}."""
    waits = {}
    for w in args.waits.split(","):
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        env.update(SPINS[w])
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), here]))
        proc = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps), "--gaps",
                               ",".join(map(str, args.gaps)), "--layouts", ",".join(args.layouts)], env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            waits[w] = dict(error=proc.stderr[-1500:])
        else:
            waits[w] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = waits[w]
        print(w, json.dumps({g: {p: (round(v["intercept_us"], 1), round(v["slope_us"], 1)) for p, v in rows.items()}
                             for g, rows in r.get("gaps", {}).items()}), "region_us", r.get("region_us"), flush=True)
        for g, rows in r.get("gaps", {}).items():  # the team's last thread at each stamp, m = 1 and 8
            for path, row in rows.items():
                for m, phases in row.get("phases_us", {}).items():
                    if m in ("1", "8"):
                        print(f"  gap {g} {path} m={m}:", " ".join(f"{k} {v[1]}" for k, v in phases.items()), flush=True)
    return waits


if __name__ == "__main__":
    raise SystemExit(main())
