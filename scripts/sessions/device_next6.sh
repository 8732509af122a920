#!/usr/bin/env bash
# The agent loop's time to first token (issue 6: 0.3 s for 1K new tokens at
# 100K; 2026-12-02 04:58: 0.65-4.9 s). (1) Per-request sizes were Triton
# specializations, so turns met new kernel variants and waited for their
# compiles: the GPU test pins that none compile after a warm-up, and the
# workers now log any request that waited for one. (2) Past 64K the prefill
# kept the in-kernel dequantization: the 1.1K-after-99K prefill is timed and
# profiled on both paths. (3) The 20-turn loop again, the workspace raised.
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "compiles_nothing"
STEP_TAIL=36 step prefill_99k_paged 170 python3 -m bench.prefill --model $M --device cuda \
  --kv-format int8 --cached-tokens 99000 --tokens 1100 --chunk 4096 --repeats 3 --profile \
  --json "$OUT/prefill_99k_paged.json"
STEP_TAIL=4 step prefill_99k_dense 120 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
  python3 -m bench.prefill --model $M --device cuda --kv-format int8 --cached-tokens 99000 \
  --tokens 1100 --chunk 4096 --repeats 3 --json "$OUT/prefill_99k_dense.json"
STEP_TAIL=30 step agent_loop 300 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
  python -m bench.agent_loop --model $M --device cuda \
  --kv-format int8 --gpu-memory-budget 130GiB --max-context-tokens 131072 --prefill-chunk 4096 \
  --turns 20 --first-turn-tokens 80000 --new-tokens 1024 --output-tokens 16 \
  --json "$OUT/agent_loop.json"
grep -h "waited for" "$OUT/agent_loop.log" | cut -c1-400 | head -30
