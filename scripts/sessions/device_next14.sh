#!/usr/bin/env bash
# Programmatic dependent launch (engine/pdl.py) on the H200 (~9 min; carry .whl):
#  1. the GPU half of tests/test_pdl.py: a tiny model's decode graphs give
#     bitwise the same logits with TANDEM_PDL=1 and 0 (bf16 and int4 weights);
#  2. the 27B int4 decode step (16:15 UTC: 7.83 ms, 1.73 ms of an 8.78 ms
#     profiled step idle between 883 kernels) and the bf16 step at 4K and
#     128K (16:10: 15.50 / 18.44 ms), each with PDL off and on;
#  3. where the int4 step goes with PDL on (bench.profile_step);
#  4. the k=3 verify step against a plain step (verify now walks decode's
#     64-key tiles; 12-01: 1.09x);
#  5. compiled kernel tests with PDL on (the default), graph replays
#     against eager, speculative parity.
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
STEP_SIGNAL=ABRT STEP_TAIL=6 step pdl_parity 150 python3 -m pytest -q -p no:cacheprovider \
  tests/test_pdl.py
for p in 0 1; do
  STEP_TAIL=4 step int4_pdl$p 90 env TANDEM_PDL=$p python3 -m bench.quant --rows 1 \
    --only lm_head --decode-steps 16
done
for p in 0 1; do
  STEP_TAIL=4 step bf16_pdl$p 100 env TANDEM_PDL=$p python3 -m bench.decode --model $M \
    --device cuda --kv-format int8 --batch 1 --context 4096 131072 --steps 16
done
STEP_TAIL=30 step profile_int4_pdl 90 python3 -m bench.profile_step --weights int4 --top 14
STEP_TAIL=4 step verify_k3 90 python3 -m bench.speculative --device cuda --verify-model $M \
  --ks 1 3 --repeats 20
STEP_SIGNAL=ABRT STEP_TAIL=8 step kernels_pdl 170 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_cuda_graphs.py tests/test_fused.py tests/test_gdn_kernels.py \
  tests/test_speculative.py -k "cuda or graph or parity or fused or step"
