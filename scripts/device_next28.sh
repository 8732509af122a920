#!/usr/bin/env bash
# Next GPU session (after 2026-12-03 12:30), two calls of 27B work that carry
# the GGUF's first two parts for the MTP head's third call:
#   bash scripts/device_chain_mtp.sh 1 bash scripts/device_next28.sh 1   (part aa)
#   bash scripts/device_chain_mtp.sh 2 bash scripts/device_next28.sh 2   (part ab)
#   VARIED=5000 BUDGETS=420 bash scripts/device_chain_mtp.sh 3          (part ac and
#     .device/mtp_corpus.pt: only NATURAL_CHAT's ~500 new requests are answered)
# Call 1: why rk4's agent loop reads 0.411 s at 100K where int8 read 0.304 s:
#   the prefill attention alone at the agent loop's shape (1,100 new tokens
#   over 100K), rk4 and int8, today's tiles (4: 128 x 64, 8 warps) against 128 x
#   32 (3; static sm_90 build: rk4 no stack and int8 80 B, where 128 x 64 has
#   rk4 16-32 B and int8 152-192 B of stack, 43-51 spill stores a tile) and
#   two staged variants, over key splits.
# Call 2: the 32K prefill's MFU with rk4 (57% on 12-02, before the
#   channel-pair program, which took rk4's prefill tile from 1,390 to 1,138 loop
#   instructions and its stack from 184 to 16 B, static build) on today's
#   128 x 64 tiles and on TANDEM_PREFILL_BLOCK_N=32; then rk4's agent loop on
#   128 x 32 tiles (12-03 11:16 on 128 x 64: median 0.297 s, 0.411 s at 100K).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
case "${1:?call 1 or 2}" in
  1)
    STEP_TAIL=40 step prefill_attention 400 python3 -m bench.attention --context 100352 \
      --new 1100 --kv-format rk4 int8 --candidates 3 4 5 9 --splits 1 8 --repeats 3
    ;;
  2)
    for bn in 64 32; do
      STEP_TAIL=8 step prefill_rk4_bn$bn 150 env TANDEM_PREFILL_BLOCK_N=$bn python3 -m \
        bench.prefill --model $M --device cuda --kv-format rk4 --tokens 32768 --chunk 4096 --repeats 1
    done
    TANDEM_PREFILL_BLOCK_N=32 KV=rk4 PROFILE_EVERY=10 bash scripts/device_agent_loop.sh
    ;;
esac
