#!/usr/bin/env bash
# Creates .venv (Python 3.12) with the package. With --test also the test extras and llama-cpp-python,
# built for the CPU with the flags the oracle tests need (the native/AMX build has segfaulted on these
# machines). Idempotent: a second run installs only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${BLOOMERY_PYTHON:-}
if [ -z "$PY" ]; then
  # Run each candidate rather than trusting `command -v`: a pyenv shim for python3.12 exists even
  # where pyenv's selected version lacks it, and then exits 127.
  for cand in python3.12 "env PYENV_VERSION=3.12.1 python3" python3; do
    if $cand -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then PY=$cand; break; fi
  done
  [ -n "$PY" ] || { echo "setup_env: no Python >= 3.12 found (tried python3.12, PYENV_VERSION=3.12.1 python3, python3); set BLOOMERY_PYTHON" >&2; exit 1; }
fi
[ -x .venv/bin/python ] || $PY -m venv .venv
.venv/bin/python -c 'import sys; assert sys.version_info >= (3, 12), "bloomery-jax needs Python >= 3.12"'
.venv/bin/python -m pip install -q -U pip
if [ "${1:-}" = "--test" ]; then .venv/bin/python -m pip install -q -e ".[test]"; else .venv/bin/python -m pip install -q -e .; exit 0; fi
LLAMA_CPP_PYTHON_VERSION=0.3.36
if ! .venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null; then
  echo "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION for the CPU (3-4 minutes)..." >&2
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF" \
    .venv/bin/python -m pip install -q --no-cache-dir "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
