#!/usr/bin/env bash
# After the 20:33 run (~8 min; carry .whl). The 24 GiB demonstration came
# back over its 1.0 GiB spare: 23.42 / 23.91 GiB (12-01 18:00: 22.55 / 22.84);
# the decode worker 1.50 GiB against 0.79, the prefill 1.26 / 1.45 against
# 1.09, the store unchanged. The workers now log PyTorch's peak reserve
# (after the decode warm-up's prefill, after the warm-up, after each
# request), which device_memory24.sh's filter of "[" lines dropped: one 8K
# run with every line kept. Since then the decode warm-up prefills in the
# fused GDN steps' chunks (no fla autotune, whose 256 MiB flush buffer stayed
# reserved) and the prefill worker empties the cache after its warm-up.
# Then issue 6's MPS shares 70 and 80 (never run).
set -uo pipefail
source scripts/device_env.sh
STEP_TAIL=2 step reserve_test 60 python3 -m pytest -q -p no:cacheprovider tests/test_reserve_watch.py
for run in "8192 2" "32768 4"; do
  set -- $run
  timeout 200 python -m bench.memory --model qwen3.5-27b --weights int4 --kv-format rk4 \
    --speculative mtp --draft-tokens 3 --device cuda --max-context-tokens 262144 \
    --prefill-chunk 512 --gpu-memory-budget 24GiB --prompt-tokens "$1" --new-tokens 64 \
    --serve-args "--live-slots 1 --snapshot-slots $2 --max-batch 1" \
    --json "$OUT/memory_$1.json" > "$OUT/memory_$1.log" 2>&1
  grep -e "reserve" -e "warmed" -e "GEMV" -e "total" -e "decode  " -e "prefill  " -e "kvstore" \
    "$OUT/memory_$1.log" | tail -16
done
SHARES="70 80" bash scripts/device_mps.sh
