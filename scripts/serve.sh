#!/usr/bin/env bash
# The README's main command: set up .venv (scripts/setup_env.sh) and start the OpenAI-compatible
# server. With no arguments it serves the embedded default model (Gemma 3 270M Q4_K_M) on
# http://127.0.0.1:8080; arguments go to `python -m bloomery_jax.serve` (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m bloomery_jax.serve "$@"
