#!/usr/bin/env bash
# 2026-12-03, third call (~8 min; carry .whl). Nsight Compute at 06:09 put
# rk4's 128K decode attention (389 us a layer, 61% of the roofline for the
# step) on its shared memory: L1/TEX 92% busy, DRAM 8%, IPC 0.97, MIO stalls.
# Its fp32 K and V tiles (64 x 256) pass through shared memory into the tf32
# dots; bf16 operands halve that. A/B:
#  1. decode attention alone at 131,072 tokens, 64 splits: today's tiles
#     (int8: 14; rk4: 20) against bf16 dots (19, 21), one stage (22, 24),
#     128-key tiles (23);
#  2. the whole step, TANDEM_DECODE_DOT_BF16=0/1, rk4 and int8, 4K and 128K;
#  3. GPU tests: decode/verify attention with bf16 dots, speculative parity
#     with them on (decode and verify must read the same sums), and the
#     27B-width tuned GEMV configs (their rows=1 DP4A oracle, fixed 06:05).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
STEP_TAIL=20 step attn_decode 120 python3 -m bench.attention --new 1 --context 131072 \
  --kv-format rk4 int8 --candidates 14 19 20 21 22 23 24 --splits 64 --repeats 20
for f in 0 1; do
  for kv in rk4 int8; do
    STEP_TAIL=2 step ${kv}_dot$f 90 env TANDEM_DECODE_DOT_BF16=$f python3 -m bench.decode \
      --model $M --device cuda --kv-format $kv --batch 1 --context 4096 131072 --steps 16
  done
done
STEP_TAIL=4 step attn_tests 90 python3 -m pytest -q -p no:cacheprovider \
  tests/test_attention.py -k "bf16_dots or decode or verify"
STEP_TAIL=4 step parity_bf16dots 120 env TANDEM_DECODE_DOT_BF16=1 python3 -m pytest -q \
  -p no:cacheprovider tests/test_speculative.py -k "cuda or graph or parity or verify"
STEP_TAIL=4 step tuned_tests 100 python3 -m pytest -q -p no:cacheprovider \
  tests/test_quant_kernels.py -k "tuned_configs"
