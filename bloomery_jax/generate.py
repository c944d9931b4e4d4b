"""``python -m bloomery_jax.generate``: stream a completion of one prompt.

    python -m bloomery_jax.generate --model M.gguf --prompt "Once upon a time" -n 64
    python -m bloomery_jax.generate --prompt "Why is the sky blue?" --chat --seed 1   # default model
    python -m bloomery_jax.generate --model M.gguf --prompt "..." --temperature 0 --json

Text goes to stdout as it is generated; progress (loading, compiling) and the closing line with
prompt and decode tok/s go to stderr. ``--json`` prints one JSON object instead: the prompt and
generated token ids, the text, the finish reason and the timings. Sampling defaults are
llama.cpp's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); ``--temperature 0`` is greedy.
Without ``--model`` the embedded default model (Gemma 3 270M) is used. Every error is one line
on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from .cli_options import (ATTENTION_HELP, BRIDGE_HELP, KERNELS_HELP, PLACE_HELP, ROUTING_HELP, WEIGHTS_HELP,
                          add_residency_args)
from .errors import BloomeryError, ConfigError
from .settings import ATTENTION, BRIDGES, KERNELS, ROUTING, WEIGHT_FORMS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise ConfigError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bloomery_jax.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn of the chat template")
    p.add_argument("--system", help="with --chat: a system message")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.05, help="0 = off")
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ctx", type=int, help="positions in the KV cache (default: prompt + n, rounded up)")
    p.add_argument("--ubatch", type=int, default=512, help="prompt tokens per prefill step (<= 4096)")
    p.add_argument("--place", default="card", help=PLACE_HELP)
    p.add_argument("--weights", choices=WEIGHT_FORMS, default="auto", help=WEIGHTS_HELP)
    p.add_argument("--kernels", choices=KERNELS, default="auto", help=KERNELS_HELP)
    p.add_argument("--attention", choices=ATTENTION, default="auto", help=ATTENTION_HELP)
    p.add_argument("--bridge", choices=BRIDGES, default="auto", help=BRIDGE_HELP)
    p.add_argument("--routing", choices=ROUTING, default="auto", help=ROUTING_HELP)
    p.add_argument("--decode-block", type=int, default=0,
                   help="decode steps per device call (default 0: 8 on a GPU, 1 elsewhere): the host's per-call "
                        "work is paid once for that many tokens; tokens after a stop are computed and dropped")
    add_residency_args(p)
    p.add_argument("--json", action="store_true", help="print token ids and timings as JSON")
    p.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compilation cache")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def prompt_ids(tokenizer, text: str, chat: bool, system: str | None, *, is_default: bool = False,
               log=None) -> list[int]:
    """Token ids of the prompt, rendered through the chat template with ``chat``.

    A file without ``tokenizer.chat_template`` uses the default model's Gemma template when it
    is the default model, else ChatML (saying so through ``log``), as the server does.
    """
    if not chat:
        return tokenizer.encode(text, add_special=True, parse_special=False)
    from . import default_model
    from .chat import CHATML_TEMPLATE, ChatTemplate

    source = tokenizer.vocab.chat_template
    if source is None:
        source = default_model.CHAT_TEMPLATE if is_default else CHATML_TEMPLATE
        if not is_default and log:
            log("the file has no tokenizer.chat_template: --chat uses ChatML")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    template = ChatTemplate.from_tokenizer(tokenizer, source)
    rendered = template.render(messages, add_generation_prompt=True)
    # Templates usually write the BOS text themselves; adding it again would double it.
    has_bos = bool(template.bos_token) and rendered.startswith(template.bos_token)
    return tokenizer.encode(rendered, add_special=not has_bos, parse_special=True)


def context_for(n_prompt: int, n_predict: int, model_context: int) -> int:
    """Default cache length: the next power of two >= prompt + n (at least 64), within the model's."""
    need = max(64, n_prompt + n_predict)
    size = 1 << (need - 1).bit_length()
    return max(min(size, model_context), min(need, model_context))


def run(argv: list[str] | None = None, out=None, err=None) -> dict:
    """Run the command (stream text to ``out``, progress to ``err``); returns the JSON record."""
    from .engine.engine import Engine
    from .engine.sampling import SamplingParams
    from .engine.scheduler import Scheduler, resolve_decode_block
    from .engine.startup import (Progress, enable_compile_cache, make_trace, open_model, placement_stats,
                                 residency_from_args)
    from .engine.stops import StopConditions

    out = out or sys.stdout
    err = err or sys.stderr
    args = _parser().parse_args(argv)
    if args.n_predict < 1:
        raise ConfigError(f"-n must be >= 1, got {args.n_predict}")
    args.decode_block = resolve_decode_block(args.decode_block, "--decode-block")
    if not args.no_compile_cache:
        enable_compile_cache()
    progress = Progress(err, quiet=args.quiet)
    model, tok, load_s = open_model(args.model, progress, args.place, args.weights, args.kernels, args.attention,
                                    args.bridge, args.routing)
    ids = prompt_ids(tok, args.prompt, args.chat, args.system, is_default=args.model is None, log=progress.done)
    model_ctx = int(getattr(model.cfg, "context_length", 4096))
    ctx = args.ctx or context_for(len(ids), args.n_predict, model_ctx)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed if args.seed is not None else random.SystemRandom().getrandbits(63))
    engine = Engine(model, n_slots=1, max_context=ctx, ubatch=args.ubatch,
                    residency=residency_from_args(model, args), routing_trace=make_trace(model, args))
    sched = Scheduler(engine, detokenizer=tok.detokenizer, decode_block=args.decode_block)
    stop = StopConditions.build(max_tokens=args.n_predict, stop_tokens=tok.eog_ids, stop_strings=args.stop)
    req = sched.submit(ids, params, stop)  # validates before compiling
    compile_s = engine.warmup(progress.update, chunks=sorted(set(engine.prefill_plan(len(ids)))),
                              buckets=engine.buckets[:1], decode_block=args.decode_block)
    progress.done(f"compiled in {compile_s:.2f} s")
    pieces = []
    for ev in sched.drive(req):
        pieces.append(ev.text)
        if not args.json and ev.text:
            out.write(ev.text)
            out.flush()
    t = req.timings
    record = {
        "model": str(model.path), "architecture": model.gguf.architecture,
        "prompt_tokens": ids, "tokens": req.tokens, "text": "".join(pieces), "finish_reason": req.finish_reason,
        "seed": params.seed,
        "timings": {"load_s": load_s, "compile_s": compile_s, "n_prompt": t.n_prompt, "prompt_s": t.prompt_s,
                    "prompt_tps": t.prompt_tps, "n_generated": t.n_generated, "decode_s": t.decode_s,
                    "decode_tps": t.decode_tps},
    }
    placement_stats(engine, record, args)
    if args.json:
        out.write(json.dumps(record) + "\n")
    else:
        out.write("\n")
        err.write(f"prompt: {t.n_prompt} tokens, {_rate(t.prompt_tps)} | decode: {t.n_generated} tokens, "
                  f"{_rate(t.decode_tps)} | finish: {req.finish_reason}\n")
    return record


def _rate(tps: float | None) -> str:
    return "n/a tok/s" if tps is None else f"{tps:.1f} tok/s"


def main(argv: list[str] | None = None) -> int:
    try:
        run(argv)
    except BloomeryError as e:
        print(f"error: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
