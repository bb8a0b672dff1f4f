#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and `llama-quantize`, for K-quant bench files) from the llama.cpp vendored in the llama-cpp-python
# source package on PyPI (GitHub is not reachable from the bench machines; PyPI is).
# The binary is cached under ~/.cache/pagedllm/llama-server/<version>/ and the build is
# skipped when it is already there. A bench step only: never part of `make setup` or tests.
#
#   scripts/build_llama_server.sh [version]     (default 0.3.36)
#   JOBS=2 NICE=15 scripts/build_llama_server.sh
#
# Instruction sets are explicit (GGML_NATIVE=OFF) so the binary does not depend on the
# build host, and match what pagedllm's own kernels may use on the bench machine
# (AVX2/FMA/F16C, and AVX-512 with VNNI and BF16 where the CPU has it). AMX off: on a Xeon with AMX
# (amx_int8 in /proc/cpuinfo) this llama.cpp's AMX matmul died of SIGILL at its first tile instruction
# (tilezero in ggml_backend_amx_mul_mat, on an OpenMP worker), so its AVX-512 VNNI path is its best one there.
set -euo pipefail

VERSION="${1:-0.3.36}"
JOBS="${JOBS:-2}"
NICE="${NICE:-15}"
PY="${PYTHON:-python3}"
CACHE="${PAGEDLLM_CACHE:-$HOME/.cache/pagedllm}/llama-server/$VERSION"
BIN="$CACHE/llama-server"

# AVX-512 (with VNNI and BF16) where this CPU has it, else AVX2 only: a binary with AVX-512 code
# paths dies of SIGILL on an AVX2-only machine. The cache remembers which it holds.
if grep -qw avx512f /proc/cpuinfo; then ISA=avx512; AVX512=ON; else ISA=avx2; AVX512=OFF; fi
if [[ -x "$BIN" && "$(cat "$CACHE/isa" 2>/dev/null)" == "$ISA" ]]; then
    echo "cached: $BIN ($ISA)"
    exit 0
fi

WORK="$CACHE/src"
mkdir -p "$WORK"
cd "$WORK"
SDIST="llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d .
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -d "$SRC" ]] || tar xzf "$SDIST"

# LLAMA_CURL is deprecated in recent llama.cpp (a warning only); kept for older versions.
# The prebuilt web UI would be fetched from the network: off. OpenSSL is not needed for a
# local HTTP bench.
start=$(date +%s)
cmake -S "$SRC" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=$AVX512 -DGGML_AVX512_VNNI=$AVX512 -DGGML_AVX512_BF16=$AVX512 \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
nice -n "$NICE" cmake --build "$WORK/build" --target llama-server llama-quantize -j "$JOBS"
cp "$WORK/build/bin/llama-server" "$BIN"
cp "$WORK/build/bin/llama-quantize" "$CACHE/"  # bench llamacpp --random-qtype Q4_K_M requantizes with it
echo "$ISA" > "$CACHE/isa"
end=$(date +%s)
echo "built $BIN ($ISA) in $((end - start)) s"
"$BIN" --version 2>&1 | head -3 || true
