#!/usr/bin/env bash
# 12-05 late: issue 7's 24 GiB service at a 260,000-token prompt, the whole
# service's NVML peak (12-05 15:08 measured the prefill worker alone after
# the allocator fix), with the warm-up now compiling the in-kernel
# attention path; then the GPU run of the service tests' bf16 oracle.
# Chained calls on one warm machine (it goes back after 30 s idle):
#   bash scripts/sessions/device_next51.sh long     (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next51.sh step     (carry .whl .device/gguf.part.ab)
#   bash scripts/sessions/device_next51.sh service  (carry .whl .device/gguf.part.ac)
# then, on a fresh machine (17:17: 3 service tests failed; the oracle and
# the single-GPU transfer fixed):
#   bash scripts/sessions/device_next51.sh profile  (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next51.sh dummies  (carry .whl .device/gguf.part.ab)
#   bash scripts/sessions/device_next51.sh embedded (carry .whl .device/gguf.part.ac)
#   bash scripts/sessions/device_next51.sh sweep    (carry .whl): the host-bound 512-token
#     chunks against the workspace size (fewer slices, fewer launches a chunk)
set -uo pipefail
call=${1:?long, step or service}
source scripts/device_env.sh
park_parts
case "$call" in
  long)
    STEP_TAIL=16 step memory_260k 540 python3 -m bench.memory --model qwen3.5-27b --weights int4 \
      --kv-format rk4 --speculative mtp --draft-tokens 3 --device cuda --max-context-tokens 262144 \
      --prefill-chunk 512 --gpu-memory-budget 24GiB --prompt-tokens 260000 --new-tokens 64 \
      --serve-args "--live-slots 1 --snapshot-slots 4 --max-batch 1" --json "$OUT/memory_260k.json"
    grep -i -e "reserve" -e "compile" -e "warm" -e "peak" "$OUT/memory_260k.log" | head -30 ;;
  step)  # the int4 step, and the 4K prefill at the chunks the 24 GiB plan allows
    step_27b int4_step
    for c in 512 1024; do
      STEP_TAIL=5 step prefill_int4_chunk$c 150 python3 -m bench.prefill --model qwen3.5-27b \
        --device cuda --weights int4 --kv-format rk4 --tokens 4096 --chunk $c --repeats 1
    done ;;
  service)
    assemble_gguf
    STEP_TAIL=12 step service_cuda 300 env TANDEM_TEST_DEVICE=cuda python3 -m pytest -q \
      -p no:cacheprovider tests/test_service.py tests/test_service_hybrid.py \
      tests/test_service_disagg.py -k "greedy or concurrent or agent or parity"
    PROBE_KV=bf16 STEP_TAIL=8 step probe_embedded_bf16kv 100 python3 scripts/sessions/parity_probe.py embedded ;;
  profile)  # where a 512-token chunk's time goes with int4 weights; the warm-up's GPU tests
    STEP_TAIL=40 step prefill_profile 200 python3 -m bench.prefill --model qwen3.5-27b \
      --device cuda --weights int4 --kv-format rk4 --tokens 4096 --chunk 512 --repeats 1 --profile
    STEP_TAIL=4 step warmup_tests 200 python3 -m pytest -q -p no:cacheprovider \
      tests/test_cuda.py -k "compile or reuse or warm" ;;
  dummies)
    STEP_TAIL=12 step service_dummies 330 env TANDEM_TEST_DEVICE=cuda python3 -m pytest -q \
      -p no:cacheprovider tests/test_service_hybrid.py tests/test_service_disagg.py \
      -k "not embedded and (hybrid or agent or two_by_two or prefix or cancel or full or cache)" ;;
  embedded)
    assemble_gguf
    STEP_TAIL=12 step service_embedded 300 env TANDEM_TEST_DEVICE=cuda python3 -m pytest -q \
      -p no:cacheprovider tests/test_service.py tests/test_service_disagg.py \
      -k "greedy or concurrent or bit_exact or next_turn_moves" ;;
  sweep)
    for mb in 64 128 256; do
      TANDEM_QUANT_GEMM_WORKSPACE_MB=$mb STEP_TAIL=3 step prefill_ws$mb 150 python3 -m bench.prefill \
        --model qwen3.5-27b --device cuda --weights int4 --kv-format rk4 --tokens 4096 \
        --chunk 512 --repeats 2
    done ;;
esac
