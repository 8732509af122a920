#!/usr/bin/env bash
# Superseded: 12-03 13:27 ran its calls, trimmed, as device_next29.sh 1 and 2.
# Next GPU session (after 2026-12-03 12:30), two calls of 27B work that carry
# the GGUF's first two parts for the MTP head's third call:
#   bash scripts/device_chain_mtp.sh 1 bash scripts/sessions/device_next28.sh 1   (part aa)
#   bash scripts/device_chain_mtp.sh 2 bash scripts/sessions/device_next28.sh 2   (part ab)
#   VARIED=5000 BUDGETS=420 bash scripts/device_chain_mtp.sh 3          (part ac and
#     .device/mtp_corpus.pt: only NATURAL_CHAT's ~500 new requests are answered)
# Call 1: the prefill attention alone at the agent loop's shape (1,100 new
#   tokens over 100K) over rk4 and int8 pages in-kernel (what a turn past the
#   bf16 workspace's 64K bound runs: the default service, the 24 GiB plan) and
#   over bf16 (the workspace), today's tiles (4: 128 x 64, 8 warps) against
#   128 x 32 (3; static sm_90 build: rk4 no stack and int8 80 B, where 128 x 64
#   has rk4 16 B and int8 192 B, 4 and 49 spill stores a tile) and 64 x 64 on
#   8 warps (12: no stack for either, but half the rows share each K/V tile's
#   dequantization); then the 32K
#   prefill's MFU with rk4 (57% on 12-02) on 128 x 64 and on
#   TANDEM_PREFILL_BLOCK_N=32.
# Call 2: the agent loop with int8 and then rk4 KV on one host: 7 of rk4's 19
#   turns spiked to 0.32-0.41 s, the rest 0.26-0.30 s (12-03 11:16; int8 on
#   12-02 14:15, another host: median 0.299, p90 0.365 s).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
case "${1:?call 1 or 2}" in
  1)
    STEP_TAIL=40 step prefill_attention 300 python3 -m bench.attention --context 100352 \
      --new 1100 --kv-format rk4 int8 bf16 --candidates 3 4 12 --splits 1 8 --repeats 3
    for bn in 64 32; do
      STEP_TAIL=8 step prefill_rk4_bn$bn 120 env TANDEM_PREFILL_BLOCK_N=$bn python3 -m \
        bench.prefill --model $M --device cuda --kv-format rk4 --tokens 32768 --chunk 4096 --repeats 1
    done
    ;;
  2)
    for kv in int8 rk4; do
      KV=$kv PROFILE_EVERY=10 AGENT_LIMIT=270 bash scripts/device_agent_loop.sh
      mv "$OUT/agent_loop.log" "$OUT/agent_loop_$kv.log"; mv "$OUT/agent_loop.json" "$OUT/agent_loop_$kv.json"
    done
    ;;
esac
