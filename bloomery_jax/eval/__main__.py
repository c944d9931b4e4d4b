"""``python -m bloomery_jax.eval``: logits files and perplexity / KL divergence of a GGUF model.

    python -m bloomery_jax.eval logits --model M.gguf (--tokens 1,2,3 | --text "...") --out logits.npy
    python -m bloomery_jax.eval perplexity --model M.gguf --text-file F [--ctx 512]
        [--save-base base.npz] [--kl-base base.npz] [--json]

``logits`` writes float32 ``[n_tokens, n_vocab]`` (every position) with ``np.save``.
``perplexity`` scores the second half of each ``--ctx`` chunk like llama-perplexity; with
``--kl-base`` (a file written by an earlier ``--save-base`` run on the same text) it adds the
mean / max / 99th-percentile KL divergence and the same-top-1 percentage. Text is tokenized
with the file's own vocabulary (BOS as the file says). ``--act-rounding ggml-cpu`` rounds
matmul activations as llama.cpp's CPU backend does. Errors: one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..cli_options import PLACE_HELP
from ..errors import BloomeryError, ConfigError
from ..ops.actquant import ACT_ROUNDINGS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise ConfigError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bloomery_jax.eval", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(sp):
        sp.add_argument("--model", required=True, help="GGUF file")
        sp.add_argument("--ubatch", type=int, default=512, help="tokens per forward step (default 512)")
        sp.add_argument("--place", default="card", help=PLACE_HELP)
        sp.add_argument("--act-rounding", choices=ACT_ROUNDINGS, default=None,
                        help="none: exact float32 reference; ggml-cpu / ggml-cuda: round activations like llama.cpp's "
                             "CPU / CUDA backend (default: none)")

    lg = sub.add_parser("logits", help="logits of every position to a .npy file")
    common(lg)
    src = lg.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids")
    src.add_argument("--text", help="text, tokenized with the model's vocabulary")
    lg.add_argument("--out", required=True, help="output .npy (float32 [n_tokens, n_vocab])")

    pp = sub.add_parser("perplexity", help="perplexity over chunks of a text file, optionally KL against a base")
    common(pp)
    pp.add_argument("--text-file", required=True, help="UTF-8 text")
    pp.add_argument("--ctx", type=int, default=512, help="chunk length (default 512)")
    pp.add_argument("--save-base", help="write this run's scored logits here (.npz) for a later --kl-base")
    pp.add_argument("--kl-base", help="base-logits file from an earlier --save-base run on the same text")
    pp.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _parse_token_list(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ConfigError(f"--tokens must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ConfigError("--tokens is empty")
    return ids


def _tokenizer(gf):
    from ..tokenizer import Tokenizer  # only text input needs it

    return Tokenizer.from_gguf(gf)


def _cmd_logits(args, model) -> None:
    ids = _parse_token_list(args.tokens) if args.tokens is not None else _tokenizer(model.gguf).encode(args.text)
    from .runner import sequence_logits

    logits = sequence_logits(model, ids, ubatch=args.ubatch, act_rounding=args.act_rounding)
    try:
        with open(args.out, "wb") as f:  # a file object: np.save would add ".npy" to other names
            np.save(f, logits)
    except OSError as e:
        raise ConfigError(f"cannot write --out {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}: float32 {list(logits.shape)}", file=sys.stderr)


def _cmd_perplexity(args, model) -> None:
    from .metrics import perplexity
    from .perplexity import compare_to_base, load_base, run_perplexity, save_base

    base = load_base(args.kl_base) if args.kl_base else None  # fail on a bad base before the long run
    try:
        text = Path(args.text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read --text-file {args.text_file}: {e}") from None
    tok = _tokenizer(model.gguf)
    bos = tok.bos_id if tok.vocab.add_bos else None
    run = run_perplexity(model, tok.encode(text), args.ctx, bos_id=bos, ubatch=args.ubatch,
                         act_rounding=args.act_rounding)
    ppl, err = perplexity(run.nll)
    result = {"model": model.path, "ctx": run.ctx, "n_chunks": int(run.tokens.shape[0]),
              "n_scored": int(run.nll.size), "ppl": ppl, "ppl_err": err}
    if base is not None:
        result.update(compare_to_base(run, base, args.kl_base))
    if args.save_base:
        save_base(args.save_base, run)
    if args.json:
        print(json.dumps(result))
        return
    print(f"perplexity: {ppl:.4f} +/- {err:.5f} ({result['n_chunks']} chunks of {run.ctx}, "
          f"{result['n_scored']} tokens scored)")
    if base is not None:
        print(f"base perplexity: {result['base_ppl']:.4f} +/- {result['base_ppl_err']:.5f}")
        print(f"KL divergence: mean {result['kl_mean']:.6f} +/- {result['kl_mean_err']:.6f}, "
              f"max {result['kl_max']:.6f}, 99% {result['kl_p99']:.6f}")
        print(f"same top-1: {result['same_top1_pct']:.3f}%")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        from ..models.loader import load_model

        model = load_model(args.model, place=args.place)
        (_cmd_logits if args.command == "logits" else _cmd_perplexity)(args, model)
    except BloomeryError as e:
        print(str(e).splitlines()[0] if str(e) else type(e).__name__, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
