#!/usr/bin/env bash
# Issue 7's demonstration: the 27B shape with 4-bit (int4) dummy weights, rk4
# KV and MTP k=3, laid out for a 262,144-token context inside a 24 GiB
# budget, served by `tandem serve` (three GPU processes) while NVML samples
# every process; first the plan, then an 8K and a 32K prompt (each prefilled,
# then served again from the prefix cache while decoding 64 tokens).
# ~4 minutes. Logs and JSON under $OUT.
set -uo pipefail
source scripts/device_env.sh
COMMON=(--model qwen3.5-27b --weights int4 --kv-format rk4 --speculative mtp --draft-tokens 3)
echo "== plan"
python -m tandem.cli plan "${COMMON[@]}" --context 262144 --snapshot-slots 2 --prefill-chunk 512 \
  --gpu-memory-budget 24GiB --device cuda 2>&1 | tee "$OUT/plan.txt"
echo "== python scripts/device_context.py --stack 64"
python scripts/device_context.py --stack 64 2>&1 | tee "$OUT/context.txt"
for tokens in 8192 32768; do
  echo "== service, prompt $tokens"
  timeout 200 python -m bench.memory "${COMMON[@]}" --device cuda --max-context-tokens 262144 \
    --prefill-chunk 512 --gpu-memory-budget 24GiB --prompt-tokens "$tokens" --new-tokens 64 \
    --serve-args "--live-slots 1 --snapshot-slots 2 --max-batch 1" --json "$OUT/memory_$tokens.json" \
    2>&1 | tee "$OUT/memory_$tokens.log" | tail -25
done
