#!/usr/bin/env bash
# Set up Tandem (venv, dependencies, bundled models) and run it locally: all five services as
# processes, a demo prompt streamed through the SDK, then serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/tandem up "$@"
