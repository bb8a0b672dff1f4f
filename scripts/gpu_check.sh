#!/usr/bin/env bash
# The prepared GPU check: kernel correctness, paged vs contiguous attention time, end-to-end tokens/s
# beside HF transformers, decode HBM bandwidth. Runs in under 8 minutes on one H200.
#
#   scripts/gpu_check.sh            # the full check
#   scripts/gpu_check.sh --quick    # a smoke run (tiny sizes)
#
# The device machine has torch, triton and transformers but no package registry. pagedllm's engine
# also imports msgspec and gguf: when they are missing, they are installed from build/gpu-wheels
# (made here by scripts/fetch_gpu_wheels.sh and carried along: carry=["build/gpu-wheels"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import msgspec, gguf" 2>/dev/null; then
    if [ -d build/gpu-wheels ]; then
        "$PY" -m pip install -q --no-index --no-deps --target build/gpu-site --find-links build/gpu-wheels msgspec gguf
        export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu-site"
    else
        echo "msgspec/gguf missing and no build/gpu-wheels: run scripts/fetch_gpu_wheels.sh and carry build/gpu-wheels" >&2
        exit 2
    fi
fi
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'"
exec timeout 470 "$PY" scripts/gpu_check.py "$@"
