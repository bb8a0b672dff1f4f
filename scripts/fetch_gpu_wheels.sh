#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh needs on a machine without a package registry:
# msgspec (compiled: one wheel per CPython version) and gguf (pure Python), into build/gpu-wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/pip}"
mkdir -p build/gpu-wheels
for version in 3.10 3.11 3.12 3.13; do
    "$PIP" download -q --no-deps --only-binary=:all: --python-version "$version" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d build/gpu-wheels msgspec || true
done
"$PIP" download -q --no-deps -d build/gpu-wheels gguf
ls -la build/gpu-wheels
