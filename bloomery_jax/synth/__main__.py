"""``python -m bloomery_jax.synth``: write a synthetic GGUF model and print its report.

Errors (bad options, unknown types, an unwritable path) print one line to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import BloomeryError
from .core import PLUGINS, synthesize
from .policy import QTYPES

MEASURE_UP_TO_BYTES = 256 << 20

# CLI flag -> plug-in hyper-parameter
_HPARAM_FLAGS = {
    "layers": "n_layers", "hidden": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads",
    "head_dim": "head_dim", "experts": "n_experts", "top_k": "n_experts_used",
    "expert_ff": "expert_ff", "vocab": "n_vocab",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bloomery_jax.synth", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3moe", choices=sorted(PLUGINS))
    p.add_argument("--out", required=True, help="GGUF file to write")
    for flag in _HPARAM_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int, default=None)
    p.add_argument("--qtype", default="F32", choices=QTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--route-skew", type=float, default=0.0, help="A >= 0: how much hotter the hot experts are")
    p.add_argument("--twin", default=None, help="also write the F32 twin (exact dequantized values) here")
    fast = p.add_mutually_exclusive_group()
    fast.add_argument("--fast", dest="fast", action="store_true", default=None,
                      help="draw expert tensors as random quant blocks (default: above 1 GiB)")
    fast.add_argument("--no-fast", dest="fast", action="store_false")
    measure = p.add_mutually_exclusive_group()
    measure.add_argument("--measure", dest="measure", action="store_true", default=None,
                         help="run our forward pass for the mean max next-token probability "
                              f"(default: for files up to {MEASURE_UP_TO_BYTES >> 20} MiB)")
    measure.add_argument("--no-measure", dest="measure", action="store_false")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    hparams = {v: getattr(args, k) for k, v in _HPARAM_FLAGS.items() if getattr(args, k) is not None}
    try:
        report = synthesize(args.out, arch=args.arch, qtype=args.qtype, seed=args.seed,
                            route_skew=args.route_skew, twin_path=args.twin, fast=args.fast, **hparams)
        if args.measure or (args.measure is None and report.bytes <= MEASURE_UP_TO_BYTES):
            from .measure import mean_max_prob

            report.mean_max_prob = mean_max_prob(args.out, seed=args.seed)
    except (BloomeryError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
