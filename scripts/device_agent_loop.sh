#!/usr/bin/env bash
# Issue 6's agent loop on the 27B shape through `tandem serve` (~5 min; carry
# .whl): 20 turns from 80K to 101K tokens, ~1.1K new tokens a turn, int8 KV (KV=rk4p: another),
# with the prefill workspace raised past 100K (WS= to leave it at 64K). The
# service's log lines that matter: the prefill worker's warm-up, any request
# or step that waited for a Triton compile (there should be none), and where
# every 4th turn's prefill went (TANDEM_PROFILE_PREFILL; those turns run under
# torch.profiler, so read their TTFT as slower than the rest; the trace is read
# after the reply since 12-02 12:50, before it the report cost them 0.4-1.9 s).
set -uo pipefail
source scripts/device_env.sh
WS=${WS-131072}
STEP_TAIL=30 step agent_loop ${AGENT_LIMIT:-330} env ${WS:+TANDEM_PREFILL_WORKSPACE_TOKENS=$WS} \
  TANDEM_PROFILE_PREFILL=${PROFILE_EVERY-4} \
  python -m bench.agent_loop --model qwen3.5-27b --device cuda \
  --kv-format ${KV:-int8} --gpu-memory-budget 130GiB --max-context-tokens 131072 --prefill-chunk 4096 \
  --turns 20 --first-turn-tokens 80000 --new-tokens 1024 --output-tokens 16 \
  --json "$OUT/agent_loop.json"
grep -h "waited for\|warmed up\|warm-up\|from arrival\|garbage collection" "$OUT/agent_loop.log" | cut -c1-400 | head -40
