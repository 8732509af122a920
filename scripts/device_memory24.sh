#!/usr/bin/env bash
# Issue 7's demonstration: the 27B shape with 4-bit (int4) dummy weights, rk4
# KV and MTP k=3, laid out for a 262,144-token context inside a 24 GiB
# budget, served by `tandem serve` (three GPU processes) while NVML samples
# every process; first the plans, then an 8K prompt (2 snapshot slots) and a
# 32K one (4 slots), each prefilled, then served again from the prefix cache
# while decoding 64 tokens. The token table stays in host memory (the
# default --embeddings auto on a GPU).
# KV=rk4p runs it with the page-wise format (32-token pages, bf16 staging
# pages in the store; `tandem plan` gives 22.32 GiB for it, 1.68 spare).
# ~4 minutes. Logs and JSON under $OUT.
set -uo pipefail
source scripts/device_env.sh
COMMON=(--model qwen3.5-27b --weights int4 --kv-format "${KV:-rk4}" --speculative mtp --draft-tokens 3)
for snapshots in 2 4; do
  echo "== plan, $snapshots snapshot slots"
  python -m tandem.cli plan "${COMMON[@]}" --context 262144 --snapshot-slots "$snapshots" \
    --prefill-chunk 512 --gpu-memory-budget 24GiB --device cuda 2>&1 | tee "$OUT/plan_$snapshots.txt"
done
echo "== python scripts/device_context.py --stack 64"
python scripts/device_context.py --stack 64 2>&1 | tee "$OUT/context.txt"
for run in "8192 2" "32768 4"; do
  set -- $run
  echo "== service, prompt $1, $2 snapshot slots"
  timeout 200 python -m bench.memory "${COMMON[@]}" --device cuda --max-context-tokens 262144 \
    --prefill-chunk 512 --gpu-memory-budget 24GiB --prompt-tokens "$1" --new-tokens 64 \
    --serve-args "--live-slots 1 --snapshot-slots $2 --max-batch 1" --json "$OUT/memory_$1.json" \
    > "$OUT/memory_$1.log" 2>&1
  # the table, and the workers' lines saying where their PyTorch reserve peaked
  grep -e "reserve" -e "GEMV" "$OUT/memory_$1.log"; grep -v "^\[" "$OUT/memory_$1.log" | tail -12
done
