#!/usr/bin/env bash
# The next device session's first call (~9 min; carry .whl). What the
# 2026-12-02 session built but could not time:
#  - the prefill worker's stream made once (the agent loop's 0.6-4.3 s
#    prefill calls at 31K-101K; issue 6's goal is 0.3 s at 100K), and the
#    prefill of 1.1K new tokens after 31K cached, profiled by kernel;
#  - the rk4p attention kernel rebuilt twice (128K decode 113 -> 46.8 ms
#    after the first; int8 18.4 ms), its compiled tests at last.
# Second call: scripts/device_mps.sh (decode beside a prefill under MPS).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_attention_rk4p.py -k "worker_stream or decode or verify or prefill or sin"
for kv in rk4p int8; do
  STEP_TAIL=4 step decode_$kv 100 python3 -m bench.decode --model $M --device cuda \
    --kv-format $kv --batch 1 --context 4096 131072 --steps 16 --json "$OUT/decode_$kv.json"
done
STEP_TAIL=40 step prefill_cached 150 python3 -m bench.prefill --model $M --device cuda \
  --kv-format int8 --cached-tokens 31000 --tokens 1100 --chunk 4096 --repeats 3 --profile \
  --json "$OUT/prefill_cached.json"
STEP_TAIL=30 step agent_loop 300 python -m bench.agent_loop --model $M --device cuda \
  --kv-format int8 --gpu-memory-budget 130GiB --max-context-tokens 131072 --prefill-chunk 4096 \
  --turns 20 --first-turn-tokens 80000 --new-tokens 1024 --output-tokens 16 \
  --json "$OUT/agent_loop.json"
