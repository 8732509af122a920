#!/usr/bin/env bash
# 2026-12-03, third call (~9 min; carry .whl). device_next19.sh (03:37) found
# the 24 GiB run's extra ~0.9 GiB: kernels that spill raised the workers'
# stack limits (decode 2,448 B = 631 MiB of local memory, prefill 1,776 B):
# the 64-row verify attention tiles (int8 416 B, rk4 1,568 B a thread on
# sm_90), rk4's 4-warp decode tiles (288 B) and the prefill's 64 x 128 conv
# chunk. Now: verify on 32 rows x 8 warps, rk4 decode on 8 warps, conv
# chunk 8 x 256 (tests/test_kernel_stacks.py pins none of them spilling).
#  1. GPU tests: attention over every format, speculative parity (verify
#     against plain decode on the new verify tiles), the GDN conv chunk;
#  2. the 24 GiB demonstration (8K and 32K) with the workers' stack lines;
#  3. the k=3 verify step against a plain step (12-02 16:42: 1.10x);
#  4. rk4 decode at 4K / 128K on its 8-warp tiles (12-02 11:53: 16.86 /
#     48.88 ms on 32-key tiles).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
STEP_TAIL=6 step gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_attention.py tests/test_attention_rk4p.py tests/test_speculative.py \
  tests/test_gdn_kernels.py tests/test_reserve_watch.py -k "cuda or graph or parity or verify or conv"
bash scripts/device_memory24.sh
STEP_TAIL=5 step verify_k3 90 python3 -m bench.speculative --device cuda --verify-model $M \
  --context 4096 --ks 3 --repeats 10
STEP_TAIL=3 step rk4_decode 90 python3 -m bench.decode --model $M --device cuda --kv-format rk4 \
  --batch 1 --context 4096 131072 --steps 16
tar czf /tmp/next20.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next20.tgz "$OUT/"
