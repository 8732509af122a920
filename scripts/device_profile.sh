#!/usr/bin/env bash
# Where the 27B-shape decode step's GPU time goes (issues 6 and 7): the
# kernels of one batch-1 step at 4K context, graph-captured, for bf16 and
# int4 weights, and the eager bf16 step for launch counts. ~4 minutes.
set -uo pipefail
source scripts/device_env.sh
for weights in bf16 int4; do
  echo "== $weights weights, CUDA graphs"
  timeout 150 python -m bench.profile_step --weights "$weights" --json "$OUT/profile_$weights.json" \
    2>&1 | tee "$OUT/profile_$weights.log" | tail -75
done
echo "== bf16 weights, eager"
timeout 120 python -m bench.profile_step --weights bf16 --no-cuda-graphs --top 25 \
  --json "$OUT/profile_bf16_eager.json" 2>&1 | tee "$OUT/profile_bf16_eager.log" | tail -45
