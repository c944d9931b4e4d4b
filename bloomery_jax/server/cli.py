"""Command line of ``python -m bloomery_jax.serve``: options → settings → provider → uvicorn.

With no arguments it serves the embedded default model (Gemma 3 270M Q4_K_M) on
http://127.0.0.1:8080 with the settings of ``configs/<architecture>.gin``. The port is bound
at once (``/health`` answers 503 while the model loads and compiles); the URL is printed on
stdout when the model is ready. Bad options, files or settings print one line to stderr and
exit with status 2; a model that fails to load exits with status 1.

Compiled steps are kept in a persistent JAX compilation cache (``<user cache>/xla``, or
``--compile-cache DIR``; ``--no-compile-cache`` turns it off), so a second start skips most of
the compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading

from ..cli_options import BRIDGE_HELP, PLACE_HELP, add_residency_args
from ..errors import BloomeryError
from ..settings import BRIDGES, CONFIG_DIR, load_settings


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        from ..errors import ConfigError

        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bloomery_jax.serve",
                                description="OpenAI-compatible HTTP server for a GGUF model.")
    p.add_argument("--model", "-m", help="GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--config", action="append", default=[],
                   help="gin file(s) (default: configs/<architecture>.gin, else configs/base.gin)")
    p.add_argument("--gin_param", "--gin-param", action="append", default=[], dest="gin_param",
                   help="gin binding, e.g. 'RuntimeSettings.max_context = 2048' (repeatable)")
    p.add_argument("--parallel", "-np", type=int, help="sequence slots (default: RuntimeSettings.parallel)")
    p.add_argument("--place", help=PLACE_HELP.replace("(default card)", "(default: RuntimeSettings.placement)"))
    p.add_argument("--bridge", choices=BRIDGES, help=BRIDGE_HELP.replace("default callback", "default: RuntimeSettings.bridge"))
    add_residency_args(p, record_routing=False)
    p.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot (default 16)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may take, queue wait included (default 600)")
    p.add_argument("--alias", help="the model name reported and accepted (default: the file name)")
    p.add_argument("--full-warmup", action="store_true",
                   help="compile every prefill chunk length before ready (default: the longer ones while idle)")
    p.add_argument("--compile-cache", help="persistent JAX compilation cache directory")
    p.add_argument("--no-compile-cache", action="store_true", help="do not keep compiled steps on disk")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    return p


def _default_config(model_path: str) -> list[str]:
    from ..gguf_file import GGUFFile

    arch = GGUFFile(model_path).architecture
    family = os.path.join(CONFIG_DIR, f"{arch}.gin")
    return [family if os.path.isfile(family) else os.path.join(CONFIG_DIR, "base.gin")]


def _check(args) -> None:
    from ..errors import ConfigError

    for name, value, lo in (("--port", args.port, 0), ("--parallel", args.parallel, 1), ("--queue", args.queue, 0)):
        if value is not None and not (lo <= value <= (65535 if name == "--port" else 4096)):
            raise ConfigError(f"{name} {value} is out of range")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout} must be > 0")
    if args.model is not None and not os.path.isfile(args.model):
        raise ConfigError(f"--model {args.model!r}: no such file")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty")


def _compile_cache(args) -> None:
    if args.no_compile_cache:
        return
    from ..engine.startup import enable_compile_cache  # the cache generate uses too

    enable_compile_cache(args.compile_cache)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check(args)
        from ..default_model import default_model_path

        path = args.model or str(default_model_path())
        settings = load_settings(args.config or _default_config(path), args.gin_param)
        if args.place is not None:
            settings = dataclasses.replace(settings, placement=args.place)
        if args.bridge is not None:
            settings = dataclasses.replace(settings, bridge=args.bridge)
        from ..placement.rules import parse_rule

        parse_rule(settings.placement)  # a bad rule is a one-line error before the server starts
        _compile_cache(args)
    except (BloomeryError, OSError) as e:
        print(f"bloomery_jax.serve: {e}".splitlines()[0], file=sys.stderr)
        return 2

    import uvicorn

    from .app import create_app
    from .provider import Provider, ProviderOptions

    options = ProviderOptions(model=args.model, settings=settings, parallel=args.parallel, queue=args.queue,
                              time_limit=args.timeout, alias=args.alias, full_warmup=args.full_warmup,
                              residency=args.residency, prompt_streaming=not args.no_prompt_streaming,
                              max_swaps=args.max_swaps)
    provider = Provider(options).start()
    server = uvicorn.Server(uvicorn.Config(create_app(provider, args.api_key), host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5))
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown_host}:{args.port}"
    print(f"bloomery_jax.serve: listening on {url} (loading the model; /health answers 503 until it is ready)",
          file=sys.stderr, flush=True)
    failed = threading.Event()

    def announce():
        provider.ready.wait()
        if provider.state == "ready":
            b = provider.bundle
            print(f"bloomery_jax.serve: ready at {url}/v1 (model {b.model_id!r}, {provider.engine.n_slots} slots, "
                  f"context {b.n_ctx}, loaded in {provider.load_seconds:.1f} s)", flush=True)
        else:
            failed.set()
            server.should_exit = True

    threading.Thread(target=announce, name="bloomery-announce", daemon=True).start()
    try:
        server.run()
    finally:
        provider.close()
    return 1 if failed.is_set() else 0
