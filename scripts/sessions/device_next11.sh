#!/usr/bin/env bash
# What the 12:04 run left unmeasured (~8 min; carry .whl): since c3db5ab the
# batch builds fla's chunk indices on the host (748089c: no stream sync left
# inside a prefill forward, if the sync-debug test now passes) and prefill
# chunks split their keys 8 ways (32640f7; 4 in the 12:04 run).
#  1. the compiled tests: no sync in a prefill forward, fla's own chunk
#     indices, no compile after the warm-up, split prefill vs reference;
#  2. 1.1K after 99K cached, int8 (0.275 s at 12:04) and rk4p (0.288 s);
#  3. decode's attention alone at 128K by key splits: int8's step spends
#     ~3.4 ms more at 128K than at 4K for ~4.2 GB more KV, ~1.2 TB/s against
#     the card's 4.2 (batch 1 has 4 KV heads x 64 splits = 256 programs);
#  4. the agent loop, one profiled turn in ten (TTFT 0.315-0.483 s at 12:04,
#     goal 0.3 s).
# Then: SHARES="70 80" bash scripts/device_mps.sh, and the MTP A/B
# (BATCH_SAMPLES=8 SOFT=1 bash scripts/device_mtp.sh, the GGUF in two parts).
# At most 8 files come back from $OUT: the steps keep to 7 (their logs hold
# the tables; the agent loop adds its JSON).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_gdn_fla.py tests/test_attention.py -k "never_waits or varlen or fla_prefill or compiles_nothing or splits"
for kv in int8 rk4p; do
  STEP_TAIL=4 step prefill_99k_$kv 70 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
    python3 -m bench.prefill --model $M --device cuda --kv-format $kv --cached-tokens 99000 \
    --tokens 1100 --chunk 4096 --repeats 3
done
STEP_TAIL=14 step decode_attention_128k 80 python3 -m bench.attention --context 131072 --new 1 \
  --kv-format int8 rk4p --candidates 13 --splits 32 64 128 256
PROFILE_EVERY=10 AGENT_LIMIT=200 bash scripts/device_agent_loop.sh
