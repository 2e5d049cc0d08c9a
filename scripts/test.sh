#!/usr/bin/env bash
# Set up Tandem with its test dependencies and run the whole test suite (what CI runs).
# With no arguments: every module but the serial ones (tests/conftest.py SERIAL_MODULES) on two
# pytest-xdist workers, a module per worker at a time, then the serial ones alone. Extra
# arguments go to one plain pytest run instead, e.g. `scripts/test.sh tests/unit -x`.
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
if [[ $# -gt 0 ]]; then
  exec .venv/bin/python -m pytest "$@"
fi
rc=0
.venv/bin/python -m pytest -n 2 --dist loadfile -m "not serial" || rc=$?
.venv/bin/python -m pytest -m serial || rc=$?
exit $rc
