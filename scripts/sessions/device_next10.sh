#!/usr/bin/env bash
# An agent turn's prefill without host stalls (~9 min; carry .whl). The
# 11:39 run of device_next9 found a 1.1K-token prefill after 99K cached at
# 0.416 s wall against 0.307 s of kernels, and the key-split sweep (208
# programs on 132 SMs) 16% faster at 4 splits. Since then: the GDN layers
# share one cu_seqlens (host and device copies) instead of two stream syncs
# a layer, the attention metadata comes from host page tables, and prefill
# chunks split their keys when that fills the last wave
# (attention.prefill_key_splits). Measures:
#  1. the compiled tests: no sync inside a prefill forward, no compile after
#     the warm-up's chunk kinds, the split prefill against its reference;
#  2. bench.attention 1.1K x 100K, splits 1 / 4 / 8;
#  3. 1.1K after 99K cached: int8 (0.470 s in the 04:50 run) and rk4p
#     profiled (0.416 s, 11:39);
#  4. the 20-turn agent loop through tandem serve (TTFT 0.41-0.69 s at 11:44).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 130 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_attention.py tests/test_gdn_fla.py \
  -k "never_waits or compiles_nothing or splits or prefill or fla"
STEP_TAIL=14 step attention_100k 80 python3 -m bench.attention --context 100000 --new 1100 \
  --kv-format bf16 int8 --candidates 4 --splits 1 4 8 --json "$OUT/attention_100k.json"
STEP_TAIL=4 step prefill_99k_int8 70 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
  python3 -m bench.prefill --model $M --device cuda --kv-format int8 --cached-tokens 99000 \
  --tokens 1100 --chunk 4096 --repeats 3 --json "$OUT/prefill_99k_int8.json"
STEP_TAIL=30 step prefill_99k_rk4p 100 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
  python3 -m bench.prefill --model $M --device cuda --kv-format rk4p --cached-tokens 99000 \
  --tokens 1100 --chunk 4096 --repeats 2 --profile --json "$OUT/prefill_99k_rk4p.json"
AGENT_LIMIT=200 bash scripts/device_agent_loop.sh
