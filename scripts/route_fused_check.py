"""Check on a card the launches whose last program finishes by ticket (``pallas.tickets``):
the router launch's own top-k (``router_logits(..., route_k=)``) against ``route_topk`` on the
logits that launch wrote, and the down launch's and the output projection's sums
(``moe_gemv_q8``/``qgemv_q8(..., combine=)``) against x plus the plain launch's rows.

The last program reads the others' stores after an atomic ticket (a barrier, then an
acquire-release add at GPU scope). The CPU tests run programs one by one, so only a card can
show a read that ran ahead of another program's stores. Each jitted call chains ``--layers``
launches on one counter buffer, as a decode step does (every layer different inputs), and
checks each one:
- router: experts, margins and card slots bit for bit; weights and card weights within
  ``WEIGHT_ULPS`` 2^-24 (the softmax's sums run over the launch's warps, route_topk's over one);
  a stale logit would pick another expert or move a margin;
- down and o: outputs off by more than 1e-4 of their magnitude (|x| + sum_j w_j |y_j|) are
  counted: rounding differs by a few 2^-24 of it, a stale or missing row by a whole row;
- attention (``attention_prepped``: the queries and own key formed in the launch, its splits
  combined by ticket) against ``decode_qk_prep`` then ``decode_attention`` on the same cache:
  the caches bit for bit, outputs off by more than 1e-4 of 1 + |output| counted (the sums'
  order moves them by ~1e-7; a stale split by its whole share);
- the counters back at 0 after every call.
Prints one JSON line per shape and the whole result (also to --json).

  python scripts/route_fused_check.py --calls 200 --json check.json     # on the GPU
  python scripts/route_fused_check.py --calls 2 --layers 2 --interpret  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bloomery_jax.ops.experts import _weighted_sum  # noqa: E402
from bloomery_jax.pallas.attention import cache_rows, decode_attention  # noqa: E402
from bloomery_jax.pallas.attention_prepped import decode_attention_prepped  # noqa: E402
from bloomery_jax.pallas.attn_prep import decode_qk_prep  # noqa: E402
from bloomery_jax.pallas.qgemv_q8 import moe_gemv_q8, qgemv_q8  # noqa: E402
from bloomery_jax.pallas.route import route_topk, router_logits  # noqa: E402
from bloomery_jax.pallas.tickets import new_tickets  # noqa: E402
from bloomery_jax.quant.repack import repack  # noqa: E402
from bloomery_jax.synth.blocks import random_blocks  # noqa: E402


WEIGHT_ULPS = 16  # weights (<= 1) equal to within this many 2^-24: a few ulps of the softmax's sums


def _chain(x, norm, w, table, tickets, *, k: int, interpret: bool):
    """``layers`` router launches on one counter buffer; per layer the fused routing and route_topk's on
    its logits, and the counters at the end."""
    fused, split = [], []
    for i in range(w.shape[0]):
        out = router_logits(x[i], norm[i], 1e-6, w[i], rounded=True, route_k=k, slot_table=table, layer=i,
                            tickets=tickets, interpret=interpret)
        tickets = out.tickets
        fused.append(jax.tree.leaves(out.route))
        split.append(jax.tree.leaves(route_topk(out.logits, k, table, i, interpret=interpret)))
    return fused, split, tickets


def _down_chain(h, experts, weights, x, down, tickets, *, interpret: bool):
    """``layers`` down launches on one counter buffer: per layer the combined sum, and x plus the
    weighted sum of the plain launch's rows (with its magnitude)."""
    fused, plain = [], []
    n, k = weights.shape[1:]
    for i in range(h.shape[0]):
        got, tickets = moe_gemv_q8(h[i], down, experts[i], swiglu_halves=True, combine=(weights[i], x[i], tickets),
                                   interpret=interpret)
        y = moe_gemv_q8(h[i], down, experts[i], swiglu_halves=True, interpret=interpret)  # [P, D]
        fused.append(got)
        plain.append((x[i] + _weighted_sum(y.reshape(n, k, -1), weights[i]), jnp.abs(x[i]) + _weighted_sum(
            jnp.abs(y).reshape(n, k, -1), weights[i])))
    return fused, plain, tickets


def _o_chain(a, x, w_o, tickets, *, interpret: bool):
    """``layers`` output projections adding x on one counter buffer, and x plus the plain launch's."""
    fused, plain = [], []
    for i in range(a.shape[0]):
        got, tickets = qgemv_q8(a[i], w_o, combine=(x[i], tickets), interpret=interpret)
        y = qgemv_q8(a[i], w_o, interpret=interpret)
        fused.append(got)
        plain.append((x[i] + y, jnp.abs(x[i]) + jnp.abs(y)))
    return fused, plain, tickets


