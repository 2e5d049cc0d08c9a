#!/usr/bin/env bash
# Set up Tandem with its test dependencies and run the whole test suite (what CI runs).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian tools the tests use: promtool (Prometheus config/metrics checks, live PromQL test).
if ! command -v promtool >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing prometheus (promtool) from Debian"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "[test] promtool missing and not root: its tests will be skipped" >&2
  fi
fi
scripts/setup.sh --dev
.venv/bin/ruff check .          # lint (pyproject.toml [tool.ruff]); a finding fails CI
exec .venv/bin/python -m pytest "$@"
