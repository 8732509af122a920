#!/usr/bin/env bash
# After the 13:50 run (~9 min; carry .whl and .device/gguf.part.aa, which it
# parks in /tmp/gguf for the MTP run two calls later):
#  1. the compiled tests: no sync in a prefill chunk, batch building included
#     (13:50: the dense workspace's metadata was a pageable upload, fixed by
#     engine/uploads.py); snapshots left inside a forward against forwards cut
#     at them (fla, the fused steps, a gathered batch); no compile after the
#     warm-up's new jobs; fla's chunk indices. ABRT: the 13:50 pytest hung
#     after its last test, faulthandler shows where;
#  2. 1.1K after 99K cached, rk4p (timed out at 70 s at 13:50: cold compiles);
#  3. the agent loop with the prompt-end snapshot folded into the chunk, no
#     stream sync, and the start-up heap frozen (13:57: TTFT median 0.361 s,
#     p90 0.568 s, goal 0.3 s);
#  4. (before 3) decode attention tiles at 128K: block_n, warps, stages.
set -uo pipefail
source scripts/device_env.sh
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ 2>/dev/null
M=qwen3.5-27b
STEP_SIGNAL=ABRT STEP_TAIL=30 step pytest 200 python3 -m pytest -q -p no:cacheprovider \
  tests/test_cuda.py tests/test_snapshot_fold.py tests/test_gdn_fla.py \
  -k "never_waits or snapshot or varlen or compiles_nothing or engine_matches"
STEP_TAIL=4 step prefill_99k_rk4p 110 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
  python3 -m bench.prefill --model $M --device cuda --kv-format rk4p --cached-tokens 99000 \
  --tokens 1100 --chunk 4096 --repeats 3
STEP_TAIL=16 step decode_attention_tiles 70 python3 -m bench.attention --context 131072 --new 1 \
  --kv-format int8 --candidates 13 14 15 16 17 18 19 --splits 64 128
PROFILE_EVERY=10 AGENT_LIMIT=200 bash scripts/device_agent_loop.sh
grep -h "garbage collection" "$OUT/agent_loop.log" | head -5
