#!/usr/bin/env bash
# Issue 6's service benchmarks on the Qwen3.5-27B dummy shape (bf16 weights,
# rk4 KV), each against a real `tandem serve`: the agent loop (an 80K-token
# first turn, then 19 turns of ~1K new tokens, growing past 100K: reuse ratio
# and TTFT per turn) and interference (decode ITL idle and during a 32K
# prefill, prefill throughput alone and shared). KV=rk4p (or int8) picks the
# KV format (the goals name the 4-bit one; rk4p is the one that meets
# its quality goals in fp32). ~6 minutes.
set -uo pipefail
source scripts/device_env.sh
M=(--model qwen3.5-27b --device cuda --kv-format "${KV:-rk4}" --gpu-memory-budget 130GiB)
echo "== agent loop"
timeout 300 python -m bench.agent_loop "${M[@]}" --max-context-tokens 131072 --prefill-chunk 4096 \
  --turns 20 --first-turn-tokens 80000 --new-tokens 1024 --output-tokens 32 \
  --json "$OUT/agent_loop.json" 2>&1 | grep -v "^\[" | tee "$OUT/agent_loop.log" | tail -30
echo "== interference"
timeout 200 python -m bench.interference "${M[@]}" --max-context-tokens 65536 --prefill-chunk 2048 \
  --prefill-tokens 32768 --decode-tokens 1200 --json "$OUT/interference.json" \
  2>&1 | grep -v "^\[" | tee "$OUT/interference.log" | tail -20
