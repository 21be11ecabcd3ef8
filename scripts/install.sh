#!/usr/bin/env bash
# Install k3trt and its test dependencies into the current Python environment.
# torch first, pinned, so pip takes the CPU build this workplace keeps on disk instead of
# downloading a multi-GB CUDA build; on a GPU machine with torch already installed it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
