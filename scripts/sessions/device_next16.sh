#!/usr/bin/env bash
# After the 20:01 run (device_next15.sh: EARLY 7.30 vs 7.40/7.59 ms, one
# pair each; the dense GEMV's default configs lost the bf16 step, 16.22 vs
# 14.93 ms at 4K, while the sweep's best per shape summed 12.64 ms against
# cuBLAS's 13.14): with those best configs now picked by shape
# (engine/dense_gemv.py TUNED), the bf16 step both ways, alternating; two
# more EARLY pairs on the int4 step; then issue 7's 24 GiB demonstration
# (device_memory24.sh, not re-run since the prefill's split-key partials).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
for d in 1 0 1 0; do
  STEP_TAIL=3 step bf16_tuned_dense$d 90 env TANDEM_DENSE_GEMV=$d python3 -m bench.decode \
    --model $M --device cuda --kv-format int8 --batch 1 --context 4096 131072 --steps 16
done
for e in 1 0 1 0; do
  STEP_TAIL=1 step int4_early$e 70 env TANDEM_GEMV_EARLY=$e python3 -m bench.quant --rows 1 \
    --only lm_head --decode-steps 16
done
bash scripts/device_memory24.sh > "$OUT/memory24.log" 2>&1; tail -40 "$OUT/memory24.log"
# more than the 8 files a call brings back: one archive
tar czf /tmp/next16.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next16.tgz "$OUT/"
