#!/usr/bin/env bash
# The README's test command: installs k3trt with its test extras (idempotent), lints with ruff (the
# rules in pyproject.toml), then runs the CPU suite (tiny models). GPU tests skip themselves without
# CUDA; `-m slow` runs the heavier ones. Arguments go to pytest (e.g. `-n 2`, a test folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
"${PYTHON:-python3}" -m ruff check .
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --durations=15 "$@"
