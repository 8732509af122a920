#!/usr/bin/env bash
# Device call (~4 min; carry .whl), 2026-12-02: the rebuilt rk4p attention
# (RoPE on the rotary channels only, Cody-Waite sin/cos) at 128K decode
# (113 ms before, int8 18.4 ms) and its compiled tests; the agent loop with
# the router's TTFT phases (tokenize / reserve / prefill / cache).
set -uo pipefail
source scripts/device_env.sh
STEP_TAIL=6 step decode128k_rk4p 70 python3 -m bench.decode --model qwen3.5-27b --device cuda \
  --kv-format rk4p --batch 1 --context 131072 --steps 16 --json "$OUT/decode128k_rk4p.json"
STEP_TAIL=4 step pytest_rk4p 60 python3 -m pytest -q -p no:cacheprovider tests/test_attention_rk4p.py
STEP_TAIL=12 step agent_loop 120 python -m bench.agent_loop --model qwen3.5-27b --device cuda \
  --kv-format int8 --gpu-memory-budget 130GiB --max-context-tokens 131072 --prefill-chunk 4096 \
  --turns 6 --first-turn-tokens 95000 --new-tokens 1024 --output-tokens 16 --json "$OUT/agent_loop.json"
