#!/usr/bin/env bash
# The main job on the embedded default: a tiny random-weight K3 checkpoint -> a torch engine ->
# generation with MTP speculative decoding (K = 3), constrained to a JSON schema. CPU is enough.
# Usage: bash scripts/quickstart.sh [WORKDIR]   (default: ./quickstart-out)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
out=${1:-quickstart-out}
k3trt() { "${PYTHON:-python3}" -m k3trt "$@"; }     # works whether or not the entry point is on PATH
if [ ! -f "$out/ckpt/config.json" ]; then
  k3trt make-checkpoint --preset tiny --output "$out/ckpt" --seed 0
fi
if [ ! -f "$out/engine/config.json" ]; then
  k3trt build "$out/ckpt" --output "$out/engine" --dtype fp32 --spec-tokens 3
fi
k3trt --log-level WARNING run "$out/engine" --prompt "A person, as JSON: " \
  --speculative mtp --json-schema examples/person.schema.json --max-tokens 96 --seed 0 --json
