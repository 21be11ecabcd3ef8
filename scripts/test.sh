#!/usr/bin/env bash
# The README's test command: installs k3trt with its test extras (idempotent), then runs the
# CPU suite (tiny models). GPU tests skip themselves without CUDA; `-m slow` runs the heavier ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --durations=15 "$@"
