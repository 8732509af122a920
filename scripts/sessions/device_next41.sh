#!/usr/bin/env bash
# The CUDA DP4A GEMV as the default (one call, carry .whl):
#   bash scripts/sessions/device_next41.sh
# tests: the GPU suites that run one-row 4-bit GEMVs, now on the CUDA kernel;
# step: the int4 27B step, TANDEM_GEMV_CUDA=0 (Triton) against the default, three
#   alternating rounds; then bench.profile_step's kernel table with the default.
set -uo pipefail
source scripts/device_env.sh
STEP_TAIL=12 step tests 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv_cuda.py \
  tests/test_quant_kernels.py tests/test_pdl.py tests/test_cuda_graphs.py tests/test_dense_gemv.py
for round in 1 2 3; do
  TANDEM_GEMV_CUDA=0 STEP_TAIL=3 step "step_triton_$round" 100 python3 -m bench.quant --rows 1 \
    --only lm_head --decode-steps 16
  STEP_TAIL=3 step "step_cuda_$round" 100 python3 -m bench.quant --rows 1 --only lm_head \
    --decode-steps 16
done
TANDEM_PDL=0 STEP_TAIL=20 step profile 150 python3 -m bench.profile_step --weights int4