def _attention_chain(qkv, pos, cos, sin, norms, caches, tickets, *, interpret: bool):
    """``layers`` one-launch attentions on one counter buffer and one cache, and beside them the
    two-launch form on its own copy of the cache: (outputs, theirs with magnitudes 1 + |y|, the
    caches both ways, the tickets)."""
    qn, kn = norms
    ck, cv = caches
    pk, pv = caches  # the two-launch form's
    lengths = pos + 1
    scale = float(ck.shape[-1]) ** -0.5
    fused, plain = [], []
    for i in range(qkv.shape[0]):
        got, ck, cv, tickets = decode_attention_prepped(qkv[i], qn, kn, cos, sin, ck, cv, lengths, i, 0, pos, tickets,
                                                        scale=scale, eps=1e-6, interpret=interpret)
        q, pk, pv = decode_qk_prep(qkv[i], qn, kn, cos, sin, pk, pv, i, 0, pos, eps=1e-6, interpret=interpret)
        k_rows, v_rows, rows = cache_rows(pk, pv, i, 0, pos.shape[0])
        want = decode_attention(q, k_rows, v_rows, pos + 1, scale, rows, interpret=interpret)
        fused.append(got)
        plain.append((want, 1.0 + jnp.abs(want)))
    return fused, plain, (ck, cv), (pk, pv), tickets


