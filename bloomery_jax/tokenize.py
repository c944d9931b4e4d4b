"""``python -m bloomery_jax.tokenize``: text to token ids (or back) with a GGUF file's vocabulary.

    python -m bloomery_jax.tokenize --model M.gguf --text "Hello"        # prints [9259]
    python -m bloomery_jax.tokenize --text-file prompt.txt                # the default model
    python -m bloomery_jax.tokenize --model M.gguf --detokenize --text "[9259, 1902]"

Ids are printed as one JSON array. As with llama.cpp's ``llama-tokenize``, BOS/EOS are added
as the file says and special-token texts are parsed, unless ``--no-add-special`` /
``--no-parse-special``. Without ``--model`` the embedded default model is used. Every error is
one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import BloomeryError, ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise ConfigError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bloomery_jax.tokenize", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text (with --detokenize: a JSON array of ids)")
    src.add_argument("--text-file", help="read the text (or the ids) from this UTF-8 file")
    p.add_argument("--detokenize", action="store_true", help="ids -> text")
    p.add_argument("--no-add-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--no-parse-special", action="store_true", help="treat special-token texts as plain text")
    p.add_argument("--special", action="store_true", help="with --detokenize: print control tokens")
    return p


def _read_input(args) -> str:
    if args.text is not None:
        return args.text
    try:
        return Path(args.text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read --text-file {args.text_file}: {e}") from None


def _parse_ids(text: str) -> list[int]:
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--detokenize needs a JSON array of token ids: {e}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError("--detokenize needs a JSON array of integer token ids")
    return ids


def run(argv: list[str] | None = None) -> str:
    """Run the command and return what it prints (raises BloomeryError on bad input)."""
    from .gguf_file import GGUFFile
    from .tokenizer import Tokenizer

    args = _parser().parse_args(argv)
    text = _read_input(args)  # before loading: a bad input file fails fast
    if args.model is None:
        from .default_model import default_model_path

        model = default_model_path()
    else:
        model = args.model
    tok = Tokenizer.from_gguf(GGUFFile(model))
    if args.detokenize:
        return tok.decode(_parse_ids(text), special=args.special)
    ids = tok.encode(text, add_special=not args.no_add_special, parse_special=not args.no_parse_special)
    return json.dumps(ids)


def main(argv: list[str] | None = None) -> int:
    try:
        out = run(argv)
    except BloomeryError as e:
        print(f"error: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
