#!/usr/bin/env bash
# Sets up Tandem on a fresh machine: .venv, dependencies, the bundled models.
# Idempotent: a second run only checks.  Usage: scripts/setup.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0; [[ "${1:-}" == "--dev" ]] && DEV=1
PY=${PYTHON:-python3}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [[ ! -x .venv/bin/python ]]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip wheel setuptools

# torch: the CPU build of 2.13.0 lies on this machine's disk; elsewhere users pick their own
# build (CUDA) before running this script, and we leave it alone.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  say "installing torch (${TANDEM_TORCH_SPEC:-torch==2.13.0})"
  $PIP install --progress-bar on "${TANDEM_TORCH_SPEC:-torch==2.13.0}"
fi

# llama-cpp-python compiles from source (~10 min on 2 cores); pip caches the wheel, so only the
# first set-up on a machine pays.  Only the core library is built: no llava/mtmd, tools, tests.
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  say "building llama-cpp-python (first time: ~10 min on 2 cores; cached afterwards)"
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_BLAS=OFF}" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    $PIP install --progress-bar on "llama-cpp-python==0.3.36"
fi

say "installing tandem and its dependencies"
if [[ $DEV == 1 ]]; then
  $PIP install -q --progress-bar on -e ".[dev]"
else
  $PIP install -q --progress-bar on -e .
fi

say "preparing the bundled models"
.venv/bin/tandem models prepare
say "ready"
