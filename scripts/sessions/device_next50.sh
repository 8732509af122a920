#!/usr/bin/env bash
# 12-05 evening: issue 7's int4 prefill (never measured against llama.cpp's
# 2,460 tok/s at 4K) with the new dequantize-into-a-workspace + cuBLAS path
# beside the fused Triton gemm, and why the service's greedy parity fails on
# CUDA. Chained calls on one warm machine (it goes back after 30 s idle):
#   bash scripts/sessions/device_next50.sh prefill  (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next50.sh long     (carry .device/gguf.part.ab)
#   bash scripts/sessions/device_next50.sh service  (carry .device/gguf.part.ac)
#   bash scripts/sessions/device_next50.sh probe    (what is left: 512-token chunks, the step)
# long: issue 7's 24 GiB service filled to 260,000 prompt tokens (every earlier
#   run laid 262,144 out but prompted 8K or 32K), NVML over every process.
set -uo pipefail
call=${1:?prefill, probe or service}
source scripts/device_env.sh
park_parts
int4_prefill() {  # int4_prefill NAME TOKENS...: the 27B dummy's prefill, int4 weights, rk4 KV
  local name=$1; shift
  STEP_TAIL=5 step "$name" 240 python3 -m bench.prefill --model qwen3.5-27b --device cuda \
    --weights int4 --kv-format rk4 --tokens "$@" --chunk 4096 --repeats 1
}
case "$call" in
  prefill)
    STEP_TAIL=4 step quant_tests 200 python3 -m pytest -q -p no:cacheprovider \
      tests/test_quant_kernels.py -k "dequantize_rows or workspace or gemm or dispatch"
    STEP_TAIL=40 step quant_gemm 150 python3 -m bench.quant_gemm --rows 64 512 4096 \
      --workspace-mb 16 64 --json "$OUT/quant_gemm.json"
    int4_prefill prefill_int4 4096 32768
    TANDEM_QUANT_GEMM_WORKSPACE_MB=0 int4_prefill prefill_int4_fused 4096
    STEP_TAIL=8 step probe_tiny 90 python3 scripts/sessions/parity_probe.py tiny-qwen3.5 TANDEM_PDL=0
    PROBE_KV=bf16 STEP_TAIL=8 step probe_tiny_bf16kv 80 python3 scripts/sessions/parity_probe.py tiny-qwen3.5 ;;
  long)
    STEP_TAIL=14 step memory_260k 520 python3 -m bench.memory --model qwen3.5-27b --weights int4 \
      --kv-format rk4 --speculative mtp --draft-tokens 3 --device cuda --max-context-tokens 262144 \
      --prefill-chunk 512 --gpu-memory-budget 24GiB --prompt-tokens 260000 --new-tokens 64 \
      --serve-args "--live-slots 1 --snapshot-slots 4 --max-batch 1" --json "$OUT/memory_260k.json"
    grep -e "reserve" -e "compile" -e "GEMV" "$OUT/memory_260k.log" | head -20 ;;
  probe)
    STEP_TAIL=5 step prefill_bf16 150 python3 -m bench.prefill --model qwen3.5-27b --device cuda \
      --kv-format rk4 --tokens 4096 --chunk 4096 --repeats 1
    TANDEM_QUANT_GEMM_DENSE_MIN_ROWS=4096 int4_prefill prefill_int4_chunk512_fused 4096 --chunk 512
    int4_prefill prefill_int4_chunk512 4096 --chunk 512
    assemble_gguf
    STEP_TAIL=8 step service_cuda 200 env TANDEM_TEST_DEVICE=cuda python3 -m pytest -q \
      -p no:cacheprovider tests/test_service.py tests/test_service_hybrid.py -k "greedy or concurrent or agent"
    step_27b int4_step ;;
  service)  # rk4 against bf16 KV: which paths drift from CPU fp32, and by how much
    assemble_gguf
    STEP_TAIL=8 step probe_embedded 120 python3 scripts/sessions/parity_probe.py embedded \
      TANDEM_FUSED_NORMS=0 TANDEM_PDL=0
    PROBE_KV=bf16 STEP_TAIL=8 step probe_embedded_bf16kv 100 python3 scripts/sessions/parity_probe.py embedded ;;
esac
