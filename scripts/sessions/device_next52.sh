#!/usr/bin/env bash
# 12-05 evening: the GPU re-run of last session's unverified fixes (the GDN
# step kernels no longer specialise on pointer alignment; the dummy-model
# tolerance for bf16 rounding), then the 512-token int4 chunk against the
# weight workspace. Chained calls on one warm machine:
#   bash scripts/sessions/device_next52.sh verify   (carry .whl)
#   bash scripts/sessions/device_next52.sh sweep    (carry .whl)
# then, with the workspace's default at 256 MB:
#   bash scripts/sessions/device_next52.sh prologue (carry .whl): the GEMV
#     prologues re-timed since their norm weights go through L1 (.ca), untimed
#   bash scripts/sessions/device_next52.sh memory   (carry .whl): the 24 GiB
#     service past the dense workspace's 64K keys, with the larger slice
# then the GEMV's tiles through a shared-memory ring of bulk copies (STAGES):
#   bash scripts/sessions/device_next52.sh ring     (carry .whl)
# then the 24 GiB service at the full context with 1,024-token chunks (the
# plan fits at 23.67 GiB with 4 snapshot slots; 1,024-token chunks ran 1.93x
# llama.cpp's 4K prefill on an H100 with 256 MB slices):
#   bash scripts/sessions/device_next52.sh long1024 (carry .whl)
set -uo pipefail
call=${1:?verify or sweep}
source scripts/device_env.sh
case "$call" in
  verify)
    STEP_TAIL=6 step warmup_tests 200 python3 -m pytest -q -p no:cacheprovider \
      tests/test_cuda.py -k "compile or reuse or warm"
    STEP_TAIL=12 step service_dummies 330 env TANDEM_TEST_DEVICE=cuda python3 -m pytest -q \
      -p no:cacheprovider tests/test_service_hybrid.py tests/test_service_disagg.py \
      -k "not embedded and (hybrid or agent or two_by_two or prefix or cancel or full or cache)" ;;
  sweep)
    for mb in 64 256; do
      TANDEM_QUANT_GEMM_WORKSPACE_MB=$mb STEP_TAIL=3 step prefill_ws$mb 150 python3 -m bench.prefill \
        --model qwen3.5-27b --device cuda --weights int4 --kv-format rk4 --tokens 4096 \
        --chunk 512 --repeats 2
    done
    step_27b int4_step ;;
  prologue)
    STEP_TAIL=30 step prologues 200 python3 -m bench.gemv_cuda --rows 4 --norm --silu --gated
    step_27b step_default
    for p in GATED NORM SILU; do
      export TANDEM_${p}_PROLOGUE=1; step_27b step_$p; unset TANDEM_${p}_PROLOGUE
    done
    step_27b step_default_again ;;
  ring)
    STEP_TAIL=8 step ring_tests 240 python3 -m pytest -q -p no:cacheprovider -x \
      tests/test_gemv_cuda.py -k "ring or walking or matches_the_reference or spills or chained or dependent"
    STEP_TAIL=20 step ring_sweep 200 python3 -m bench.gemv_cuda --rows 4 --stages 2 3 4 6 \
      --plans-out "$OUT/plans.json" --json "$OUT/ring_sweep.json"
    step_27b step_default
    for st in 3 4; do
      export TANDEM_GEMV_CUDA_STAGES=$st; step_27b step_stages$st; unset TANDEM_GEMV_CUDA_STAGES
    done
    export TANDEM_GEMV_CUDA_PLANS=$OUT/plans.json; step_27b step_swept; unset TANDEM_GEMV_CUDA_PLANS
    step_27b step_default_again
    export TANDEM_GEMV_CUDA_STAGES=4; step_27b step_stages4_again; unset TANDEM_GEMV_CUDA_STAGES ;;
  long1024)
    STEP_TAIL=16 step memory_260k_c1024 440 python3 -m bench.memory --model qwen3.5-27b \
      --weights int4 --kv-format rk4 --speculative mtp --draft-tokens 3 --device cuda \
      --max-context-tokens 262144 --prefill-chunk 1024 --gpu-memory-budget 24GiB \
      --prompt-tokens 260000 --new-tokens 64 \
      --serve-args "--live-slots 1 --snapshot-slots 4 --max-batch 1" --json "$OUT/memory_260k_c1024.json"
    grep -i -e "compile" -e "peak" -e "total" -e "spare" "$OUT/memory_260k_c1024.log" | head -30 ;;
  memory)
    STEP_TAIL=16 step memory_70k 330 python3 -m bench.memory --model qwen3.5-27b --weights int4 \
      --kv-format rk4 --speculative mtp --draft-tokens 3 --device cuda --max-context-tokens 262144 \
      --prefill-chunk 512 --gpu-memory-budget 24GiB --prompt-tokens 70000 --new-tokens 16 \
      --serve-args "--live-slots 1 --snapshot-slots 4 --max-batch 1" --json "$OUT/memory_70k.json"
    for c in 512 1024; do
      STEP_TAIL=3 step prefill_chunk$c 150 python3 -m bench.prefill --model qwen3.5-27b \
        --device cuda --weights int4 --kv-format rk4 --tokens 4096 --chunk $c --repeats 2
    done ;;
esac
