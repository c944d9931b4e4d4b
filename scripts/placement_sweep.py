"""Replay a routing trace offline under every placement rule and card budget; no model, no JAX.

For each budget (a fraction of all routed experts that the card holds) and rule it replays the
trace step by step through :class:`ResidencyController` and prints the card-served fraction of
routed (token, expert) calls: over all steps, the prompt, all decode steps, the first and the
last ``--edge`` decode steps; and swaps per decode step (and bytes moved with ``--expert-bytes``).

Rules (every one holds exactly round(budget * L * E) experts on the card):
  static-n-cpu-moe     llama.cpp --n-cpu-moe: the first layers' experts on the host, whole layers;
                       the remainder fills one more layer by expert id
  static-last-cpu-moe  the last layers' experts on the host (the `budget=` rule's fill order)
  static-uniform       every layer the same number of slots, its first experts by id
  static-oracle        the trace's hottest (layer, expert) pairs overall: no static choice serves more
  lfu, lfu+stream      LFU residency from the uniform start, without / with prompt-time streaming
  lru, lru+stream      LRU residency likewise
Adaptive rules swap at most --max-swaps experts per layer after each step (prompt streaming is
not capped). Policies read gin bindings (``--gin_param 'LFU.decay = 0.9'``).

  python scripts/placement_sweep.py --synthetic --budgets 0.1,0.25,0.5
  python scripts/placement_sweep.py trace.npz --expert-bytes 3059712 --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys

import gin
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bloomery_jax  # noqa: E402  (its __init__ imports nothing heavy)


def _load_jax_free(name: str):
    """``bloomery_jax.placement.<name>`` without running ``placement/__init__`` (which imports JAX).

    The module goes into sys.modules under its own name, so a later normal import (and gin's
    registry) sees the same module; if the package is already imported, that import is used.
    """
    full = f"bloomery_jax.placement.{name}"
    if full in sys.modules:
        return sys.modules[full]
    if "bloomery_jax.placement" in sys.modules:
        return importlib.import_module(full)
    path = os.path.join(os.path.dirname(bloomery_jax.__file__), "placement", f"{name}.py")
    spec = importlib.util.spec_from_file_location(full, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    return module


residency = _load_jax_free("residency")
trace_mod = _load_jax_free("trace")

STATIC_RULES = ("static-n-cpu-moe", "static-last-cpu-moe", "static-uniform", "static-oracle")
ADAPTIVE_RULES = ("lfu", "lfu+stream", "lru", "lru+stream")
DEFAULT_RULES = STATIC_RULES + ("lfu", "lfu+stream", "lru")


# --- traces ------------------------------------------------------------------------------------

def synthetic_trace(n_layers=48, n_experts=128, k=8, prompt=512, decode=128, ubatch=512, zipf=1.0,
                    drift=0.25, seed=0):
    """A skewed trace: per layer a Zipf(``zipf``) popularity over its own random expert order.

    The prompt (``prompt`` tokens in ubatches of ``ubatch``) and the decode steps (one token
    each) draw from the same layer distributions, except that the decode phase re-deals the
    popularity ranks of a ``drift`` share of each layer's experts (a topic shift, so that the
    prompt's hot set is not exactly decode's). Each token takes k distinct experts, drawn in
    proportion to popularity (Gumbel top-k).
    """
    rng = np.random.default_rng(seed)
    L, E = n_layers, n_experts
    weight = 1.0 / np.arange(1, E + 1) ** zipf  # [E] by rank
    rank_of = np.argsort(rng.random((L, E)), axis=1)  # [L, E] rank of each expert, per layer
    logw_prompt = np.log(weight)[rank_of]  # [L, E]
    moved = rng.random((L, E)) < drift  # [L, E] experts whose rank is re-dealt
    rank_dec = rank_of.copy()
    for l in range(L):
        idx = np.flatnonzero(moved[l])
        rank_dec[l, idx] = rank_of[l, rng.permutation(idx)]
    logw_decode = np.log(weight)[rank_dec]

    def draw(logw, n):  # -> int16 [n, L, k]
        g = logw[None] + rng.gumbel(size=(n, L, E))  # [n, L, E]
        return np.argsort(-g, axis=2)[:, :, :k].astype(np.int16)

    rec = trace_mod.TraceRecorder(L, E, dict(source="synthetic", zipf=zipf, drift=drift, seed=seed))
    for a in range(0, prompt, ubatch):
        rec.append(draw(logw_prompt, min(ubatch, prompt - a)).transpose(1, 0, 2), "prefill")
    dec = draw(logw_decode, decode)  # [D, L, k]
    for t in range(decode):
        rec.append(dec[t][:, None, :], "decode")
    return rec.trace()


# --- starting tables ---------------------------------------------------------------------------

def _fill_layers(L, E, n_card, layer_order) -> np.ndarray:
    on_card = np.zeros((L, E), bool)
    left = n_card
    for l in layer_order:
        take = min(E, left)
        on_card[l, :take] = True
        left -= take
    return on_card


def static_table(rule: str, L: int, E: int, n_card: int, counts=None) -> np.ndarray:
    """bool ``[L, E]`` on-card table with exactly ``n_card`` True."""
    if rule == "static-n-cpu-moe":
        return _fill_layers(L, E, n_card, range(L - 1, -1, -1))
    if rule == "static-last-cpu-moe":
        return _fill_layers(L, E, n_card, range(L))
    if rule == "static-uniform":
        per = np.full(L, n_card // L)
        per[: n_card % L] += 1
        return np.arange(E)[None, :] < per[:, None]
    if rule == "static-oracle":
        flat = np.asarray(counts, np.float64).ravel()
        order = np.lexsort((np.arange(flat.size), -flat))  # hottest first, ties by (layer, expert)
        on_card = np.zeros(L * E, bool)
        on_card[order[:n_card]] = True
        return on_card.reshape(L, E)
    raise ValueError(f"unknown static rule {rule!r}")


def slot_table(on_card) -> np.ndarray:
    """As ``placement.table.slot_table`` (which imports JAX): card experts take slots 0.. by id."""
    on_card = np.asarray(on_card, bool)
    return np.where(on_card, np.cumsum(on_card, axis=1) - 1, -1).astype(np.int32)


# --- replay ------------------------------------------------------------------------------------

def replay(trace, on_card, policy=None, stream=False, max_swaps=None, expert_bytes=None, edge=16) -> dict:
    """Run one rule over a trace; returns the served fractions and swap counters."""
    ctrl = residency.ResidencyController(slot_table(on_card), policy or residency.Static(),
                                         expert_bytes=expert_bytes, window=edge)
    rows = []  # (kind, served, routed, swaps after the step)
    for step in trace:
        served, routed = ctrl.observe(step.experts)
        if step.kind == trace_mod.PREFILL and stream:  # as slots.LiveResidency: an LFU's ratio
            ctrl.prompt_plan(step.experts, hysteresis=getattr(ctrl.policy, "hysteresis", 1.0))
        else:
            ctrl.step_plan(max_swaps)
        rows.append((step.kind, served, routed, ctrl.swaps_last))
    kind, served, routed, swaps = np.array(rows, np.int64).reshape(-1, 4).T  # each [n_steps]
    dec = kind == trace_mod.DECODE

    def frac(sel):
        r = routed[sel].sum()
        return float(served[sel].sum() / r) if r else None

    dec_idx = np.flatnonzero(dec)
    out = dict(all=frac(slice(None)), prompt=frac(~dec), decode=frac(dec),
               first=frac(dec_idx[:edge]), last=frac(dec_idx[-edge:]),
               swaps=int(swaps.sum()), prompt_swaps=int(swaps[~dec].sum()),
               swaps_per_decode_step=float(swaps[dec].mean()) if dec.any() else 0.0)
    if expert_bytes is not None:
        out["bytes_moved"] = ctrl.bytes_moved
    return out


def sweep(trace, budgets, rules=DEFAULT_RULES, max_swaps=None, expert_bytes=None, edge=16) -> list[dict]:
    L, E = trace.n_layers, trace.n_experts
    counts = trace.counts()
    results = []
    for b in budgets:
        n_card = int(round(b * L * E))
        for rule in rules:
            if rule in STATIC_RULES:
                on_card, policy, stream = static_table(rule, L, E, n_card, counts), None, False
            elif rule in ADAPTIVE_RULES:
                name, _, tail = rule.partition("+")
                on_card = static_table("static-uniform", L, E, n_card)
                policy, stream = residency.make_policy(name), tail == "stream"
            else:
                raise ValueError(f"unknown rule {rule!r}; known: {', '.join(STATIC_RULES + ADAPTIVE_RULES)}")
            res = replay(trace, on_card, policy, stream, max_swaps, expert_bytes, edge)
            results.append(dict(budget=b, n_card=n_card, rule=rule, policy=repr(policy) if policy else None, **res))
    return results


# --- command line ------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 3059712, 2.9MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _fmt(x, width=7):
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.3f}"


def format_table(results, edge: int) -> str:
    lines = [f"{'budget':>6} {'rule':<20} {'all':>7} {'prompt':>7} {'decode':>7} {'first' + str(edge):>7} "
             f"{'last' + str(edge):>7} {'swaps/st':>8} {'swaps':>7}" +
             (f" {'moved MiB':>10}" if results and "bytes_moved" in results[0] else "")]
    for r in results:
        line = (f"{r['budget']:>6.3g} {r['rule']:<20} {_fmt(r['all'])} {_fmt(r['prompt'])} {_fmt(r['decode'])} "
                f"{_fmt(r['first'])} {_fmt(r['last'])} {r['swaps_per_decode_step']:>8.2f} {r['swaps']:>7}")
        if "bytes_moved" in r:
            line += f" {r['bytes_moved'] / 2**20:>10.1f}"
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", help="routing trace .npz (bloomery_jax.placement.trace)")
    p.add_argument("--synthetic", action="store_true", help="replay a synthetic skewed trace instead of a file")
    p.add_argument("--budgets", default="0.1,0.25,0.5", help="card share of all routed experts, comma-separated")
    p.add_argument("--rules", default=",".join(DEFAULT_RULES),
                   help=f"comma-separated, from {', '.join(STATIC_RULES + ADAPTIVE_RULES)}")
    p.add_argument("--max-swaps", default="2", help="swaps per layer per step for adaptive rules ('none': no cap)")
    p.add_argument("--expert-bytes", type=parse_bytes, help="bytes of one expert (reports bytes moved)")
    p.add_argument("--edge", type=int, default=16, help="decode steps in the first/last windows")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--gin_file", action="append", default=[], help="gin file(s) binding residency.* policies")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. 'LFU.decay = 0.9'")
    g = p.add_argument_group("synthetic trace")
    g.add_argument("--layers", type=int, default=48)
    g.add_argument("--experts", type=int, default=128)
    g.add_argument("--k", type=int, default=8)
    g.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    g.add_argument("--decode", type=int, default=128, help="decode steps")
    g.add_argument("--ubatch", type=int, default=512)
    g.add_argument("--zipf", type=float, default=1.0, help="popularity exponent")
    g.add_argument("--drift", type=float, default=0.25, help="share of experts re-ranked for decode")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-trace", help="also write the synthetic trace to this .npz")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if bool(args.trace) == args.synthetic:
        build_parser().error("give a trace file or --synthetic (one of them)")
    if args.gin_file or args.gin_param:
        gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
    budgets = [float(b) for b in args.budgets.split(",")]
    if not all(0.0 <= b <= 1.0 for b in budgets):
        build_parser().error(f"budgets must lie in [0, 1], got {args.budgets}")
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = [r for r in rules if r not in STATIC_RULES + ADAPTIVE_RULES]
    if unknown:
        build_parser().error(f"unknown rule(s) {', '.join(unknown)}; known: {', '.join(STATIC_RULES + ADAPTIVE_RULES)}")
    max_swaps = None if args.max_swaps.lower() == "none" else int(args.max_swaps)
    if args.synthetic:
        trace = synthetic_trace(args.layers, args.experts, args.k, args.prompt, args.decode, args.ubatch,
                                args.zipf, args.drift, args.seed)
        if args.save_trace:
            trace.save(args.save_trace)
    else:
        trace = trace_mod.load_trace(args.trace)
    results = sweep(trace, budgets, rules, max_swaps, args.expert_bytes, args.edge)
    info = dict(source=args.trace or "synthetic", n_layers=trace.n_layers, n_experts=trace.n_experts, k=trace.k,
                steps=trace.n_steps, prompt_tokens=trace.tokens(trace_mod.PREFILL),
                decode_steps=int((trace.step_kind == trace_mod.DECODE).sum()), metadata=trace.metadata)
    if args.json:
        print(json.dumps(dict(trace=info, max_swaps=max_swaps, edge=args.edge, results=results), indent=1))
    else:
        print(f"trace {info['source']}: L={info['n_layers']} E={info['n_experts']} k={info['k']}, "
              f"{info['prompt_tokens']} prompt tokens, {info['decode_steps']} decode steps; "
              f"max swaps/layer/step {max_swaps}; card-served fraction of routed calls")
        print(format_table(results, args.edge))
    return 0


if __name__ == "__main__":
    sys.exit(main())
