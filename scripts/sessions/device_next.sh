#!/usr/bin/env bash
# The next device session's first call (~8 min; carry .whl): the 4-bit GEMV,
# issue 7's main lever. The int8-activation (DP4A) kernel's compiled tests;
# the sweep of the merged and the largest shapes with the DP4A configs beside
# the float ones (paste its TUNED lines into engine/quant/gemv.py; a DP4A
# line changes numerics, measured on the CPU by bench.int8_activations: at
# the level of bf16-vs-fp32 compute); the int4 decode step with and without
# TANDEM_GEMV_INT8_X=1. Second call: scripts/sessions/device_next2.sh.
set -uo pipefail
source scripts/device_env.sh
step pytest_x8 90 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py \
  -k "int8_activ"
STEP_TAIL=40 step sweep 240 python3 -m bench.quant --rows 1 4 --sweep --int8-x --decode-steps 0 \
  --only gate_up down "gdn in_proj" "gdn out" "attn qkv" --json "$OUT/sweep.json"
for x8 in 0 1; do
  STEP_TAIL=4 step int4_step_x8_$x8 90 env TANDEM_GEMV_INT8_X=$x8 python3 -m bench.quant \
    --rows 1 --only lm_head --decode-steps 16 --json "$OUT/int4_step_x8_$x8.json"
done
