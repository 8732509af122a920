#!/usr/bin/env bash
# 2026-12-03, fourth call (~5 min; carry .whl), with decode's bf16 dot
# operands the default (TANDEM_DECODE_DOT_BF16, A/B'd at 06:19):
#  1. the decode step: rk4, int8, rk4p at 4K and 128K (bf16 weights);
#  2. the k=3 verify step against a plain step (issue 5's <= 1.15x);
#  3. for the next session: decode attention alone at 128K by key splits
#     (32-256; MAX_SPLITS is 64 today): with bf16 dots rk4 and int8 both sit
#     near 0.19 ms a layer, ~0.8 / 1.4 TB/s, latency-bound in one wave of 256
#     programs; the 4-warp tiles (19) beside the 8-warp ones (21).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
for kv in rk4 int8 rk4p; do
  STEP_TAIL=2 step ${kv}_decode 90 python3 -m bench.decode --model $M --device cuda \
    --kv-format $kv --batch 1 --context 4096 131072 --steps 16
done
STEP_TAIL=5 step verify_k3 90 python3 -m bench.speculative --device cuda --verify-model $M \
  --context 4096 --ks 3 --repeats 10
STEP_TAIL=20 step attn_splits 100 python3 -m bench.attention --new 1 --context 131072 \
  --kv-format rk4 int8 --candidates 19 21 --splits 32 64 128 256 --repeats 20
