#!/usr/bin/env bash
# The CUDA DP4A GEMV (engine/quant/q4_gemv.cu) on the H200, one call (carry .whl):
#   bash scripts/sessions/device_next40.sh
# tests: tests/test_gemv_cuda.py on the GPU (the kernel against its reference);
# sweep: bench.gemv_cuda, each 27B Q4_K shape, Triton against the CUDA plans,
#   the best plan per shape into $OUT/plans.json;
# step: the int4 27B decode step, Triton then CUDA (TANDEM_GEMV_CUDA=1 with the
#   sweep's plans), two alternating rounds (bench.quant --decode-steps 16).
set -uo pipefail
source scripts/device_env.sh
STEP_TAIL=25 step tests 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv_cuda.py
STEP_TAIL=30 step sweep 240 python3 -m bench.gemv_cuda --plans-out "$OUT/plans.json" \
  --json "$OUT/sweep.json"
[ -s "$OUT/plans.json" ] || exit 1
for round in 1 2; do
  STEP_TAIL=4 step "step_triton_$round" 150 python3 -m bench.quant --rows 1 --only lm_head \
    --decode-steps 16
  TANDEM_GEMV_CUDA=1 TANDEM_GEMV_CUDA_PLANS="$OUT/plans.json" STEP_TAIL=4 \
    step "step_cuda_$round" 150 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
done
