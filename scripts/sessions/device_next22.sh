#!/usr/bin/env bash
# 2026-12-03, second call (~8 min; carry .whl). After device_next21.sh (05:56):
#  1. the 27B-width tuned-config tests whose one-row DP4A configs were held
#     to the fp32 oracle (6 failures at 05:56; now the int8 reference), and
#     the rk4p write/attention tests after its decode write skips the page
#     kernels (tokens < page size store nothing);
#  2. the decode step with the split-K fix-up on by default: bf16 weights,
#     rk4 / rk4p / int8 KV at 4K and 128K, and the int4 step;
#  3. Nsight Compute on one 128K decode attention launch with rk4 KV (its
#     loads rewritten at 10cd134: 26.8% -> 60.7% of the roofline at 128K)
#     and int8 beside it: where rk4's remaining ~6 ms at 128K goes.
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
STEP_TAIL=6 step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_kv_rk4p.py tests/test_attention_rk4p.py tests/test_quant_kernels.py \
  -k "rk4p or paged or tuned_configs"
for kv in rk4 rk4p int8; do
  STEP_TAIL=3 step ${kv}_decode 120 python3 -m bench.decode --model $M --device cuda \
    --kv-format $kv --batch 1 --context 4096 131072 --steps 16
done
STEP_TAIL=1 step int4_step 120 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
KVS="rk4 int8" bash scripts/device_ncu_attention.sh  # STEP_TAIL 80 and a 150 s limit when run
