#!/usr/bin/env bash
# Three chained calls that bring the embedded GGUF (98 MB, split in
# .device/gguf.part.a{a,b,c}) to the device machine for the MTP head's
# training, each call carrying `.whl` and one part and giving the machine real
# work meanwhile (it is released after 30 s idle, and /tmp with it):
#   call 1 (carry .device/gguf.part.aa): Nsight Compute on rk4's decode
#     attention alone at 131,072 tokens with today's tiles (16 rows, 64 keys,
#     4 warps, bf16 dots; 0.185 ms a layer, ~4x its bytes' time): which pipe
#     bounds it now that the dots take bf16 (the fp32 tiles were L1-bound);
#   call 2 (part ab): the 27B prefill at 32K with rk4 KV (KVS="rk4 rk4p": both),
#     today's code (12-02: 57.1% MFU, rk4p 48.9%; the Hadamard kernel now
#     rotates every prefill chunk's K/V writes);
#   call 3 (part ac): scripts/device_mtp.sh on all 2,514 varied prompts and the
#     first 100 templated ones, greedy, 160 tokens (~2.6K tok/s: ~160 s), heads
#     trained 30 s and 90 s, both returned for the dev set (bench.mtp_gap, CPU).
#   bash scripts/device_chain_mtp.sh 1|2|3
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ && ls /tmp/gguf
case "${1:?call 1, 2 or 3}" in
  1)
    STEP_TAIL=70 step ncu_rk4_decode_attention 200 ncu --clock-control none \
      --kernel-name regex:_paged_attention_kernel --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section InstructionStats \
      python3 -m bench.attention --new 1 --context 131072 --kv-format rk4 --candidates 19 \
      --splits 64 --repeats 2
    ;;
  2)
    for kv in ${KVS:-rk4}; do
      STEP_TAIL=8 step prefill_$kv 150 python3 -m bench.prefill --model $M --device cuda \
        --kv-format $kv --tokens 32768 --chunk 4096 --repeats 1
    done
    ;;
  3)
    VARIED=${VARIED:-2514} MAX_PROMPTS=${MAX_PROMPTS:-100} SAMPLES=${SAMPLES:-1} NEW=${NEW:-160} \
      BUDGETS=${BUDGETS:-"30 90"} OLD_HEAD=0 METHODS=mtp KS=3 CORPUS=/tmp/mtp_corpus.pt \
      bash scripts/device_mtp.sh
    cp /tmp/mtp_corpus.pt "$OUT/" 2>/dev/null
    ;;
esac
