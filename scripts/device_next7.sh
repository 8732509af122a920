#!/usr/bin/env bash
# Issue 6's time to first token, after the fixes the 2026-12-02 05:13 run
# pointed at (~7 min; carry .whl). That run's compile log showed each spiky
# agent turn waiting 1-5 s for the GDN step kernels (MAX_T was the prefill
# tail's length, a constexpr); and the turns without a spike took ~1.0 s
# against 0.6 s on the one turn whose tail was a single token (decode's key
# splits): a 2-8 token tail ran on one program per KV head over 100K keys.
# Now MAX_T is 1 or 8 and short batches split their keys.
#  1. the compiled tests of both (GDN step kernels, no compile after warm-up);
#  2. the dense prefill kernel for 1.1K queries over 100K keys, by key splits;
#  3. the 20-turn agent loop (the workspace raised past 100K).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_gdn_kernels.py -k "compiles_nothing or step or verify"
STEP_TAIL=12 step attention_100k 100 python3 -m bench.attention --context 100000 --new 1100 \
  --kv-format bf16 --candidates 4 --splits 1 2 4 8 --json "$OUT/attention_100k.json"
STEP_TAIL=30 step agent_loop 300 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
  python -m bench.agent_loop --model $M --device cuda \
  --kv-format int8 --gpu-memory-budget 130GiB --max-context-tokens 131072 --prefill-chunk 4096 \
  --turns 20 --first-turn-tokens 80000 --new-tokens 1024 --output-tokens 16 \
  --json "$OUT/agent_loop.json"
grep -h "waited for" "$OUT/agent_loop.log" | cut -c1-400 | head -30
