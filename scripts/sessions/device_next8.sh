#!/usr/bin/env bash
# The dense prefill's reads in the stored space (~7 min; carry .whl). Since
# commit "Dense prefill reads K/V in the format's stored space", a prefill
# chunk's workspace no longer rotates the prefix back (rk4, rk4p's V) and
# rk4p's read is one kernel with RoPE (attention_kernels.rk4p_dense) instead
# of ~15 PyTorch ops per 4K-token slice. Measures:
#  1. the compiled tests of the dense path and of the new kernel;
#  2. the 27B's 32K prefill with rk4p KV (5.10 s, 48.9% MFU at ca43867);
#  3. 1.1K new tokens after 99K cached with rk4p and int8 through the
#     workspace, profiled (the timed tokens only): where an agent turn's
#     prefill goes by kernel kind.
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_rk4p.py \
  tests/test_attention.py -k "dense or reads_into"
STEP_TAIL=4 step prefill_32k_rk4p 100 python3 -m bench.prefill --model $M --device cuda \
  --kv-format rk4p --tokens 32768 --chunk 4096 --repeats 1 --json "$OUT/prefill_32k_rk4p.json"
for kv in rk4p int8; do
  STEP_TAIL=40 step prefill_99k_$kv 160 env TANDEM_PREFILL_WORKSPACE_TOKENS=131072 \
    python3 -m bench.prefill --model $M --device cuda --kv-format $kv --cached-tokens 99000 \
    --tokens 1100 --chunk 4096 --repeats 2 --profile --json "$OUT/prefill_99k_$kv.json"
done
