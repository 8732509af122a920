#!/usr/bin/env bash
# One call (~9 min; carry .whl) that times what sessions 7 and 8 built and no
# GPU had run: the parts of device_next7.sh and device_next8.sh that answer
# open questions, within one call's 600 s.
#  1. the compiled tests: the dense prefill path and its rk4p read kernel,
#     and the GDN step kernels compiling nothing after warm-up;
#  2. decode with rk4 KV (issue 6's roofline format) at 4K and 128K;
#  3. the prefill kernel for 1.1K queries over 100K keys by key splits;
#  4. 1.1K new tokens after 99K cached with rk4p through the dense
#     workspace, profiled over the timed tokens: where a turn's prefill goes.
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_rk4p.py \
  tests/test_attention.py tests/test_cuda.py tests/test_gdn_kernels.py \
  -k "dense or reads_into or compiles_nothing or step or verify"
STEP_TAIL=4 step decode_rk4 110 python3 -m bench.decode --model $M --device cuda \
  --kv-format rk4 --batch 1 --context 4096 131072 --steps 16 --json "$OUT/decode_rk4.json"
STEP_TAIL=14 step attention_100k 100 python3 -m bench.attention --context 100000 --new 1100 \
  --kv-format bf16 int8 --candidates 4 --splits 1 2 4 --json "$OUT/attention_100k.json"
STEP_TAIL=40 step prefill_99k_rk4p 160 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
  python3 -m bench.prefill --model $M --device cuda --kv-format rk4p --cached-tokens 99000 \
  --tokens 1100 --chunk 4096 --repeats 2 --profile --json "$OUT/prefill_99k_rk4p.json"
