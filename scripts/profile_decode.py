"""Where a decode step's time goes: host dispatch, device kernels by name, and the gaps between.

Loads a model as `bench` does, prefills one prompt, then runs --steps decode steps of one
sequence twice: first timed (per step: the jitted call's return = host dispatch, then the wait
for the sampled token = the rest), then under ``jax.profiler.trace`` with a Perfetto trace,
whose device events are summed by kernel name. With ``--prefill`` the "steps" are whole
prefills of the --prompt tokens instead (a fresh sequence each, one ubatch of --prompt), for
pp512's breakdown. Prints one JSON line:

  leaves           arrays passed to every step (params, placement): dispatch walks them all
  dispatch_ms      median time for the step call to return (async: the host's own work)
  step_ms          median time from the call to the sampled token on the host
  device_busy_ms   sum of device kernel durations per step (from the trace)
  device_span_ms   median time per step from its first kernel's start to its last kernel's end
                   (steps split at idle gaps over --step-gap-us): busy time plus the gaps between
                   kernels, which inside a CUDA graph are the graph's per-node cost
  timeline         the middle traced step's kernels in order: name, start offset and duration (us)
  kernels          the top --top kernels: name, calls and microseconds per step, share of busy time
  families         the same for every kernel family: the name up to XLA's ``__N`` (one a layer)

Beside profile.json, events.json.gz keeps every event of the trace (host threads too), compact.

  python scripts/profile_decode.py --model M.gguf --kernels pallas --out prof/   # GPU
  python scripts/profile_decode.py --model M.gguf --kernels pallas --prefill --prompt 512 --steps 3 --out pp/
  python scripts/profile_decode.py --tiny --out /tmp/prof                        # CPU smoke run

XLA turns command buffers off while a profiler runs, so the trace shows kernels launched one by
one; ``XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`` keeps the CUDA graphs, and
then the gaps are the graph's own.

On the CPU the "device" is the host: the trace then holds XLA's CPU ops, good only for
checking the script.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bloomery_jax.engine.engine import Engine  # noqa: E402
from bloomery_jax.engine.sampling import SamplingParams  # noqa: E402
from bloomery_jax.engine.startup import Progress, open_model  # noqa: E402
from bloomery_jax.settings import ROUTING  # noqa: E402


def decode_inputs(engine, seq):
    """The arrays ``Engine.decode`` builds for one sequence in slot 0 of a bucket of one."""
    tokens = np.array([seq.tokens[-1]], np.int32)
    positions = np.array([seq.n_cached], np.int32)
    return tokens, positions, np.ones(1, bool)


def timed_steps(engine, seq, n: int, block: int = 1) -> tuple[list[float], list[float]]:
    """n decode steps of ``seq``, ``block`` a device call: (dispatch seconds, call-to-token
    seconds) per step (a block's times divided by its steps)."""
    dispatch, total = [], []
    for _ in range(n // block):
        tokens, positions, active = decode_inputs(engine, seq)
        plan = engine.sampler_plan([seq])  # as the engine's own decode: greedy, the argmax alone
        t0 = time.perf_counter()
        if block == 1:
            engine.cache, engine.sampler, out, _, engine.last_routing = engine.steps.decode(
                engine.params, engine.cache, engine.sampler, engine.placement, tokens, positions, active, plan)
        else:
            engine.cache, engine.sampler, out, engine.last_routing = engine.steps.decode_block(
                engine.params, engine.cache, engine.sampler, engine.placement, tokens, positions, active, block, plan)
        t1 = time.perf_counter()
        new = np.asarray(jax.device_get(out.token)).reshape(block, -1)[:, 0].tolist()  # [block] tokens of row 0
        t2 = time.perf_counter()
        seq.n_cached += block
        seq.tokens += new
        dispatch += [(t1 - t0) / block] * block
        total += [(t2 - t0) / block] * block
    return dispatch, total


def timed_prefills(engine, n: int, prompt: int) -> tuple[list[float], list[float]]:
    """n prefills of a fresh ``prompt``-token sequence (released after): (dispatch seconds of
    the last chunk's call, call-to-logits seconds of the whole prefill) each."""
    dispatch, total = [], []
    rng = np.random.default_rng(1)
    for _ in range(n):
        seq = engine.add(rng.integers(0, engine.n_vocab, prompt).tolist(), SamplingParams(temperature=0.0))
        t0 = time.perf_counter()
        while seq.pending > 1:
            t1 = time.perf_counter()
            engine.prefill(seq)
            dispatch.append(time.perf_counter() - t1)
        jax.block_until_ready(engine.cache)
        total.append(time.perf_counter() - t0)
        engine.release(seq)
    return dispatch[-n:], total


def trace_events(trace_dir: Path) -> list[dict]:
    """The events of the newest Perfetto trace under trace_dir."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no Perfetto trace under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)["traceEvents"]


def device_events(events: list[dict]) -> list[dict]:
    """Kernel events of a trace: the stream threads ("Stream #...") of processes named like
    /device:GPU:0, not their derived "XLA Ops"/"XLA Modules" lines, which would count each
    kernel again; every complete event when there is no GPU (CPU)."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if "GPU" in name or "gpu" in name}
    if not gpu:
        return [e for e in events if e.get("ph") == "X"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu}
    streams = {key for key, name in threads.items() if name.startswith("Stream")}
    print(f"device threads: {sorted(set(threads.values()))}", file=sys.stderr)
    return [e for e in events if e.get("ph") == "X" and e["pid"] in gpu
            and (not streams or (e["pid"], e.get("tid")) in streams)]


def save_events(events: list[dict], dest: Path) -> None:
    """Every complete event of a trace (host threads too), compact, for reading offline:
    {"threads": {"pid/tid": "process / thread"}, "events": [[name, "pid/tid", ts us, dur us]]}."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {f"{e['pid']}/{e['tid']}": f"{procs.get(e['pid'], e['pid'])} / {e['args']['name']}" for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    rows = [[e["name"][:100], f"{e['pid']}/{e.get('tid')}", e["ts"], e.get("dur", 0)] for e in events if e.get("ph") == "X"]
    with gzip.open(dest, "wt") as f:
        json.dump(dict(threads=threads, events=rows), f)


def summarize(events: list[dict], steps: int, top: int) -> tuple[float, list[dict], list[dict]]:
    """Busy ms a step, the top kernels by name, and every kernel family (the name up to its
    ``__N``: XLA numbers one kernel's copies, one a layer) by time."""
    by_name = collections.defaultdict(lambda: [0, 0.0])  # name -> [calls, total us]
    by_family = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        for row in (by_name[e["name"]], by_family[e["name"].split("__")[0]]):
            row[0] += 1
            row[1] += float(e.get("dur", 0.0))
    busy = sum(us for _, us in by_name.values()) / steps

    def table(groups, n=None):
        rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:n]
        return [dict(name=name[:120], calls_per_step=round(calls / steps, 2), us_per_step=round(us / steps, 1),
                     share=round(us / steps / busy, 3) if busy else 0.0) for name, (calls, us) in rows]

    return busy / 1e3, table(by_name, top), table(by_family)


def split_steps(events: list[dict], gap_us: float) -> list[list[dict]]:
    """Kernel events in time order, split where the device was idle longer than gap_us (the
    host's wait for a sampled token between two decode steps)."""
    events = sorted(events, key=lambda e: float(e["ts"]))
    steps, end = [], None
    for e in events:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if end is None or ts - end > gap_us:
            steps.append([])
        steps[-1].append(e)
        end = ts + dur if end is None else max(end, ts + dur)
    return steps


def step_spans(steps: list[list[dict]]) -> list[float]:
    """Microseconds from each step's first kernel start to its last kernel end."""
    return [max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in s) - float(s[0]["ts"]) for s in steps]


def timeline(step: list[dict]) -> list[list]:
    """[name, start offset us, duration us] of one step's kernels in order."""
    t0 = float(step[0]["ts"])
    return [[e["name"][:60], round(float(e["ts"]) - t0, 1), round(float(e.get("dur", 0.0)), 1)] for e in step]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file")
    p.add_argument("--tiny", action="store_true", help="a small synthetic qwen3moe model (CPU smoke run)")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--attention", default="xla", choices=("xla", "pallas"))
    p.add_argument("--place", default="card")
    p.add_argument("--bridge", default="callback", choices=("callback", "ffi"), help="host experts' bridge")
    p.add_argument("--routing", default="xla", choices=[r for r in ROUTING if r != "auto"], help="MoE routing (cli_options.ROUTING_HELP)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before decoding")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed, then traced")
    p.add_argument("--top", type=int, default=40, help="kernels listed")
    p.add_argument("--out", type=Path, required=True, help="trace directory (and profile.json)")
    p.add_argument("--decode-block", type=int, default=1, help="decode steps a device call (--steps a multiple)")
    p.add_argument("--prefill", action="store_true", help="profile prefills of --prompt tokens, not decode steps")
    p.add_argument("--step-gap-us", type=float, default=200.0,
                   help="an idle device gap longer than this separates two steps in the trace")
    p.add_argument("--no-trace", action="store_true",
                   help="timed steps only (XLA turns command buffers off while profiling)")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    if a.tiny:
        from bloomery_jax.synth import synthesize

        a.model = str(a.out / "tiny-q4km.gguf")
        a.out.mkdir(parents=True, exist_ok=True)
        synthesize(a.model, qtype="Q4_K_M", seed=0, n_layers=2, d_model=256, n_heads=4, n_kv_heads=2,
                   head_dim=64, n_experts=16, n_experts_used=4, expert_ff=256, n_vocab=1024)
    elif not a.model:
        p.error("--model or --tiny")
    progress = Progress(sys.stderr, quiet=True)
    model, _, load_s = open_model(a.model, progress, a.place, "auto", a.kernels, a.attention, a.bridge,
                                   a.routing)
    engine = Engine(model, n_slots=1, max_context=a.prompt + 3 * a.steps + 2 * a.decode_block + 8,
                    ubatch=max(a.prompt, 16))
    if a.prefill:
        run = lambda n: timed_prefills(engine, n, a.prompt)  # noqa: E731
    else:
        seq = engine.add(np.random.default_rng(0).integers(0, engine.n_vocab, a.prompt).tolist(),
                         SamplingParams(temperature=0.0))
        while seq.pending > 1:
            engine.prefill(seq)
        run = lambda n: timed_steps(engine, seq, n, a.decode_block)  # noqa: E731
    t0 = time.perf_counter()
    run(2 * a.decode_block)  # compile and warm
    compile_s = time.perf_counter() - t0
    dispatch, total = run(a.steps)
    busy_ms, kernels, families, span_ms, n_split, middle = None, [], [], None, None, []
    if not a.no_trace:
        trace_dir = a.out / "trace"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            run(a.steps)
        everything = trace_events(trace_dir)
        save_events(everything, a.out / "events.json.gz")
        events = device_events(everything)
        busy_ms, kernels, families = summarize(events, a.steps, a.top)
        steps = split_steps(events, a.step_gap_us)
        n_split = len(steps)  # a.steps when the gap threshold separates exactly the steps
        span_ms = statistics.median(step_spans(steps)) / 1e3
        middle = timeline(steps[len(steps) // 2])
    leaves = len(jax.tree_util.tree_leaves((engine.params, engine.placement)))
    result = dict(bench="profile_prefill" if a.prefill else "profile_decode", prompt=a.prompt, model=a.model, kernels=a.kernels, attention=a.attention, place=a.place, bridge=a.bridge, routing=a.routing, decode_block=a.decode_block,
                  device=str(jax.devices()[0].device_kind), layers=model.cfg.n_layers, leaves=leaves,
                  load_s=round(load_s, 1), compile_s=round(compile_s, 1), steps=a.steps,
                  dispatch_ms=round(statistics.median(dispatch) * 1e3, 3),
                  step_ms=round(statistics.median(total) * 1e3, 3),
                  device_busy_ms=None if busy_ms is None else round(busy_ms, 3),
                  device_span_ms=None if span_ms is None else round(span_ms, 3), traced_steps_found=n_split,
                  xla_flags=os.environ.get("XLA_FLAGS", ""),
                  kernels_top=kernels, families=families, timeline=middle)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}))  # the timeline is in profile.json
    print("families, us a step:", ", ".join(f"{f['name']} {f['us_per_step']} ({f['calls_per_step']:g})" for f in families[:16]))


if __name__ == "__main__":
    main()
