#!/usr/bin/env bash
# Device call (~5 min; carry .whl), 2026-12-02: the dense prefill attention
# (quantized pages dequantized once per layer into a bf16 workspace) and the
# DP4A GEMV as the one-row 4-bit default. Compiled tests of both; the int4
# decode step with the DP4A default and with TANDEM_GEMV_INT8_X=0; the 32K
# prefill with rk4 and rk4p KV (21% and 3.5% MFU with in-kernel dequant).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py \
  tests/test_quant_kernels.py -k "dense or prefill or int8_activ or dp4a or picked_one_row or heuristic"
for x8 in default 0; do
  if [ $x8 = default ]; then env=(env -u TANDEM_GEMV_INT8_X); else env=(env TANDEM_GEMV_INT8_X=0); fi
  STEP_TAIL=4 step int4_step_x8_$x8 75 "${env[@]}" python3 -m bench.quant \
    --rows 1 --only lm_head --decode-steps 16 --json "$OUT/int4_step_x8_$x8.json"
done
for kv in rk4 rk4p int8; do
  STEP_TAIL=5 step prefill_$kv 100 python3 -m bench.prefill --model $M --device cuda \
    --kv-format $kv --tokens 32768 --chunk 4096 --repeats 1 --json "$OUT/prefill_$kv.json"
done
