#!/usr/bin/env bash
# The next device session's second call (~8 min; carry .whl): the prefill
# attention tiles for rk4 and rk4p pages (the 32K prefill with rk4 KV ran at
# 21% MFU against int8's 57%, 2026-12-01), the prefill with rk4 / rk4p, and
# the 27B decode step at 128K (issue 6's >= 75% of roofline) with int8 and
# rk4p KV. Then: KV=int8 and KV=rk4p bash scripts/device_service27b.sh (the
# agent loop and interference through the service, never run on the 27B).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
STEP_TAIL=40 step attention 150 python3 -m bench.attention --context 32768 --new 4096 \
  --kv-format rk4 rk4p --json "$OUT/attention.json"
for kv in rk4 rk4p; do
  STEP_TAIL=6 step prefill_$kv 100 python3 -m bench.prefill --model $M --device cuda \
    --kv-format $kv --tokens 4096 32768 --chunk 4096 --repeats 1 --json "$OUT/prefill_$kv.json"
done
for kv in int8 rk4p; do
  STEP_TAIL=6 step decode128k_$kv 90 python3 -m bench.decode --model $M --device cuda \
    --kv-format $kv --batch 1 --context 131072 --steps 16 --json "$OUT/decode128k_$kv.json"
done
