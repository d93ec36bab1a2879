#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, a peer for `python -m bench.compare --peer llama.cpp`, from the only place
# this machine can fetch from: PyPI's source package of llama-cpp-python, which vendors llama.cpp (0.3.36: llama.cpp
# of 2026-10-01), for this CPU, without a web UI or HTTPS. On a CPU with AMX, its AMX kernels are left out: built in
# (-march=native), they stopped the server with SIGILL at its warm-up on this project's Xeon (2026-11-30, a Q4_1
# file); that build gets every AVX-512 kernel (and the Q4_0 weights repacked for them) by name instead. About 5
# minutes on 2 cores; needs cmake, ninja and a C++ compiler.
# usage: bench/setup_llamacpp.sh [PREFIX=~/.cache/peers/llama.cpp]   -> PREFIX/bin/llama-server, llama-quantize
set -euo pipefail
PREFIX=${1:-$HOME/.cache/peers/llama.cpp}
VERSION=0.3.36
PYTHON=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
ISA=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo; then
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
       -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON)
fi
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF
# llama-quantize too: its fastest CPU path takes Q4_0, which a Q4_1 file is requantized to (--allow-requantize)
cmake --build "$WORK/build" --target llama-server llama-quantize -j "$(nproc)"
mkdir -p "$PREFIX/bin"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-quantize" "$PREFIX/bin/"
"$PREFIX/bin/llama-server" --version
