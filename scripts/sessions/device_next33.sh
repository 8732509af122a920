#!/usr/bin/env bash
# The GPU session of 2026-12-03 18:30-18:55, all calls run, and a fourth:
# call 3 again with TARGET_T=1.5 BUDGETS=270 (BENCHMARKS.md, "transformers'
# floor on the 27B shape"; next: device_next34.sh). device_next32.sh's plan,
# never run, is folded in. Chain three calls so the GGUF's parts meet on the machine
# (scripts/device_chain_mtp.sh carries one each):
#   bash scripts/device_chain_mtp.sh 1 bash scripts/sessions/device_next33.sh 1   (part aa)
#   bash scripts/device_chain_mtp.sh 2 bash scripts/sessions/device_next33.sh 2   (part ab)
#   TARGET_T=0.5 VARIED=5000 BUDGETS=420 bash scripts/device_chain_mtp.sh 3
#     (part ac and .device/mtp_corpus.pt: every answer is cached, so the call trains)
# Call 1: the DP4A GEMV's three 8-warp prefetching block shapes (X8_CANDIDATES'
#   new ones: the 4-warp prefetching loop holds 126 registers, 25% occupancy)
#   against the picked configs on the five merged 27B shapes; the sweep's JSON
#   stays in /tmp for call 2 (TANDEM_GEMV_TUNED reads it); then transformers'
#   own model of the 27B shape (bench.transformers_floor), issue 6's floor.
# Call 2: the int4 step with TUNED and with the sweep file, alternating, twice;
#   then the rk4 agent loop with the timeline alone (PROFILE_EVERY=1000), not
#   measured since the rotations were folded into the kernels.
# Call 3: the MTP head with sharpened soft targets (train-mtp
#   --target-temperature 0.5) for 420 s on the 14:31 corpus: greedy acceptance
#   needs only the base's argmax, and T=1 spends a one-layer head on the
#   distribution's tail (340 -> 420 s at T=1 moved every figure < 0.03, so
#   the budget alone is not the lever). Judge on the dev set first
#   (bench.mtp_gap --prompts dev on the CPU), as README's train-mtp says.
set -uo pipefail
M=qwen3.5-27b
SWEEP=/tmp/sweep_next33.json  # /tmp outlives a call while the machine stays warm
source scripts/device_env.sh
case "${1:?call 1 or 2}" in
  1)
    STEP_TAIL=30 step gemv_sweep 240 python3 -m bench.quant --rows 1 --sweep --int8-x-only \
      --decode-steps 0 --only gate_up down "gdn in_proj" "gdn out" "attn qkv" \
      --candidates x8-n32-k1024-w8-pf x8-n64-k1024-w8-pf x8-n64-k512-w8-pf \
      --json "$OUT/sweep.json"
    cp "$OUT/sweep.json" "$SWEEP"
    STEP_TAIL=6 step transformers_floor 240 python3 -m bench.transformers_floor \
      --prompt-tokens 4096 --new-tokens 32 --json "$OUT/transformers_floor.json"
    ;;
  2)
    for i in 1 2; do
      STEP_TAIL=4 step "int4_step_tuned_$i" 100 python3 -m bench.quant --rows 1 --only lm_head \
        --decode-steps 16
      STEP_TAIL=4 TANDEM_GEMV_TUNED=$SWEEP step "int4_step_swept_$i" 100 python3 -m bench.quant \
        --rows 1 --only lm_head --decode-steps 16
    done
    KV=rk4 PROFILE_EVERY=1000 AGENT_LIMIT=270 bash scripts/device_agent_loop.sh
    (cd "$OUT" && tar czf call2_logs.tgz ./int4_step_*.log && rm -f ./int4_step_*.log)
    ;;
esac
