#!/usr/bin/env bash
# The README's test command: set up .venv (scripts/setup_env.sh) and run the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `-k gguf`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --test
# Default: everything but tests marked slow (they run with `bash scripts/test.sh -m slow`).
if [ $# -eq 0 ]; then set -- -m "not slow"; fi
exec .venv/bin/python -m pytest -q "$@"
