#!/usr/bin/env bash
# 12-05 night: the CUDA GEMV's shared-memory ring on whatever card comes (its
# guard test and the e8ce5ee refactor never ran on a GPU), then the 24 GiB
# service's prefill worker at 2,048-token chunks: the plan counts 2.55 GiB of
# activations there and refuses 24 GiB by 760 MiB, while at 1,024 it counted
# 1.57 GiB against a measured 1.25 GiB process. Chained calls:
#   bash scripts/sessions/device_next53.sh ring      (carry .whl)
#   bash scripts/sessions/device_next53.sh calib2048 (carry .whl): the 260K
#     service at 2,048-token chunks under a 25 GiB budget the old plan accepts,
#     to measure what its prefill worker really holds
#   bash scripts/sessions/device_next53.sh long2048  (carry .whl): the same in
#     24 GiB once the plan is calibrated, and the 4K prefill rate at 2,048
#   bash scripts/sessions/device_next53.sh auto      (carry .whl): the service
#     with --prefill-chunk left at auto (the store picks 2,048 in 24 GiB and its
#     prefill worker runs the store's), then where the int4 step's time goes
set -uo pipefail
call=${1:?ring, calib2048 or long2048}
source scripts/device_env.sh
memory_260k() {  # memory_260k NAME CHUNK BUDGET
  STEP_TAIL=16 step "$1" 480 python3 -m bench.memory --model qwen3.5-27b \
    --weights int4 --kv-format rk4 --speculative mtp --draft-tokens 3 --device cuda \
    --max-context-tokens 262144 --prefill-chunk "$2" --gpu-memory-budget "$3" \
    --prompt-tokens 260000 --new-tokens 64 \
    --serve-args "--live-slots 1 --snapshot-slots 4 --max-batch 1" --json "$OUT/$1.json"
  grep -i -e "compile" -e "peak" -e "total" -e "spare" "$OUT/$1.log" | head -30
}
case "$call" in
  auto)
    STEP_TAIL=16 step memory_70k_auto 300 python3 -m bench.memory --model qwen3.5-27b \
      --weights int4 --kv-format rk4 --speculative mtp --draft-tokens 3 --device cuda \
      --max-context-tokens 262144 --gpu-memory-budget 24GiB --prompt-tokens 70000 \
      --new-tokens 32 --serve-args "--live-slots 1 --snapshot-slots 4 --max-batch 1" \
      --json "$OUT/memory_70k_auto.json"
    grep -i -e "activation reserve" -e "chunks of up to" -e "total" -e "spare" \
      "$OUT/memory_70k_auto.log" | head -20
    TANDEM_PDL=0 STEP_TAIL=40 step profile_int4 200 python3 -m bench.profile_step --weights int4 ;;
  ring) bash scripts/sessions/device_next52.sh ring ;;
  calib2048) memory_260k memory_260k_c2048_25g 2048 25GiB ;;
  long2048)
    memory_260k memory_260k_c2048 2048 24GiB
    for c in 1024 2048; do
      STEP_TAIL=3 step prefill_chunk$c 150 python3 -m bench.prefill --model qwen3.5-27b \
        --device cuda --weights int4 --kv-format rk4 --tokens 4096 --chunk $c --repeats 3
    done ;;
esac
# the ring on the H200 (12-05 21:57: stages 3 6.95 ms against the default's
# 7.12 / 7.18 in one run each): alternating rounds of default, stages 3 and
# the swept plans (lm_head through a 3-stage ring), carried as PLANS
if [ "$call" = ab ]; then
  for round in 1 2 3; do
    step_27b ab${round}_default
    TANDEM_GEMV_CUDA_STAGES=3 step_27b ab${round}_stages3
    TANDEM_GEMV_CUDA_PLANS=${PLANS:?} step_27b ab${round}_swept
  done
  grep -h -A2 step_ms "$OUT"/ab*.log | grep -v -e step_ms -e -- | awk '{print $2}' | paste -sd' '
fi
# the per-card plans (gemv_cuda.CARD_PLANS) as the default against plan_for's
# (TANDEM_GEMV_CUDA_STAGES=0), alternating, after the GEMV's GPU tests
if [ "$call" = cardplans ]; then
  STEP_TAIL=4 step gemv_tests 200 python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_gemv_cuda.py -k "card or matches_the_reference or dependent"
  for round in 1 2; do
    step_27b cp${round}_cardplans
    TANDEM_GEMV_CUDA_STAGES=0 step_27b cp${round}_planfor
  done
  grep -h -A2 step_ms "$OUT"/cp*.log | grep -v -e step_ms -e -- | awk '{print $2}' | paste -sd' '
fi
