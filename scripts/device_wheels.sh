#!/usr/bin/env bash
# Downloads the pure-Python wheels the GPU machine lacks into .whl/ (git-ignored), for the device
# tool's `carry`. On the device, install them with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# With --server it adds the FastAPI stack too.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(gguf==0.19.0 gin-config==0.5.0)
if [ "${1:-}" = "--server" ]; then
  pkgs+=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 typing-inspection annotated-types opentelemetry-api)
fi
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pkgs[@]}"
ls .whl
