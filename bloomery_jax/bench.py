"""``python -m bloomery_jax.bench``: llama-bench-style prefill and decode speed.

    python -m bloomery_jax.bench --model M.gguf -p 512 -n 128 --parallel 1,2 --reps 5
    python -m bloomery_jax.bench --model M.gguf -p 512 -n 128 --depth 4096 --json

For each ``--parallel`` P, P sequences of random prompt tokens run together on one engine:
``pp<p>`` times feeding p prompt tokens of every sequence (one sequence's chunk per step,
``--ubatch`` tokens at most), ``tg<n>`` times n decode steps, each producing one token of every
sequence; the rate counts all sequences' tokens together. With ``--depth D`` each sequence first
holds D tokens in its cache (untimed). Each test runs once as a warm-up, then ``--reps`` times;
a record gives the median and the min-max of tokens/s. Decoding is greedy (the sampler's cheap
branch; llama-bench does not sample at all). ``--decode-block N`` runs the decode N steps a
device call (``Engine.decode_block``; ``generate --decode-block``, ``RuntimeSettings.decode_block``
for the server), each block launched before the previous one's tokens are read, as the server's
scheduler does (``--no-lookahead``: each block after the read).

Every record carries a source witness (bloomery_jax.witness): git commit, number of dirty
tracked files (unknown, never 0, when git cannot tell), package versions, device. Loading and
compiling print a progress line and their times on stderr; the table (or ``--json``, one JSON
object per line) goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .cli_options import (ATTENTION_HELP, BRIDGE_HELP, KERNELS_HELP, PLACE_HELP, ROUTING_HELP, WEIGHTS_HELP,
                          add_residency_args)
from .engine.steps import bucket_for
from .errors import BloomeryError, ConfigError
from .settings import ATTENTION, BRIDGES, KERNELS, ROUTING, WEIGHT_FORMS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise ConfigError(f"{self.prog}: {message}")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bloomery_jax.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens per sequence (0 = no pp test)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens per sequence (0 = no tg test)")
    p.add_argument("--parallel", type=_int_list, default=[1], help="sequences at once, e.g. 1,2 (default 1)")
    p.add_argument("-d", "--depth", type=int, default=0, help="tokens already in each cache (default 0)")
    p.add_argument("-r", "--reps", type=int, default=5, help="timed repetitions after one warm-up (default 5)")
    p.add_argument("--ubatch", type=int, default=512, help="prompt tokens per prefill step (<= 4096)")
    p.add_argument("--kv-dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    p.add_argument("--place", default="card", help=PLACE_HELP)
    p.add_argument("--weights", choices=WEIGHT_FORMS, default="auto", help=WEIGHTS_HELP)
    p.add_argument("--kernels", choices=KERNELS, default="auto", help=KERNELS_HELP)
    p.add_argument("--attention", choices=ATTENTION, default="auto", help=ATTENTION_HELP)
    p.add_argument("--bridge", choices=BRIDGES, default="auto", help=BRIDGE_HELP)
    p.add_argument("--routing", choices=ROUTING, default="auto", help=ROUTING_HELP)
    p.add_argument("--decode-block", type=int, default=0,
                   help="decode steps per device call (Engine.decode_block; default 0: 8 on a GPU, 1 elsewhere)")
    p.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each decode block before the previous one's tokens are read, as the server "
                        "does (default on)")
    add_residency_args(p)
    p.add_argument("--json", action="store_true", help="one JSON record per line instead of a table")
    p.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compilation cache")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _timed_prefill(engine, seqs) -> float:
    """Seconds to feed every sequence's pending tokens (the last sample syncs the device)."""
    t0 = time.perf_counter()
    for s in seqs:
        while s.pending > 1:
            engine.prefill(s)
    rest = [s for s in seqs if s.pending == 1 and s.n_generated == 0]
    if rest:  # a prompt whose last token was left alone after a full chunk: fed by one decode
        engine.decode(rest)
    return time.perf_counter() - t0


def _timed_decode(engine, seqs, n: int, block: int = 1, lookahead: bool = False) -> tuple[float, list[tuple[int, int]]]:
    """Seconds of ``n`` decode steps, ``block`` steps a device call (the rest one a call), and
    each call's (card-served, routed) expert calls. ``lookahead``: each block that another
    follows launches it before its tokens are read (``Engine.decode_block(ahead=True)``)."""
    calls = []
    t0 = time.perf_counter()
    done = 0
    while done < n:
        m = block if n - done >= block else 1
        before = engine.card_calls, engine.routed_calls
        # reads the sampled tokens back: synchronous, but for a block launched ahead
        engine.decode_block(seqs, m, ahead=lookahead and n - done - m >= block)
        calls.append((engine.card_calls - before[0], engine.routed_calls - before[1]))
        done += m
    return time.perf_counter() - t0, calls


