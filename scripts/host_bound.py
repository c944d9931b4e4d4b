"""The decode bound that the host's read bandwidth sets for a placement, beside what ran.

    python3 scripts/host_bound.py --bench OUT/bench-ncmoe36-...json --host OUT/host_bench.json \
        --model /tmp/bloomery/qwen3-30b-a3b-shape-q4km.gguf [--json OUT/host_bound.json]

Issue 8 asks hybrid decode to come within 15% of "the bound that the host's bandwidth sets for
that placement". For a placement that puts whole layers' experts on the host (``n-cpu-moe=N``,
``cpu-moe``, ``last-cpu-moe=N``, or an ``override`` that moves whole layers), every decode token
reads its k routed experts of each host layer from host memory: ``host_bytes`` = sum over host
layers of k * the layer's bytes of one expert, as the loader places them (``parse_rule(...).place``
over ``ExpertLayout.from_file``). At the read bandwidth host_bench measured (a Numba parallel sum
at the bridge's thread count, the larger of its two samples) that takes ``host_bytes / BW`` at
least. Two bounds:

- ``host_only``: the token takes no more than the host's reads (the card and the bridge free);
- ``host_floor``: the host's reads at full bandwidth and everything else as measured: the
  token's time outside host calls, ``t_token * (1 - decode_host_share)``, from the same record
  (layers run in order, so a host layer's reads cannot overlap the card's work of other layers).

The fraction printed is measured tok/s over the bound's tok/s."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models.registry import module_for_file
from bloomery_jax.placement import ExpertLayout, parse_rule


def host_layer_bytes(model: Path, rule: str) -> tuple[dict[int, int], int, int]:
    """The layers the rule puts on the host, each with its bytes of one expert; E; the experts a
    token routes to (k). A layer with experts on both sides is refused: its host bytes a token
    depend on the routing."""
    gf = GGUFFile(model)
    module = module_for_file(gf)
    cfg = module.Config.from_gguf(gf)
    layout = ExpertLayout.from_file(gf, module.tensor_specs(cfg))
    on_card = parse_rule(rule).place(layout)  # [L, E] bool
    split = [layer for layer in range(layout.n_layers) if 0 < on_card[layer].sum() < layout.n_experts]
    if split:
        raise SystemExit(f"placement {rule!r}: layers {split} have experts on both sides; the bound needs "
                         "whole layers on the host (a budget or residency rule's host bytes vary by token)")
    host = {layer: layout.expert_bytes[layer] for layer in range(layout.n_layers)
            if layout.expert_bytes[layer] and not on_card[layer].any()}
    return host, layout.n_experts, cfg.n_experts_used


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", type=Path, required=True, help="a bench JSON with a tg record over a host bridge")
    p.add_argument("--host", type=Path, required=True, help="host_bench.py's JSON from the same call (read bandwidth)")
    p.add_argument("--model", type=Path, required=True, help="the GGUF the bench ran")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)

    tg = [r for r in json.loads(args.bench.read_text())["records"] if r["test"].startswith("tg")]
    if not tg or "decode_host_share" not in tg[-1].get("placement", {}):
        raise SystemExit(f"{args.bench}: no tg record with decode host fields")
    rec = tg[-1]
    placed = rec["placement"]
    bandwidth = json.loads(args.host.read_text())["bandwidth"]
    threads, bw = max(bandwidth.items(), key=lambda kv: int(kv[0]))  # the bridge's count: host_bench's largest
    host, experts, k = host_layer_bytes(args.model, placed["rule"])
    host_bytes = sum(k * b for b in host.values())
    t_token = 1.0 / rec["tps_median"]
    t_other = t_token * (1.0 - placed["decode_host_share"])
    t_reads = host_bytes / (bw * 1e9)
    t_host = t_token * placed["decode_host_share"]
    result = dict(
        bench=str(args.bench), rule=placed["rule"], host_layers=len(host), experts=experts, k=k,
        host_bytes_per_token=host_bytes, read_bandwidth_GBps=bw, bandwidth_threads=int(threads),
        tps=rec["tps_median"], token_ms=t_token * 1e3, host_ms=t_host * 1e3, other_ms=t_other * 1e3,
        reads_ms=t_reads * 1e3, host_GBps=host_bytes / t_host / 1e9,
        host_fraction_of_bandwidth=t_reads / t_host,
        bound_host_only_tps=1.0 / t_reads, fraction_of_host_only=rec["tps_median"] * t_reads,
        bound_host_floor_tps=1.0 / (t_reads + t_other), fraction_of_host_floor=rec["tps_median"] * (t_reads + t_other))
    print(f"{placed['rule']}: {len(host)} host layers, {host_bytes / 1e6:.1f} MB of experts a token; "
          f"read bandwidth {bw:.1f} GB/s ({threads} threads)")
    print(f"  measured {rec['tps_median']:.1f} tok/s: {t_token * 1e3:.2f} ms a token, host calls {t_host * 1e3:.2f} ms "
          f"({result['host_GBps']:.1f} GB/s, {result['host_fraction_of_bandwidth']:.2f} of bandwidth), "
          f"the rest {t_other * 1e3:.2f} ms")
    print(f"  bound, host reads alone: {result['bound_host_only_tps']:.1f} tok/s ({result['fraction_of_host_only']:.3f})")
    print(f"  bound, host reads at bandwidth + the rest as measured: {result['bound_host_floor_tps']:.1f} tok/s "
          f"({result['fraction_of_host_floor']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
