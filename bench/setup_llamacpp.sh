#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, a peer for `python -m bench.compare --peer llama.cpp`, from the only place
# this machine can fetch from: PyPI's source package of llama-cpp-python, which vendors llama.cpp (0.3.36: llama.cpp
# of 2026-10-01). Native CPU flags (AVX-512, AMX where the CPU has them), no web UI, no HTTPS. About 20 minutes on 2
# cores; needs cmake, ninja and a C++ compiler.
# usage: bench/setup_llamacpp.sh [PREFIX=~/.cache/peers/llama.cpp]   -> PREFIX/bin/llama-server
set -euo pipefail
PREFIX=${1:-$HOME/.cache/peers/llama.cpp}
VERSION=0.3.36
PYTHON=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server -j "$(nproc)"
mkdir -p "$PREFIX/bin"
cp "$WORK/build/bin/llama-server" "$PREFIX/bin/"
"$PREFIX/bin/llama-server" --version
