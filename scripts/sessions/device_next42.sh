#!/usr/bin/env bash
# The CUDA DP4A GEMV, second round (carry .whl); two calls back to back:
#   bash scripts/sessions/device_next42.sh a
#   bash scripts/sessions/device_next42.sh b
# a: the GPU suites that run one-row 4-bit GEMVs, now on the CUDA kernel by
#    default (12-04 16:43 ran ~270 of them in 300 s without a failure, then
#    stopped); then bench.gemv_cuda with the new tile-queue variant and the
#    norm prologue against a norm launch plus the GEMV (--norm)
#    (plans into /tmp/plans.json, which b reads while the machine stays warm);
# b: the rest of the suites, and the int4 27B step: the default plans
#    against the sweep's, the norms in the GEMV prologue (TANDEM_NORM_PROLOGUE=1)
#    and TANDEM_GEMV_CUDA=0, three alternating rounds.
set -uo pipefail
call=${1:?a or b}
source scripts/device_env.sh
case "$call" in
  a)
    STEP_TAIL=12 step tests_a 360 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_gemv_cuda.py tests/test_quant_kernels.py
    STEP_TAIL=36 step sweep 150 python3 -m bench.gemv_cuda --norm --plans-out /tmp/plans.json \
      --json "$OUT/sweep.json"
    cp /tmp/plans.json "$OUT/" ;;
  b)
    STEP_TAIL=12 step tests_b 240 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_pdl.py tests/test_cuda_graphs.py tests/test_dense_gemv.py tests/test_profiling.py
    for round in 1 2 3; do
      step_27b "step_default_$round"
      TANDEM_GEMV_CUDA_PLANS=/tmp/plans.json step_27b "step_swept_$round"
      TANDEM_NORM_PROLOGUE=1 step_27b "step_norm_$round"
      TANDEM_GEMV_CUDA=0 step_27b "step_triton_$round"
    done ;;
esac
