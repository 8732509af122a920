#!/usr/bin/env bash
# Next GPU session (after 2026-12-03 18:55), two calls, no GGUF needed (carry .whl):
#   bash scripts/sessions/device_next34.sh 1; bash scripts/sessions/device_next34.sh 2
# Call 1: the stream-K DP4A GEMV (GemvConfig.stream_k, docs/ARCHITECTURE.md), never run
# on a GPU: its kernel tests on the H200 first (the interpreter cannot see
# races between a block's partial sums and its last arrival), then the
# sweep of STREAM_CANDIDATES against the picked configs on the five merged
# 27B shapes (down and gdn out, at 54-58% of their floor, are the targets),
# then the int4 step with TUNED and with the sweep's winners
# (TANDEM_GEMV_TUNED), alternating three times: one kernel set's step spread
# 7.08-7.87 ms over four runs on 12-03 18:33, so one pair decides nothing.
# Call 2: prefill against transformers on one host: 12-03 18:32 measured
# transformers' 4K prefill at 8,866 tok/s, only ~1.14x under tandem's last
# 4K figure (10,099, int8 pages, 12-01); both at 4K and 32K, same call; and
# transformers' prefill of a whole 101K-token conversation, which is its time
# to first token for the agent turn tandem serves in 0.28 s from its cache
# (transformers keeps no cache across requests).
set -uo pipefail
SWEEP=/tmp/sweep_next34.json
source scripts/device_env.sh
if [ "${1:?call 1 or 2}" = 2 ]; then
  STEP_TAIL=8 step prefill_tandem 200 python3 -m bench.prefill --model qwen3.5-27b --device cuda \
    --kv-format rk4 --tokens 4096 32768 --chunk 4096 --repeats 1
  STEP_TAIL=8 step transformers_floor 300 python3 -m bench.transformers_floor \
    --prompt-tokens 4096 32768 101000 --new-tokens 8 --json "$OUT/transformers_floor.json"
  exit 0
fi
STEP_TAIL=6 step stream_k_tests 240 python3 -m pytest -q -x tests/test_quant_kernels.py \
  -k "stream_k or int8_activation or split_fixup or sweep_file or tuned_configs"
STEP_TAIL=30 step gemv_sweep 240 python3 -m bench.quant --rows 1 --sweep --int8-x-only \
  --decode-steps 0 --only gate_up down "gdn in_proj" "gdn out" "attn qkv" \
  --candidates x8-n32-k1024-w4-pf-sk2 x8-n32-k1024-w4-pf-sk3 x8-n16-k1024-w4-pf-sk4 \
  x8-n16-k1024-w4-pf-sk5 --json "$OUT/sweep.json"
cp "$OUT/sweep.json" "$SWEEP"
# what the split kernel's prefetching loop and down's winner stall on (issue
# stalls or loads). Codes made once a row and loaded by every program do not
# shorten the loop statically (CPU, 12-03 19:10: 2.12 -> 2.09 instructions a
# weight, 2.36 -> 2.27 prefetching, at 221 registers; loaded tile-wide 2.39 /
# 2.73), so pre-quantized activations are not the lever unless ncu says so.
ncu_gemv gate_up
TANDEM_GEMV_TUNED=$SWEEP ncu_gemv down
(cd "$OUT" && tar czf ncu.tgz ncu_*.log && rm -f ncu_*.log)
for i in 1 2 3; do
  STEP_TAIL=4 step "int4_step_tuned_$i" 100 python3 -m bench.quant --rows 1 --only lm_head \
    --decode-steps 16
  STEP_TAIL=4 TANDEM_GEMV_TUNED=$SWEEP step "int4_step_swept_$i" 100 python3 -m bench.quant \
    --rows 1 --only lm_head --decode-steps 16
done
(cd "$OUT" && tar czf int4_steps.tgz ./int4_step_*.log && rm -f ./int4_step_*.log)
