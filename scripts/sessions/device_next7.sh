#!/usr/bin/env bash
# Issue 6's time to first token, after the fixes the 2026-12-02 05:13 run
# pointed at (~7 min; carry .whl). That run's compile log showed each spiky
# agent turn waiting 1-5 s for the GDN step kernels (MAX_T was the prefill
# tail's length, a constexpr); and the turns without a spike took ~1.0 s
# against 0.6 s on the one turn whose tail was a single token (decode's key
# splits): a 2-8 token tail ran on one program per KV head over 100K keys.
# Now MAX_T is 1 or 8, short batches split their keys, and the prefill
# worker warms up before serving.
#  1. the compiled tests of both (GDN step kernels, no compile after warm-up);
#  2. the prefill kernel for 1.1K queries over 100K keys, by key splits, on
#     bf16 pages (the dense workspace's kernel) and int8 pages (in-kernel);
#  3. 1.1K new tokens after 99K cached, in-kernel (the default past 64K)
#     against the dense workspace, without the profiler (it ran past 170 s);
#  4. decode with rk4 KV, issue 6's format for its roofline goals (85% at 4K,
#     75% at 128K), not measured since the kernels changed.
# Then: scripts/device_agent_loop.sh, and SHARES="70 80" scripts/device_mps.sh.
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
step pytest 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  tests/test_gdn_kernels.py -k "compiles_nothing or step or verify"
STEP_TAIL=14 step attention_100k 100 python3 -m bench.attention --context 100000 --new 1100 \
  --kv-format bf16 int8 --candidates 4 --splits 1 2 4 --json "$OUT/attention_100k.json"
for ws in 65536 131072; do  # 65536: the default bound, so 99K keys stay in-kernel
  STEP_TAIL=4 step prefill_99k_ws$ws 100 env TANDEM_PREFILL_WORKSPACE_TOKENS=$ws \
    python3 -m bench.prefill --model $M --device cuda --kv-format int8 --cached-tokens 99000 \
    --tokens 1100 --chunk 4096 --repeats 3 --json "$OUT/prefill_99k_ws$ws.json"
done
STEP_TAIL=4 step decode_rk4 120 python3 -m bench.decode --model $M --device cuda \
  --kv-format rk4 --batch 1 --context 4096 131072 --steps 16 --json "$OUT/decode_rk4.json"
