#!/usr/bin/env bash
# Next GPU session (after 2026-12-03 16:33; the plan of device_next30.sh, never run
# and removed, carried over). Chain three calls so the GGUF's parts meet on the
# machine (scripts/device_chain_mtp.sh carries one each):
#   bash scripts/device_chain_mtp.sh 1 bash scripts/device_next32.sh 1   (part aa)
#   bash scripts/device_chain_mtp.sh 2 bash scripts/device_next32.sh 2   (part ab)
#   VARIED=5000 BUDGETS=420 bash scripts/device_chain_mtp.sh 3            (part ac and
#     .device/mtp_corpus.pt: with all 3,956 answers in it the call only trains;
#     without it the H200 answers them first, ~260 s: then BUDGETS=270)
# Call 1: Nsight Compute on gate_up's prefetching DP4A GEMV and on down (what
#   their loads wait on now); the int4 step twice; rk4 decode at 4K / 128K with
#   its rotations folded (the default) and not, alternating, on a third host
#   (16:11 and 16:22 disagreed at 4K; 128K was 75.4-76.5% folded); then
#   transformers' own model of the 27B shape (bench.transformers_floor),
#   the floor issue 6 names, not yet measured.
# Call 2: the int8 agent loop with the timeline alone (PROFILE_EVERY=1000;
#   13:31's int8 run had the profiler on turns 9 and 19).
# Call 3: the MTP head for 420 s on the 14:31 corpus: the 270 s head moved chat
#   1.66 -> 1.74 and cost code 2.33 -> 2.16 (H200 benchmark); is it the budget?
#   Then, if the session has the time, the same with sharpened soft targets
#   (TARGET_T=0.5 VARIED=5000 BUDGETS=270 bash scripts/device_chain_mtp.sh 3):
#   greedy acceptance needs only the base's argmax, and T=1 spends a
#   one-layer head on the distribution's tail. Judge on the dev set first
#   (bench.mtp_gap --prompts dev on the CPU), as README's train-mtp says.
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
case "${1:?call 1 or 2}" in
  1)
    for only in gate_up down; do ncu_gemv "$only"; done
    for i in 1 2; do
      STEP_TAIL=4 step int4_step_$i 100 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
      for sites in none all; do
        STEP_TAIL=3 TANDEM_RK4_FUSED_ROTATION=$sites step "rk4_${sites}_$i" 100 \
          python3 -m bench.decode --model $M --device cuda --kv-format rk4 --batch 1 \
          --context 4096 131072 --steps 16
      done
    done
    # issue 6's floor: transformers' own Qwen3.5-27B (fla-core's GDN, bf16),
    # prefill of 4K and decode after it, never measured on the H200 until now
    STEP_TAIL=6 step transformers_floor 240 python3 -m bench.transformers_floor \
      --prompt-tokens 4096 --new-tokens 32 --json "$OUT/transformers_floor.json"
    # at most 8 files come back from a call: one archive of every log
    (cd "$OUT" && tar czf call1_logs.tgz ./*.log ./*.json && rm -f ./*.log ./*.json)
    ;;
  2)
    KV=int8 PROFILE_EVERY=1000 AGENT_LIMIT=270 bash scripts/device_agent_loop.sh
    ;;
esac