def check_attention(args, rng) -> list[dict]:
    """The one-launch decode attention against the two-launch form, per row count: Qwen3-30B-A3B's
    heads (32 query, 4 kv of 128), a 4,096-slot cache (16 splits), random positions."""
    L, Hq, Hkv, Dh, S = args.layers, 32, 4, 128, 4096
    run = jax.jit(lambda *a: _attention_chain(*a, interpret=args.interpret))
    out = []
    for n in (int(r) for r in args.rows.split(",")):
        off, worst, cache_diffs, tickets_nonzero = 0, 0.0, 0, 0
        tickets = new_tickets()
        caches = tuple(jnp.asarray(rng.standard_normal((L, n, S, Hkv, Dh)), jnp.float32) for _ in range(2))
        calls = max(1, args.calls // 4)
        for _ in range(calls):
            qkv = jnp.asarray(rng.standard_normal((L, 4, n, (Hq + 2 * Hkv) * Dh)), jnp.float32)  # 4 partial sums
            pos = jnp.asarray(rng.integers(0, S, n), jnp.int32)
            angle = rng.uniform(0, 6.3, (n, Dh // 2))
            cos, sin = jnp.asarray(np.cos(angle), jnp.float32), jnp.asarray(np.sin(angle), jnp.float32)
            norms = tuple(jnp.asarray(rng.uniform(0.5, 1.5, Dh), jnp.float32) for _ in range(2))
            fused, plain, caches, theirs, tickets = run(qkv, pos, cos, sin, norms, caches, tickets)
            o, wst = _count_off(fused, plain)
            off, worst = off + o, max(worst, wst)
            cache_diffs += sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in zip(caches, theirs))
            tickets_nonzero += int(np.asarray(tickets).any())
        shape = {"launch": "attention", "rows": n, "outputs": calls * L * n * Hq * Dh, "off": off,
                 "worst_relative": worst, "cache_diffs": cache_diffs, "tickets_nonzero": tickets_nonzero}
        print(json.dumps(shape), flush=True)
        out.append(shape)
    return out


def _count_off(fused, plain) -> tuple[int, float]:
    """Outputs off by more than 1e-4 of their magnitude, and the largest relative difference."""
    off, worst = 0, 0.0
    for got, (want, mag) in zip(fused, plain):
        rel = np.abs(np.asarray(got) - np.asarray(want)) / np.asarray(mag)
        off += int(np.sum(rel > 1e-4))
        worst = max(worst, float(rel.max()))
    return off, worst


def check_combines(args, rng) -> list[dict]:
    """The down launch's and the output projection's combine against the plain launches, per row
    count (random Q6_K down experts [16, 2048, 768], a Q4_K [2048, 4096] projection)."""
    L, k, n_exp, d, f = args.layers, args.k, 16, args.dim, 768
    down = repack(random_blocks(14, (n_exp, d, f), 0.02, rng), 14, (n_exp, d, f), "ggml")  # Q6_K
    w_o = repack(random_blocks(12, (d, 2 * d), 0.02, rng), 12, (d, 2 * d), "ggml")  # Q4_K
    out = []
    calls = max(1, args.calls // 4)
    for n in (int(r) for r in args.rows.split(",")):
        for launch in ("down", "o"):
            chain = _down_chain if launch == "down" else _o_chain
            run = jax.jit(lambda *a, chain=chain: chain(*a, interpret=args.interpret))
            off, worst, tickets_nonzero = 0, 0.0, 0
            tickets = new_tickets()
            for _ in range(calls):
                x = jnp.asarray(rng.standard_normal((L, n, d)), jnp.float32)
                if launch == "down":
                    h = jnp.asarray(rng.standard_normal((L, 2, n * k, 2 * f)), jnp.float32)  # gate/up's split-K partials
                    experts = jnp.asarray(rng.integers(0, n_exp, (L, n * k)), jnp.int32)
                    weights = jnp.asarray(rng.uniform(0, 1, (L, n, k)), jnp.float32)
                    fused, plain, tickets = run(h, experts, weights, x, down, tickets)
                else:
                    a = jnp.asarray(rng.standard_normal((L, n, 2 * d)), jnp.float32)
                    fused, plain, tickets = run(a, x, w_o, tickets)
                o, wst = _count_off(fused, plain)
                off, worst = off + o, max(worst, wst)
                tickets_nonzero += int(np.asarray(tickets).any())
            shape = {"launch": launch, "rows": n, "sums": calls * L * n * d, "off": off, "worst_relative": worst,
                     "tickets_nonzero": tickets_nonzero}
            print(json.dumps(shape), flush=True)
            out.append(shape)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="jitted calls per shape")
    ap.add_argument("--layers", type=int, default=48, help="router launches chained on one counter buffer per call")
    ap.add_argument("--rows", default="1,2,8", help="token rows a launch routes (comma list)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke run)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()

    L, E, D, k = args.layers, args.experts, args.dim, args.k
    rng = np.random.default_rng(0)
    result = {"check": "route_fused", "device": jax.devices()[0].device_kind, "layers": L, "experts": E, "dim": D,
              "k": k, "calls": args.calls, "shapes": []}
    for n in (int(r) for r in args.rows.split(",")):
        run = jax.jit(lambda *a: _chain(*a, k=k, interpret=args.interpret))
        mismatched = {"experts": 0, "weights": 0, "margin": 0, "slots": 0, "card_weights": 0}
        tickets_nonzero, worst_weight = 0, 0.0
        tickets = new_tickets()
        for c in range(args.calls):
            x = jnp.asarray(rng.standard_normal((L, n, D)) * 3, jnp.float32)
            norm = jnp.asarray(rng.uniform(0.5, 2, (L, D)), jnp.float32)
            # a router with near-ties on some calls (rounded weights): the order among equal
            # logits must come out as route_topk's too
            w = rng.standard_normal((L, E, D)) * 0.02
            if c % 4 == 3:
                w = np.round(w * 64) / 64
            table = np.where(rng.random((L, E)) < 0.4, -1, rng.integers(0, E, (L, E)))
            fused, split, tickets = run(x, norm, jnp.asarray(w, jnp.float32), jnp.asarray(table, jnp.int32), tickets)
            for f, r in zip(fused, split):
                for name, a, b in zip(mismatched, f, r):
                    a, b = np.asarray(a), np.asarray(b)
                    if "weights" in name:  # the softmax sums run in another order (the launch's warps): ulps
                        worst_weight = max(worst_weight, float(np.max(np.abs(a - b))))
                        mismatched[name] += int(np.sum(np.abs(a - b) > WEIGHT_ULPS * 2.0 ** -24))
                    else:
                        mismatched[name] += int(np.sum(a != b))
            tickets_nonzero += int(np.asarray(tickets).any())
        shape = {"launch": "router", "rows": n, "routings": args.calls * L * n, "mismatched": mismatched,
                 "worst_weight_diff": worst_weight, "tickets_nonzero": tickets_nonzero}
        result["shapes"].append(shape)
        print(json.dumps(shape), flush=True)
    result["combines"] = check_combines(args, rng)
    result["attention"] = check_attention(args, rng)
    result["ok"] = (all(not sum(s["mismatched"].values()) and not s["tickets_nonzero"] for s in result["shapes"])
                    and all(not s["off"] and not s["tickets_nonzero"] for s in result["combines"])
                    and all(not (s["off"] or s["cache_diffs"] or s["tickets_nonzero"]) for s in result["attention"]))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