def _served(steps: list[tuple[int, int]]) -> float:
    """Card-served fraction of the routed calls of some decode steps."""
    return sum(c for c, _ in steps) / sum(r for _, r in steps)


def _fill_depth(engine, seqs, depth: int) -> None:
    """Feed the first ``depth`` tokens of each sequence, untimed."""
    for s in seqs:
        while s.n_cached < depth:
            engine.prefill(s, budget=depth - s.n_cached)


def run_parallel(model, args, parallel: int, progress, rng) -> tuple[list[dict], float]:
    """The pp and tg records for one parallel count, and the compile seconds."""
    from .engine.engine import Engine
    from .engine.sampling import SamplingParams
    from .engine.startup import make_trace, placement_stats, residency_from_args

    p, n, depth = args.n_prompt, args.n_gen, args.depth
    prompt_len = depth + max(p, 1)
    ctx = prompt_len + n + 1
    engine = Engine(model, n_slots=parallel, max_context=ctx, ubatch=min(args.ubatch, 4096),
                    kv_dtype=args.kv_dtype, residency=residency_from_args(model, args),
                    routing_trace=make_trace(model, args))
    greedy = SamplingParams(temperature=0.0)  # llama-bench samples nothing: ours takes the argmax alone
    compile_s = engine.warmup(progress.update, chunks=_chunks_used(engine, depth, max(p, 1)),
                              buckets=[bucket_for(engine.buckets, parallel)],
                              decode_block=args.decode_block, samplers=[greedy])
    progress.done(f"parallel {parallel}: compiled in {compile_s:.2f} s")
    pp, tg, edges, host_decode = [], [], [], []
    host = model.placement.host if model.placement is not None else None
    for rep in range(args.reps + 1):
        label = "warm-up" if rep == 0 else f"rep {rep}/{args.reps}"
        progress.update(f"parallel {parallel}: {label}")
        seqs = [engine.add(rng.integers(0, engine.n_vocab, prompt_len).tolist(), greedy) for _ in range(parallel)]
        _fill_depth(engine, seqs, depth)
        if p > 0:
            t = _timed_prefill(engine, seqs)
            if rep:
                pp.append(parallel * p / t)
        else:
            _timed_prefill(engine, seqs)
        if n > 0:
            before = _host_totals(host)
            t, calls = _timed_decode(engine, seqs, n, args.decode_block, args.lookahead)
            if rep:
                tg.append(parallel * n / t)
                if host is not None:  # the host kernels' share of this decode: its calls and seconds alone
                    after = _host_totals(host)
                    host_decode.append((after[0] - before[0], after[1] - before[1], t,
                                        [a - b for a, b in zip(after[2], before[2])]))
                if engine.routed_calls:  # host experts: how much of this decode the card served, early and late
                    edge = -(-16 // args.decode_block)  # the calls holding the first / last 16 steps
                    edges.append((_served(calls[:edge]), _served(calls[-edge:])))
        for s in seqs:
            engine.release(s)
    progress.done(f"parallel {parallel}: {args.reps} repetitions done")
    records = []
    for test, samples, count in (("pp", pp, p), ("tg", tg, n)):
        if count > 0:
            records.append({"test": f"{test}{count}", "parallel": parallel, "depth": depth, "n_tokens": count,
                            "tps_median": statistics.median(samples), "tps_min": min(samples),
                            "tps_max": max(samples), "samples": samples})
    if records:
        placement_stats(engine, records[-1], args)
    if edges and n > 0:  # the tg record: medians over repetitions
        records[-1]["placement"]["decode_first16_card_fraction"] = statistics.median(e[0] for e in edges)
        records[-1]["placement"]["decode_last16_card_fraction"] = statistics.median(e[1] for e in edges)
    if host_decode and n > 0:  # the timed decodes only (the run's totals above count warm-up and prefill too)
        stats = records[-1]["placement"]
        stats["decode_host_calls"] = statistics.median(c for c, _, _, _ in host_decode)
        stats["decode_host_share"] = statistics.median(s / t for _, s, t, _ in host_decode)
        per_call = [s / c * 1e3 for c, s, _, _ in host_decode if c]
        if per_call:
            stats["decode_host_ms_per_call"] = statistics.median(per_call)
            stats["decode_host_us_per_call_split"] = _call_split([(c, d) for c, _, _, d in host_decode if c])
    return records, compile_s


def _host_totals(host) -> tuple[int, float, tuple] | None:
    """The host bridge's calls, kernel seconds and kernel tick spans so far (None without one)."""
    if host is None:
        return None
    stats = host.stats
    return stats.calls, stats.seconds, stats.ticks


def _call_split(decodes: list[tuple[int, list[int]]]) -> dict:
    """Where a decode's host call goes, in us a call (medians over the timed decodes, each given as
    its calls and tick spans, swiglu.SPANS): the serial part (grouping the pairs, buffers, rounding
    the activations), the wait for the last worker to start (wake), the work, and the wait from the
    last work item's end to the region's end (join)."""
    from .host.swiglu import SPAN_CALL, SPAN_JOIN, SPAN_REGIONS, SPAN_WAKE
    from .host.ticks import ticks_per_second

    us = 1e6 / ticks_per_second()
    parts = {"serial": lambda d: d[SPAN_CALL] - d[SPAN_REGIONS], "wake": lambda d: d[SPAN_WAKE],
             "work": lambda d: d[SPAN_REGIONS] - d[SPAN_WAKE] - d[SPAN_JOIN], "join": lambda d: d[SPAN_JOIN]}
    return {name: round(statistics.median(part(d) * us / c for c, d in decodes), 2) for name, part in parts.items()}


def _chunks_used(engine, depth: int, n_prompt: int) -> list[int]:
    """Padded chunk lengths of filling ``depth`` tokens in budgeted chunks, then reading the prompt."""
    fill = [min(engine.ubatch, depth - i) for i in range(0, depth, engine.ubatch)]
    return sorted({bucket_for(engine.chunks, n) for n in fill} | set(engine.prefill_plan(n_prompt)))


def run(argv: list[str] | None = None, out=None, err=None) -> list[dict]:
    """Run the benchmark; prints the table or JSON lines to ``out``; returns the records."""
    from .engine.scheduler import resolve_decode_block
    from .engine.startup import Progress, enable_compile_cache, open_model
    from .witness import describe, source_witness

    out = out or sys.stdout
    args = _parser().parse_args(argv)
    for name in ("n_prompt", "n_gen", "depth"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.reps < 1:
        raise ConfigError(f"--reps must be >= 1, got {args.reps}")
    args.decode_block = resolve_decode_block(args.decode_block, "--decode-block")
    if args.n_prompt == 0 and args.n_gen == 0:
        raise ConfigError("nothing to measure: -p and -n are both 0")
    if not args.no_compile_cache:
        enable_compile_cache()
    progress = Progress(err or sys.stderr, quiet=args.quiet)
    model, _, load_s = open_model(args.model, progress, args.place, args.weights, args.kernels, args.attention,
                                  args.bridge, args.routing)
    witness = source_witness()
    size = sum(int(t.data.nbytes) for t in model.gguf.tensors.values())
    kernels, bridge = model.kernels, model.bridge
    # the FFI bridge's signal on a GPU (ffi.resolve_signal), None without host experts or ffi;
    # the host experts' memory pages (host.memory) and whether the host calls come in halves
    # around the card's experts (ffi.resolve_overlap) and run on the host team (ffi.resolve_team),
    # None without host experts
    host = getattr(model.placement, "host", None)
    signal, pages, overlap, team = (getattr(host, a, None) for a in ("signal", "pages", "overlap", "team"))
    rng = np.random.default_rng(args.seed)
    records = []
    for parallel in args.parallel:
        recs, compile_s = run_parallel(model, args, parallel, progress, rng)
        for r in recs:
            r.update(model=str(model.path), architecture=model.gguf.architecture, model_bytes=size,
                     ubatch=args.ubatch, kv_dtype=args.kv_dtype, kernels=kernels, attention=model.attention,
                     bridge=bridge, host_signal=signal, host_pages=pages, host_overlap=overlap, host_team=team,
                     routing=model.routing,
                     weights=args.weights,
                     decode_block=args.decode_block, lookahead=args.lookahead, reps=args.reps, load_s=load_s,
                     compile_s=compile_s, witness=witness)
            if args.json:  # as each finishes: a run cut short still leaves what it measured
                out.write(json.dumps(r) + "\n")
                out.flush()
        records += recs
    if not args.json:
        out.write(format_table(records) + "\n" + describe(witness) + "\n")
    return records


def format_table(records: list[dict]) -> str:
    """A markdown table in llama-bench's shape: one row per test and parallel count."""
    head = "| model | size | backend | parallel | depth | test | t/s (median, min-max) |"
    rows = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for r in records:
        name = r["model"].rsplit("/", 1)[-1]
        size = f"{r['model_bytes'] / 2**30:.2f} GiB" if r["model_bytes"] >= 2**30 else f"{r['model_bytes'] / 2**20:.1f} MiB"
        backend = r["witness"]["device"].get("platform") or "unknown"
        rows.append(f"| {name} | {size} | {backend} | {r['parallel']} | {r['depth']} | {r['test']} | "
                    f"{r['tps_median']:.2f} ({r['tps_min']:.2f}-{r['tps_max']:.2f}) |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    try:
        run(argv)
    except BloomeryError as e:
        print(f"error: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
